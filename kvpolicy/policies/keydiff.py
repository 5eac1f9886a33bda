"""KeyDiff (Park et al., 2025, "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context
LLM Inference in Resource-Constrained Environments")."""

from __future__ import annotations

from ..params import Param
from ..policy import Array, CandidateSum, array_namespace
from ..registry import register_policy
from ..statistics import COSINE_GRID, KEY_EPS, CachedTokens, anchor_scores, key_anchor, key_scores, unit_keys
from .lowest import KeepHighest


class UnitKeySum(CandidateSum):
    """KeyDiff's score as a sum over the candidates (:class:`kvpolicy.CandidateSum`): a token's
    score depends on the others only through the sum of their unit keys (the anchor is their
    mean, normalised). The estimate is the same cosine in float32 (a matrix product: a backend that
    may run float32 products in lower precision, a GPU's TF32, does not use the estimate)."""

    def summand(self, keys: Array) -> Array:
        return unit_keys(keys)

    def statistic(self, total: Array, count: Array) -> Array:
        return key_anchor(total, count)

    def exact(self, keys: Array, summand: Array, statistic: Array) -> Array:
        return anchor_scores(summand, statistic)

    def estimate(self, keys: Array, statistic: Array) -> Array:
        xp = array_namespace(keys)
        k = keys if keys.dtype == xp.float32 else xp.astype(keys, xp.float32)  # (float32 keys: no copy)
        # (`@`, both float32: the compat wrapper's matmul would cast each to it again)
        dot = (xp.astype(statistic, xp.float32)[..., None, :] @ xp.matrix_transpose(k))[..., 0, :]
        return -dot / xp.clip(xp.linalg.vector_norm(k, axis=-1), min=KEY_EPS)

    def error(self, head_dim: int) -> float:
        # float32 (unit roundoff 2**-24): the key's and the anchor's rounding, a d-term dot product,
        # a d-term norm and a division are each within (d + 2) units of a cosine of at most 1; twice
        # that for margin, and half the grid the exact cosine is rounded to
        return (4 * head_dim + 16) * 2.0**-24 + COSINE_GRID


@register_policy
class KeyDiff(KeepHighest):
    """Keep the ``size`` tokens whose keys differ most from the others.

    A token's score is minus the cosine similarity of its cached key with the anchor, the mean of
    the candidates' L2-normalised keys (``score_statistic = "key_diff"``,
    :func:`kvpolicy.statistics.key_scores`); the candidates are the cached tokens outside the
    newest ``recent``. Backends compute the scores from the keys they hold after a prompt and at
    every ``refresh``-th decode step (64 by default; ``refresh=1``: before every eviction decision,
    the paper's decode rule, as the anchor moves with every token that comes and goes), so
    attention is never captured. While the cache holds more than ``size`` tokens, the candidate
    most similar to the anchor goes (the lowest score; ties: the earliest position): one token per
    decode step; after a prompt longer than ``size``, the ``size`` least similar keys (the newest
    ``recent`` among them) are kept in one decision, kvpress's ``KeyDiffPress`` when ``recent=0``.

    Parameters:
        size: tokens kept between steps (>= 1).
        recent: newest tokens never evicted and not in the anchor (0 to ``size - 1``; default 0,
            the paper's rule).
        refresh: decode steps between two scorings (>= 1; default 64; 1: every step, the paper's
            rule). With ``N > 1`` the keys are scored after a prompt and at every ``N``-th decode
            step (as kvpress's ``DecodingPress`` compresses every ``N`` steps); in between the held
            tokens keep their scores and a token appended since scores
            :data:`~kvpolicy.statistics.UNSCORED` (kept before every scored one), as Expected
            Attention's ``refresh``: a decode step no longer rescores every held key (faster, and
            on the embedded model better: docs/policies.md, KeyDiff).
        selection: ``"per_head"`` (default): every KV head keeps its own tokens (its own anchor);
            ``"shared"``: scores summed over the heads of the layer, the same tokens on every head.

    Example:
        >>> from kvpolicy import KeyDiff
        >>> p = KeyDiff(size=64, recent=4)
        >>> p.capacity, p.key_recent, p.captures_attention
        (65, 4, False)
        >>> p.refresh, KeyDiff(size=64, refresh=1)
        (64, KeyDiff(size=64, recent=0, refresh=1))
    """

    name = "keydiff"
    score_statistic = "key_diff"
    candidate_sum = UnitKeySum()  # the anchor is a sum over the candidates: kept from step to step

    recent = Param(int, 0, minimum=0, maximum=lambda p: p.size - 1,
                   doc="most recent tokens always kept, outside the anchor (0: the paper's rule)")
    # (64: the paper's every-step rule rescores every held key at every decode step, 60-80% of
    # the limit, and evicts the newest keys as readily as any; docs/policies.md measures both)
    refresh = Param(int, 64, minimum=1, shown="non-default", doc="decode steps between two scorings (1: every step, the paper's rule)")

    @property  # type: ignore[override]
    def key_recent(self) -> int:
        return self.recent

    def cache_score(self, tokens: CachedTokens) -> Array:
        """Minus each key's cosine with the anchor of the candidates (:func:`kvpolicy.statistics.key_scores`)."""
        return key_scores("key_diff", tokens.keys, tokens.positions, tokens.n_seen, tokens.recent)
