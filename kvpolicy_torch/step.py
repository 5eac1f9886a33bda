"""The eager decode step's *attend* and *accumulate*: attention over the returned slots, holes
masked, and what each slot received folded into its score, in one pass over the keys.

The common step (H2O, BUZZ: scores accumulate, no window, no log n, no pos-shift) runs on the
storage's grouped 3-D views (:func:`~kvpolicy_torch.attention.grouped_decode`); every other one
through :func:`~kvpolicy_torch.attention.decode_attention`. Received attention is folded by the
policy's statistic (:func:`~kvpolicy_torch.scores.fold_received`, the rule the static step uses
too); an accumulated score that may go down voids the victim search's candidates, whose bound
assumes scores only grow.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kvpolicy.policy import KEY_STATISTICS, EvictionPolicy
from kvpolicy.statistics import LOW_MARGIN, low_attention

from .attention import decode_attention, grouped_decode
from .layout import SlotLayout
from .scores import fold_received

__all__ = ["add_received", "attend_slots", "query_record"]


def add_received(layout: SlotLayout, policy: EvictionPolicy, scores: torch.Tensor, received: torch.Tensor) -> None:
    """Fold ``received`` ``[batch, kv_heads, n]`` into ``scores`` (the returned slots' scores, or
    a prefix of the storage's) by ``policy.score_statistic``. A ``"low_history"`` record of a
    chunk is shifted in by each row's real queries (a left-padded row has fewer), a decode
    query's by one.

    Example:
        >>> from kvpolicy import H2O
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
    plain = extra_bias is None and row_scale is None and prefix is None and query.dtype == store.keys.dtype
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
        # output alone, its hole bias cast from the scores' dtype (float64 for a score from the
        # cache: ~1 us, where the general path cast the logits and summed the probabilities)
        b, hq, _, d = query.shape
        views = store.range_views(hi)
        bh = views.keys3t.shape[0]
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
    store = layout.storage()
    hi = layout.returned
    b, hq, _, d = query.shape
    views = store.range_views(hi)
    bh = views.keys3t.shape[0]
    r = hq * b // bh
    out3, probs3 = grouped_decode(query.reshape(bh, r, d), views.keys3t, views.values3, scaling)
    received = probs3.view(b, bh // b, r, hi).sum(dim=2)
    # (a NaN is no low event, as in low_attention; the threshold as it computes it, in float64)
    low = received.to(torch.float64) < (1 - LOW_MARGIN) * r / hi
    history = policy.score_history
    torch.add(low, views.scores.fmod_(2.0 ** (history - 1)), alpha=2.0, out=views.scores)  # type: ignore[operator]
    return out3.view(b, 1, hq, -1)
