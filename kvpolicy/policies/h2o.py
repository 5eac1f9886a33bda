"""H2O (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of LLMs")."""

from __future__ import annotations

from functools import cached_property
from typing import Any

from ..params import Param
from ..policy import DecodeEviction
from ..registry import register_policy
from .lowest import KeepAtMost


@register_policy
class H2O(KeepAtMost):
    """Heavy hitters plus a recent window.

    While the cache holds more than ``heavy + recent`` tokens, evict the token with the lowest
    accumulated score outside the last ``recent`` positions (ties: the earliest position goes
    first; a NaN score counts as ``-inf``, see :attr:`kvpolicy.CacheView.ranking_scores`).
    Evicting one at a time or all at once is the same here, since scores do not change between
    evictions of one step: the decision is one stable argsort.

    Parameters:
        heavy: heavy-hitter tokens kept outside the recent window (>= 1).
        recent: most recent tokens always kept (>= 1).
        selection: ``"per_head"`` (default) or ``"shared"`` across KV heads.

    Example:
        >>> from kvpolicy import H2O
        >>> H2O(heavy=32, recent=32).capacity
        65
    """

    name = "h2o"

    heavy = Param(int, minimum=1, doc="heavy-hitter tokens kept outside the recent window")
    recent = Param(int, minimum=1, doc="most recent tokens always kept")

    @cached_property
    def rule(self) -> DecodeEviction:
        # heavy + recent kept; the lowest accumulated score outside the recent window goes
        return DecodeEviction(limit=self.heavy + self.recent, victim="lowest", recent=self.recent)

    min_size = 2

    @classmethod
    def from_size(cls, size: int, **overrides: Any) -> "H2O":
        # The H2O paper splits the budget evenly between heavy hitters and recent tokens.
        heavy = overrides.pop("heavy", max(1, size // 2))
        return cls(heavy=heavy, recent=overrides.pop("recent", max(1, size - heavy)), **overrides)
