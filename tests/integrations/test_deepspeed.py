"""The DeepSpeed integration in one process: validation and refusals, head and memory arithmetic
(on meta-device models of Llama-2-13B's shape: no weights), and tp=1 engines on a tiny *random*
Llama. The multi-rank runs are in test_deepspeed_multi.py."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvpolicy import BUZZ, H2O, FullCache  # noqa: E402
from kvpolicy.deepspeed import (  # noqa: E402
    KERNEL_INJECTION_ERROR,
    ModelGeometry,
    ShardedEvictingCache,
    init_inference,
    local_heads,
    make_cache,
    shard_layout,
    split_sizes,
    weight_numel_per_rank,
)
from kvpolicy.hf import cache_kwargs  # noqa: E402
from kvpolicy_tools.models import tiny_llama  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def _example():
    spec = importlib.util.spec_from_file_location("deepspeed_llama2_13b", ROOT / "examples" / "deepspeed_llama2_13b.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses need the module registered
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def example():
    return _example()


@pytest.fixture(scope="module")
def llama13b_small(example):
    """Llama-2-13B's head structure (40 layers' worth of heads: 40 heads, no GQA) with 2 layers
    and head_dim 4 (hidden 160), on the meta device."""
    return example.meta_model(example.llama2_13b_config(num_hidden_layers=2, head_dim=4))


# ------------------------------------------------------------------------------------------------
# Head arithmetic
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tp", "per_rank"),
    [(1, [40]), (2, [20] * 2), (4, [10] * 4), (8, [5] * 8), (3, [14, 13, 13]), (6, [7, 7, 7, 7, 6, 6])],
)
def test_llama2_13b_heads_over_ranks_on_meta_device(llama13b_small, tp, per_rank):
    model = llama13b_small
    assert next(model.parameters()).device.type == "meta"
    layout = shard_layout(model, tp)
    assert [s.n_kv_heads for s in layout.shards] == per_rank
    assert [s.n_q_heads for s in layout.shards] == per_rank  # no GQA: one query head per KV head
    starts = [s.kv_start for s in layout.shards]
    assert starts == [sum(per_rank[:r]) for r in range(tp)]  # contiguous, in rank order
    assert layout.shards[-1].kv_stop == 40
    g = layout.geometry
    assert (g.layers, g.heads, g.kv_heads, g.head_dim, g.hidden_size) == (2, 40, 40, 4, 160)
    for r in range(tp):  # 2 (K and V) * layers * local heads * head_dim * 2 bytes
        assert layout.kv_bytes_per_token(r) == 2 * 2 * per_rank[r] * 4 * 2
    # the projection rows AutoTP gives each rank follow the heads
    q_rows = split_sizes(g.heads * g.head_dim, tp, kv_heads=g.kv_heads, by_heads=True)
    assert q_rows == [n * g.head_dim for n in per_rank]


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_llama2_13b_full_shape_weights_and_kv_bytes(example, tp):
    """The numbers docs/deepspeed.md quotes, from the full-size model on the meta device."""
    model = example.meta_model(example.llama2_13b_config())
    total = sum(p.numel() for p in model.parameters())
    assert total == 13_015_864_320
    per_rank = weight_numel_per_rank(model, tp)
    h, v, inter, layers = 5120, 32000, 13824, 40
    sharded = layers * (4 * h * h + 3 * h * inter) + v * h  # attention + MLP + lm_head
    replicated = v * h + layers * 2 * h + h  # embedding + norms
    assert per_rank == [sharded // tp + replicated] * tp
    assert sum(per_rank) == total + (tp - 1) * replicated
    layout = shard_layout(model, tp)
    assert layout.kv_bytes_per_token(0, dtype_bytes=2) == 2 * 40 * (40 // tp) * 128 * 2 == 819_200 // tp


def test_uneven_gqa_split_like_smollm2():
    model = tiny_llama(num_layers=1, heads=9, kv_heads=3, head_dim=8)
    layout = shard_layout(model, 2)
    assert [(s.q_start, s.q_stop, s.kv_start, s.kv_stop) for s in layout.shards] == [(0, 6, 0, 2), (6, 9, 2, 3)]
    assert local_heads(model) == (9, 3)


def test_more_ranks_than_kv_heads_is_refused():
    with pytest.raises(ValueError, match="no heads at all"):
        shard_layout(tiny_llama(heads=4, kv_heads=2), 4)
    with pytest.raises(ValueError, match="tp_size must be a positive integer"):
        shard_layout(tiny_llama(), 0)


def test_unsupported_model_type_is_refused():
    from transformers import AutoModelForCausalLM, FalconConfig, GPT2Config

    # the same capability detection as EvictingCache: Falcon's attention bypasses the interface
    with pytest.raises(ValueError, match="attention interface"):
        ModelGeometry.from_config(FalconConfig())
    # GPT-2 is served by EvictingCache, but its fused c_attn is not the layout AutoTP is sharded by here
    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=64))
    with pytest.raises(ValueError, match="separate q/k/v/o projections.*EvictingCache without DeepSpeed works"):
        ModelGeometry.from_config(gpt2)


@pytest.mark.parametrize("tp", [2, 3, 4, 8])
def test_split_sizes_mirror_deepspeed(tp):
    """Our pure-Python rule equals DeepSpeed's own get_shard_size_list on the same inputs."""
    pytest.importorskip("deepspeed")
    from deepspeed.module_inject.tp_shard import AutoTPMeta, get_shard_size_list

    for heads, kv, hd, hidden, inter, vocab in [(40, 40, 128, 5120, 13824, 32000), (9, 3, 64, 576, 1536, 49152), (8, 4, 16, 128, 288, 128)]:
        if tp > kv:
            continue
        meta = AutoTPMeta(num_kv_heads=kv, num_attention_heads=heads, n_embd=hidden, tp_grain_size=64)
        for total, name, by_heads in [
            (heads * hd, "self_attn.q_proj", True),
            (kv * hd, "self_attn.k_proj", True),
            (heads * hd, "self_attn.o_proj", True),
            (inter, "mlp.gate_proj", False),
            (inter, "mlp.down_proj", False),
            (hidden, "lm_head", False),
        ]:
            assert split_sizes(total, tp, kv_heads=kv, by_heads=by_heads) == get_shard_size_list(total, tp, meta, name), name


# ------------------------------------------------------------------------------------------------
# Memory arithmetic of the runbook
# ------------------------------------------------------------------------------------------------


def test_runbook_memory_arithmetic(example):
    model = example.meta_model(example.llama2_13b_config())
    gib = 2**30
    limit = example.H100_USABLE_GIB * gib  # what torch can use of an 80 GB H100 (docs/deepspeed.md)
    assert example.H100_USABLE_GIB < 80
    for tp in (2, 4, 8):
        full = example.max_context(model, tp, policy="none")
        buzz = example.max_context(model, tp, policy="buzz", budget=0.25)
        for m in (full, buzz):
            assert m.total <= limit
            assert example.rank_memory(model, tp, m.context + 64, policy=m.policy, budget=0.25).total > limit
        assert full.kv == full.context * 819_200 // tp
        assert buzz.cached_tokens < buzz.context / 2  # BUZZ keeps a third of the context at its peak
        assert buzz.context > 2 * full.context
    m = example.rank_memory(model, 2, 8192, policy="none")
    assert m.weights == 6_590_059_520 * 2
    # the score capture's workspace is bounded (blocks of at most 256 MiB of logits), not per key
    b = example.rank_memory(model, 2, 32768, policy="buzz", budget=0.25)
    keys = b.cached_tokens + 4096
    assert b.workspace == keys * 3 * 4096 + 2 * (256 << 20)
    from kvpolicy_torch.scores import DEFAULT_WORKSPACE_BYTES

    assert example.SCORE_WORKSPACE_BYTES == DEFAULT_WORKSPACE_BYTES


def test_example_plan_only_prints_the_arithmetic(example, capsys):
    example.main(["--plan-only", "--tp", "2", "--layers", "2", "--head-dim", "4"])
    out = capsys.readouterr().out
    assert "rank 1: KV heads 20..39 (20)" in out
    assert "KV bytes per token per rank: 2 * 2 * 20 * 4 * 2 = 640" in out
    assert "full cache (DynamicCache)" in out and "buzz at 25%" in out


# ------------------------------------------------------------------------------------------------
# Validation and refusals (before any engine is built)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        {"replace_with_kernel_inject": True},
        {"kernel_inject": True},  # DeepSpeed's alias
        {"config": {"replace_with_kernel_inject": True}},
    ],
    ids=["keyword", "alias", "config-dict"],
)
@pytest.mark.deepspeed
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed")
def test_kernel_injection_is_refused_with_the_reason(options):
    with pytest.raises(ValueError) as err:
        init_inference(tiny_llama(), BUZZ(4, 16, 5, 32), **options)
    assert str(err.value) == KERNEL_INJECTION_ERROR
    assert "append-only KV workspace" in str(err.value) and "replace_with_kernel_inject=False" in str(err.value)


@pytest.mark.deepspeed
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed")
def test_kernel_injection_refused_from_json_config_before_anything_else(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"replace_with_kernel_inject": True, "tensor_parallel": {"tp_size": 64}}))
    with pytest.raises(ValueError, match="append-only KV workspace"):
        init_inference(object(), "buzz", config=str(path))  # type: ignore[arg-type]  # not even a model


@pytest.mark.deepspeed
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed")
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"enable_cuda_graph": True}, "CUDA graph"),
        ({"no_such_option": 1}, "no_such_option"),
        ({"tp_size": 2}, r"deepspeed --num_gpus 2"),
        ({"tp_size": 4}, "no heads at all"),
        ({"tp_size": 2, "tensor_parallel": {"tp_size": 3}}, "disagrees"),
        ({"dtype": "int8"}, "dtype must be one of"),
        ({"context_length": 8192, "max_tokens": 1024}, "below context_length"),
        ({"context_length": 0}, "context_length"),
    ],
)
def test_invalid_options_are_refused_up_front(kwargs, match):
    policy = kwargs.pop("policy", H2O(8, 8))
    with pytest.raises(ValueError, match=match):
        init_inference(tiny_llama(heads=4, kv_heads=2), policy, **kwargs)


@pytest.mark.deepspeed
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed")
def test_tp_group_smaller_than_the_world_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="launch exactly 2 processes"):
        init_inference(tiny_llama(heads=4, kv_heads=2), H2O(8, 8), tp_size=2)


@pytest.mark.deepspeed
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed")
def test_unknown_policy_name_is_refused():
    with pytest.raises(ValueError):
        init_inference(tiny_llama(), "no_such_policy")


# ------------------------------------------------------------------------------------------------
# make_cache on plain models
# ------------------------------------------------------------------------------------------------


def test_make_cache_on_a_plain_model_is_a_whole_model_cache():
    model = tiny_llama()
    cache = make_cache(model, H2O(4, 4, selection="shared"))
    assert isinstance(cache, ShardedEvictingCache)
    assert cache.tp_size == 1 and cache.shard.kv_heads == range(2)
    assert all(layer.store.reduce_scores is None for layer in cache.layers)  # one rank: nothing to reduce
    ids = torch.randint(3, 128, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, **cache_kwargs(model, cache))
    assert cache.gather_positions()[0].shape == (1, 2, 8)  # heavy + recent after eviction


def test_make_cache_refuses_a_sharding_it_does_not_understand():
    model = tiny_llama(heads=4, kv_heads=2, head_dim=16)
    attn = model.model.layers[0].self_attn
    attn.k_proj = torch.nn.Linear(64, 16, bias=False)  # one KV head: not what AutoTP gives any rank at tp=1
    with pytest.raises(ValueError, match="AutoTP's head split"):
        make_cache(model, BUZZ(4, 16, 5, 32))


# ------------------------------------------------------------------------------------------------
# tp=1 engines in this process
# ------------------------------------------------------------------------------------------------


@pytest.mark.deepspeed
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed")
def test_long_prompt_refused_by_deepspeed_default_accepted_by_ours():
    import deepspeed

    ids = torch.randint(3, 128, (1, 1100), generator=torch.Generator().manual_seed(0))
    raw = deepspeed.init_inference(tiny_llama(max_position_embeddings=4096), dtype=torch.float32)
    with pytest.raises(RuntimeError, match="exceeds maximum length of 1024"):
        raw.generate(input_ids=ids, max_new_tokens=2, do_sample=False)

    model = tiny_llama(max_position_embeddings=4096)
    engine = init_inference(model, "buzz", budget=0.3)
    assert engine.context_length == 4096  # from max_position_embeddings (DeepSpeed's max_out_tokens: the 1,100-token generate below)
    assert next(engine.module.parameters()).dtype == torch.float32  # the model's, not DeepSpeed's float16 default
    assert type(engine.module.model.layers[0].self_attn).__name__ == "LlamaAttention"  # no kernel injection
    out = engine.generate(ids, max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 1103)
    cache = engine.last_cache
    assert isinstance(cache.policy, BUZZ) and max(cache.lengths()) <= cache.policy.capacity < 1100

    with pytest.raises(ValueError, match="longer than context_length"):
        init_inference(tiny_llama(), FullCache(), context_length=64).generate(ids[:, :65], max_new_tokens=1)


@pytest.mark.deepspeed
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed")
def test_engine_generate_equals_plain_evicting_cache_tp1():
    from kvpolicy.hf import EvictingCache, cache_kwargs

    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(3))
    policy = H2O(6, 6)
    ref_model = tiny_llama(seed=5)
    ref_cache = EvictingCache(policy, ref_model)
    with torch.no_grad():
        ref = ref_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False, **cache_kwargs(ref_model, ref_cache))
    engine = init_inference(tiny_llama(seed=5), policy, dtype="fp32")
    out = engine.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(out, ref)
    for a, b in zip(engine.last_cache.layers, ref_cache.layers, strict=True):
        assert torch.equal(a.store.positions, b.store.positions)


@pytest.mark.deepspeed
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed")
def test_example_runs_random_weights_tp1(example):
    result = example.main(
        ["--random-weights", "--layers", "2", "--head-dim", "4", "--context", "300", "--max-new-tokens", "4",
         "--dtype", "fp32", "--prefill-chunk", "128", "--policy", "buzz", "--budget", "0.25"]
    )  # fmt: skip
    assert result["tp"] == 1 and result["prompt_tokens"] == 300 and result["new_tokens"] == 4
    assert result["cached_tokens"] < 300 and result["decode_tok_per_s"] > 0


# ------------------------------------------------------------------------------------------------
# Per-rank materialisation (the runbook's meta-device path) and the launcher check
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tp", [1, 2, 3, 8])
def test_parameter_shards_tile_every_parameter_and_match_the_weight_count(llama13b_small, tp):
    from kvpolicy.deepspeed import parameter_shard

    model = llama13b_small
    geometry = ModelGeometry.from_config(model)
    totals = [0] * tp
    for name, p in model.named_parameters():
        shards = [parameter_shard(name, tuple(p.shape), geometry, tp, r) for r in range(tp)]
        if shards[0] is None:
            assert all(s is None for s in shards)
            for r in range(tp):
                totals[r] += p.numel()
            continue
        dims = {s[0] for s in shards}
        assert len(dims) == 1
        (dim,) = dims
        # contiguous, in rank order, covering the dimension exactly
        assert shards[0][1] == 0 and shards[-1][2] == p.shape[dim]
        assert all(a[2] == b[1] for a, b in zip(shards, shards[1:]))
        for r, (_, start, stop) in enumerate(shards):
            totals[r] += (stop - start) * (p.numel() // p.shape[dim])
    assert totals == weight_numel_per_rank(model, tp)


def test_materialize_shards_fills_this_ranks_slice_and_checks_shapes(llama13b_small):
    """A rank's parameters, cut by hand as AutoTP would, are filled with exactly the slices of
    the whole (seeded) tensors; a wrong local shape is refused."""
    from kvpolicy.deepspeed import materialize_shards, parameter_shard

    model = llama13b_small
    geometry = ModelGeometry.from_config(model)
    full = {name: tuple(p.shape) for name, p in model.named_parameters()}
    whole = {name: torch.randn(shape, generator=torch.Generator().manual_seed(i)) for i, (name, shape) in enumerate(full.items())}
    tp, rank = 2, 1
    params = {}
    for name, shape in full.items():
        s = parameter_shard(name, shape, geometry, tp, rank)
        size = list(shape)
        if s is not None:
            size[s[0]] = s[2] - s[1]
        params[name] = torch.nn.Parameter(torch.empty(size, dtype=torch.bfloat16), requires_grad=False)

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = model.config
            for k, v in params.items():
                self.register_parameter(k.replace(".", "__"), v)

        def named_parameters(self, *args, **kwargs):  # the real names, as AutoTP's module has them
            return iter(params.items())

    holder = Holder()
    written = materialize_shards(holder, full, lambda name, shape: whole[name], tp_size=tp, rank=rank, geometry=geometry)
    assert written == sum(p.numel() * 2 for p in params.values())
    q = "model.layers.0.self_attn.q_proj.weight"
    torch.testing.assert_close(params[q], whole[q][80:160].to(torch.bfloat16))  # 20 heads x 4 of rank 1
    lazy = materialize_shards(holder, full, lambda name, shape: (lambda index: whole[name][index]), tp_size=tp, rank=rank, geometry=geometry)
    assert lazy == written
    with pytest.raises(ValueError, match="AutoTP's rule gives"):
        materialize_shards(holder, full, lambda name, shape: whole[name], tp_size=4, rank=0, geometry=geometry)


@pytest.mark.parametrize(
    ("env", "accelerator", "refused"),
    [
        ({"WORLD_SIZE": "2"}, "cpu", True),
        ({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}, "cpu", True),
        ({"WORLD_SIZE": "2", "LOCAL_SIZE": "2"}, "cpu", False),
        ({"WORLD_SIZE": "2"}, "cuda", False),
        ({"WORLD_SIZE": "1"}, "cpu", False),
        ({}, "cpu", False),
    ],
)
def test_launcher_env_check(env, accelerator, refused):
    from kvpolicy.deepspeed import check_launcher_env

    if refused:
        with pytest.raises(ValueError, match="LOCAL_SIZE is not set") as err:
            check_launcher_env(env, accelerator=accelerator)
        hint = "LOCAL_SIZE=2 torchrun" if "LOCAL_WORLD_SIZE" in env else "LOCAL_SIZE=<processes on this node> torchrun"
        assert "deepspeed --num_gpus 2" in str(err.value) and hint in str(err.value)
    else:
        check_launcher_env(env, accelerator=accelerator)
