"""Attention probabilities each cached token receives, per KV head (GQA aware)."""

from __future__ import annotations

import torch

__all__ = ["received_attention", "group_query_heads"]


def group_query_heads(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[batch, q_heads, q, d] -> [batch, kv_heads, n_rep, q, d]``.

    Query head ``g * n_rep + r`` attends with KV head ``g`` (transformers' ``repeat_kv`` order),
    so a reshape groups them; ``chunk`` along heads would pair them wrongly.
    """
    b, hq, q, d = query.shape
    if hq % kv_heads:
        raise ValueError(f"query heads ({hq}) must be a multiple of kv_heads ({kv_heads})")
    return query.reshape(b, kv_heads, hq // kv_heads, q, d)


def received_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    scaling: float,
    *,
    query_scale: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    query_valid: torch.Tensor | None = None,
    block: int = 512,
) -> torch.Tensor:
    """Attention each key received from the current queries, summed per KV head.

    Args:
        query: ``[batch, q_heads, q, head_dim]`` (already rotated).
        keys: ``[batch, kv_heads, n, head_dim]``; the last ``q`` keys are the queries' own tokens,
            the first ``n - q`` are cached and visible to every query (causal within the chunk).
        scaling: the softmax scale (``1/sqrt(head_dim)``).
        query_scale: optional ``[q]`` or ``[batch, q]`` extra logit factor per query (BUZZ's log n).
        mask: optional boolean ``[batch | 1, 1, q, n]`` (True: attend) replacing the causal rule
            above (a slot cache with holes or a left-padded chunk: ``LayerCache.chunk_mask()``).
        query_valid: optional ``[batch, q]`` bool; False rows (pad queries) add nothing.
        block: queries per block, bounding the ``[.., block, n]`` temporary during a long prefill.

    Returns:
        ``[batch, kv_heads, n]`` float32 (float64 for float64 inputs): the softmax probabilities
        summed over the query heads of each KV head and over the queries.
    """
    b, hq, q, d = query.shape
    kv_heads, n = keys.shape[1], keys.shape[2]
    work = torch.float64 if query.dtype == torch.float64 else torch.float32
    grouped = group_query_heads(query, kv_heads).to(work)
    k = keys.to(work)
    if query_scale is not None and query_scale.ndim == 1:
        query_scale = query_scale[None].expand(b, q)
    if q == 1 and mask is None and query_valid is None:
        # Decode fast path: one query per head needs neither the causal mask nor blocks; one bmm
        # over batch x kv_heads ([r, d] x [d, n]; a cache's [batch, heads, :n] view of its storage
        # reshapes without a copy) replaces the 5-D einsum, and the sum over the r query heads of
        # a KV head is the only reduction.
        r = hq // kv_heads
        logits = torch.bmm(grouped.reshape(b * kv_heads, r, d), k.reshape(b * kv_heads, n, d).transpose(1, 2))
        logits = logits.view(b, kv_heads, r, n) * scaling
        if query_scale is not None:
            logits = logits * query_scale[:, 0].view(b, 1, 1, 1).to(work)
        return torch.softmax(logits, dim=-1).sum(dim=2)
    out = torch.zeros(b, kv_heads, n, dtype=work, device=keys.device)
    offset = n - q
    for start in range(0, q, block):  # one block for a decode step; a few for a long prefill
        stop = min(q, start + block)
        logits = torch.einsum("bgrqd,bgnd->bgrqn", grouped[:, :, :, start:stop], k) * scaling
        if query_scale is not None:
            logits = logits * query_scale[:, None, None, start:stop, None].to(work)
        if mask is not None:  # [b|1, 1, q, n] -> [b|1, 1, 1, block, n]
            logits = logits.masked_fill(~mask[:, :, None, start:stop], float("-inf"))
        elif q > 1:
            rows = torch.arange(start, stop, device=keys.device)[:, None]
            cols = torch.arange(n, device=keys.device)[None, :]
            logits = logits.masked_fill(cols > offset + rows, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if query_valid is not None:
            probs = probs * query_valid[:, None, None, start:stop, None].to(work)
        out += probs.sum(dim=(2, 3))
    return out
