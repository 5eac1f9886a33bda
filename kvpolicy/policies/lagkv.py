"""LagKV (Liang et al., 2025, "LagKV: Lag-Relative Information of the KV Cache Tells Which Tokens
Are Important")."""

from __future__ import annotations

from ..params import Param
from ..policy import Array
from ..registry import register_policy
from ..statistics import CachedTokens, lag_scores
from .lowest import KeepHighest


@register_policy
class LagKV(KeepHighest):
    """Keep the ``size`` tokens whose keys and values stand out most against the next partition's.

    Attention-free: a token's score comes from the cached keys and values alone
    (``score_statistic = "cache"``, :func:`kvpolicy.statistics.lag_scores`). After the first
    ``sink`` tokens, a head's cache is cut into partitions of ``lag`` tokens; each partition is
    scored against the next one (its lag): every channel scaled by the next partition's min and
    max, the standard deviation over the channels softmaxed over the partition, keys and values
    averaged, then (unless ``cross_scoring``) replaced by its rank within the partition. The sinks,
    the last complete partition and the tokens after it score 1, above every ranked token; a cache
    of fewer than ``sink + 2 lag`` tokens keeps its sinks and then its newest tokens. While the
    cache holds more than ``size`` tokens, the lowest score outside the newest ``recent`` goes
    (ties, which ranks make common across partitions: the earliest position): one token per decode
    step; after a prompt longer than ``size``, the ``size`` highest in one decision: kvpress's
    ``LagKVPress`` (whose defaults these are), but for its ties (``topk``'s order) and a channel
    whose lag has one value (0 here, NaN there). The scores are computed after a prompt and at
    every ``refresh``-th decode step (64 by default), held in between, the tokens appended since
    scoring :data:`~kvpolicy.statistics.UNSCORED` (kept before every scored one), as KeyDiff's and
    Expected Attention's ``refresh`` (as kvpress's ``DecodingPress`` compresses every ``N`` steps):
    every eviction moves the partitions after it, so ``refresh=1``, rescoring the whole cache at
    every decode step (``O(n d)`` with a sort), ran at 17-78% of the limit (docs/policies.md,
    LagKV).

    Parameters:
        size: tokens kept between steps (>= 1).
        recent: newest tokens never evicted (0 to ``size - 1``; default 0, as kvpress).
        sink: first tokens always scored 1 (kvpress's ``n_sink``, 4).
        lag: tokens per partition (kvpress's ``lag_size``, 128).
        cross_scoring: compare the softmaxed scores across partitions instead of ranks (False).
        refresh: decode steps between two scorings (>= 1; default 64; 1: every step).
        selection: ``"per_head"`` (default) or ``"shared"`` (scores summed over a layer's heads).

    Example:
        >>> from kvpolicy import LagKV
        >>> p = LagKV(size=64, lag=16)
        >>> p.capacity, p.sink, p.captures_attention
        (65, 4, False)
        >>> LagKV(size=64, lag=16).refresh, LagKV(size=64, lag=16, refresh=1)
        (64, LagKV(size=64, recent=0, sink=4, lag=16, refresh=1))
    """

    name = "lagkv"
    score_statistic = "cache"

    sink = Param(int, 4, minimum=0, doc="first tokens always kept (n_sink)")
    lag = Param(int, 128, minimum=1, doc="tokens per partition, each scored against the next (lag_size)")
    cross_scoring = Param(bool, False, shown="non-default", doc="rank scores across partitions, not within")
    refresh = Param(int, 64, minimum=1, shown="non-default", doc="decode steps between two scorings (1: every step)")

    def cache_score(self, tokens: CachedTokens) -> Array:
        """Each token's lag-relative score (:func:`kvpolicy.statistics.lag_scores`)."""
        return lag_scores(tokens.keys, tokens.values, tokens.positions, sink=self.sink, lag=self.lag,
                          cross_scoring=self.cross_scoring)
