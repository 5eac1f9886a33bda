"""Decode attention over a slot cache, with the scores the policies need, and the masks of sliding
and chunked windows on original positions (RoPE's rotations are :mod:`~kvpolicy_torch.posshift`'s).

The eager decode step's *attend* and *accumulate* live here too (:func:`attend_slots`), so that a
decode step's attention stays in one module: attention over the returned slots, holes masked, and
what each slot received folded into its score, in one pass over the keys. The common step (H2O,
BUZZ: scores accumulate, no window, no log n, no pos-shift) runs on the storage's grouped 3-D views
(:func:`grouped_decode`); every other one through :func:`decode_attention`. Received attention is
folded by the policy's statistic (:func:`~kvpolicy_torch.scores.fold_received`, the rule the static
step uses too); an accumulated score that may go down voids the victim search's candidates, whose
bound assumes scores only grow.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from kvpolicy.policy import KEY_STATISTICS, EvictionPolicy
from kvpolicy.statistics import LOW_MARGIN, low_attention

from .scores import fold_received

if TYPE_CHECKING:
    from .layout import SlotLayout

__all__ = ["add_received", "attend_slots", "decode_attention", "grouped_decode", "query_record", "window_bias",
           "window_chunk_mask", "window_limit"]


def grouped_decode(
    q3: torch.Tensor, k3: torch.Tensor, v3: torch.Tensor, scaling: float, bias3: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The common decode step of :func:`decode_attention` on its grouped 3-D operands, in as few ops
    as possible (a decode step is a few dozen tiny ops per layer: each one saved counts).

    Args:
        q3: ``[batch * kv_heads, r, head_dim]``: the ``r`` query heads of each KV head.
        k3: ``[batch * kv_heads, head_dim, n]``: the keys, transposed (a view is fine).
        v3: ``[batch * kv_heads, n, head_dim_v]``.
        scaling: the logit scale.
        bias3: ``[batch * kv_heads, 1, n]`` additive (``-inf`` at holes), or ``None``; in the
            inputs' dtype.

    Returns:
        ``(out3, probs3)``: ``[batch * kv_heads, r, head_dim_v]`` and the probabilities
        ``[batch * kv_heads, r, n]``, all in the inputs' dtype (float32 or float64: the softmax of
        a half-precision step wants :func:`decode_attention`).

    Example:
        >>> q3, k3, v3 = torch.randn(2, 3, 8), torch.randn(2, 8, 5), torch.randn(2, 5, 8)
        >>> out3, probs3 = grouped_decode(q3, k3, v3, 8 ** -0.5)
        >>> out3.shape, bool(torch.allclose(probs3.sum(-1), torch.ones(2, 3)))
        (torch.Size([2, 3, 8]), True)
    """
    if bias3 is None:
        logits3 = torch.bmm(q3, k3).mul_(scaling)
    else:  # bias + scaling * q.k in one op
        logits3 = torch.baddbmm(bias3, q3, k3, alpha=scaling)
    probs3 = torch.softmax(logits3, dim=-1)
    return torch.bmm(probs3, v3), probs3


def decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float,
    *,
    bias: torch.Tensor | None = None,
    row_scale: torch.Tensor | None = None,
    prefix: tuple[int, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one query per head over a cache's slots, and what each slot received, in one
    pass over the keys.

    Args:
        query: ``[batch, q_heads, 1, head_dim]``; key, value: ``[batch, kv_heads, n, head_dim]``
            (a ``[batch, kv_heads, lo:hi]`` view of a cache's storage reshapes without a copy).
        scaling: the logit scale.
        bias: ``[batch, kv_heads, n]`` additive (``0`` or ``-inf`` at holes), or ``None``.
        row_scale: ``[batch]`` extra logit factor per row (BUZZ's log n), or ``None``.
        prefix: ``(k, query_k)``: the logits of slots ``[0, k)`` are computed with ``query_k``
            (``query`` rotated back by those keys' pos-shift: StreamingLLM's sinks), or ``None``.

    Returns:
        ``(out, received)``: ``out`` ``[batch, 1, q_heads, head_dim]`` (the layout transformers'
        attention functions return) and ``received`` ``[batch, kv_heads, n]`` float32 (float64 for
        float64 inputs), the probabilities summed over each KV head's query heads.

    GQA needs no copy: the ``r`` query heads of a KV head are the rows of one ``[r, d] x [d, n]``
    product. Logits are computed in the inputs' dtype and the softmax in float32 (float64 for
    float64), as SDPA's math path does.

    Example:
        >>> q, k, v = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
        >>> out, received = decode_attention(q, k, v, 8 ** -0.5)
        >>> out.shape, received.shape, bool(torch.allclose(received.sum(-1), torch.full((1, 2), 2.0)))
        (torch.Size([1, 1, 4, 8]), torch.Size([1, 2, 5]), True)
    """
    b, hq, _, d = query.shape
    g, n, dv = key.shape[1], key.shape[2], value.shape[-1]
    r = hq // g
    work = torch.float64 if query.dtype == torch.float64 else torch.float32
    # query head g * r + i attends with KV head g: [b * g, r, d] x [b * g, d, n]
    q3, k3 = query.reshape(b * g, r, d), key.reshape(b * g, n, d).transpose(1, 2)
    if prefix is None and row_scale is None and work == query.dtype == value.dtype and (bias is None or bias.dtype == work):
        bias3 = None if bias is None else bias.reshape(b * g, 1, n)
        out, probs3 = grouped_decode(q3, k3, value.reshape(b * g, n, dv), scaling, bias3)
        return out.view(b, 1, hq, dv), probs3.view(b, g, r, n).sum(dim=2)
    logits = torch.bmm(q3, k3).to(work).view(b, g, r, n)
    if prefix is not None and prefix[0]:
        k = prefix[0]
        head = torch.bmm(prefix[1].reshape(b * g, r, d), key[:, :, :k].reshape(b * g, k, d).transpose(1, 2))
        logits[..., :k] = head.to(work).view(b, g, r, k)
    logits.mul_(scaling)
    if row_scale is not None:
        logits.mul_(row_scale.to(work).view(b, 1, 1, 1))
    if bias is not None:
        logits.add_(bias.to(work)[:, :, None, :])
    probs = torch.softmax(logits, dim=-1)  # [b, g, r, n]
    out = torch.bmm(probs.view(b * g, r, n).to(value.dtype), value.reshape(b * g, n, dv))  # [b * g, r, dv]
    return out.view(b, 1, hq, dv), probs.sum(dim=2)


# ---------------------------------------------------------------- sliding and chunked windows
def window_limit(newest: Any, kind: str, width: int) -> Any:
    """The newest original position a query at position ``newest`` no longer sees in a layer of
    this ``kind`` and ``width`` (keys at positions ``<= limit`` are outside): ``"sliding"`` (as
    transformers: a key is seen while ``key > query - width``) or ``"chunked"`` (a key is seen in
    the query's own chunk of ``width`` positions). ``newest``: an int, or an int64 tensor of them
    (the static step's device counts, a chunk's query positions); floor division either way.

    Example:
        >>> window_limit(9, "sliding", 4), window_limit(9, "chunked", 4)
        (5, 7)
        >>> window_limit(torch.tensor([3, 8]), "chunked", 4).tolist()
        [-1, 7]
    """
    if kind == "sliding":
        return newest - width
    if kind == "chunked":
        return newest // width * width - 1
    raise ValueError(f"kind must be 'sliding' or 'chunked', got {kind!r}")


def window_bias(positions: torch.Tensor, limits: list[int]) -> torch.Tensor:
    """A decode step's additive bias ``[batch, kv_heads, n]`` float32: ``-inf`` where a slot's
    original position (``positions`` ``[batch, kv_heads, n]``; a hole's ``-1`` too) is at or
    below its row's limit (:func:`window_limit`, ``limits``: one per row), else ``0``.

    Example:
        >>> window_bias(torch.tensor([[[0, 4, 6]]]), [4]).tolist()
        [[[-inf, -inf, 0.0]]]
    """
    lim = torch.tensor(limits, device=positions.device).view(-1, 1, 1)
    zero = torch.zeros((), dtype=torch.float32, device=positions.device)
    return torch.where(positions > lim, zero, float("-inf"))


def window_chunk_mask(mask: torch.Tensor, positions: torch.Tensor, kind: str, width: int) -> torch.Tensor:
    """A prompt chunk's boolean mask ``[batch | 1, 1 | kv_heads, q, n]`` (True: attend) restricted
    to a sliding or chunked window on original positions: ``positions`` ``[batch, kv_heads, n]``
    are the slots' (a chunk's queries are its last ``q`` slots, at the same positions on every
    head); a pad query (position ``-1``) keeps what ``mask`` gives it (its own column).

    Example:
        >>> causal = torch.ones(3, 3, dtype=torch.bool).tril()[None, None]
        >>> window_chunk_mask(causal, torch.tensor([[[0, 1, 2]]]), "sliding", 2)[0, 0].int().tolist()
        [[1, 0, 0], [1, 1, 0], [0, 1, 1]]
    """
    pos = positions[:, : mask.shape[1], :]  # [b, h | 1, n]: rows are compacted for a chunk, head 0 speaks for all
    qpos = pos[:, 0, -mask.shape[-2] :]  # the chunk's own slots
    lim = window_limit(qpos, kind, width)
    inside = (pos[:, :, None, :] > lim[:, None, :, None]) | (qpos < 0)[:, None, :, None]
    return mask & inside


# ---------------------------------------------------------------- the eager decode step over slots
def add_received(layout: SlotLayout, policy: EvictionPolicy, scores: torch.Tensor, received: torch.Tensor) -> None:
    """Fold ``received`` ``[batch, kv_heads, n]`` into ``scores`` (the returned slots' scores, or
    a prefix of the storage's) by ``policy.score_statistic``. A ``"low_history"`` record of a
    chunk is shifted in by each row's real queries (a left-padded row has fewer), a decode
    query's by one.

    Example:
        >>> from kvpolicy import H2O
        >>> from kvpolicy_torch.layout import SlotLayout
        >>> from kvpolicy_torch.victims import CandidateSearch
        >>> scores = torch.zeros(1, 1, 3)
        >>> add_received(SlotLayout(CandidateSearch(), None), H2O(heavy=2, recent=1), scores,
        ...              torch.tensor([[[0.5, float("nan"), 0.25]]]))
        >>> scores.tolist()  # (a NaN counts as -inf: evicted first, never kept by a NaN)
        [[[0.5, -inf, 0.25]]]
    """
    statistic = policy.score_statistic
    if statistic == "accumulate":
        if layout.search.active:
            low, high = torch.aminmax(received)
            if not bool((low >= 0) & (high < math.inf)):
                # a score may go down (negative, NaN, or -inf + inf): the candidates' bound no longer holds
                layout.search.forget()
        fold_received(scores, None, received, statistic)
        return
    rows: Any = 1
    if layout.chunk is not None and statistic == "low_history":
        _, q, valid = layout.chunk
        rows = q if valid is None else valid.sum(dim=-1).view(-1, 1, 1)
    fold_received(scores, layout.returned_positions(), received, statistic, history=policy.score_history, rows=rows)


def query_record(layout: SlotLayout, policy: EvictionPolicy, received: torch.Tensor, group: int) -> torch.Tensor:
    """What a decode query gave each returned slot, as the policy folds it: for ``"low_history"``
    (Scissorhands) that query's record of low attention (:func:`kvpolicy.statistics.low_attention`),
    else ``received`` itself."""
    if policy.score_statistic != "low_history":
        return received
    return low_attention(received, group, kept=layout.returned_positions() >= 0).to(torch.float64)


def attend_slots(
    layout: SlotLayout,
    policy: EvictionPolicy,
    query: torch.Tensor,
    scaling: float,
    *,
    extra_bias: torch.Tensor | None,
    row_scale: torch.Tensor | None,
    prefix: tuple[int, torch.Tensor] | None,
) -> torch.Tensor:
    """A decode query ``[batch, q_heads, 1, head_dim]`` over the slots the last append returned
    (they start at slot 0), holes masked; what each slot received is folded into its score when
    the policy captures attention. Returns ``[batch, 1, q_heads, head_dim]``."""
    store = layout.store if layout.store is not None else layout.storage()
    hi = layout.returned
    statistic = policy.score_statistic
    views = layout.views  # (None: the storage is a view of some slots; the general path serves it)
    plain = (extra_bias is None and row_scale is None and prefix is None and query.dtype == store.keys.dtype
             and views is not None)
    # (16-bit keys: grouped_decode's probabilities would be 16-bit too, where the general path
    # computes them in float32; the low events must be the reference's)
    if (plain and statistic == "low_history" and not layout.bias_needed and policy.uses_scores
            and store.keys.dtype in (torch.float32, torch.float64)):
        return _attend_low_history(layout, policy, query, scaling)
    # (attributes only, no property: a decode step counts its calls, benchmarks/decode_calls.py)
    captures = statistic in ("accumulate", "latest") and policy.uses_scores
    scoreless = statistic in KEY_STATISTICS or not policy.uses_scores
    if plain and (
        (captures and layout.search.slots is None and query.dtype == store.scores.dtype)  # (search.active)
        or (scoreless and query.dtype == store.values.dtype and query.dtype in (torch.float32, torch.float64))
    ):
        # the common step on the storage's grouped views: grouped_decode, then (H2O, BUZZ, TOVA)
        # the probabilities summed per KV head into the scores. A policy that captures nothing
        # (Knorm, KeyDiff, Expected Attention: scores from the cache; the local window) takes the
        # output alone (its hole bias cast to a 16-bit query's dtype)
        b, hq, _, d = query.shape
        bh = views.keys3t.shape[0]  # type: ignore[union-attr]  # (plain: views is not None)
        r = hq * b // bh
        bias3 = views.bias3 if layout.bias_needed else None
        if bias3 is not None and bias3.dtype != query.dtype:
            bias3 = bias3.to(query.dtype)
        out3, probs3 = grouped_decode(query.reshape(bh, r, d), views.keys3t, views.values3, scaling, bias3)
        if captures:
            # fold_received's two rules inlined (no candidates to void, dtypes equal, the sum a fresh
            # tensor: NaN made -inf in place): the hot path of every H2O, BUZZ and TOVA decode step
            received = probs3.view(b, bh // b, r, hi).sum(dim=2).nan_to_num_(nan=-math.inf, posinf=math.inf, neginf=-math.inf)
            if statistic == "accumulate":
                views.scores.add_(received)
            else:  # "latest" (TOVA): this query's attention replaces the scores; holes keep +inf
                views.scores.copy_(received.masked_fill_(views.positions < 0, math.inf))
        return out3.view(b, 1, hq, -1)
    key, value = store.keys.narrow(2, 0, hi), store.values.narrow(2, 0, hi)
    bias = store.bias.narrow(2, 0, hi) if layout.bias_needed else None
    if extra_bias is not None:
        bias = extra_bias if bias is None else bias + extra_bias
    out, received = decode_attention(query, key, value, scaling, bias=bias, row_scale=row_scale, prefix=prefix)
    if policy.captures_attention:  # received comes from a softmax: its shape is right and it is real
        record = query_record(layout, policy, received, query.shape[1] // key.shape[1])
        add_received(layout, policy, store.scores.narrow(2, 0, hi), record)
    return out


def _attend_low_history(layout: SlotLayout, policy: EvictionPolicy, query: torch.Tensor, scaling: float) -> torch.Tensor:
    """:func:`attend_slots` for a ``"low_history"`` policy (Scissorhands) whose returned slots hold
    no hole: the query's record of low attention shifted into the scores in place, four ops
    where :func:`query_record` and :func:`add_received` took about twenty (docs/performance.md,
    issue 43: Scissorhands' share of the limit). The same bits as they give:
    every one of the ``hi`` slots is attended, so the average is ``group / hi``
    (:func:`kvpolicy.statistics.low_attention`), and a record shifted by one query is
    ``(score % 2 ** (history - 1)) * 2 + low`` (:func:`kvpolicy.statistics.shift_history`), exact in
    float64 for the finite records that slots without holes hold."""
    views = layout.views
    assert views is not None  # (attend_slots' plain test)
    hi = layout.returned
    b, hq, _, d = query.shape
    bh = views.keys3t.shape[0]
    r = hq * b // bh
    out3, probs3 = grouped_decode(query.reshape(bh, r, d), views.keys3t, views.values3, scaling)
    received = probs3.view(b, bh // b, r, hi).sum(dim=2)
    # (a NaN is no low event, as in low_attention; the threshold as it computes it, in float64)
    low = received.to(torch.float64) < (1 - LOW_MARGIN) * r / hi
    history = policy.score_history
    torch.add(low, views.scores.fmod_(2.0 ** (history - 1)), alpha=2.0, out=views.scores)  # type: ignore[operator]
    return out3.view(b, 1, hq, -1)
