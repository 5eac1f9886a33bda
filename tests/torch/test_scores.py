"""received_attention's prefill path: blocked over queries (block size from a memory bound),
causal key ranges per block, 16-bit keys upcast per chunk, against a float64 dense reference."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from kvpolicy_torch import prefill_attention, received_attention  # noqa: E402
from kvpolicy_torch.scores import prefill_block_rows  # noqa: E402


def dense_reference(query, keys, scaling, query_scale=None):
    """softmax(q k^T * scale) with the causal mask, every query at once, in float64."""
    b, hq, q, d = query.shape
    g, n = keys.shape[1], keys.shape[2]
    qq = query.double().reshape(b, g, hq // g, q, d)
    logits = torch.einsum("bgrqd,bgnd->bgrqn", qq, keys.double()) * scaling
    if query_scale is not None:
        logits = logits * query_scale.double()[:, None]
    mask = torch.arange(n)[None, :] > (n - q) + torch.arange(q)[:, None]
    return torch.softmax(logits.masked_fill(mask, float("-inf")), dim=-1).sum(dim=(2, 3))


@given(
    b=st.integers(1, 2), g=st.integers(1, 3), r=st.integers(1, 3), q=st.integers(2, 40), cached=st.integers(0, 30),
    block=st.one_of(st.none(), st.integers(1, 17)), log_n=st.booleans(), seed=st.integers(0, 2**16),
)  # fmt: skip
@settings(max_examples=60, deadline=None)
def test_prefill_equals_the_dense_reference(b, g, r, q, cached, block, log_n, seed):
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(b, g * r, q, 8, generator=gen)
    keys = torch.randn(b, g, cached + q, 8, generator=gen)
    qs = torch.rand(q, generator=gen) + 0.5 if log_n else None
    got = received_attention(query, keys, 0.35, query_scale=qs, block=block)
    assert got.dtype == torch.float32 and got.shape == (b, g, cached + q)
    torch.testing.assert_close(got.double(), dense_reference(query, keys, 0.35, qs), rtol=1e-5, atol=1e-5)
    # every query row's probabilities sum to one
    torch.testing.assert_close(got.sum(-1).double(), torch.full((b, g), float(r * q), dtype=torch.float64), rtol=1e-5, atol=0)


def test_float64_stays_float64_and_exact():
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(1, 4, 33, 16, generator=gen, dtype=torch.float64)
    keys = torch.randn(1, 2, 50, 16, generator=gen, dtype=torch.float64)
    got = received_attention(query, keys, 0.25, block=5)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, dense_reference(query, keys, 0.25), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_keys_upcast_per_chunk_equal_the_float32_product(dtype):
    """A tiny workspace forces one-key chunks: the result equals the float32 computation on the
    upcast values (16-bit values are exact in float32, so only summation order differs)."""
    gen = torch.Generator().manual_seed(1)
    query = torch.randn(2, 6, 21, 8, generator=gen).to(dtype)
    keys = torch.randn(2, 3, 30, 8, generator=gen).to(dtype)
    got = received_attention(query, keys, 0.35, workspace_bytes=1)
    assert got.dtype == torch.float32
    want = received_attention(query.float(), keys.float(), 0.35)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # log n scales, one of them 0 (log_floor=0 at n = 1: uniform attention, no NaN from -inf * 0)
    qs = torch.linspace(0.0, 1.5, 21)
    got = received_attention(query, keys, 0.35, query_scale=qs, workspace_bytes=1)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), dense_reference(query.float(), keys.float(), 0.35, qs), rtol=1e-5, atol=1e-5)


def test_no_float32_copy_of_all_keys_for_16bit_keys(monkeypatch):
    """Spy on Tensor.to: with 16-bit keys no call converts more than one chunk of keys."""
    gen = torch.Generator().manual_seed(2)
    query = torch.randn(1, 4, 64, 8, generator=gen).to(torch.bfloat16)
    keys = torch.randn(1, 2, 200, 8, generator=gen).to(torch.bfloat16)
    biggest = []
    original = torch.Tensor.to

    def spy(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if self.dtype == torch.bfloat16 and out.dtype == torch.float32:
            biggest.append(self.numel())
        return out

    monkeypatch.setattr(torch.Tensor, "to", spy)
    chunk_keys = 16  # workspace for 16 keys of 2 heads x 8 dims in float32
    got = received_attention(query, keys, 0.35, workspace_bytes=1 * 2 * 8 * 4 * chunk_keys)
    monkeypatch.undo()
    assert len(biggest) > 200 // chunk_keys  # the keys were converted, chunk by chunk
    assert max(biggest) <= 1 * 2 * chunk_keys * 8 < keys.numel()
    torch.testing.assert_close(got, received_attention(query.float(), keys.float(), 0.35), rtol=1e-5, atol=1e-5)


@given(
    b=st.integers(1, 2), g=st.integers(1, 3), r=st.integers(1, 3), q=st.integers(2, 40), cached=st.integers(0, 30),
    block=st.one_of(st.none(), st.integers(1, 17)), log_n=st.booleans(), holes=st.booleans(), pads=st.booleans(),
    f64=st.booleans(), seed=st.integers(0, 2**16),
)  # fmt: skip
@settings(max_examples=60, deadline=None)
def test_prefill_attention_is_masked_attention_and_received_attention(b, g, r, q, cached, block, log_n, holes, pads, f64, seed):
    """prefill_attention's output is the masked softmax attention (float64 dense reference, GQA:
    query head g * r + i reads KV head g), and its sums are received_attention's, bit for bit, with
    log n scales, holes among the cached keys and pad queries (which see only themselves, as
    LayerCache.chunk_mask makes them, and add nothing)."""
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.float64 if f64 else torch.float32
    n = cached + q
    query = torch.randn(b, g * r, q, 8, generator=gen, dtype=dtype)
    keys, values = torch.randn(b, g, n, 8, generator=gen, dtype=dtype), torch.randn(b, g, n, 6, generator=gen, dtype=dtype)
    qs = torch.rand(b, q, generator=gen, dtype=dtype) + 0.5 if log_n else None
    rows, cols = torch.arange(q)[:, None], torch.arange(n)[None, :]
    mask = (cols <= cached + rows)[None].expand(b, q, n).clone()
    if holes:
        mask[:, :, :cached] &= torch.rand(b, 1, cached, generator=gen) < 0.7
    valid = None
    if pads:
        valid = torch.arange(q)[None, :] >= torch.randint(0, q, (b, 1), generator=gen)
        mask &= torch.cat([torch.ones(b, cached, dtype=torch.bool), valid], dim=1)[:, None, :]  # nobody attends to a pad ...
        mask |= (cols == cached + rows)[None] & ~valid[:, :, None]  # ... which sees only itself
    mask = mask[:, None] if holes or pads else None
    out, received = prefill_attention(query, keys, values, 0.35, query_scale=qs, mask=mask, query_valid=valid, block=block)
    assert out.dtype == dtype and out.shape == (b, q, g * r, 6) and received.dtype == dtype
    assert torch.equal(received, received_attention(query, keys, 0.35, query_scale=qs, mask=mask, query_valid=valid, block=block))
    logits = torch.einsum("bgrqd,bgnd->bgrqn", query.double().reshape(b, g, r, q, 8), keys.double()) * 0.35
    if qs is not None:
        logits = logits * qs.double()[:, None, None, :, None]
    seen = (cols <= cached + rows)[None, None, None] if mask is None else mask[:, :, None]
    probs = torch.softmax(logits.masked_fill(~seen, float("-inf")), dim=-1)
    want = torch.einsum("bgrqn,bgnv->bqgrv", probs, values.double()).reshape(b, q, g * r, 6)
    tol = 1e-12 if f64 else 1e-5
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)


def test_prefill_attention_refuses_16bit_and_mixed_dtypes():
    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match="float32 or float64 .* got torch.bfloat16"):
        prefill_attention(q.bfloat16(), k.bfloat16(), k.bfloat16(), 0.35)
    with pytest.raises(ValueError, match="one dtype, got torch.float32, torch.float32 and torch.float64"):
        prefill_attention(q, k, k.double(), 0.35)


def test_block_rows_follow_the_workspace():
    assert prefill_block_rows(1, 40, 32768, workspace_bytes=256 << 20) == 51
    assert prefill_block_rows(2, 40, 32768, workspace_bytes=256 << 20) == 25
    assert prefill_block_rows(1, 40, 10**9) == 1  # never zero
    # the default block's logits stay under the workspace
    rows = prefill_block_rows(1, 9, 16384)
    assert rows * 9 * 16384 * 4 <= 256 << 20 < (rows + 1) * 9 * 16384 * 4


@given(
    b=st.integers(1, 2), g=st.integers(1, 3), r=st.integers(1, 3), n=st.integers(1, 40), holes=st.data(),
    row_scale=st.booleans(), prefix=st.integers(0, 3), f64=st.booleans(), seed=st.integers(0, 2**16),
)  # fmt: skip
@settings(max_examples=80, deadline=None)
def test_decode_attention_equals_the_dense_reference(b, g, r, n, holes, row_scale, prefix, f64, seed):
    """decode_attention (every branch: fused bias + scaling, row scales, a rotated-back prefix)
    against a float64 softmax over the same logits with holes masked."""
    from kvpolicy_torch import decode_attention

    dtype = torch.float64 if f64 else torch.float32
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(b, g * r, 1, 8, generator=gen, dtype=dtype)
    keys = torch.randn(b, g, n, 8, generator=gen, dtype=dtype)
    values = torch.randn(b, g, n, 8, generator=gen, dtype=dtype)
    hole = torch.tensor(holes.draw(st.lists(st.booleans(), min_size=b * g * n, max_size=b * g * n))).view(b, g, n)
    hole[..., -1] = False  # every row and head attends to at least one key
    bias = torch.zeros(b, g, n, dtype=dtype).masked_fill(hole, float("-inf"))
    scales = torch.rand(b, generator=gen, dtype=dtype) + 0.5 if row_scale else None
    k = min(prefix, n)
    back = torch.randn(b, g * r, 1, 8, generator=gen, dtype=dtype) if k else None
    out, received = decode_attention(
        query, keys, values, 0.35, bias=bias, row_scale=scales, prefix=(k, back) if k else None
    )
    qq = query.double().view(b, g, r, 8)
    logits = torch.einsum("bgrd,bgnd->bgrn", qq, keys.double())
    if k:
        logits[..., :k] = torch.einsum("bgrd,bgnd->bgrn", back.double().view(b, g, r, 8), keys[:, :, :k].double())
    logits = logits * 0.35 * (scales.double().view(b, 1, 1, 1) if scales is not None else 1.0)
    probs = torch.softmax(logits.masked_fill(hole[:, :, None, :], float("-inf")), dim=-1)
    want_out = torch.einsum("bgrn,bgnd->bgrd", probs, values.double()).reshape(b, 1, g * r, 8)
    tol = 1e-12 if f64 else 1e-5
    torch.testing.assert_close(out.double(), want_out, rtol=tol, atol=tol)
    torch.testing.assert_close(received.double(), probs.sum(dim=2), rtol=tol, atol=tol)


@given(
    policy=st.sampled_from(["h2o", "buzz", "tova", "scissorhands"]), b=st.integers(1, 2), g=st.integers(1, 3),
    r=st.integers(1, 3), prompt=st.integers(1, 30), steps=st.integers(1, 30), f64=st.booleans(),
    window=st.booleans(), seed=st.integers(0, 2**16),
)  # fmt: skip
@settings(max_examples=80, deadline=None)
def test_attend_is_decode_attention_then_accumulate_query(policy, b, g, r, prompt, steps, f64, window, seed):
    """LayerCache.attend (its fast path on the storage's grouped views, and its general one)
    equals decode_attention over the slots append returned, holes masked, followed by
    accumulate_query: the same output and the same scores, bit for bit, every step."""
    from kvpolicy import BUZZ, H2O, TOVA, Scissorhands
    from kvpolicy_torch import LayerCache, decode_attention

    make = {"h2o": lambda: H2O(heavy=4, recent=3), "buzz": lambda: BUZZ(sink=2, window=3, stride=3, threshold=6),
            "tova": lambda: TOVA(size=6, recent=1), "scissorhands": lambda: Scissorhands(size=8, history=4, recent=2)}
    dtype = torch.float64 if f64 else torch.float32
    fast, slow = LayerCache(make[policy]()), LayerCache(make[policy]())
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(b, g, prompt, 8, generator=gen, dtype=dtype)
    for layer in (fast, slow):
        layer.append(kv, kv)
        layer.accumulate(torch.rand(b, g, prompt, generator=torch.Generator().manual_seed(seed), dtype=dtype))
        layer.evict()
    for t in range(steps):
        kv = torch.randn(b, g, 1, 8, generator=gen, dtype=dtype)
        query = torch.randn(b, g * r, 1, 8, generator=gen, dtype=dtype)
        keys, values = fast.append(kv, kv)
        slow.append(kv, kv)
        extra = None
        if window:  # an extra bias (a sliding window's): the general path
            extra = torch.zeros(keys.shape[:3]).masked_fill(fast.slot_positions < t, float("-inf"))
        out = fast.attend(query, 0.3, extra_bias=extra)
        bias = slow.bias
        if extra is not None:
            bias = extra if bias is None else bias + extra
        want, received = decode_attention(query, keys, values, 0.3, bias=bias)
        slow.accumulate_query(received, r)
        assert torch.equal(out, want), t
        assert torch.equal(fast.scores, slow.scores) and torch.equal(fast.positions, slow.positions), t
        fast.evict()
        slow.evict()


def _attend_ops(policy) -> int:
    """Top-level ATen ops of one eager decode step's attend() (GQA 9 / 3 heads, 40 cached tokens)."""
    from torch.profiler import ProfilerActivity, profile

    from kvpolicy_torch import LayerCache

    layer, gen = LayerCache(policy), torch.Generator().manual_seed(0)
    kv = torch.randn(1, 3, 40, 16, generator=gen)
    layer.append(kv, kv)
    layer.accumulate(torch.rand(1, 3, 40, generator=gen))
    layer.evict()
    for _ in range(3):
        kv = torch.randn(1, 3, 1, 16, generator=gen)
        layer.append(kv, kv)
        query = torch.randn(1, 9, 1, 16, generator=gen)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            layer.attend(query, 0.25)
        layer.evict()
    return sum(1 for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None)


def test_a_scissorhands_decode_step_costs_about_an_h2o_step() -> None:
    """Scissorhands' record of low attention is shifted into the scores in place on the grouped
    step (its attend took 37 ops to H2O's 10, 86% of the limit at 2,048 tokens on SmolLM2-135M);
    its bits are held to the general path by the test above."""
    from kvpolicy import H2O, Scissorhands

    assert _attend_ops(Scissorhands(size=64, history=16, recent=4)) <= _attend_ops(H2O(heavy=30, recent=30)) + 2


# ---------------------------------------------------------------------------- the decode path (one query) against the 5-D einsum it replaced
from kvpolicy_torch.scores import group_query_heads  # noqa: E402


def _received_before(query, keys, scaling, *, query_scale=None, block=512):
    """received_attention before the decode fast path (the 5-D einsum for every q)."""
    b, hq, q, d = query.shape
    kv_heads, n = keys.shape[1], keys.shape[2]
    work = torch.float64 if query.dtype == torch.float64 else torch.float32
    grouped = group_query_heads(query, kv_heads).to(work)
    k = keys.to(work)
    out = torch.zeros(b, kv_heads, n, dtype=work)
    for start in range(0, q, block):
        stop = min(q, start + block)
        logits = torch.einsum("bgrqd,bgnd->bgrqn", grouped[:, :, :, start:stop], k) * scaling
        if query_scale is not None:
            logits = logits * query_scale[start:stop, None].to(work)
        if q > 1:
            rows = torch.arange(start, stop)[:, None]
            logits = logits.masked_fill(torch.arange(n)[None, :] > n - q + rows, float("-inf"))
        out += torch.softmax(logits, dim=-1).sum(dim=(2, 3))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("q, hq, kv", [(1, 4, 2), (1, 6, 6), (1, 9, 3), (3, 4, 2)])
@pytest.mark.parametrize("log_n", [False, True])
def test_received_attention_decode_path_equals_the_einsum(dtype, q, hq, kv, log_n) -> None:
    g = torch.Generator().manual_seed(q * 100 + hq)
    query = torch.randn(2, hq, q, 8, generator=g).to(dtype)
    keys = torch.randn(2, kv, 40, 8, generator=g).to(dtype)[:, :, :37]  # a view, like the cache's
    qs = torch.tensor([1.3, 1.1, 0.7][:q]) if log_n else None
    got = received_attention(query, keys, 0.35, query_scale=qs)
    want = _received_before(query, keys, 0.35, query_scale=qs)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
