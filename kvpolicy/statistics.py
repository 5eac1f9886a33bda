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

from typing import Any

from array_api_compat import device

from .policy import Array, array_namespace

__all__ = ["COSINE_GRID", "KEY_EPS", "LOW_MARGIN", "MAX_HISTORY", "history_counts", "history_record", "key_scores", "low_attention", "shift_history"]

#: KeyDiff's cosines are rounded to multiples of this (``2 ** -30``, far below the float32 precision
#: of a model's keys): cosines equal up to float rounding, which any two candidates have when there
#: are two (each is as similar to their mean), are then exactly equal on every backend, whatever
#: order each sums in, and the tie goes to the earliest position.
COSINE_GRID = 2.0**-30
#: Norms below this count as this when a key (or KeyDiff's anchor) is L2-normalised, as
#: ``torch.nn.functional.normalize`` does: a zero key has cosine 0 with everything.
KEY_EPS = 1e-12

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
    k = xp.astype(keys, xp.float64)
    kept = positions >= 0
    norm = xp.sqrt(xp.sum(k * k, axis=-1))
    if statistic == "key_norm":
        score = -norm
    elif statistic == "key_diff":
        unit = k / xp.clip(norm, min=KEY_EPS)[..., None]
        candidate = kept & (positions < n_seen - recent)
        weight = xp.astype(candidate, xp.float64)
        count = xp.clip(xp.sum(weight, axis=-1, keepdims=True), min=1.0)
        anchor = xp.sum(unit * weight[..., None], axis=-2) / count  # [..., d]
        anchor = anchor / xp.clip(xp.sqrt(xp.sum(anchor * anchor, axis=-1, keepdims=True)), min=KEY_EPS)
        cosine = xp.sum(unit * anchor[..., None, :], axis=-1)
        score = -xp.round(cosine / COSINE_GRID) * COSINE_GRID
    else:
        raise ValueError(f"statistic must be one of key_norm, key_diff, got {statistic!r}")
    return xp.where(kept, score, xp.full_like(score, xp.inf))
