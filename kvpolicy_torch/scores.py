"""Attention probabilities each cached token receives, per KV head (GQA aware), and what they do
to the tokens' scores (:func:`fold_received`)."""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from kvpolicy.policy import KEY_STATISTICS, RECONSTRUCTION
from kvpolicy.statistics import low_attention, shift_history

__all__ = [
    "DEFAULT_WORKSPACE_BYTES", "fold_received", "group_query_heads", "prefill_attention", "prefill_block_rows", "received_attention",
]


def fold_received(
    scores: torch.Tensor,
    positions: torch.Tensor | None,
    received: torch.Tensor,
    statistic: str,
    *,
    history: int | None = None,
    rows: Any = 1,
) -> None:
    """Fold what the slots just received ``[batch, kv_heads, n]`` into their ``scores`` in place,
    by the policy's :attr:`~kvpolicy.EvictionPolicy.score_statistic`: ``"accumulate"`` adds it
    (H2O, BUZZ); ``"latest"`` replaces the scores (TOVA); ``"low_history"`` (Scissorhands) takes it
    as the step's record of low-attention events (:func:`kvpolicy.statistics.history_record`) and
    shifts it into each token's record over ``rows`` queries (an int, or a per-row tensor
    ``[batch, 1, 1]``) of ``history``. A NaN counts as ``-inf``: that token is evicted first, never
    kept by a NaN. Holes (``positions`` ``-1``; ``positions`` is needed by the last two rules
    only) keep ``+inf``, except under ``"accumulate"`` at a step whose attention is NaN throughout
    (the holes' share too: ``+inf - inf`` is NaN), which is why victim searches rank holes by their
    position (:func:`~kvpolicy_torch.victims.eviction_ranks`). A statistic from keys
    (:data:`kvpolicy.KEY_STATISTICS`) and a reconstruction (KVzip) ignore it. One rule for the eager and the static (compiled)
    step alike.

    Example:
        >>> scores = torch.tensor([[[1.0, math.inf]]])
        >>> fold_received(scores, torch.tensor([[[0, -1]]]), torch.tensor([[[float("nan"), 0.5]]]), "latest")
        >>> scores.tolist()
        [[[-inf, inf]]]
    """
    if statistic in KEY_STATISTICS or statistic == RECONSTRUCTION:
        return  # scores come from the keys (the layer computes them before it evicts) or a reconstruction
    received = torch.nan_to_num(received.to(scores.dtype), nan=-math.inf, posinf=math.inf, neginf=-math.inf)
    if statistic == "accumulate":
        scores += received
        return
    assert positions is not None  # (documented: "latest" and "low_history" need them)
    new = received if statistic == "latest" else shift_history(scores, received, rows, history)  # type: ignore[arg-type]
    scores.copy_(torch.where(positions >= 0, new, math.inf))


def group_query_heads(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[batch, q_heads, q, d] -> [batch, kv_heads, n_rep, q, d]``.

    Query head ``g * n_rep + r`` attends with KV head ``g`` (transformers' ``repeat_kv`` order),
    so a reshape groups them; ``chunk`` along heads would pair them wrongly.
    """
    b, hq, q, d = query.shape
    if hq % kv_heads:
        raise ValueError(f"query heads ({hq}) must be a multiple of kv_heads ({kv_heads})")
    return query.reshape(b, kv_heads, hq // kv_heads, q, d)


#: Default bytes for one prefill block's float32 logits ``[batch, q_heads, block, keys]``
#: (:func:`prefill_block_rows`): 256 MiB, small next to an 80 GB GPU's KV cache and large
#: enough that the per-block overhead (a few kernel launches) is negligible.
DEFAULT_WORKSPACE_BYTES = 256 << 20


def prefill_block_rows(batch: int, q_heads: int, keys: int, *, workspace_bytes: int = DEFAULT_WORKSPACE_BYTES, itemsize: int = 4) -> int:
    """Query rows per block so that one block's logits ``[batch, q_heads, rows, keys]`` fit in
    ``workspace_bytes`` (at least 1 row).

    Example:
        >>> prefill_block_rows(1, 40, 32768)  # Llama-2-13B on one GPU, 32k keys: 51 rows per block
        51
        >>> prefill_block_rows(1, 9, 2048)
        3640
    """
    per_row = max(1, batch * q_heads * keys * itemsize)
    return max(1, workspace_bytes // per_row)


@contextmanager
def _tf32_for_16bit(dtype: torch.dtype, device: torch.device) -> Iterator[None]:
    """Allow TF32 for float32 matmuls on CUDA while the operands are upcast 16-bit values.

    TF32 keeps 10 mantissa bits: every float16 and bfloat16 value is exactly representable, and
    a product of two is exact in float32, so with float32 accumulation the result equals the
    IEEE float32 product up to summation order. Float32 inputs keep IEEE float32 (TF32 would
    round them)."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        yield
        return
    matmul = torch.backends.cuda.matmul
    old = matmul.fp32_precision
    matmul.fp32_precision = "tf32"
    try:
        yield
    finally:
        matmul.fp32_precision = old


def received_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    scaling: float,
    *,
    query_scale: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    query_valid: torch.Tensor | None = None,
    block: int | None = None,
    workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
    rows: int | None = None,
    history: int | None = None,
) -> torch.Tensor:
    """Attention each key received from the current queries, summed per KV head.

    Args:
        query: ``[batch, q_heads, q, head_dim]`` (already rotated).
        keys: ``[batch, kv_heads, n, head_dim]``; the last ``q`` keys are the queries' own tokens,
            the first ``n - q`` are cached and visible to every query (causal within the chunk).
        scaling: the softmax scale (``1/sqrt(head_dim)``).
        query_scale: optional ``[q]`` or ``[batch, q]`` extra logit factor per query (BUZZ's log n).
        mask: optional boolean ``[batch | 1, 1, q, n]`` (True: attend), applied on top of the
            causal rule above: holes of a slot cache and pads of a left-padded chunk
            (``LayerCache.chunk_mask()``).
        query_valid: optional ``[batch, q]`` bool; False rows (pad queries) add nothing.
        block: queries per block during a prefill; default: as many as
            :func:`prefill_block_rows` fits in ``workspace_bytes``, and at most an eighth of the
            chunk (at least 64), so the causal blocks skip most of the masked product.
        workspace_bytes: the bound on one block's float32 logits and their softmax (when ``block``
            is ``None``).
        rows: a policy's ``prompt_rows``: sum over the last ``rows`` query rows only (TOVA: 1,
            SnapKV: its observation window; they are the chunk's last rows, so they see every
            cached key), computed on those rows only; ``None`` (default): every row.
        history: for a ``"low_history"`` policy (Scissorhands, ``score_history``): return the
            chunk's record of low-attention events instead (float64; bit ``k`` set where the
            ``k``-th query before the last attends to the key less than average,
            :func:`kvpolicy.statistics.low_attention`, for the last ``history`` queries; pads at
            the start of a row, as left padding puts them, are no queries).

    Returns:
        ``[batch, kv_heads, n]`` float32 (float64 for float64 inputs): the softmax probabilities
        summed over the query heads of each KV head and over the queries.

    A prefill never copies all keys to float32: logits are computed in float32 block by block,
    each block only over the keys its rows can see (causal), then the block's softmax. Float32 keys are used as they are. 16-bit keys are upcast one key chunk at a time, and
    on CUDA their product with the (unscaled, upcast) 16-bit queries runs in TF32, which is exact
    for 16-bit operands (10 mantissa bits; products exact in float32, float32 accumulation); the
    scale, the softmax and the sums stay IEEE float32. For float32 inputs the product follows
    torch's global float32 matmul precision (IEEE unless TF32 was enabled globally).

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> q, k = torch.randn(1, 4, 6, 8, generator=g), torch.randn(1, 2, 6, 8, generator=g)
        >>> r = received_attention(q, k, 8 ** -0.5, block=2)
        >>> r.shape, round(float(r.sum()), 4)  # 4 query heads x 6 rows, each row sums to 1
        (torch.Size([1, 2, 6]), 24.0)
    """
    if history is not None:
        return _history_record(query, keys, scaling, history, query_scale=query_scale, mask=mask, query_valid=query_valid)
    if rows is not None:
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise ValueError(f"rows must be an int >= 1 or None, got {rows!r}")
        if rows < query.shape[2]:
            # The chunk's last `rows` queries: the causal rule below treats the last `rows` keys
            # as their own tokens, which they are.
            first = query.shape[2] - rows
            return received_attention(
                query[:, :, first:],
                keys,
                scaling,
                query_scale=None if query_scale is None else query_scale[..., first:],
                mask=None if mask is None else mask[:, :, first:],
                query_valid=None if query_valid is None else query_valid[:, first:],
                block=block,
                workspace_bytes=workspace_bytes,
            )
    b, hq, q, d = query.shape
    kv_heads, n = keys.shape[1], keys.shape[2]
    work = torch.float64 if query.dtype == torch.float64 else torch.float32
    grouped = group_query_heads(query, kv_heads)
    if query_scale is not None and query_scale.ndim == 1:
        query_scale = query_scale[None].expand(b, q)
    if q == 1 and mask is None and query_valid is None:
        # Decode fast path: one query per head needs neither the causal mask nor blocks; one bmm
        # over batch x kv_heads ([r, d] x [d, n]; a cache's [batch, heads, :n] view of its storage
        # reshapes without a copy) replaces the 5-D einsum, and the sum over the r query heads of
        # a KV head is the only reduction.
        grouped, k = grouped.to(work), keys.to(work)
        r = hq // kv_heads
        logits = torch.bmm(grouped.reshape(b * kv_heads, r, d), k.reshape(b * kv_heads, n, d).transpose(1, 2))
        logits = logits.view(b, kv_heads, r, n) * scaling
        if query_scale is not None:
            logits = logits * query_scale[:, 0].view(b, 1, 1, 1).to(work)
        return torch.softmax(logits, dim=-1).sum(dim=2)
    received, _ = _blocked(query, keys, None, scaling, query_scale, mask, query_valid, block, workspace_bytes)
    return received


def prefill_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scaling: float,
    *,
    query_scale: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    query_valid: torch.Tensor | None = None,
    block: int | None = None,
    workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A prompt chunk's attention output and the attention each key received, in one blocked pass.

    What SDPA followed by :func:`received_attention` computes, with the logits and the softmax of
    each query block computed once: the block's exponentials give both the output (their product
    with the values, divided by the row's total) and the received sums (the column sums weighted
    by the rows' reciprocal totals). A policy that reads every prompt row's attention (H2O,
    BUZZ) thus pays one attention pass, not two (docs/performance.md, section 8).

    Args:
        query: ``[batch, q_heads, q, head_dim]`` (already rotated), float32 or float64.
        keys: ``[batch, kv_heads, n, head_dim]``, values ``[batch, kv_heads, n, head_dim_v]``, in
            the query's dtype; the last ``q`` keys are the queries' own tokens (causal within the
            chunk), the first ``n - q`` are visible to every query.
        scaling, query_scale, mask, query_valid, block, workspace_bytes: as for
            :func:`received_attention` (``query_scale`` scales the output's logits too: BUZZ's
            log n); a pad query (``query_valid`` False) gets its output but adds nothing to the sums.

    Returns:
        ``(out, received)``: ``out`` ``[batch, q, q_heads, head_dim_v]`` in the query's dtype (the
        layout transformers' attention functions return) and ``received`` ``[batch, kv_heads, n]``,
        equal to :func:`received_attention`'s, bit for bit.

    Raises:
        ValueError: 16-bit inputs (their softmax wants a float32 copy: SDPA then
            :func:`received_attention`, which upcasts the keys a chunk at a time), or keys and
            values of another dtype than the query.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> q, k, v = (torch.randn(1, h, 6, 8, generator=g) for h in (4, 2, 2))
        >>> out, received = prefill_attention(q, k, v, 8 ** -0.5, block=2)
        >>> sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        >>> bool(torch.allclose(out.transpose(1, 2), sdpa, atol=1e-6))
        True
        >>> bool(torch.equal(received, received_attention(q, k, 8 ** -0.5, block=2)))
        True
    """
    if query.dtype not in (torch.float32, torch.float64) or keys.dtype != query.dtype or values.dtype != query.dtype:
        raise ValueError(
            f"prefill_attention takes float32 or float64 query, keys and values of one dtype, got {query.dtype}, "
            f"{keys.dtype} and {values.dtype} (16-bit: SDPA, then received_attention)"
        )
    group_query_heads(query, keys.shape[1])  # (checks the heads)
    if query_scale is not None and query_scale.ndim == 1:
        query_scale = query_scale[None].expand(query.shape[0], query.shape[2])
    received, out = _blocked(query, keys, values, scaling, query_scale, mask, query_valid, block, workspace_bytes)
    assert out is not None  # (values given)
    return out, received


def _blocked(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor | None,
    scaling: float,
    query_scale: torch.Tensor | None,
    mask: torch.Tensor | None,
    query_valid: torch.Tensor | None,
    block: int | None,
    workspace_bytes: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The blocked prefill pass of :func:`received_attention` (``values`` ``None``) and of
    :func:`prefill_attention`: ``(received, out or None)``; ``query_scale`` is ``[batch, q]``."""
    b, hq, q, d = query.shape
    kv_heads, n = keys.shape[1], keys.shape[2]
    work = torch.float64 if query.dtype == torch.float64 else torch.float32
    grouped = group_query_heads(query, kv_heads)
    itemsize = torch.finfo(work).bits // 8
    if block is None:
        # The memory bound (a block's logits and their softmax), and at least 16 blocks for a long
        # chunk: block i multiplies only the keys its rows can see, so 16 blocks skip about 15/32
        # of the causal product.
        block = min(prefill_block_rows(b, hq, n, workspace_bytes=workspace_bytes // 2, itemsize=itemsize), max(64, -(-q // 16)))
        if keys.device.type == "cpu":
            # and at most 128 rows on a CPU: a block's logits stay near the caches (one layer at
            # SmolLM2's shapes, 8,192 tokens: 455-row blocks 2.9-3.1 s, 128-row blocks 1.7 s)
            block = min(block, 128)
    out = torch.zeros(b, kv_heads, n, dtype=work, device=keys.device)
    attended = None
    if values is not None:  # [b, q, g, r, dv]: written a block of rows at a time, returned as [b, q, hq, dv]
        attended = torch.empty(b, q, kv_heads, hq // kv_heads, values.shape[-1], dtype=values.dtype, device=values.device)
    offset = n - q
    cast = keys.dtype != work
    above_diagonal = torch.ones(min(block, q), min(block, q), dtype=torch.bool, device=keys.device).triu_(1)
    r = hq // kv_heads
    # On a CPU one KV head at a time, its block's logits in one workspace reused by every block and
    # the softmax written over them: a block's logits stay in the caches, and no block pays for
    # fresh pages (one layer at SmolLM2's shapes, 8,192 tokens: 1.47-1.55 s with every head's
    # block at once and a new tensor per block and softmax, 1.11-1.27 s so; SDPA alone 1.02-1.05 s).
    # Elsewhere every head at once (fewer, larger kernels; a softmax over its own output is not
    # relied on there).
    on_cpu = keys.device.type == "cpu"
    heads = 1 if on_cpu else kv_heads
    # (out= writes do not record gradients: inputs that require them take fresh tensors)
    reuse = on_cpu and not any(t is not None and t.requires_grad for t in (query, keys, values))
    workspace = torch.empty(b * heads * r * min(block, q) * n, dtype=work, device=keys.device) if reuse else None
    for start in range(0, q, block):  # a few blocks for a long prefill
        stop = min(q, start + block)
        rows = stop - start
        visible = offset + stop  # keys past it are masked for every row of this block
        factor = torch.full((1, 1, 1, rows, 1), scaling, dtype=work, device=keys.device)
        if query_scale is not None:  # [b, 1, 1, rows, 1]
            factor = factor * query_scale[:, None, None, start:stop, None].to(work)
        # each query row's weight in the sums over rows (a pad query's 0), alike for every KV head
        if query_valid is None:
            weights = torch.ones(1, 1, 1, r * rows, dtype=work, device=keys.device).expand(b, heads, 1, r * rows)
        else:
            weights = query_valid[:, None, None, None, start:stop].to(work).expand(b, heads, 1, r, rows).reshape(b, heads, 1, r * rows)
        for h0 in range(0, kv_heads, heads):
            hs = slice(h0, h0 + heads)
            qb = grouped[:, hs, :, start:stop].to(work)  # small: [b, heads, r, rows, d]
            logits = None if workspace is None else workspace[: b * heads * r * rows * visible].view(b, heads, r * rows, visible)
            if not cast:  # float32/float64: fold the scale into the (small) query block
                qb = (qb * factor).reshape(b, heads, r * rows, d)  # one [r * rows, d] x [d, keys] product per KV head
                logits = torch.matmul(qb, keys[:, hs, :visible].mT, out=logits)
            else:  # upcast a key chunk at a time: never a float32 copy of all keys
                qb = qb.reshape(b, heads, r * rows, d)  # unscaled: exact 16-bit values, so TF32 is exact
                if logits is None:
                    logits = torch.empty(b, heads, r * rows, visible, dtype=work, device=keys.device)
                chunk = max(1, workspace_bytes // max(1, b * heads * d * itemsize))
                with _tf32_for_16bit(keys.dtype if query.dtype == keys.dtype else work, keys.device):  # the matmul only
                    for k0 in range(0, visible, chunk):
                        k1 = min(visible, k0 + chunk)
                        logits[..., k0:k1] = torch.matmul(qb, keys[:, hs, k0:k1].to(work).mT)
                logits.view(b, heads, r, rows, visible).mul_(factor)  # before the mask: no -inf * 0
            # causal within the chunk: row i sees keys up to offset + start + i; only the last `rows`
            # columns can be masked
            tail = logits.view(b, heads, r, rows, visible)[..., offset + start : visible]
            tail.masked_fill_(above_diagonal[:rows, :rows], float("-inf"))
            if mask is not None:  # [b|1, 1|kv_heads, rows, visible] -> over the KV heads' r query heads
                head_mask = mask if mask.shape[1] == 1 else mask[:, hs]
                logits.view(b, heads, r, rows, visible).masked_fill_(~head_mask[:, :, None, start:stop, :visible], float("-inf"))
            # one softmax kernel (row by row in cache: half the time of max, subtract, exp and sum as
            # four passes over the block), then the sum over query rows as one [1, r * rows] x
            # [r * rows, keys] product per KV head, a pad query's row weighted 0
            probs = torch.softmax(logits, dim=-1, out=logits) if reuse else torch.softmax(logits, dim=-1)
            if attended is not None and values is not None:  # the output: the same probabilities times the values
                rows_out = torch.matmul(probs, values[:, hs, :visible])  # [b, heads, r * rows, dv]
                attended[:, start:stop, hs] = rows_out.view(b, heads, r, rows, -1).permute(0, 3, 1, 2, 4)
            out[:, hs, :visible] += torch.matmul(weights, probs)[:, :, 0]
            del logits, probs
    return out, None if attended is None else attended.view(b, q, hq, -1)


def _history_record(
    query: torch.Tensor,
    keys: torch.Tensor,
    scaling: float,
    history: int,
    *,
    query_scale: torch.Tensor | None,
    mask: torch.Tensor | None,
    query_valid: torch.Tensor | None,
) -> torch.Tensor:
    """:func:`received_attention`'s ``history`` case: ``[batch, kv_heads, n]`` float64 records of
    the last ``history`` queries (a decode step's is its one query's bit), row by row in float64."""
    if isinstance(history, bool) or not isinstance(history, int) or history < 1:
        raise ValueError(f"history must be an int >= 1 or None, got {history!r}")
    b, hq, q, d = query.shape
    kv_heads, n = keys.shape[1], keys.shape[2]
    r = hq // kv_heads
    first = max(0, q - history)  # older rows fall out of every record
    grouped = group_query_heads(query, kv_heads)[:, :, :, first:].to(torch.float64)  # [b, g, r, rows, d]
    logits = torch.matmul(grouped, keys.to(torch.float64)[:, :, None].mT) * scaling  # [b, g, r, rows, n]
    if query_scale is not None:
        scale = query_scale if query_scale.ndim == 2 else query_scale[None].expand(b, q)
        logits = logits * scale[:, None, None, first:, None].to(torch.float64)
    rows = q - first
    seen = torch.arange(n, device=keys.device)[None, :] <= (n - q + first + torch.arange(rows, device=keys.device))[:, None]
    seen = seen[None, None]  # [1, 1, rows, n]: causal within the chunk
    if mask is not None:
        seen = seen & mask[:, :, first:, :]
    probs = torch.softmax(logits.masked_fill(~seen[:, :, None], float("-inf")), dim=-1).sum(dim=2)  # [b, g, rows, n]
    low = low_attention(probs, r, kept=seen.expand(probs.shape))
    weights = 2.0 ** torch.arange(rows - 1, -1, -1, device=keys.device, dtype=torch.float64)  # the last row is bit 0
    if query_valid is not None:  # a pad row is no query (left padding: pads come first)
        weights = weights * query_valid[:, first:].to(torch.float64)[:, None, :]
    return (low.to(torch.float64) * weights[..., None]).sum(dim=-2)
