"""The rule TOVA, Knorm and KeyDiff share: keep ``size`` tokens, evict the lowest score outside the
newest ``recent``. Each of them declares only where its scores come from."""

from __future__ import annotations

from typing import Any

from ..params import Param
from ..policy import Array, CacheView, DecodeEviction, EvictionPolicy, Ranking, SizeRule, keep_at_most


class KeepHighest(EvictionPolicy):
    """Keep ``size`` tokens: while the cache holds more, evict the token with the lowest score
    outside the newest ``recent`` (ties: the earliest position; a NaN score counts as ``-inf``).
    One token per decode step (the declared :class:`~kvpolicy.DecodeEviction`); after a prompt
    longer than ``size``, the ``size`` highest scores in one decision. Not registered: the
    policies built on it (TOVA, Knorm, KeyDiff) say what a score is.

    Example:
        >>> from kvpolicy import Knorm
        >>> isinstance(Knorm(size=4), KeepHighest), Knorm(size=4).decode_eviction.limit
        (True, 4)
    """

    size = Param(int, minimum=1, doc="tokens kept")
    recent = Param(int, 0, minimum=0, maximum=lambda p: p.size - 1, doc="most recent tokens always kept (0: none)")

    @property
    def capacity(self) -> int:
        return self.size + 1

    def select(self, view: CacheView) -> Array | None:
        n = view.n_cached
        if n <= self.size:
            return None
        # the lowest scores outside the recent window go, the earliest of a tie first
        return view.drop_lowest(n - self.size, self.recent)

    def head_budget(self, n_cached: int, phase: str) -> int | None:
        return self.size if n_cached > self.size else None

    def ranking(self, view: CacheView) -> Ranking:
        # select's order: the lowest score goes first, the earliest of a tie; the recent window stays
        return view.lowest_first(self.recent)

    @property
    def decode_eviction(self) -> DecodeEviction:
        # One over `size`: the lowest score outside the recent window goes (select dropping one).
        return DecodeEviction(limit=self.size, victim="lowest", recent=self.recent)

    def size_rule(self) -> SizeRule:
        return keep_at_most(self.size)

    min_size = 1

    @classmethod
    def from_size(cls, size: int, **overrides: Any) -> "KeepHighest":
        return cls(size=size, **overrides)
