"""Decode attention over a slot cache, with the scores the policies need, RoPE re-rotation, and
the masks of sliding and chunked windows on original positions."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["decode_attention", "grouped_decode", "rope_matrix", "rope_rotate", "window_bias", "window_chunk_mask",
           "window_limit"]


def rope_rotate(
    x: torch.Tensor,
    delta: torch.Tensor,
    inv_freq: torch.Tensor,
    *,
    style: str = "half",
    rotary_dim: int | None = None,
) -> torch.Tensor:
    """Rotate ``x`` ``[..., head_dim]`` by ``delta`` positions with RoPE; ``delta`` broadcasts
    against ``x[..., 0]``.

    Args:
        style: ``"half"`` (Llama's ``rotate_half``, pairs ``(i, i + rotary_dim / 2)``) or
            ``"interleaved"`` (pairs ``(2i, 2i + 1)``: Cohere, GLM, GPT-J).
        rotary_dim: the leading dimensions rotated (partial rotary: GPT-NeoX, Phi, StableLM,
            GLM); the rest pass through. Default ``head_dim``; must be ``2 * len(inv_freq)``.

    RoPE scores depend only on the difference of the query's and the key's positions, so moving a
    key by ``delta`` or its query by ``-delta`` gives the same score. Angles are computed as
    transformers computes them (``float32(delta) * inv_freq``), in float32 (float64 for float64
    inputs). Scaled variants (linear, NTK, llama3, YaRN, LongRoPE) differ only in ``inv_freq``
    and in a magnitude factor that a key already carries, so rotating by angles alone is exact.

    Example:
        >>> x = torch.tensor([[1.0, 0.0]])
        >>> y = rope_rotate(rope_rotate(x, torch.tensor([3]), torch.tensor([0.5])), torch.tensor([-3]), torch.tensor([0.5]))
        >>> bool(torch.allclose(y, x, atol=1e-6))
        True
        >>> rope_rotate(torch.tensor([[1.0, 0.0, 0.0, 0.0, 2.0]]), torch.tensor([1]), torch.tensor([1.0, 0.0]),
        ...             style="interleaved", rotary_dim=4)
        tensor([[0.5403, 0.8415, 0.0000, 0.0000, 2.0000]])
    """
    if style not in ("half", "interleaved"):
        raise ValueError(f"style must be 'half' or 'interleaved', got {style!r}")
    dim = x.shape[-1] if rotary_dim is None else rotary_dim
    if dim != 2 * inv_freq.shape[-1] or dim > x.shape[-1]:
        raise ValueError(
            f"RoPE needs rotary_dim = 2 * len(inv_freq) <= head_dim, got rotary_dim {dim}, "
            f"{inv_freq.shape[-1]} frequencies, head_dim {x.shape[-1]}"
        )
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    angles = delta.to(torch.float32)[..., None] * inv_freq.to(device=x.device, dtype=torch.float32)
    cos, sin = angles.cos().to(work), angles.sin().to(work)
    xf = x.to(work)
    rot, rest = xf[..., :dim], xf[..., dim:]
    if style == "half":
        half = dim // 2
        x1, x2 = rot[..., :half], rot[..., half:]
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    if rest.shape[-1]:
        rotated = torch.cat((rotated, rest), dim=-1)
    return rotated.to(x.dtype)


def rope_matrix(
    delta: torch.Tensor,
    inv_freq: torch.Tensor,
    head_dim: int,
    *,
    style: str = "half",
    rotary_dim: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``[len(delta), 1, head_dim, head_dim]`` matrices ``R`` such that ``x @ R`` rotates row ``r``
    of ``x`` ``[batch, heads, s, head_dim]`` by ``delta[r]`` positions, as :func:`rope_rotate`.

    For rotating many small tensors by the same shifts (StreamingLLM's sinks in every layer of a
    model): the matrices are built once, and each rotation is then one matmul instead of a dozen
    element-wise ops. Same angles as :func:`rope_rotate` (``float32(delta) * inv_freq``); the
    product may round differently in the last bit.

    Example:
        >>> x, d, f = torch.randn(2, 3, 4, 8), torch.tensor([1, 5]), torch.rand(4)
        >>> got = x @ rope_matrix(d, f, 8)
        >>> bool(torch.allclose(got, rope_rotate(x, d.view(2, 1, 1), f), atol=1e-6))
        True
    """
    if style not in ("half", "interleaved"):
        raise ValueError(f"style must be 'half' or 'interleaved', got {style!r}")
    dim = head_dim if rotary_dim is None else rotary_dim
    if dim != 2 * inv_freq.shape[-1] or dim > head_dim:
        raise ValueError(
            f"RoPE needs rotary_dim = 2 * len(inv_freq) <= head_dim, got rotary_dim {dim}, "
            f"{inv_freq.shape[-1]} frequencies, head_dim {head_dim}"
        )
    if delta.ndim != 1:
        raise ValueError(f"delta must be 1-D (one shift per row), got shape {tuple(delta.shape)}")
    dev = delta.device
    angles = delta.to(torch.float32)[:, None] * inv_freq.to(device=dev, dtype=torch.float32)  # [b, dim/2]
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    half = dim // 2
    i = torch.arange(half, device=dev)
    # pairs (first, second) rotate as y_first = x_first cos - x_second sin, y_second = x_second cos + x_first sin
    first, second = (i, i + half) if style == "half" else (2 * i, 2 * i + 1)
    r = torch.zeros(delta.shape[0], head_dim, head_dim, dtype=dtype, device=dev)
    r[:, first, first] = cos
    r[:, second, second] = cos
    r[:, second, first] = -sin
    r[:, first, second] = sin
    rest = torch.arange(dim, head_dim, device=dev)
    r[:, rest, rest] = 1  # partial rotary: the other dimensions pass through
    return r[:, None]


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
