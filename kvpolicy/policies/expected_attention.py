"""Expected Attention (Devoto et al., 2025, "Expected Attention: KV Cache Compression by Estimating
Attention from Future Queries Distribution")."""

from __future__ import annotations

from ..params import Param
from ..policy import Array
from ..registry import register_policy
from ..statistics import CachedTokens, expected_attention
from .lowest import KeepHighest


@register_policy
class ExpectedAttention(KeepHighest):
    """Keep the ``size`` tokens that future queries are expected to attend to most, by value norm.

    The future queries of each query head are modelled as Gaussian, with the mean and covariance
    of the queries the layer has seen (before RoPE: every query at a position ``>= sink``, a
    running estimate that each decode step's query updates), rotated by the average of RoPE's
    rotations over the next ``future`` positions. A cached key's expected attention is the softmax,
    over the non-sink cached tokens, of ``<R mu, k> / sqrt(d) + k^T R S R^T k / (2 d)`` (the log
    of ``E[exp(<q, k> / sqrt(d))]``), averaged over the query heads of its KV head; the score is
    that plus ``epsilon``, times the norm of the token's value (``score_statistic =
    "expected_attention"``, :func:`kvpolicy.statistics.expected_attention`). Backends compute
    the scores after a prompt and at every ``refresh``-th decode step (64 by default, as
    kvpress's ``DecodingPress`` compresses every ``compression_interval`` steps; attention is
    never captured): in between the held tokens keep the scores of the last scoring, and a token
    appended since scores :data:`~kvpolicy.statistics.UNSCORED` (kept before every scored token;
    when none is left outside the sinks and the recent window, the earliest unscored goes).
    ``refresh=1`` is the paper's rule at every step, rescoring every held token in float64 (the
    statistics move with every query): about 2-4x slower to decode, and worse on the stream and
    perplexity tasks (docs/policies.md measures both). The first ``sink`` tokens are always kept. While the cache holds
    more than ``size`` tokens, the lowest score outside the newest ``recent`` goes (ties: the
    earliest position): one token per decode step; after a prompt longer than ``size``, the
    ``size`` highest scores in one decision: kvpress's ``ExpectedAttentionPress`` (whose defaults
    these are) on the prompt's queries.

    Parameters:
        size: tokens kept between steps (>= 1).
        recent: newest tokens never evicted (0 to ``size - sink``; default 0, as kvpress).
        sink: first tokens always kept, whose queries are left out of the statistics (kvpress's
            ``n_sink``; default 4, at most ``size - recent``).
        future: the next positions whose RoPE rotations are averaged (``n_future_positions``, 512;
            1 to 65536: each eviction holds ``future`` rotations per row in memory).
        epsilon: added to the expected attention before the value norm multiplies it (0.0).
        covariance: use the queries' covariance, not only their mean (True).
        value_norm: multiply by the value's L2 norm (True).
        refresh: decode steps between two scorings (>= 1; default 64; 1: every step, the
            paper's rule, which kvpress applies to a prompt).
        selection: ``"per_head"`` (default): every KV head keeps its own tokens;
            ``"shared"``: scores summed over the heads of the layer, the same tokens on every head.

    Example:
        >>> from kvpolicy import ExpectedAttention
        >>> p = ExpectedAttention(size=64)
        >>> p.capacity, p.sink, p.future, p.captures_attention
        (65, 4, 512, False)
        >>> p.refresh, ExpectedAttention(size=64, refresh=1)
        (64, ExpectedAttention(size=64, recent=0, sink=4, future=512, refresh=1))
    """

    name = "expected_attention"
    score_statistic = "expected_attention"
    # size and recent are KeepHighest's, and so is the rule (the lowest score outside the recent
    # window goes). The sinks are the statistic's: they score +inf, so the rule never picks them
    # (a DecodeEviction protects sinks only with victim="oldest").
    sink = Param(int, 4, minimum=0, maximum=lambda p: p.size - p.recent,
                 doc="first tokens always kept, their queries out of the statistics (kvpress's n_sink)")
    future = Param(int, 512, minimum=1, maximum=1 << 16,  # (each eviction averages `future` rotations per row: bounded memory)
                   doc="next positions whose RoPE rotations are averaged (n_future_positions)")
    epsilon = Param(float, 0.0, minimum=0.0, high_open=True, shown="non-default", doc="added to the expected attention before the value norm")
    covariance = Param(bool, True, shown="non-default", doc="use the queries' covariance, not only their mean")
    value_norm = Param(bool, True, shown="non-default", doc="multiply by the value's L2 norm")
    # (64: the paper's every-step rule rescores every held token in float64 at every decode step,
    # 20-50% of the limit; kvpress's DecodingPress also compresses every N steps; docs/policies.md)
    refresh = Param(int, 64, minimum=1, shown="non-default", doc="decode steps between two scorings (1: every step, the paper's rule)")

    min_size = 5  # the default sink (4) and one token to evict

    def cache_score(self, tokens: CachedTokens) -> Array:
        """Each token's expected attention times its value norm (:func:`kvpolicy.statistics.expected_attention`)."""
        if tokens.values is None or tokens.moments is None:
            raise ValueError(f"{self!r} scores from keys, values and the queries' moments: values and moments are required")
        return expected_attention(
            tokens.keys, tokens.values, tokens.positions, tokens.n_seen, tokens.moments, sink=self.sink, future=self.future,
            epsilon=self.epsilon, rotary=tokens.rotary, covariance=self.covariance, value_norm=self.value_norm,
        )
