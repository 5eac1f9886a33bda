"""Local window: only the most recent tokens (the paper's "Local" baseline)."""

from __future__ import annotations

from typing import Any

from ..params import Param
from ..policy import Array, CacheView, DecodeEviction, EvictionPolicy, SizeRule, keep_at_most
from ..registry import register_policy


@register_policy
class LocalWindow(EvictionPolicy):
    """Keep the last ``window`` positions after every step.

    Parameters:
        window: tokens kept after eviction (>= 1). The next query attends to ``window + 1``.
        selection: accepted like every policy's; this policy reads no scores and keeps the same
            slots on every head, so ``"shared"`` is the same as ``"per_head"``.

    Example:
        >>> from kvpolicy import LocalWindow
        >>> LocalWindow(window=8).capacity
        9
    """

    name = "local"
    uses_scores = False

    window = Param(int, minimum=1, doc="most recent positions kept")

    @property
    def capacity(self) -> int:
        return self.window + 1

    def select(self, view: CacheView) -> Array | None:
        n = view.n_cached
        if n <= self.window:
            return None
        return view.keep(view.arange(n - self.window, n))

    @property
    def decode_eviction(self) -> DecodeEviction:
        return DecodeEviction(limit=self.window, victim="oldest")

    def size_rule(self) -> SizeRule:
        return keep_at_most(self.window)

    @classmethod
    def from_size(cls, size: int, **overrides: Any) -> "LocalWindow":
        return cls(window=overrides.pop("window", size), **overrides)
