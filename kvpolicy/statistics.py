"""Scissorhands' score statistic, on any array namespace: a per-token record of low-attention events.

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

__all__ = ["LOW_MARGIN", "MAX_HISTORY", "history_counts", "history_record", "low_attention", "shift_history"]

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
