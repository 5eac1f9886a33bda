"""The score product of one decode step, before and after the fast paths (one group per size).

* ``einsum (before)``: ``received_attention`` as it was (5-D einsum, a zero-filled output, blocks);
* ``received_attention``: today's, with the q=1 fast path (one batched matmul);
* ``sdpa``: the attention output alone (what a cache that reads no scores pays);
* ``sdpa + received_attention``: the unfused decode path (``fused_decode=False``);
* ``fused``: ``kvpolicy_torch.decode_attention``, output and scores in one pass over the keys.

Shapes of the embedded model (9 query heads, 3 KV heads, head_dim 64), batch 1.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import _settings  # noqa: E402

from kvpolicy_torch import decode_attention, received_attention  # noqa: E402
from kvpolicy_torch.scores import group_query_heads  # noqa: E402

SIZES = (512, 2048) if _settings.QUICK else (512, 2048, 8192, 32768)


def received_attention_before(query, keys, scaling, *, query_scale=None, block=512):
    """``kvpolicy_torch.received_attention`` before the decode fast path (verbatim)."""
    b, hq, q, d = query.shape
    kv_heads, n = keys.shape[1], keys.shape[2]
    work = torch.float64 if query.dtype == torch.float64 else torch.float32
    grouped = group_query_heads(query, kv_heads).to(work)
    k = keys.to(work)
    out = torch.zeros(b, kv_heads, n, dtype=work, device=keys.device)
    offset = n - q
    for start in range(0, q, block):
        stop = min(q, start + block)
        logits = torch.einsum("bgrqd,bgnd->bgrqn", grouped[:, :, :, start:stop], k) * scaling
        if query_scale is not None:
            logits = logits * query_scale[start:stop, None].to(work)
        if q > 1:
            rows = torch.arange(start, stop, device=keys.device)[:, None]
            cols = torch.arange(n, device=keys.device)[None, :]
            logits = logits.masked_fill(cols > offset + rows, float("-inf"))
        out += torch.softmax(logits, dim=-1).sum(dim=(2, 3))
    return out


def _inputs(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 9, 1, 64, generator=g)
    # keys/values as a cache holds them: a [.., :n] view of a larger preallocated storage
    k = torch.randn(1, 3, n + 64, 64, generator=g)[:, :, :n]
    v = torch.randn(1, 3, n + 64, 64, generator=g)[:, :, :n]
    return q, k, v


def _sdpa(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.125, enable_gqa=True)


VARIANTS = {
    "einsum (before)": lambda q, k, v: received_attention_before(q, k, 0.125),
    "received_attention": lambda q, k, v: received_attention(q, k, 0.125),
    "sdpa": _sdpa,
    "sdpa + received_attention": lambda q, k, v: (_sdpa(q, k, v), received_attention(q, k, 0.125)),
    "fused": lambda q, k, v: decode_attention(q, k, v, 0.125),
}


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_decode_score_product(benchmark, variant, n):
    q, k, v = _inputs(n)
    fn = VARIANTS[variant]
    benchmark.group = f"decode score product, {n} keys"
    benchmark.extra_info.update(variant=variant, keys=n)
    benchmark.pedantic(fn, args=(q, k, v), rounds=_settings.ROUNDS * 20, iterations=5, warmup_rounds=2)
    # all variants agree on what they compute
    ref = received_attention_before(q, k, 0.125)
    torch.testing.assert_close(received_attention(q, k, 0.125), ref, rtol=1e-5, atol=1e-6)
    out, received = decode_attention(q, k, v, 0.125)
    torch.testing.assert_close(received, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.transpose(1, 2), _sdpa(q, k, v), rtol=1e-5, atol=1e-6)
