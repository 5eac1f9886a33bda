"""Knorm (Devoto et al., 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache
Compression")."""

from __future__ import annotations

from typing import Any

from ..params import Param
from ..policy import Array, CacheView, DecodeEviction, EvictionPolicy, SizeRule, keep_at_most
from ..registry import register_policy


@register_policy
class Knorm(EvictionPolicy):
    """Keep the ``size`` tokens whose keys have the lowest L2 norm.

    A token's score is minus the L2 norm of its cached key (``score_statistic = "key_norm"``,
    :func:`kvpolicy.statistics.key_scores`): the backends compute it from the keys they hold, so
    attention is never captured (decode takes plain SDPA). While the cache holds more than
    ``size`` tokens, the token with the largest key norm outside the newest ``recent`` goes (ties:
    the earliest position): one token per decode step; after a prompt longer than ``size``, the
    ``size`` smallest norms are kept in one decision. Norms are of the keys as cached (after RoPE
    in the transformers cache, as kvpress's ``KnormPress`` reads them).

    Parameters:
        size: tokens kept between steps (>= 1).
        recent: newest tokens never evicted (0 to ``size - 1``; default 0: the paper has none).
        selection: ``"per_head"`` (default): every KV head keeps its own tokens, the paper's rule;
            ``"shared"``: norms summed over the heads of the layer, the same tokens on every head.

    Example:
        >>> from kvpolicy import Knorm
        >>> p = Knorm(size=64)
        >>> p.capacity, p.captures_attention
        (65, False)
    """

    name = "knorm"
    score_statistic = "key_norm"

    size = Param(int, minimum=1, doc="tokens kept")
    recent = Param(int, 0, minimum=0, maximum=lambda p: p.size - 1, doc="most recent tokens always kept (0: none)")

    @property
    def capacity(self) -> int:
        return self.size + 1

    def select(self, view: CacheView) -> Array | None:
        n = view.n_cached
        if n <= self.size:
            return None
        # the lowest scores (largest norms) outside the recent window go, the earliest of a tie first
        return view.drop_lowest(n - self.size, self.recent)

    @property
    def decode_eviction(self) -> DecodeEviction:
        return DecodeEviction(limit=self.size, victim="lowest", recent=self.recent)

    def size_rule(self) -> SizeRule:
        return keep_at_most(self.size)

    min_size = 1

    @classmethod
    def from_size(cls, size: int, **overrides: Any) -> "Knorm":
        return cls(size=size, **overrides)
