"""Knorm (Devoto et al., 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache
Compression")."""

from __future__ import annotations

from ..policy import Array
from ..registry import register_policy
from ..statistics import CachedTokens, key_scores
from .lowest import KeepHighest


@register_policy
class Knorm(KeepHighest):
    """Keep the ``size`` tokens whose keys have the lowest L2 norm.

    A token's score is minus the L2 norm of its cached key (``score_statistic = "key_norm"``,
    :func:`kvpolicy.statistics.key_scores`): the backends compute it from the keys they hold, so
    attention is never captured (decode takes plain SDPA); a norm depends on its key alone
    (``score_once``), so a decode token is scored once, when it is cached. While the cache holds more than
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
    score_once = True  # a key's norm is its own: scored once, when the key is cached

    def cache_score(self, tokens: CachedTokens) -> Array:
        """Minus the L2 norm of each cached key (:func:`kvpolicy.statistics.key_scores`)."""
        return key_scores("key_norm", tokens.keys, tokens.positions, tokens.n_seen)
