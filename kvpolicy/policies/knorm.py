"""Knorm (Devoto et al., 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache
Compression")."""

from __future__ import annotations

from ..policy import Array, array_namespace
from ..registry import register_policy
from ..statistics import CachedTokens
from .lowest import KeepHighest


@register_policy
class Knorm(KeepHighest):
    """Keep the ``size`` tokens whose keys have the lowest L2 norm.

    A token's score is minus the L2 norm of its cached key, in float64 (``score_statistic =
    "key_norm"``, as :func:`kvpolicy.statistics.key_scores` gives it): the backends compute it from the keys they hold, so
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
        """Minus the L2 norm of each cached key, in float64 (holes are the backends' to mask:
        :meth:`~kvpolicy.EvictionPolicy.cache_score`; a decode token, scored when it is cached, is
        none, so its score is these three ops)."""
        xp = array_namespace(tokens.keys)
        keys = tokens.keys if tokens.keys.dtype == xp.float64 else xp.astype(tokens.keys, xp.float64)
        return -xp.linalg.vector_norm(keys, axis=-1)
