"""Full cache: the reference every policy approximates (no eviction)."""

from __future__ import annotations

from typing import Any

from ..policy import Array, CacheView, EvictionPolicy, SizeRule
from ..registry import register_policy


@register_policy
class FullCache(EvictionPolicy):
    """Keep every token: dense attention, the paper's upper bound.

    Parameters: none besides ``selection`` (accepted like every policy's; nothing is ever
    evicted, so ``"shared"`` is the same as ``"per_head"``). ``capacity`` is ``None``
    (unbounded); backends grow the cache as needed.

    Example:
        >>> from kvpolicy import FullCache
        >>> FullCache().capacity is None
        True
    """

    name = "full"
    uses_scores = False
    evicts = False

    @property
    def capacity(self) -> int | None:
        return None

    def select(self, view: CacheView) -> Array | None:
        return None

    def size_rule(self) -> SizeRule:
        return lambda n, state: n

