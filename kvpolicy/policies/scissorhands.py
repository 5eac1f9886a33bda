"""Scissorhands (Liu et al., 2023, "Scissorhands: Exploiting the Persistence of Importance
Hypothesis for LLM KV Cache Compression at Test Time")."""

from __future__ import annotations

import math
from typing import Any

from ..params import Param
from ..policy import Array, CacheView, EvictionPolicy, SizeRule
from ..registry import register_policy
from ..statistics import MAX_HISTORY, history_counts


def _drop_count(size: int, drop: float) -> int:
    return max(1, min(size - 1, math.floor(drop * size)))


def _per_head(selection: str) -> str:
    if selection != "per_head":
        raise ValueError(
            "selection must be 'per_head' for Scissorhands: its scores are per-head records of "
            f"low-attention events, which do not add up across heads; got {selection!r}"
        )
    return selection


@register_policy
class Scissorhands(EvictionPolicy):
    """Persistence of importance: drop the tokens that were most often unimportant lately.

    Every query marks, per KV head, the tokens it attends to less than average (``group / n``:
    ``n`` the tokens it attends to, ``group`` its query heads, GQA; a relative margin of
    ``kvpolicy.statistics.LOW_MARGIN`` keeps exact ties "average" on every backend). Each token
    keeps the record of its last ``history`` queries (its score; ``score_statistic =
    "low_history"``, see :mod:`kvpolicy.statistics`: a prompt's rows count as queries, newest
    last). When the cache reaches ``size`` tokens, it drops ``m = floor(drop x size)`` (at least 1)
    of them: the most recent ``recent`` tokens stay, and of the others those with the most low
    events in their record go (ties: the latest position goes first; a stable sort of the counts
    keeps the earliest). The cache then holds ``size - m`` tokens and grows back to ``size``.

    Parameters:
        size: the budget ``B``: most tokens held, during attention included (>= 2).
        history: queries a record covers, the history window ``w`` (1..52: a record is ``w``
            bits of one float64).
        drop: share of ``size`` dropped at each compression (0 < drop < 1; ``m`` in the paper).
        recent: most recent tokens never dropped, the recent window ``r`` (0..size - m).
        selection: ``"per_head"`` only (records do not add up across heads).

    Defaults (history 16, drop 0.25, recent 8) are ours; the paper leaves them as parameters.

    Example:
        >>> from kvpolicy import Scissorhands
        >>> p = Scissorhands(size=64, history=8, drop=0.25, recent=4)
        >>> p.capacity, p.dropped
        (64, 16)
    """

    name = "scissorhands"
    score_statistic = "low_history"

    size = Param(int, minimum=2, doc="most tokens held (the budget B)")
    history = Param(int, 16, minimum=1, maximum=MAX_HISTORY, doc="queries a token's record covers (w)")
    drop = Param(float, 0.25, minimum=0.0, maximum=1.0, low_open=True, high_open=True,
                 doc="share of size dropped at each compression (m = floor(drop x size), >= 1)")
    recent = Param(int, 8, minimum=0, maximum=lambda p: p.size - _drop_count(p.size, p.drop),
                   doc="most recent tokens never dropped (r)")

    def __post_init__(self) -> None:
        _per_head(self.selection)
        self.dropped = _drop_count(self.size, self.drop)

    @property
    def score_history(self) -> int:
        return self.history

    @property
    def capacity(self) -> int:
        return self.size

    def select(self, view: CacheView) -> Array | None:
        n = view.n_cached
        if n < self.size:
            return None
        xp = view.xp
        keep = self.size - self.dropped
        counts = history_counts(view.scores, self.history)
        # the recent window ranks first (count -1); a stable sort keeps the earliest of a tie
        if self.recent:
            counts[..., n - self.recent :] = -1
        order = xp.argsort(counts, axis=-1, stable=True)
        return xp.sort(order[..., :keep], axis=-1)

    def size_rule(self) -> SizeRule:
        size, keep = self.size, self.size - self.dropped
        return lambda n, state: keep if n >= size else n

    min_size = 2

    @classmethod
    def from_size(cls, size: int, **overrides: Any) -> "Scissorhands":
        """The budget whose average cache is about ``size``: it cycles from ``B - m`` to ``B``, so
        ``B = size / (1 - drop / 2)``; a recent window larger than fits shrinks to fit."""
        drop = overrides.pop("drop", 0.25)
        valid = isinstance(drop, (int, float)) and not isinstance(drop, bool) and 0 < drop < 1
        budget = overrides.pop("size", max(2, round(size / (1 - drop / 2))) if valid else size)
        if "recent" not in overrides and valid and isinstance(budget, int) and budget >= 2:
            overrides["recent"] = min(8, budget - _drop_count(budget, drop))
        return cls(size=budget, drop=drop, **overrides)
