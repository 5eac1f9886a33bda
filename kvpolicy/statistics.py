"""Score statistics every backend computes with the same functions, on any array namespace.

Statistics from keys (:data:`kvpolicy.policy.KEY_STATISTICS`): :func:`key_scores` gives each cached
token's score from the cached keys, recomputed before every eviction decision: ``"key_norm"``
(Knorm: minus the key's L2 norm) and ``"key_diff"`` (KeyDiff: minus the cosine similarity of the
key with the mean of the candidates' L2-normalised keys).

Example:
    >>> import numpy as np
    >>> keys = np.array([[[3.0, 4.0], [1.0, 0.0], [0.0, 2.0]]])  # [heads, n, d]
    >>> key_scores("key_norm", keys, np.arange(3)[None], 3).tolist()
    [[-5.0, -1.0, -2.0]]
    >>> [round(x, 4) for x in key_scores("key_diff", keys, np.arange(3)[None], 3)[0].tolist()]
    [-0.9965, -0.6644, -0.7474]

Scissorhands' score statistic: a per-token record of low-attention events.

A policy whose :attr:`~kvpolicy.EvictionPolicy.score_statistic` is ``"low_history"`` (Scissorhands)
keeps, as each token's score, the record of the last ``history`` queries: bit ``k`` is 1 when the
query ``k`` steps ago gave the token less than the average attention. Every backend updates it
with these functions (the NumPy reference, the torch backend, the conformance kit), so the same
step gives the same bits everywhere:

* :func:`low_attention`: which tokens one query attends to less than average;
* :func:`history_record`: what a step contributes (the rows of a prompt, newest last; one row at
  a decode step);
* :func:`shift_history`: a score after a step of ``rows`` queries;
* :func:`history_counts`: the count of low events a record holds (what Scissorhands ranks).

Records are integers below ``2 ** history`` held in float64, exact for ``history <= 52``.

Example:
    >>> import numpy as np
    >>> received = np.array([[0.7, 0.2, 0.1]])  # one query over 3 tokens: the average is 1/3
    >>> low = low_attention(received, 1)
    >>> low.tolist()
    [[False, True, True]]
    >>> score = shift_history(np.array([[1.0, 1.0, 0.0]]), history_record(low[..., None, :], 3), 1, 3)
    >>> score.tolist(), history_counts(score, 3).tolist()
    ([[2.0, 3.0, 1.0]], [[1, 2, 1]])
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, NamedTuple

from array_api_compat import device

from .policy import KEY_STATISTICS, Array, CachedTokens, array_namespace

if TYPE_CHECKING:
    from .policy import EvictionPolicy

__all__ = [
    "ANCHOR_EPS", "COSINE_GRID", "FIRST_STAGE", "KEY_EPS", "LOW_MARGIN", "MAX_HISTORY", "SCORE_BITS", "UNSCORED", "CachedTokens", "QueryMoments", "Rotary",
    "anchor_scores", "average_rotation", "cache_scores", "critical_scores", "expected_attention", "history_counts", "history_record",
    "key_anchor", "key_scores", "lag_scores", "low_attention", "mark_unscored", "query_moments", "reconstruction_scores", "refresh_due",
    "refresh_interval", "refresh_sink", "scored_once", "shift_history", "unit_keys", "value_weights",
]

#: KeyDiff's cosines are rounded to multiples of this (``2 ** -30``, far below the float32 precision
#: of a model's keys): cosines equal up to float rounding, which any two candidates have when there
#: are two (each is as similar to their mean), are then exactly equal on every backend, whatever
#: order each sums in, and the tie goes to the earliest position.
COSINE_GRID = 2.0**-30
#: Norms below this count as this when a key (or KeyDiff's anchor) is L2-normalised, as
#: ``torch.nn.functional.normalize`` does: a zero key has cosine 0 with everything.
KEY_EPS = 1e-12
#: KeyDiff's anchor (the mean of the candidates' unit keys) shorter than this (``2 ** -30``) is
#: taken as 0: candidates whose unit keys cancel (the mean is exactly 0) leave a float rounding
#: of ~1e-17 that depends on the order each backend sums in, and normalising it would make every
#: cosine that rounding's; an anchor of 0 gives every token cosine 0 (the earliest goes).
ANCHOR_EPS = 2.0**-30

#: A token is "below average" when it receives less than ``(1 - LOW_MARGIN)`` times the average:
#: exact ties (uniform attention) stay "average" whatever the float rounding of each backend.
LOW_MARGIN = 1e-6
#: The longest history a float64 record holds exactly (52 bits of mantissa).
MAX_HISTORY = 52


def low_attention(received: Array, group: int, kept: Array | None = None) -> Array:
    """Bool ``[..., n]``: the tokens one query attends to less than average.

    Args:
        received: ``[..., n]`` the attention each token received from one query, summed over the
            ``group`` query heads of its KV head (what every backend computes).
        group: query heads per KV head (GQA); each one's attention sums to 1, so the group's
            average over the ``n`` tokens it attends to is ``group / n``.
        kept: ``[..., n]`` bool, False at slots the query does not attend to (holes, pads, later
            tokens of a prompt); ``None``: all.
    """
    xp = array_namespace(received)
    if kept is None:
        n = received.shape[-1]
        return received < (1 - LOW_MARGIN) * group / n
    n = xp.sum(xp.astype(kept, xp.float64), axis=-1, keepdims=True)
    n = xp.where(n > 0, n, xp.ones_like(n))
    return kept & (xp.astype(received, xp.float64) < (1 - LOW_MARGIN) * group / n)


def history_record(low_rows: Array, history: int) -> Array:
    """Float64 ``[..., n]``: what ``rows`` queries contribute to a record, from ``low_rows``
    ``[..., rows, n]`` (bool, the oldest row first): bit ``k`` is the row ``k`` steps before the
    newest, for the newest ``history`` rows."""
    xp = array_namespace(low_rows)
    rows = low_rows.shape[-2]
    take = min(rows, history)
    recent = low_rows[..., rows - take :, :]
    # the newest row is bit 0
    weights = xp.asarray([2.0**k for k in range(take - 1, -1, -1)], dtype=xp.float64, device=device(low_rows))
    return xp.sum(xp.astype(recent, xp.float64) * weights[:, None], axis=-2)


def shift_history(scores: Array, record: Array, rows: Any, history: int) -> Array:
    """The records after a step of ``rows`` queries (an int, or ``[batch, 1, 1]`` per row):
    ``(scores << rows) + record``, keeping the newest ``history`` bits; exact in float64."""
    xp = array_namespace(scores)
    scores = xp.astype(scores, xp.float64)
    # rows >= history shifts every old bit out: the old part is then scores % 1 == 0
    if isinstance(rows, int):
        shift = float(min(rows, history))
    else:
        shift = xp.minimum(xp.astype(rows, xp.float64), float(history))
    return (scores % 2.0 ** (history - shift)) * 2.0**shift + record


def history_counts(scores: Array, history: int) -> Array:
    """Int64 ``[..., n]``: the low events each record holds (its set bits); ``+inf`` (holes) or a
    negative score counts as ``history + 1``, so such a slot always ranks as least important."""
    xp = array_namespace(scores)
    scores = xp.astype(scores, xp.float64)
    valid = (scores >= 0) & (scores < 2.0**history)
    bits = xp.where(valid, scores, xp.zeros_like(scores))
    count = xp.zeros(scores.shape, dtype=xp.int64, device=device(scores))
    for _ in range(history):
        count = count + xp.astype(bits % 2.0, xp.int64)
        bits = xp.floor(bits / 2.0)
    return xp.where(valid, count, xp.full_like(count, history + 1))


def key_scores(statistic: str, keys: Array, positions: Array, n_seen: Any, recent: int = 0) -> Array:
    """Float64 ``[..., n]``: each cached token's score from its key, for a key statistic.

    Args:
        statistic: ``"key_norm"``: minus the key's L2 norm (Knorm keeps the smallest norms);
            ``"key_diff"``: minus the cosine similarity of the key with the anchor, the mean of
            the candidates' L2-normalised keys (KeyDiff keeps the keys least like the others).
        keys: ``[..., n, d]`` the cached keys (any real dtype; computed in float64).
        positions: ``[..., n]`` their original positions, ``-1`` at a hole or pad (score ``+inf``:
            never a victim, never a candidate).
        n_seen: tokens seen so far: an int, or an array broadcastable to ``positions[..., :1]``
            (one per row of a left-padded batch).
        recent: the newest ``recent`` positions (``>= n_seen - recent``) are no candidates of
            KeyDiff's anchor (its ``recent`` window, always kept anyway).

    Normalising divides by ``max(norm, KEY_EPS)``; a head without candidates has anchor 0, so
    cosine 0 everywhere. Cosines are rounded to multiples of :data:`COSINE_GRID` (ties that float
    rounding would otherwise break differently per backend). Raises ``ValueError`` for another statistic.
    """
    xp = array_namespace(keys)
    # (no cast, no filler array where none is needed: a decode step of every layer runs this)
    k = keys if keys.dtype == xp.float64 else xp.astype(keys, xp.float64)
    kept = positions >= 0
    norm = xp.linalg.vector_norm(k, axis=-1)  # (one kernel: Knorm scores every decode token with it)
    if statistic == "key_norm":
        score = -norm
    elif statistic == "key_diff":
        unit = unit_keys(k, norm)
        candidate = kept & (positions < n_seen - recent)
        weight = xp.astype(candidate, xp.float64)
        count = xp.clip(xp.sum(weight, axis=-1, keepdims=True), min=1.0)
        total = (weight[..., None, :] @ unit)[..., 0, :]  # [..., d] (`@`: both float64, no promotion to fix)
        score = anchor_scores(unit, key_anchor(total, count))
    else:
        raise ValueError(f"statistic must be one of key_norm, key_diff, got {statistic!r}")
    return xp.where(kept, score, xp.inf)


def unit_keys(keys: Array, norm: Array | None = None) -> Array:
    """Float64 ``[..., n, d]``: each key divided by its L2 norm (at least :data:`KEY_EPS`), what
    KeyDiff's anchor sums. Division, not a product with an inverse norm: a one-dimensional key is
    then exactly +-1, and opposite keys cancel to an anchor of exactly 0, as the rule says.
    ``norm``: the keys' norms, when the caller has them.

    Example:
        >>> import numpy as np
        >>> unit_keys(np.array([[3.0, 4.0], [0.0, 0.0]])).tolist()
        [[0.6, 0.8], [0.0, 0.0]]
    """
    xp = array_namespace(keys)
    k = keys if keys.dtype == xp.float64 else xp.astype(keys, xp.float64)  # (key_scores hands float64 keys)
    if norm is None:
        norm = xp.linalg.vector_norm(k, axis=-1)
    return k / xp.clip(norm, min=KEY_EPS)[..., None]


def key_anchor(total: Array, count: Array) -> Array:
    """Float64 ``[..., d]``: KeyDiff's anchor, the mean of the candidates' unit keys (their sum
    ``total`` ``[..., d]`` over their ``count`` ``[..., 1]``, at least 1), L2-normalised; a mean
    no longer than :data:`ANCHOR_EPS` is 0 (what is left when the unit keys cancel is rounding).

    Example:
        >>> import numpy as np
        >>> key_anchor(np.array([2.0, 0.0]), np.array([2.0])).tolist()
        [1.0, 0.0]
        >>> key_anchor(np.array([1e-17, 0.0]), np.array([4.0])).tolist()  # (cancelled: rounding left)
        [0.0, 0.0]
    """
    xp = array_namespace(total)
    anchor = total / count
    size = xp.linalg.vector_norm(anchor, axis=-1, keepdims=True)
    return xp.where(size > ANCHOR_EPS, anchor / xp.clip(size, min=ANCHOR_EPS), 0.0)


def anchor_scores(unit: Array, anchor: Array) -> Array:
    """Float64 ``[..., n]``: KeyDiff's scores of the tokens whose unit keys are ``unit``
    ``[..., n, d]`` (:func:`unit_keys`) against the ``anchor`` ``[..., d]`` (:func:`key_anchor`):
    minus the cosine, rounded to :data:`COSINE_GRID`. Any subset of the tokens may be scored: a
    token's score depends on the others only through the anchor.

    Example:
        >>> import numpy as np
        >>> unit = np.array([[1.0, 0.0], [0.0, 1.0]])
        >>> anchor = key_anchor(np.array([1.0, 1.0]), np.array([2.0]))
        >>> [round(x, 6) for x in anchor_scores(unit, anchor).tolist()]  # 45 degrees
        [-0.707107, -0.707107]
    """
    xp = array_namespace(unit)
    # (the anchor as a row against the transposed keys: a matrix times a one-column matrix
    # takes a slow batched kernel on a CPU, 3x this one at a decode step's 3 x 560 keys)
    row, keys_t = anchor[..., None, :], xp.matrix_transpose(unit)
    # (`@` where the dtypes agree, as unit_keys' and key_anchor's float64 do: the compat wrapper's
    # matmul casts each to the common dtype again, two dispatches a decode step of every layer)
    cosine = (row @ keys_t if row.dtype == keys_t.dtype else xp.matmul(row, keys_t))[..., 0, :]
    # -round(cosine / grid) * grid, in one op fewer: the grid is a power of two, so scaling by it
    # (or by minus its inverse) is exact, and rounding half to even is symmetric
    return xp.round(cosine * (-1.0 / COSINE_GRID)) * COSINE_GRID

# ============================================================================ Expected Attention
#: Expected Attention's scores are rounded to this many significant bits (far below float64's 52,
#: above float32's 24): scores equal up to float rounding, which keys equal or symmetric under the
#: query statistics have, are then exactly equal on every backend whatever order each sums in, and
#: the tie goes to the earliest position (as KeyDiff's :data:`COSINE_GRID`).
SCORE_BITS = 30


class Rotary(NamedTuple):
    """RoPE as a model rotates its queries and keys: what Expected Attention averages over the
    next positions (:func:`average_rotation`).

    Attributes:
        inv_freq: ``[rotary_dim / 2]`` rotary frequencies (a NumPy array or a tensor; a scaled
            variant's, e.g. llama3 or YaRN, as the model holds them).
        style: ``"half"`` (Llama's ``rotate_half``: pairs ``(i, i + rotary_dim / 2)``) or
            ``"interleaved"`` (pairs ``(2i, 2i + 1)``).
        rotary_dim: the leading dimensions rotated (``None``: ``2 * len(inv_freq)``); the rest
            pass through.
    """

    inv_freq: Array
    style: str = "half"
    rotary_dim: int | None = None


class QueryMoments(NamedTuple):
    """Sums over the queries a layer has seen, per row and query head: what Expected Attention's
    mean and covariance come from (:func:`query_moments`; backends add a step's sums to the
    running ones).

    Attributes:
        count: ``[batch]`` float64: queries summed (the same for every head of a row).
        total: ``[batch, kv_heads, group, d]`` float64: their sum (``group`` query heads per KV head).
        outer: ``[batch, kv_heads, group, d, d]`` float64: the sum of their outer products ``q q^T``.
    """

    count: Array
    total: Array
    outer: Array


def query_moments(queries: Array, weight: Array) -> QueryMoments:
    """The :class:`QueryMoments` of ``queries`` ``[batch, kv_heads, group, q, d]`` (any real
    dtype; summed in float64), each counted with ``weight`` ``[batch, q]`` (1: counted, 0: not,
    e.g. a pad or a sink's query).

    Example:
        >>> import numpy as np
        >>> q = np.array([[[[[1.0, 0.0], [3.0, 2.0], [9.0, 9.0]]]]])  # [1, 1, 1, 3, 2]
        >>> m = query_moments(q, np.array([[1.0, 1.0, 0.0]]))
        >>> m.count.tolist(), m.total.tolist(), m.outer.tolist()
        ([2.0], [[[[4.0, 2.0]]]], [[[[[10.0, 6.0], [6.0, 4.0]]]]])
    """
    xp = array_namespace(queries)
    q = xp.astype(queries, xp.float64)
    w = xp.astype(weight, xp.float64)
    weighted = q * w[:, None, None, :, None]
    total = xp.sum(weighted, axis=-2)
    outer = xp.matmul(xp.matrix_transpose(weighted), q)
    return QueryMoments(xp.sum(w, axis=-1), total, outer)


def average_rotation(rotary: Rotary, start: Any, future: int) -> tuple[Array, Array]:
    """The average of RoPE's rotations by positions ``start, ..., start + future - 1``, as
    ``(cos, sin)`` float64 ``[..., rotary_dim / 2]``: for each frequency pair the mean of the
    rotations' cosines and sines (an average of rotations is ``[[cos, -sin], [sin, cos]]`` with
    these means). ``start``: an int, or an integer array (one per row, e.g. ``[batch, 1, 1]``);
    angles are computed as transformers computes them (``float32(position) * inv_freq``).

    Example:
        >>> import numpy as np
        >>> c, s = average_rotation(Rotary(np.array([np.pi / 2])), 0, 4)  # 0, 90, 180, 270 degrees
        >>> [round(float(c[0]), 6), round(float(s[0]), 6)]
        [-0.0, -0.0]
        >>> c, s = average_rotation(Rotary(np.array([0.0])), 7, 3)
        >>> c.tolist(), s.tolist()
        ([1.0], [0.0])
    """
    xp = array_namespace(rotary.inv_freq)
    dev = device(rotary.inv_freq)
    freq = xp.astype(xp.asarray(rotary.inv_freq), xp.float32)
    offsets = xp.arange(future, dtype=xp.int64, device=dev)
    if isinstance(start, int):
        positions = offsets + start
    else:
        positions = xp.astype(xp.asarray(start), xp.int64)[..., None] + offsets
    angles = xp.astype(xp.astype(positions, xp.float32)[..., None] * freq, xp.float64)  # [..., future, d/2]
    return xp.mean(xp.cos(angles), axis=-2), xp.mean(xp.sin(angles), axis=-2)


def rotate_pairs(x: Array, cos: Array, sin: Array, style: str = "half", rotary_dim: int | None = None) -> Array:
    """``x`` ``[..., d]`` times the matrix ``[[cos, -sin], [sin, cos]]`` of each frequency pair
    (``cos``, ``sin`` ``[..., rotary_dim / 2]``, broadcast against ``x``); the dimensions from
    ``rotary_dim`` on pass through. RoPE's pairing (see :class:`Rotary`).

    Example:
        >>> import numpy as np
        >>> rotate_pairs(np.array([1.0, 0.0, 5.0]), np.array([0.0]), np.array([1.0]), rotary_dim=2).tolist()
        [0.0, 1.0, 5.0]
    """
    xp = array_namespace(x)
    dim = 2 * int(cos.shape[-1]) if rotary_dim is None else rotary_dim
    if style == "half":
        half = dim // 2
        a, b = x[..., :half], x[..., half:dim]
        return xp.concat([a * cos - b * sin, b * cos + a * sin, x[..., dim:]], axis=-1)
    if style != "interleaved":
        raise ValueError(f"style must be 'half' or 'interleaved', got {style!r}")
    a, b = x[..., 0:dim:2], x[..., 1:dim:2]
    ya, yb = a * cos - b * sin, b * cos + a * sin
    pairs = xp.stack([ya, yb], axis=-1)
    pairs = xp.reshape(pairs, (*pairs.shape[:-2], dim))
    return xp.concat([pairs, x[..., dim:]], axis=-1)


def _round_bits(x: Array, bits: int) -> Array:
    """Positive ``x`` rounded to ``bits`` significant bits; zero and below unchanged."""
    xp = array_namespace(x)
    positive = x > 0
    safe = xp.where(positive, x, xp.ones_like(x))
    step = 2.0 ** (xp.floor(xp.log2(safe)) - bits)
    return xp.where(positive, xp.round(safe / step) * step, x)


def expected_attention(
    keys: Array,
    values: Array,
    positions: Array,
    n_seen: Any,
    moments: QueryMoments,
    *,
    sink: int,
    future: int,
    epsilon: float = 0.0,
    rotary: Rotary | None = None,
    covariance: bool = True,
    value_norm: bool = True,
) -> Array:
    """Float64 ``[batch, kv_heads, n]``: Expected Attention's score of each cached token
    (Devoto et al., 2025), the attention future queries are expected to pay it, times its value norm.

    For each query head ``j`` of a KV head (``group`` of them) the future queries are modelled as
    Gaussian: mean ``mu_j = total / count`` and covariance ``S_j = outer / count - mu_j mu_j^T``
    (biased) of the queries summed in ``moments`` (before RoPE), rotated by ``R``, the average of
    RoPE's rotations by the next ``future`` positions ``n_seen .. n_seen + future - 1``
    (:func:`average_rotation`; the identity when ``rotary`` is ``None``). A key ``k`` (as cached:
    after RoPE) then gets the logit ``z_j = <R mu_j, k> / sqrt(d) + k^T R S_j R^T k / (2 d)``, the
    log of ``E[exp(<q, k> / sqrt(d))]`` for a Gaussian ``q`` (without the second term when not
    ``covariance``). Its probability ``p_j`` is the softmax of ``z_j`` over the candidates (cached
    tokens at positions ``>= sink``); the score is ``(mean_j p_j + epsilon) * ||v||``
    (``mean_j p_j`` when not ``value_norm``), rounded to :data:`SCORE_BITS` significant bits.
    Sinks (positions ``< sink``), holes and pads (position ``-1``) score ``+inf``. With no query
    counted yet the mean and covariance are 0 (every candidate equally likely).

    Args:
        keys: ``[batch, kv_heads, n, d]`` cached keys; values: ``[batch, kv_heads, n, dv]``.
        positions: ``[batch, kv_heads, n]`` their original positions, ``-1`` at a hole or pad.
        n_seen: tokens seen: an int, or an array broadcastable to ``positions[..., :1]`` (per row).
        moments: the queries' sums (:class:`QueryMoments`).
        sink, future, epsilon, covariance, value_norm: the policy's (:class:`~kvpolicy.ExpectedAttention`).
        rotary: the model's RoPE (:class:`Rotary`), ``None`` for none.

    Example:
        >>> import numpy as np
        >>> keys = np.array([[[[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]]])   # [1, 1, 3, 2]
        >>> queries = np.array([[[[[2.0, 0.0], [2.0, 0.0]]]]])         # two queries, both (2, 0)
        >>> m = query_moments(queries, np.ones((1, 2)))
        >>> s = expected_attention(keys, keys, np.arange(3)[None, None], 3, m, sink=1, future=1)
        >>> [round(float(x), 4) for x in s[0, 0]]  # token 0 a sink; logits 0 and sqrt 2; times |v|
        [inf, 0.1956, 1.1376]
    """
    xp = array_namespace(keys)
    k = xp.astype(keys, xp.float64)
    d = int(k.shape[-1])
    if k.shape[-2] == 0:  # nothing cached
        return xp.zeros(positions.shape, dtype=xp.float64, device=device(positions))
    kept = positions >= 0
    candidate = kept & (positions >= sink)
    count = xp.clip(xp.astype(moments.count, xp.float64), min=1.0)[:, None, None, None]  # [batch, 1, 1, 1]
    mean = moments.total / count  # [batch, kv_heads, group, d]
    cov = moments.outer / count[..., None] - mean[..., :, None] * mean[..., None, :] if covariance else None
    if rotary is not None:
        start = n_seen if isinstance(n_seen, int) else xp.reshape(xp.asarray(n_seen), (-1,))[:, None, None]
        cos, sin = average_rotation(rotary, start, future)  # [d/2], or [batch, 1, 1, d/2] per row
        cos, sin = xp.astype(cos, xp.float64), xp.astype(sin, xp.float64)
        # The statistics rotated, R mu and R S R^T (as kvpress rotates them), not the n keys by
        # R's transpose: group x d x (1 + 2d) values against n x d, and fewer as n grows
        mean = rotate_pairs(mean, cos, sin, rotary.style, rotary.rotary_dim)
        if cov is not None:
            c, s = cos[..., None, :], sin[..., None, :]  # (over S's rows: a per-row start broadcasts one axis further)
            rows = rotate_pairs(cov, c, s, rotary.style, rotary.rotary_dim)  # S R^T
            cov = xp.matrix_transpose(rotate_pairs(xp.matrix_transpose(rows), c, s, rotary.style, rotary.rotary_dim))  # R S R^T
    # One product per KV head over its whole group ([n, d] x [d, group * d]), not one per query
    # head against the keys repeated (a broadcast matmul copies them group times): 4-5x faster.
    batch, kv_heads, group = (int(x) for x in mean.shape[:3])
    z = xp.matrix_transpose(xp.matmul(k, xp.matrix_transpose(mean))) / math.sqrt(d)  # [batch, kv_heads, group, n]
    if cov is not None:
        side = xp.reshape(xp.permute_dims(cov, (0, 1, 3, 2, 4)), (batch, kv_heads, d, group * d))  # [.., d, group * d]
        ks = xp.reshape(xp.matmul(k, side), (batch, kv_heads, -1, group, d))  # k^T S_j per token and query head
        z = z + xp.matrix_transpose(xp.sum(ks * k[:, :, :, None, :], axis=-1)) / (2 * d)
    mask = candidate[:, :, None, :]
    z = xp.where(mask, z, xp.full_like(z, -xp.inf))
    top = xp.max(z, axis=-1, keepdims=True)
    top = xp.where(xp.isfinite(top), top, xp.zeros_like(top))
    e = xp.where(mask, xp.exp(z - top), xp.zeros_like(z))
    norm = xp.sum(e, axis=-1, keepdims=True)
    probs = xp.mean(e / xp.where(norm > 0, norm, xp.ones_like(norm)), axis=-2)  # [batch, kv_heads, n]
    if value_norm:
        v = xp.astype(values, xp.float64)
        probs = (probs + epsilon) * xp.sqrt(xp.sum(v * v, axis=-1))
    score = _round_bits(probs, SCORE_BITS)
    return xp.where(candidate, score, xp.full_like(score, xp.inf))


def _round_signed(x: Array, bits: int) -> Array:
    """``x`` rounded to ``bits`` significant bits, either sign (:func:`_round_bits` of ``|x|``)."""
    xp = array_namespace(x)
    return xp.where(x < 0, -_round_bits(-x, bits), _round_bits(x, bits))


# ============================================================================ LagKV
def _leading_holes(positions: Array) -> Array:
    """``[..., 1]`` int64: the slots of a row holding no token (position ``-1``: holes, pads)."""
    xp = array_namespace(positions)
    held = xp.astype(positions >= 0, xp.int64)
    return positions.shape[-1] - xp.sum(held, axis=-1, keepdims=True)


def _partition_scores(x: Array, lag: int) -> Array:
    """``[..., parts - 1, lag]``: LagKV's score of each token of partitions ``0 .. parts - 2`` of
    ``x`` ``[..., parts, lag, d]`` (float64): each channel scaled to ``[0, 1]`` by the next
    partition's min and max (0 where they are equal), the standard deviation over the channels
    (divided by ``d - 1``, or 1 when ``d == 1``), a softmax over the partition."""
    xp = array_namespace(x)
    ref, tokens = x[..., 1:, :, :], x[..., :-1, :, :]
    low, high = xp.min(ref, axis=-2, keepdims=True), xp.max(ref, axis=-2, keepdims=True)
    span = high - low
    scaled = xp.where(span > 0, (tokens - low) / xp.where(span > 0, span, xp.ones_like(span)), xp.zeros_like(tokens))
    d = int(x.shape[-1])
    centred = scaled - xp.mean(scaled, axis=-1, keepdims=True)
    std = xp.sqrt(xp.sum(centred * centred, axis=-1) / max(d - 1, 1))
    e = xp.exp(std - xp.max(std, axis=-1, keepdims=True))
    return e / xp.sum(e, axis=-1, keepdims=True)


def lag_scores(keys: Array, values: Array, positions: Array, *, sink: int, lag: int, cross_scoring: bool = False) -> Array:
    """Float64 ``[..., n]``: LagKV's score of each cached token (Liang et al., 2025), from the keys
    and values alone, as kvpress's ``LagKVPress`` scores a cache of ``m`` tokens.

    A head's held tokens, in position order (holes and pads, position ``-1``, are left out; a
    backend's slot order does not matter), are the first ``sink`` (score 1), then partitions of ``lag`` tokens. Each partition but
    the last complete one is scored against the next (its *lag*): every channel of a key is scaled
    by the next partition's min and max over its tokens to ``(k - min) / (max - min)`` (0 where
    ``max == min``, which kvpress leaves a NaN), the token's key score is the standard deviation of
    the scaled channels (``d - 1`` degrees of freedom), softmaxed over the partition, and the same
    for the values; the token's score is the mean of the two, rounded to :data:`SCORE_BITS`
    significant bits, then (unless ``cross_scoring``) replaced by its rank in the partition over
    ``lag`` (``0, 1 / lag, ..., (lag - 1) / lag``; equal scores: the earlier ranks lower). The
    last complete partition and the incomplete one after it score 1 (always kept first). A head
    holding fewer than ``sink + 2 lag`` tokens has nothing scored against a lag: its sinks score 1
    and the token ``i`` after them ``i / (m - sink)`` (the newest ranked highest, kvpress's ramp).
    Holes score 0 here (:func:`cache_scores` makes them ``+inf``).

    Args:
        keys: ``[..., n, d]``; values: ``[..., n, dv]`` (``None``: scored from the keys alone).
        positions: ``[..., n]``, ``-1`` at a hole or pad.
        sink, lag, cross_scoring: the policy's (:class:`~kvpolicy.LagKV`).

    Example:
        >>> import numpy as np
        >>> keys = np.array([[0.0, 1], [2, 0], [1, 1], [0, 2], [5, 0], [1, 0], [0, 1], [3, 3], [9, 9]])[None]
        >>> lag_scores(keys, keys, np.arange(9)[None], sink=1, lag=2).tolist()  # a sink, 3 partitions by their lag, the last
        [[1.0, 0.5, 0.0, 0.0, 0.5, 0.0, 0.5, 1.0, 1.0]]
        >>> lag_scores(keys[:, :6], keys[:, :6], np.arange(6)[None], sink=2, lag=3).tolist()  # 6 < 2 + 2 x 3: the ramp
        [[1.0, 1.0, 0.0, 0.25, 0.5, 0.75]]
    """
    xp = array_namespace(keys)
    dev = device(positions)
    n = int(positions.shape[-1])
    # a backend's slots need not be in position order (an O(1) decode eviction reuses a slot): the
    # head's tokens in position order, holes (-1) first, its i-th token at sorted slot i + lead
    order = xp.argsort(positions, axis=-1, stable=True)
    lead = _leading_holes(positions)  # [..., 1]
    held = n - lead  # the tokens each head holds
    slot = xp.arange(n, dtype=xp.int64, device=dev)
    source = xp.take_along_axis(order, xp.clip(slot + lead, max=n - 1), axis=-1)  # [..., n]: the slot of token i
    i = xp.astype(xp.broadcast_to(slot, source.shape), xp.float64)
    m = xp.astype(held, xp.float64)
    ramp = xp.where(i < sink, xp.ones_like(i), (i - sink) / xp.clip(m - sink, min=1.0))
    parts = max((n - sink) // lag, 0)
    score = ramp
    if parts >= 2:
        body = xp.zeros(source.shape, dtype=xp.float64, device=dev)
        for states in (keys, values) if values is not None else (keys,):
            x = xp.astype(states, xp.float64)
            aligned = xp.take_along_axis(x, xp.broadcast_to(source[..., None], (*source.shape, int(x.shape[-1]))), axis=-2)
            window = aligned[..., sink : sink + parts * lag, :]
            grouped = xp.reshape(window, (*window.shape[:-2], parts, lag, int(x.shape[-1])))
            part = xp.reshape(_partition_scores(grouped, lag), (*window.shape[:-2], (parts - 1) * lag))
            ones = xp.ones((*part.shape[:-1], sink), dtype=xp.float64, device=dev)
            rest = xp.ones((*part.shape[:-1], n - sink - (parts - 1) * lag), dtype=xp.float64, device=dev)
            body = body + xp.concat([ones, part, rest], axis=-1)
        body = _round_bits(body / (2.0 if values is not None else 1.0), SCORE_BITS)
        if not cross_scoring:
            cut = body[..., sink : sink + (parts - 1) * lag]
            cut = xp.reshape(cut, (*cut.shape[:-1], parts - 1, lag))
            rank = xp.argsort(xp.argsort(cut, axis=-1, stable=True), axis=-1, stable=True)
            rank = xp.reshape(xp.astype(rank, xp.float64) / lag, (*cut.shape[:-2], (parts - 1) * lag))
            body = xp.concat([body[..., :sink], rank, body[..., sink + (parts - 1) * lag :]], axis=-1)
        # a token is scored against a lag when its head's own partitions reach two past its own
        own = (m - sink) // lag  # the head's complete partitions
        scored = (i >= sink) & (xp.floor((i - sink) / lag) <= own - 2) & (m >= sink + 2 * lag)
        tail = (i >= sink) & (m >= sink + 2 * lag)
        score = xp.where(scored, body, xp.where(tail, xp.ones_like(ramp), ramp))
    # back to the head's slots: the slot order[j] holds its (j - lead)-th token
    by_sorted = xp.take_along_axis(score, xp.clip(slot - lead, min=0), axis=-1)
    out = xp.take_along_axis(by_sorted, xp.argsort(order, axis=-1, stable=True), axis=-1)
    return xp.where(positions >= 0, out, xp.zeros_like(out))


# ============================================================================ CriticalKV
def value_weights(values: Array, projection: Array | None = None) -> Array:
    """Float64 ``[batch, kv_heads, n]``: CriticalKV's weight of each cached value (Feng et al.,
    2025): the L1 norm of the value projected through the output projection ``W_o`` of each query
    head of its KV head, averaged over the group (kvpress's ``CriticalKVPress.vwl1norm``); without
    ``projection`` the value's own L1 norm (``W_o`` taken as the identity).

    Args:
        values: ``[batch, kv_heads, n, dv]`` the cached values.
        projection: ``[kv_heads, group, dv, hidden]``: the rows of ``W_o`` (``o_proj.weight``
            transposed) that query head ``g`` of KV head ``h`` multiplies, or ``None``.

    Example:
        >>> import numpy as np
        >>> v = np.array([[[[1.0, -2.0], [0.0, 3.0]]]])  # one KV head, two tokens
        >>> value_weights(v).tolist()
        [[[3.0, 3.0]]]
        >>> w_o = np.array([[[[1.0, 0.0], [0.0, 2.0]], [[1.0, 1.0], [0.0, 0.0]]]])  # two query heads
        >>> value_weights(v, w_o).tolist()  # head 0: |1| + |-4| and |0| + |6|; head 1: |1| + |1| and 0
        [[[3.5, 3.0]]]
    """
    xp = array_namespace(values)
    v = xp.astype(values, xp.float64)
    if projection is None:
        return xp.sum(xp.abs(v), axis=-1)
    w = xp.astype(xp.asarray(projection, device=device(values)), xp.float64)  # [kv_heads, group, dv, hidden]
    projected = xp.matmul(v[:, :, None, :, :], w[None])  # [batch, kv_heads, group, n, hidden]
    return xp.mean(xp.sum(xp.abs(projected), axis=-1), axis=-2)


#: CriticalKV's score of a first-stage token (:func:`critical_scores`; kvpress writes its dtype's
#: largest finite value): above any second-stage score, below :data:`UNSCORED` and the ``+inf`` of
#: sinks and holes, and finite, so a head whose candidates are all first-stage tokens (a recent
#: window beside ``first_stage_ratio = 1``) still evicts one, the earliest, on every backend (the
#: torch backend never picks a ``+inf`` victim), and a sum over a layer's heads stays finite.
FIRST_STAGE = 2.0**999


def critical_scores(scores: Array, weights: Array, positions: Array, first: int, epsilon: float) -> Array:
    """Float64 ``[..., n]``: CriticalKV's two-stage score (Feng et al., 2025; kvpress's
    ``CriticalKVPress.score``): the ``first`` highest ``scores`` of each head (stage one, the
    scorer's own choice; a tie: the later token) score :data:`FIRST_STAGE`, every other token ``(score +
    epsilon) x weight`` (stage two: ``weights`` from :func:`value_weights`), rounded to
    :data:`SCORE_BITS` significant bits; a score that is not finite (Expected Attention's sinks,
    ``+inf``) stays as it is. Holes and pads (position ``-1``) never take a first-stage place.

    Example:
        >>> import numpy as np
        >>> s, w = np.array([[0.5, 0.125, 0.25, 0.375]]), np.array([[1.0, 4.0, 1.0, 2.0]])
        >>> critical_scores(s, w, np.arange(4)[None], first=1, epsilon=0.0).tolist() == [[FIRST_STAGE, 0.5, 0.25, 0.75]]
        True
    """
    xp = array_namespace(scores)
    s = xp.astype(scores, xp.float64)
    n = int(s.shape[-1])
    ranked = xp.where(positions >= 0, xp.where(xp.isnan(s), -xp.inf, s), -xp.inf)
    # ascending by score, a tie by position (a backend's slots need not be in position order)
    by_position = xp.argsort(positions, axis=-1, stable=True)
    order = xp.take_along_axis(by_position, xp.argsort(xp.take_along_axis(ranked, by_position, axis=-1), axis=-1, stable=True), axis=-1)
    place = xp.argsort(order, axis=-1, stable=True)  # a token's place, ascending
    finite = xp.isfinite(s)
    weighted = (xp.where(finite, s, xp.zeros_like(s)) + epsilon) * xp.astype(weights, xp.float64)
    weighted = xp.where(finite, _round_signed(weighted, SCORE_BITS), s)  # (a sink's +inf stays the scorer's verdict)
    # (a sink's +inf takes a first-stage place, as kvpress's largest value does, and stays +inf:
    # never a victim, also when a refresh interval's unscored tokens outrank the first stage)
    return xp.where((place >= n - first) & finite, xp.full_like(s, FIRST_STAGE), weighted)


# ---------------------------------------------------------------------------- refresh interval
#: The score a token appended since the last scoring holds until the next one, when scores are
#: recomputed only every ``refresh`` decode steps (Expected Attention's ``refresh``,
#: :func:`mark_unscored`): above any score a scoring gives (a probability plus ``epsilon``, times
#: a value norm), below the sinks' and holes' ``+inf``; so such tokens are kept before every scored
#: one, the earliest of them goes first (the victim rule's tie), and a shared selection's sum of
#: it over the heads stays finite, below the sinks.
UNSCORED = 2.0**1000


def scored_once(policy: "EvictionPolicy") -> bool:
    """Whether a backend scores each decode token of ``policy`` once, when it is cached, and keeps
    the score: its score comes from the cache and its scorer declares it token-local
    (:attr:`~kvpolicy.EvictionPolicy.score_once`: Knorm). Prompt chunks and general evictions
    still score every held token (the same values).

    Example:
        >>> from kvpolicy import H2O, KeyDiff, Knorm
        >>> scored_once(Knorm(size=8)), scored_once(KeyDiff(size=8)), scored_once(H2O(heavy=2, recent=2))
        (True, False, False)
    """
    return policy.score_statistic in KEY_STATISTICS and bool(policy.statistic_policy.score_once)


def refresh_interval(policy: "EvictionPolicy") -> int:
    """Decode steps between two scorings of a policy whose scores come from the cache: its (or its
    wrapper's scorer's) ``refresh`` parameter (Expected Attention's, KeyDiff's, or any scorer that
    declares one), 1 for any other (every step), and 1 for a score declared token-local
    (:func:`scored_once`: it never goes stale).

    Example:
        >>> from kvpolicy import ExpectedAttention, Knorm
        >>> refresh_interval(ExpectedAttention(size=8, refresh=4)), refresh_interval(Knorm(size=8))
        (4, 1)
    """
    if scored_once(policy):
        return 1
    return int(getattr(policy.statistic_policy, "refresh", 1))


def refresh_due(refresh: int, n_seen: Any, scored_seen: Any) -> Any:
    """Whether scores last computed when ``scored_seen`` tokens had been seen are computed afresh at
    a decode step with ``n_seen`` seen: once ``refresh`` tokens were seen since (every
    ``refresh``-th decode step), or when ``n_seen`` went back below it (a restored snapshot). Ints
    (a bool), or arrays per row (an array: the caller rescores when any row is due; the rows of
    a batch advance together). After a prompt, and at the first decision, scores are always
    computed (the caller's rule).

    Example:
        >>> [refresh_due(3, n, 10) for n in (9, 10, 11, 12, 13)]
        [True, False, False, False, True]
    """
    return (n_seen - scored_seen >= refresh) | (n_seen < scored_seen)


def refresh_sink(policy: "EvictionPolicy") -> int:
    """The first positions a refresh interval leaves scored ``+inf`` between two scorings (what a
    scoring gives them): Expected Attention's ``sink`` (its scorer's under a wrapper), 0 for a
    policy without one (KeyDiff).

    Example:
        >>> from kvpolicy import ExpectedAttention, KeyDiff
        >>> refresh_sink(ExpectedAttention(size=8, sink=2)), refresh_sink(KeyDiff(size=8))
        (2, 0)
    """
    return int(getattr(policy.statistic_policy, "sink", 0)) if policy.observes_queries else 0


def mark_unscored(scores: Array, positions: Array, scored_seen: Any, sink: int) -> Array:
    """``scores`` between two scorings: the tokens appended since the last one (positions at or
    after ``scored_seen``, an int or an array broadcastable per row) score :data:`UNSCORED`, or
    ``+inf`` if they are sinks (positions below ``sink``, as a scoring gives them); the rest keep
    the scores that scoring gave them.

    Example:
        >>> import numpy as np
        >>> s = mark_unscored(np.array([np.inf, 0.5, 0.0, 0.0, np.inf]), np.array([0, 1, 2, 3, -1]), 2, sink=3)
        >>> s.tolist() == [np.inf, 0.5, np.inf, UNSCORED, np.inf]
        True
    """
    xp = array_namespace(scores)
    new = xp.where(positions >= sink, xp.full_like(scores, UNSCORED), xp.full_like(scores, xp.inf))
    return xp.where(positions >= scored_seen, new, scores)


def cache_scores(
    policy: "EvictionPolicy",
    keys: Array,
    values: Array | None,
    positions: Array,
    n_seen: Any,
    moments: QueryMoments | None = None,
    rotary: Rotary | None = None,
) -> Array:
    """The scores of a policy whose statistic is computed from the cache
    (:data:`kvpolicy.KEY_STATISTICS`): what every backend calls before an eviction decision. The
    policy declares the score itself (:meth:`~kvpolicy.EvictionPolicy.cache_score`; a wrapper's,
    such as AdaKV's, is its scorer's); this function hands it the cache as
    :class:`CachedTokens`, puts ``+inf`` at holes and pads (never a victim) and refuses a score
    of the wrong shape by the policy's name.

    Example:
        >>> import numpy as np
        >>> from kvpolicy import Knorm
        >>> cache_scores(Knorm(size=1), np.array([[[[3.0, 4.0]]]]), None, np.zeros((1, 1, 1), dtype=int), 1).tolist()
        [[[-5.0]]]
    """
    scorer = policy.statistic_policy
    tokens = CachedTokens(keys, values, positions, n_seen, policy.key_recent, moments, rotary)
    score = scorer.cache_score(tokens)
    xp = array_namespace(positions)
    if tuple(score.shape) != tuple(positions.shape):
        raise ValueError(
            f"{scorer!r}.cache_score must return one score per cached token, shape {tuple(positions.shape)}; "
            f"got {tuple(score.shape)}"
        )
    score = score if score.dtype == xp.float64 else xp.astype(score, xp.float64)
    return xp.where(positions >= 0, score, xp.inf)


# ============================================================================ context reconstruction
def reconstruction_scores(probs: Array, context: int) -> Array:
    """Float64 ``[..., context]``: KVzip's score of each context token (Kim et al., 2025), the most
    attention it receives from any query of the reconstruction (the model fed a repeat prompt and
    the context again after the context) in any query head of its KV head.

    Args:
        probs: ``[..., group, rows, m]`` the reconstruction queries' attention probabilities (each
            row a softmax over the keys it attends to: the context tokens scored, then the
            reconstruction's own, causal), over ``m`` keys of which the first ``context`` are
            scored; ``group``: the query heads of a KV head.
        context: the leading columns scored.

    Example:
        >>> import numpy as np
        >>> probs = np.array([[[[0.125, 0.375, 0.5, 0.0], [0.2, 0.2, 0.4, 0.2]]]])  # 1 head, 2 rows, 4 keys
        >>> reconstruction_scores(probs, 2).tolist()  # the most each of the 2 context keys gets
        [[0.2, 0.375]]
    """
    xp = array_namespace(probs)
    return xp.astype(xp.max(xp.max(probs[..., :context], axis=-2), axis=-2), xp.float64)
