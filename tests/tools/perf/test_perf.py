"""The fast paths keep behaviour identical, and the benchmark machinery measures what it claims.

Fast paths (issue 7): the exact host-integer size simulation of the built-in policies, H2O's
one-token eviction by argmin, ``CacheView.keep``'s broadcast keep arrays and the index_select
gather they allow, ``received_attention``'s decode path, and the fused decode attention of the
transformers integration. The benchmark side: eviction workloads, the prefill loaded into a
cache, slope fits and ``kvpolicy bench`` on tiny sizes (``benchmarks/gpu_decode.py``: tests/benchmarks/test_gpu_decode.py).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpolicy import BUZZ, H2O, FullCache, LocalWindow, StreamingLLM, simulate_sizes
from kvpolicy.budget import _replay_sizes
from kvpolicy.policy import CacheView
from kvpolicy_tools.perf.report import fit_slope, markdown_table, slopes
from strategies import any_policy

ROOT = Path(__file__).resolve().parents[3]


# ============================================================================ core (no torch)
@given(any_policy(), st.integers(1, 160), st.data())
def test_size_rule_equals_replaying_the_policy(policy, context, data) -> None:
    prompt = data.draw(st.integers(0, context))
    np.testing.assert_array_equal(simulate_sizes(policy, context, prompt), _replay_sizes(policy, context, prompt))


def test_subclasses_are_replayed_not_simulated() -> None:
    class EveryOther(StreamingLLM):  # a subclass may change select: the size rule must not apply
        decode_eviction = size_rule = None  # its own select: no inherited rule

        def select(self, view):
            n = view.n_cached
            if n <= self.sink + self.window:
                return None
            return view.keep(view.arange(0, n, 2))

    p = EveryOther(sink=1, window=3)
    np.testing.assert_array_equal(simulate_sizes(p, 40, 5), _replay_sizes(p, 40, 5))
    assert simulate_sizes(p, 40, 5).tolist() != simulate_sizes(StreamingLLM(sink=1, window=3), 40, 5).tolist()


def _h2o_by_sort(policy: H2O, view: CacheView) -> np.ndarray:
    """H2O's keep array through the general (stable sort) path."""
    n = view.n_cached
    candidates = n - policy.recent
    order = np.argsort(view.scores[..., :candidates], axis=-1, kind="stable")
    heavy = np.sort(order[..., n - policy.heavy - policy.recent :], axis=-1)
    return np.concatenate([heavy, np.broadcast_to(np.arange(candidates, n), heavy.shape[:2] + (policy.recent,))], -1)


@given(st.integers(1, 8), st.integers(1, 6), st.integers(1, 3), st.integers(1, 3), st.integers(0, 2**31 - 1), st.booleans())
def test_h2o_argmin_path_equals_the_stable_sort(heavy, recent, batch, heads, seed, ties) -> None:
    rng = np.random.default_rng(seed)
    n = heavy + recent + 1  # a decode step: exactly one token to evict
    scores = rng.integers(0, 3, (batch, heads, n)).astype(float) if ties else rng.random((batch, heads, n))
    view = CacheView(np.broadcast_to(np.arange(n), (batch, heads, n)), scores, n)
    policy = H2O(heavy, recent)
    np.testing.assert_array_equal(np.asarray(policy.select(view)), _h2o_by_sort(policy, view))


def test_h2o_argmin_path_on_torch_matches_numpy() -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 2, (2, 3, 9)).astype(float)  # many ties
    pos = np.broadcast_to(np.arange(9), (2, 3, 9))
    policy = H2O(4, 4)
    a = policy.select(CacheView(pos, scores, 9))
    b = policy.select(CacheView(torch.as_tensor(pos.copy()), torch.as_tensor(scores), 9))
    np.testing.assert_array_equal(np.asarray(a), b.numpy())


def test_keep_of_shared_slots_is_a_broadcast_view() -> None:
    view = CacheView(np.zeros((2, 3, 10), dtype=np.int64), np.zeros((2, 3, 10)), 10)
    keep = view.keep(view.arange(2), view.arange(6, 10))
    assert keep.shape == (2, 3, 6) and keep.strides[:2] == (0, 0)
    assert keep.tolist() == [[[0, 1, 6, 7, 8, 9]] * 3] * 2


# ============================================================================ torch backend
torch = pytest.importorskip("torch")

from kvpolicy_torch import LayerCache, received_attention  # noqa: E402
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


def test_layer_cache_index_select_path_keeps_the_same_tokens() -> None:
    """Shared keeps (StreamingLLM's broadcast arrays; shared selection) take index_select;
    per-head keeps (BUZZ) take gather: both against the NumPy reference."""
    import kvpolicy_numpy

    for policy in (StreamingLLM(sink=2, window=5), LocalWindow(6), H2O(3, 3, selection="shared"), BUZZ(1, 3, 3, 6)):
        rng = np.random.default_rng(1)
        logits = rng.normal(size=(30, 1, 30))
        trace = kvpolicy_numpy.replay(policy, logits)
        layer = LayerCache(policy)
        vals = torch.arange(30, dtype=torch.float64)
        for t in range(30):
            k = v = torch.full((1, 1, 1, 2), float(t), dtype=torch.float64)
            layer.append(k, v)
            cached = layer.slot_positions[0]  # slot order, -1 at holes
            rows = torch.as_tensor(logits[t, 0])[cached.clamp(min=0)].masked_fill(cached < 0, float("-inf"))
            layer.accumulate(torch.softmax(rows, dim=-1)[None])
            layer.evict()
            assert layer.positions[0].tolist() == trace.kept[t].tolist(), (policy, t)
            assert layer.keys[0, 0, :, 0].tolist() == vals[layer.positions[0, 0]].tolist()  # K/V moved with positions


# ============================================================================ transformers integration
pytest.importorskip("transformers")

from kvpolicy_tools.models import tiny_llama  # noqa: E402
from kvpolicy_integrations.hf import EvictingCache, cache_kwargs  # noqa: E402
from kvpolicy_torch import decode_attention, rope_rotate  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("holes", [False, True])
def test_decode_attention_equals_sdpa_plus_score_product(dtype, holes) -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 1, 16, generator=g).to(dtype)
    k = torch.randn(2, 2, 30, 16, generator=g).to(dtype)
    v = torch.randn(2, 2, 30, 16, generator=g).to(dtype)
    bias = m = None
    if holes:  # per-head holes (H2O evicts per KV head): an additive bias, -inf at the holes
        allowed = torch.ones(2, 2, 30, dtype=torch.bool)
        allowed[0, 0, :4] = False
        allowed[1, 1, 7] = False
        bias = torch.zeros(2, 2, 30, dtype=dtype).masked_fill(~allowed, float("-inf"))
        m = allowed.repeat_interleave(3, dim=1)[:, :, None, :]  # per query head, for SDPA
    out, received = decode_attention(q, k, v, 0.3, bias=bias)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(out.transpose(1, 2), ref, rtol=1e-5, atol=1e-6)
    if not holes:
        torch.testing.assert_close(received, received_attention(q, k, 0.3), rtol=1e-6, atol=1e-7)
    else:
        assert torch.all(received[0, 0, :4] == 0) and received[1, 1, 7] == 0
        torch.testing.assert_close(received.sum(-1), torch.full((2, 2), 3.0, dtype=received.dtype))


@pytest.mark.parametrize("policy", [BUZZ(2, 6, 3, 10), BUZZ(2, 6, 4, 12, log_n=True, log_base=8.0), H2O(8, 8)], ids=repr)
def test_fused_and_unfused_decode_agree(policy) -> None:
    model = tiny_llama(num_layers=2, heads=4, kv_heads=2, head_dim=16, vocab=128, seed=0)
    ids = torch.randint(3, 128, (2, 30), generator=torch.Generator().manual_seed(4))
    outs, caches = [], []
    for fused in (True, False):
        cache = EvictingCache(policy, model, fused_decode=fused)
        with torch.no_grad():
            outs.append(model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False, **cache_kwargs(model, cache)))
        caches.append(cache)
    assert torch.equal(outs[0], outs[1])
    for a, b in zip(caches[0].layers, caches[1].layers):
        assert torch.equal(a.store.positions, b.store.positions)
        torch.testing.assert_close(a.store.scores, b.store.scores, rtol=1e-5, atol=1e-5)


def test_fused_path_is_taken_in_decode_only(monkeypatch) -> None:
    from kvpolicy_torch import LayerCache

    model = tiny_llama(num_layers=1, seed=2)
    calls = []
    original = LayerCache.attend

    def spy(self, query, *a, **k):
        calls.append(query.shape[2])
        return original(self, query, *a, **k)

    monkeypatch.setattr(LayerCache, "attend", spy)
    # prefill goes through SDPA; so does a decode step that needs neither scores nor a mask:
    # StreamingLLM's sink shift is done in the storage (its sinks' keys rotated), so it takes SDPA
    for policy, expected in ((H2O(6, 6), [1, 1, 1]), (StreamingLLM(2, 8), []), (LocalWindow(8), []), (FullCache(), [])):
        calls.clear()
        cache = EvictingCache(policy, model)
        with torch.no_grad():
            model.generate(torch.arange(3, 23)[None], max_new_tokens=4, do_sample=False, **cache_kwargs(model, cache))
        assert calls == expected, policy


# ============================================================================ benchmark machinery
from kvpolicy_tools.perf.decode import Candidate, build_cache, prefill  # noqa: E402
from kvpolicy_tools.perf.eviction import POLICIES, policy_at_size, workload  # noqa: E402


@pytest.mark.parametrize("name", POLICIES)
def test_policy_at_size_evicts_at_size(name) -> None:
    """The largest of its kind within the size, from the registry and from_size: exactly the size
    for a one-token policy, a few tokens less at most for BUZZ (its capacity grows in steps)."""
    from kvpolicy.budget import fit_capacity

    p = policy_at_size(name, 300)
    if not p.evicts:
        assert p.capacity is None
        return
    assert p == fit_capacity(name, 300) and 295 <= p.capacity <= 300
    assert p.capacity == 300 or p.decode_eviction is None


@pytest.mark.parametrize("backend", ["torch", "numpy"])
@pytest.mark.parametrize("name", POLICIES)
def test_eviction_workloads(backend, name) -> None:
    w = workload(backend, name, 200, batch=2, heads=2, head_dim=4)
    length = (lambda: w.layer.length) if backend == "torch" else (lambda: w.length)
    assert w.size <= 200
    for _ in range(2):  # resets make rounds repeatable
        w.reset_before_eviction()
        assert length() == w.size
        w.one_eviction()
        assert (length() == w.size) if name == "full" else (length() < w.size)
        w.reset_after_eviction()
        start = length()
        w.decode_round()
        assert length() == (start + w.period if name == "full" else start)
    if name == "buzz":
        assert w.period > 50  # a whole cycle: the middle refills from its steady size to the threshold


def test_prefill_loaded_into_caches_decodes_like_a_real_prefill() -> None:
    model = tiny_llama(num_layers=2, heads=4, kv_heads=2, head_dim=16, vocab=128, seed=0)
    pre = prefill(model, 40, seed=3)
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(3))
    tok = torch.tensor([[7]])
    pos = torch.tensor([[40]])
    dyn = build_cache(model, Candidate("DynamicCache"), pre)
    full = build_cache(model, Candidate("FullCache", FullCache()), pre)
    with torch.no_grad():
        a = model(tok, **cache_kwargs(model, dyn), position_ids=pos).logits
        b = model(tok, **cache_kwargs(model, full), position_ids=pos).logits
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # an evicting cache ends in the size and state a real prefill leaves
    policy = BUZZ(2, 4, 3, 9)
    loaded = build_cache(model, Candidate("BUZZ", policy), pre)
    real = EvictingCache(policy, model)
    with torch.no_grad():
        model(ids, **cache_kwargs(model, real))
    assert loaded.lengths() == real.lengths()
    assert [layer.store.state for layer in loaded.layers] == [layer.store.state for layer in real.layers]
    assert loaded.get_seq_length() == real.get_seq_length() == 40


def test_slopes_and_tables() -> None:
    xs = [256, 512, 1024, 2048]
    assert fit_slope(xs, [3e-6 * x for x in xs]) == pytest.approx(1.0)
    assert fit_slope(xs, [5e-6] * 4) == pytest.approx(0.0)
    rows = [{"backend": "t", "policy": "p", "batch": 1, "heads": 1, "size": x, "v": x**2} for x in xs]
    assert slopes(rows, "v")[("t", "p", 1, 1)] == (pytest.approx(2.0), 4)
    assert markdown_table(["a", "b"], [[1, 2]]).splitlines() == ["| a | b |", "| --- | ---: |", "| 1 | 2 |"]


class HalfWindow(StreamingLLM):
    """A third-party policy for ``kvpolicy bench --policy test_perf:HalfWindow``."""

    name = "half_window_test"


def make_local(budget, context_length, prompt_length):
    return LocalWindow(window=max(1, int(budget * context_length)))


def test_bench_resolves_third_party_policies() -> None:
    from kvpolicy_tools.perf.bench import resolve_policy

    spec = resolve_policy("test_perf:HalfWindow")
    assert spec.budgeted and isinstance(spec.planner(0.25, 400, 300), HalfWindow)
    spec = resolve_policy("test_perf:make_local")
    assert spec.planner(0.25, 400, 300) == LocalWindow(100)
    with pytest.raises(ValueError, match="no attribute"):
        resolve_policy("test_perf:Nope")
    with pytest.raises(ValueError, match="cannot import"):
        resolve_policy("no_such_module_xyz:Thing")


def test_bench_command_quick_on_a_tiny_model(tmp_path) -> None:
    from kvpolicy_tools.perf.bench import main

    out = tmp_path / "bench"
    status = main([
        "--quick", "--out", str(out), "--no-progress", "--sizes", "64,128,256", "--rounds", "1",
        "--model", "tiny-llama", "--contexts", "48,96", "--steps", "2", "--decode-rounds", "2",
        "--policy", "buzz", "--policy", "test_perf:make_local",
    ])
    assert status == 0
    report = (out / "report.md").read_text()
    for needle in ("Log-log slopes", "DynamicCache", "BUZZ 25%", "make_local 25%", "capture only (unfused)", "Breakdown"):
        assert needle in report, needle
    data = json.loads((out / "results.json").read_text())
    assert {r["policy"] for r in data["complexity"]["rows"]} == set(POLICIES)
    assert {r["context"] for r in data["decode"]["results"]} == {48, 96}
    assert sorted(p.name for p in out.glob("*.png")) == ["breakdown_48.png", "breakdown_96.png", "complexity_b1_h8.png", "decode.png"]


def test_rope_rotate_equals_rope_at_the_shifted_position() -> None:
    """Rotating a key RoPE'd at p by delta equals RoPE applied at p + delta (transformers' own)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = tiny_llama(num_layers=1, heads=4, kv_heads=2, head_dim=16, seed=0)
    rotary = model.model.rotary_emb
    raw = torch.randn(1, 2, 30, 16, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(30)
    delta = torch.randint(-25, 40, (1, 2, 30), generator=torch.Generator().manual_seed(2))
    cos, sin = rotary(raw, pos[None])
    at_p, _ = apply_rotary_pos_emb(raw, raw, cos, sin)
    got = rope_rotate(at_p, delta, rotary.inv_freq)
    for h in range(2):
        c, s = rotary(raw, (pos + delta[0, h])[None])
        want, _ = apply_rotary_pos_emb(raw[:, h : h + 1], raw[:, h : h + 1], c, s)
        torch.testing.assert_close(got[:, h : h + 1], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("policy", [BUZZ(2, 5, 3, 12), H2O(6, 5), StreamingLLM(3, 9), BUZZ(1, 4, 4, 9, selection="shared")], ids=repr)
@pytest.mark.parametrize("chunk_bytes", [1, 700])  # one slot per chunk; a few slots per chunk
def test_in_place_compaction_equals_gather_then_copy(policy, chunk_bytes, monkeypatch) -> None:
    """The chunked in-place compaction moves every kept token exactly where one gather of the
    whole cache would (a chunk larger than the cache), keys, values, positions and scores alike,
    whatever the chunk size."""
    g = torch.Generator().manual_seed(7)
    steps = [(torch.randn(2, 3, q, 4, generator=g), torch.rand(2, 3, 64, generator=g)) for q in [20] + [1] * 40]
    stores = []
    for mode in (1 << 40, chunk_bytes):
        monkeypatch.setattr(LayerCache, "compaction_chunk_bytes", mode)
        layer = LayerCache(policy)
        for kv, rec in steps:
            layer.append(kv, kv * 2)
            # what a token receives depends on its position, not its slot: the two storages may
            # differ in slack (the chunk bounds it), so slot layouts differ while decisions must not
            pos = layer.slot_positions
            layer.accumulate(rec.gather(-1, pos.clamp(min=0)) * (pos >= 0))
            layer.evict()
        stores.append(layer)
    a, b = stores
    assert a.length == b.length and a.evictions == b.evictions > 0
    for x, y in ((a.keys, b.keys), (a.values, b.values), (a.positions, b.positions), (a.scores, b.scores)):
        assert torch.equal(x, y)


# ============================================================================ endurance (issue 15)
from kvpolicy_tools.perf.endurance import (  # noqa: E402
    CacheShape,
    EnduranceResult,
    EnduranceSample,
    endurance_policy,
    markdown,
    run_endurance,
)


@pytest.mark.parametrize("name", ["buzz", "h2o", "streaming_llm"])
def test_endurance_run_on_a_small_shape(name) -> None:
    policy = endurance_policy(name, 24)
    shape = CacheShape(layers=2, kv_heads=2, head_dim=8)
    seen = []
    result = run_endurance(policy, 300, shape=shape, samples=30, warmup=60, on_sample=seen.append)
    assert len(result.samples) == 30 and seen == result.samples
    assert [s.token for s in result.samples] == list(range(10, 301, 10))
    assert all(s.cached_tokens < policy.capacity for s in result.samples)
    # the storage is allocated once: the same bytes at every sample, at least two layers' keys,
    # values (fp32), positions (int64) and scores (fp32) for `capacity` slots
    per_layer = 2 * policy.capacity * (2 * 8 * 4 + 8 + 4)
    assert len({s.allocated_bytes for s in result.samples}) == 1
    assert result.samples[0].allocated_bytes >= 2 * per_layer
    assert result.flatness()["allocated_bytes"] == 1.0
    # the fastest token of each sample is never slower than its median or its mean
    assert all(0 < s.min_seconds_per_token <= min(s.seconds_per_token, s.mean_seconds_per_token) for s in result.samples)
    assert len(result.measured()) == 24  # samples after token 60
    assert "| " + repr(policy) in markdown([result])


def _fake(metric_values: list[float]) -> EnduranceResult:
    r = EnduranceResult("x", "h2o", {}, CacheShape(1, 1, 1), tokens=100 * len(metric_values), warmup=0, device="cpu")
    r.samples = [
        EnduranceSample(100 * (i + 1), 1000, 10_000, v, min_seconds_per_token=v) for i, v in enumerate(metric_values)
    ]
    return r


def test_endurance_flatness_sees_growth() -> None:
    """The measure can fail: a per-token time that grows with the stream is not flat."""
    flat, growing = _fake([1.0] * 40), _fake([1.0 + i / 10 for i in range(40)])
    assert flat.is_flat() and flat.flatness()["seconds_per_token"] == 1.0
    assert not growing.is_flat()
    # first decile: samples 0-3 (median 1.15), last: 36-39 (median 4.75)
    assert growing.deciles("seconds_per_token") == (pytest.approx(1.15), pytest.approx(4.75))
    assert growing.flatness()["min_seconds_per_token"] == pytest.approx(4.75 / 1.15)
    assert growing.is_flat(metrics=["allocated_bytes", "rss_bytes"])


def test_endurance_refuses_what_it_cannot_measure() -> None:
    with pytest.raises(ValueError, match="policy must bound the cache"):
        run_endurance(FullCache(), 100)
    with pytest.raises(ValueError, match="^policy must be an EvictionPolicy instance"):
        run_endurance("h2o", 100)
    with pytest.raises(ValueError, match=r"^samples must be >= 2 and <= 100, got 101$"):
        run_endurance(endurance_policy("h2o", 16), 100, samples=101)
    with pytest.raises(ValueError, match="need at least 2 samples after the warm-up"):
        _fake([1.0]).deciles("rss_bytes")


@pytest.mark.parametrize("n", [1, 7, 1024, 70_000, 100_003])
def test_first_argmin_equals_argmin_with_ties(n) -> None:
    """first_argmin (blocked on large CPU inputs) returns torch.argmin's first minimum, ties and
    -inf included."""
    from kvpolicy_torch import first_argmin

    g = torch.Generator().manual_seed(n)
    x = torch.randint(0, 5, (3, n), generator=g).to(torch.float32)  # many ties
    x[1, n // 2 :] = float("-inf") if n > 1 else x[1, n // 2 :]
    x[2] = float("inf")
    assert torch.equal(first_argmin(x), torch.argmin(x, dim=-1))


@given(
    rows=st.integers(1, 4), blocks=st.integers(16, 80), extra=st.integers(-1023, 1023), spare=st.integers(0, 50),
    levels=st.integers(1, 6), seed=st.integers(0, 2**16),
)  # fmt: skip
@settings(max_examples=40, deadline=None)
def test_first_argmin_on_strided_views_with_a_partial_block(rows, blocks, extra, spare, levels, seed) -> None:
    """The blocked search on a slice of a wider storage (as LayerCache passes it), with a partial
    last block, many ties and the minimum anywhere (the tail included): torch.argmin's answer."""
    from kvpolicy_torch import first_argmin

    n = blocks * 1024 + extra
    g = torch.Generator().manual_seed(seed)
    storage = torch.randint(0, levels, (rows, 2, n + spare), generator=g).to(torch.float32)
    view = storage[:, :, :n]
    assert torch.equal(first_argmin(view), torch.argmin(view, dim=-1))
