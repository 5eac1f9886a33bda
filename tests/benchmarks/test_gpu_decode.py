"""benchmarks/gpu_decode.py measures what it claims: transformers' RoPE, a memory gate from each
candidate's own bytes, real prefills, decode long enough that every policy evicts, DynamicCache
through transformers' own SDPA. The ``--tiny --device cpu`` dry run exercises every code path."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def gpu(benchmark_module):
    return benchmark_module("gpu_decode")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", ["TINY", "LLAMA2_7B"])
def test_rope_equals_a_normally_constructed_model(gpu, dtype, shape):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    settings = dict(getattr(gpu, shape))
    if shape == "LLAMA2_7B":  # the rotary module only: 7B weights do not fit a CI machine
        settings.update(num_hidden_layers=1, vocab_size=128, intermediate_size=64)
    model = gpu.build_model(settings, "cpu", dtype)
    reference = LlamaRotaryEmbedding(LlamaConfig(**settings))  # what LlamaForCausalLM(config) builds
    got = model.model.rotary_emb
    assert got.inv_freq.dtype == torch.float32  # transformers keeps it float32 whatever the weights
    torch.testing.assert_close(got.inv_freq, reference.inv_freq, rtol=0, atol=0)
    torch.testing.assert_close(got.original_inv_freq, reference.inv_freq, rtol=0, atol=0)
    assert got.attention_scaling == reference.attention_scaling
    # and the model's positions embed as a normally built model's do
    x = torch.zeros(1, 5, settings["hidden_size"], dtype=dtype)
    pos = torch.arange(5)[None]
    for a, b in zip(got(x, pos), reference(x, pos), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_chunked_prefill_equals_one_shot(gpu):
    """The benchmark prefills in chunks: the next token's logits match a one-shot prefill."""
    from kvpolicy import FullCache
    from kvpolicy.hf import cache_kwargs

    model = gpu.build_model(gpu.TINY, "cpu", torch.float32)
    ids = torch.randint(3, 128, (2, 50), generator=torch.Generator().manual_seed(0))
    nxt = torch.tensor([[5], [7]])
    for policy in (None, FullCache()):
        logits = []
        for chunk in (50, 16):
            cache = gpu.make_cache(model, policy)
            gpu.prefill(model, cache, ids, chunk)
            with torch.no_grad():
                logits.append(model(input_ids=nxt, **cache_kwargs(model, cache), position_ids=torch.full((2, 1), 50)).logits)
        torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)


def test_decode_runs_until_a_rare_eviction(gpu):
    """BUZZ evicts every few steps only: the timed decode goes on until one step has evicted."""
    from kvpolicy import BUZZ

    policy = BUZZ(sink=2, window=4, stride=3, threshold=30)
    model = gpu.build_model(gpu.TINY, "cpu", torch.float32)
    cache = gpu.make_cache(model, policy)
    gpu.prefill(model, cache, torch.randint(3, 128, (1, 40)), 16)
    seconds, evicted = gpu.decode_steps(model, cache, torch.randint(3, 128, (1, 200)), 40, min_steps=2, until_eviction=True)
    assert len(seconds) == len(evicted) > 2 and evicted[-1] and not any(evicted[:-1])
    assert all(s > 0 for s in seconds)


def test_memory_gate_uses_each_candidates_capacity(gpu):
    """On Llama-2-7B's shape (meta device): the gate's bytes follow each cache's own size, and
    the headline 32k comparison fits what an 80 GB H100 leaves after the weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvpolicy import FullCache

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**gpu.LLAMA2_7B)).to(torch.bfloat16)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_tok = gpu.kv_bytes_per_token(model, 1)
    assert kv_tok == 2 * 32 * 32 * 128 * 2
    total = 32768 + 36
    plans = {label: gpu.planned_bytes(model, policy, 1, 32768, 36, 4096) for label, policy in gpu.candidates(32768, 36, 0.25)}
    assert plans["DynamicCache"] < 1.15 * kv_tok * total  # one layer's torch.cat copy and a chunk's workspace, not twice the cache
    assert kv_tok * total <= plans["FullCache"] < 1.2 * kv_tok * total
    assert gpu.planned_bytes(model, FullCache(), 1, 32768, 36, 4096) == plans["FullCache"]
    for label in ("BUZZ 25%", "H2O 25%", "StreamingLLM 25%"):
        assert plans[label] < 0.5 * plans["FullCache"], label  # gated on its own capacity
    # an 80 GB H100 exposes about 79.1 GiB to torch; the weights take ~12.6 GiB of it
    free_after_weights = 79.1 * 2**30 - weights - 0.5 * 2**30
    assert all(need <= 0.95 * free_after_weights for need in plans.values())


def test_dry_run_exercises_every_path(gpu, tmp_path, monkeypatch):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    calls = {"sdpa": 0}
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def counting(*args, **kwargs):
        calls["sdpa"] += 1
        return sdpa(*args, **kwargs)

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "sdpa", counting)  # kvpolicy_sdpa calls SDPA directly, not this
    free = iter([float("inf")] * 15 + [1.0] + [float("inf")] * 100)  # the 16th candidate (H2O, b2, 64) does not fit
    monkeypatch.setattr(gpu, "free_device_bytes", lambda device: next(free))
    res = gpu.run(gpu.parse([
        "--tiny", "--device", "cpu", "--dtype", "fp32", "--batches", "1,2", "--contexts", "64,128",
        "--steps", "2", "--warmup", "1", "--unfused", "--prefill-chunk", "48", "--out", str(tmp_path),
    ]))  # fmt: skip
    rows = res["rows"]
    assert {r["label"] for r in rows} == {"DynamicCache", "FullCache", "BUZZ 25%", "H2O 25%", "StreamingLLM 25%", "BUZZ 25% (unfused)"}
    skipped = [r for r in rows if "skipped" in r]
    assert len(skipped) == 1 and "GiB free" in skipped[0]["skipped"]
    ran = [r for r in rows if "skipped" not in r]
    for r in ran:
        assert r["tokens_per_s"] > 0 and r["floor_tokens_per_s"] > 0 and r["over_floor"] > 0
        assert r["prefill_s"] > 0 and r["decode_steps"] >= 2
        if r["label"] in ("DynamicCache", "FullCache"):
            assert r["evicting_steps"] == 0 and r["step_s_eviction"] is None
        else:  # every policy evicted during the timed decode steps, and its cost is reported apart
            assert r["evicting_steps"] >= 1 and r["step_s_eviction"] > 0, r
            full = next(x for x in ran if x["label"] == "FullCache" and x["batch"] == r["batch"] and x["context"] == r["context"])
            assert r["kv_bytes"] < 0.5 * full["kv_bytes"]  # 25% budget: far fewer bytes held
        assert r["kv_bytes"] > 0 and r["allocated_bytes"] >= r["kv_bytes"]
    # DynamicCache rows went through transformers' own SDPA (every layer of every forward), also
    # after an EvictingCache had switched the model to kvpolicy_sdpa; no other row did
    dynamic = [r for r in ran if r["label"] == "DynamicCache"]
    # (the model stays on SDPA between EvictingCache forwards: pos-shift's one RoPE-measuring forward per
    # StreamingLLM cache, with a DynamicCache, goes through it too)
    streaming = sum(1 for r in ran if r["label"].startswith("StreamingLLM"))
    layers = gpu.TINY["num_hidden_layers"]
    assert len(dynamic) == 4
    assert calls["sdpa"] in (sum(r["forwards"] for r in dynamic) * layers + k * layers for k in range(streaming + 1))
    report = (tmp_path / "report.md").read_text()
    for needle in ("prefill s", "evicting step ms", "peak GiB beyond weights", "time / floor", "GiB free"):
        assert needle in report


@pytest.mark.slow
def test_compiled_rows_run_beside_eager(gpu, tmp_path):
    """The compiled rows (issue 25): transformers' StaticCache and each policy's static-shaped
    EvictingCache, decode steps through one compiled model (dynamo's "eager" backend here: the
    same fullgraph trace inductor and CUDA graphs get, without code generation)."""
    res = gpu.run(gpu.parse([
        "--tiny", "--device", "cpu", "--dtype", "fp32", "--batches", "1", "--contexts", "64", "--steps", "3",
        "--warmup", "2", "--compile-modes", "default", "--compile-backend", "eager", "--out", str(tmp_path),
    ]))  # fmt: skip
    labels = {r["label"] for r in res["rows"]}
    assert {"StaticCache (compiled, default)", "BUZZ 25% (compiled, default)", "H2O 25% (compiled, default)",
            "StreamingLLM 25% (compiled, default)"} <= labels
    for r in res["rows"]:
        assert r["tokens_per_s"] > 0, r
        if "compiled" in r["label"] and r["label"] != "StaticCache (compiled, default)":
            assert r["kv_bytes"] < 0.5 * next(x for x in res["rows"] if x["label"] == "FullCache")["kv_bytes"]
