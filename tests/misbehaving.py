"""Policies that break the contract on purpose, shared by the hardening tests (issue 28): each
backend and the conformance kit must refuse them with an error that names the policy."""

from __future__ import annotations

from typing import Any

import numpy as np
from array_api_compat import device

from kvpolicy import H2O, EvictionPolicy
from kvpolicy.policy import CacheView

#: How :class:`Corrupting` spoils a valid keep array, and what the error then says.
CORRUPTIONS = {
    "duplicate": "appears twice",
    "unsorted": "not in ascending order",
    "negative": "outside [0,",
    "past_end": "outside [0,",
    "float": "expected integers",
    "flat": "expected [batch, heads, k]",
    "over_capacity": "more than its capacity",
}


class Corrupting(EvictionPolicy):
    """StreamingLLM's keep (``sink`` first and ``window`` last tokens) spoiled as ``how`` says
    (one of :data:`CORRUPTIONS`), from the first eviction on."""

    name = "corrupting_test"
    uses_scores = False

    def __init__(self, how: str, sink: int = 1, window: int = 3) -> None:
        super().__init__()
        assert how in CORRUPTIONS, how
        self.how, self.sink, self.window = how, sink, window

    @property
    def capacity(self) -> int:
        return self.sink + self.window + 1

    def params(self) -> dict[str, Any]:
        return {"how": self.how, "sink": self.sink, "window": self.window}

    def select(self, view: CacheView) -> Any:
        n = view.n_cached
        if self.how == "over_capacity":
            if n <= self.capacity + 1:
                return None  # stops one token above the capacity
            keep = np.arange(n - self.capacity - 1, n)
        else:
            if n <= self.sink + self.window:
                return None
            keep = np.concatenate([np.arange(self.sink), np.arange(n - self.window, n)])
        keep = np.broadcast_to(keep, (view.batch, view.heads, keep.shape[0])).copy()
        if self.how == "duplicate":
            keep[..., 1] = keep[..., 0]
        elif self.how == "unsorted":
            keep = keep[..., ::-1].copy()
        elif self.how == "negative":
            keep[..., 0] = -1
        elif self.how == "past_end":
            keep[..., -1] = n
        elif self.how == "float":
            keep = keep.astype(np.float64)
        elif self.how == "flat":
            keep = keep[0, 0]
        return view.xp.asarray(keep, device=device(view.positions))


class WritesScores(H2O):
    """H2O that doubles ``view.scores`` in place before deciding (the ranking, so what it keeps,
    is unchanged: only the write gives it away); ``torch_only`` writes on torch views only."""

    name = "writes_scores_test"

    def __init__(self, heavy: int = 2, recent: int = 2, *, torch_only: bool = False) -> None:
        super().__init__(heavy=heavy, recent=recent)
        self.torch_only = torch_only

    decode_eviction = size_rule = None  # its own select: no inherited rule

    def select(self, view: CacheView) -> Any:
        if not self.torch_only or "torch" in view.xp.__name__:
            view.scores[...] = view.scores * 2
        return super().select(view)


class WritesPositions(H2O):
    """H2O that writes ``view.positions`` back onto itself (a write that changes nothing)."""

    name = "writes_positions_test"

    decode_eviction = size_rule = None  # its own select: no inherited rule

    def select(self, view: CacheView) -> Any:
        view.positions[..., :1] = view.positions[..., :1]
        return super().select(view)
