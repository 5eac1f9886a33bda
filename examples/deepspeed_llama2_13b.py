"""Llama-2-13B under DeepSpeed AutoTP with a kvpolicy cache: the workload of docs/deepspeed.md.

Launch one process per GPU (every rank runs this script with the same arguments)::

    # 1. fp32 parity first: 1 GPU writes its tokens, 2 GPUs must generate the same (exit 3 if not)
    deepspeed --num_gpus 1 examples/deepspeed_llama2_13b.py --model /models/Llama-2-13b-hf \\
        --dtype fp32 --context 2048 --max-new-tokens 32 --save-tokens parity.json
    deepspeed --num_gpus 2 examples/deepspeed_llama2_13b.py --model /models/Llama-2-13b-hf \\
        --dtype fp32 --context 2048 --max-new-tokens 32 --compare-tokens parity.json
    # 2. the bf16 runs
    deepspeed --num_gpus 4 examples/deepspeed_llama2_13b.py --model /models/Llama-2-13b-hf \\
        --policy buzz --budget 0.25 --context 16384 --max-new-tokens 128

    # the memory arithmetic only (no GPU, no weights, no DeepSpeed launch):
    python examples/deepspeed_llama2_13b.py --plan-only --tp 2 4 8

    # random weights of Llama-2-13B's shape (no checkpoint); --layers N / --head-dim D shrink it
    # (N layers instead of 40, hidden 40 * D) for a CPU machine:
    deepspeed --num_gpus 2 examples/deepspeed_llama2_13b.py --random-weights --layers 2 --head-dim 4 --context 300

Every rank takes its device from LOCAL_RANK before building anything, builds the model on the
``meta`` device, lets AutoTP shard it there, and fills only its own shard on its own device in
the target dtype: seeded random values (the same model for every rank and tp size) or its slices
of the safetensors checkpoint. No rank holds the whole model, on the device or in host RAM.

Rank 0 prints the head split, the policy, prefill and decode throughput, peak memory and the
cache's size against a full cache. ``--policy none`` runs the baseline: transformers'
DynamicCache, plain SDPA, no kvpolicy.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

GIB = 2**30
#: kvpolicy_torch.scores.DEFAULT_WORKSPACE_BYTES (the bound on one score block's logits), restated so
#: that --plan-only needs no torch import.
SCORE_WORKSPACE_BYTES = 256 << 20
#: What torch can allocate on an "80 GB" H100 (SXM or PCIe): nvidia-smi reports 81,559 MiB
#: (79.65 GiB) of memory, and the CUDA context (cuBLAS, NCCL, kernels) takes about 0.5 GiB of it
#: before torch's first allocation. An assumption until the first GPU run measures
#: torch.cuda.mem_get_info() (docs/deepspeed.md says so).
H100_USABLE_GIB = 79.1

#: Llama-2-13B (meta-llama/Llama-2-13b-hf config.json).
LLAMA2_13B = dict(
    vocab_size=32000,
    hidden_size=5120,
    intermediate_size=13824,
    num_hidden_layers=40,
    num_attention_heads=40,
    num_key_value_heads=40,
    head_dim=128,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


def llama2_13b_config(**overrides: Any) -> Any:
    """A ``LlamaConfig`` of Llama-2-13B's shape; ``overrides`` shrink it (``num_hidden_layers``,
    ``head_dim``: the hidden size follows as ``heads * head_dim`` unless given)."""
    from transformers import LlamaConfig

    settings = dict(LLAMA2_13B)
    settings.update(overrides)
    if "head_dim" in overrides and "hidden_size" not in overrides:
        settings["hidden_size"] = settings["num_attention_heads"] * settings["head_dim"]
    return LlamaConfig(**settings)


def meta_model(config: Any) -> Any:
    """The model on the meta device: shapes only, no memory."""
    import torch
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        return LlamaForCausalLM(config)


# ------------------------------------------------------------------------------------------------
# Memory arithmetic (per rank)
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankMemory:
    """Bytes on the busiest rank for one run; see docs/deepspeed.md for the terms."""

    tp: int
    policy: str
    context: int
    cached_tokens: int  # tokens per head held at the end of the prefill / during decode
    weights: int
    kv: int  # keys + values resident
    store: int  # positions (int64) + scores (float32) of an evicting cache
    transient: int  # one layer's temporary copy (cat/overflow) during prefill
    workspace: int  # prefill-chunk attention temporaries
    reserve: int

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.store + self.transient + self.workspace + self.reserve


def _layout(config: Any, tp: int) -> Any:
    from kvpolicy.deepspeed import shard_layout

    return shard_layout(config, tp)


def weight_bytes_per_rank(model: Any, tp: int, dtype_bytes: int = 2) -> list[int]:
    """Weight bytes of every rank after AutoTP (model may be on the meta device)."""
    from kvpolicy.deepspeed import weight_numel_per_rank

    return [n * dtype_bytes for n in weight_numel_per_rank(model, tp)]


def rank_memory(
    model: Any,
    tp: int,
    context: int,
    *,
    policy: str = "none",
    budget: float = 0.25,
    new_tokens: int = 128,
    dtype_bytes: int = 2,
    chunk: int = 4096,
    reserve_gib: float = 3.0,
    weights: int | None = None,
) -> RankMemory:
    """Memory of the busiest rank (rank 0: it has the most heads) for a ``context``-token run
    whose prompt is ``context - new_tokens`` tokens, prefilled in chunks of ``chunk``.

    ``policy="none"``: transformers' DynamicCache (exactly ``context`` tokens, plain SDPA). Any
    other name is planned with :func:`kvpolicy.plan_policy` for ``budget``; its storage is
    preallocated to the policy's capacity (the *peak* size, larger than the budget's average).
    """
    from kvpolicy import plan_policy

    if context <= new_tokens:
        raise ValueError(f"context ({context}) must exceed new_tokens ({new_tokens})")
    layout = _layout(model, tp)
    g, shard = layout.geometry, layout[0]
    if weights is None:
        weights = max(weight_bytes_per_rank(model, tp, dtype_bytes))
    kv_tok = layout.kv_bytes_per_token(0, dtype_bytes)
    prompt = context - new_tokens
    c = min(chunk, prompt)
    mask = 3 * c  # HF's bool mask [chunk, keys] and SDPA's additive copy of it, per key (estimate)
    if policy == "none":
        cached = context
        kv, store = cached * kv_tok, 0
        transient = cached * kv_tok // g.layers  # torch.cat of the last layer
        workspace = mask * cached
    else:
        cap = plan_policy(policy, budget, context_length=context, prompt_length=prompt).capacity
        cached = min(cap if cap is not None else context, context)
        kv, store = cached * kv_tok, cached * layout.store_bytes_per_token(0)
        keys = cached + c  # keys one prefill chunk attends to
        per_layer = (kv_tok + layout.store_bytes_per_token(0)) // g.layers
        transient = 2 * keys * per_layer  # overflow concat, then the gathered copy
        # received_attention: one block's float32 logits and softmax, bounded by its workspace (256 MiB; the
        # 16-bit keys are upcast a chunk at a time within the same bound), plus the block's
        # reciprocal row sums; SDPA's mask as above.
        workspace = keys * mask + 2 * SCORE_WORKSPACE_BYTES
    return RankMemory(tp, policy, context, cached, weights, kv, store, transient, workspace, int(reserve_gib * GIB))


def max_context(model: Any, tp: int, *, gpu_gib: float = H100_USABLE_GIB, **kwargs: Any) -> RankMemory:
    """The longest context whose :func:`rank_memory` fits ``gpu_gib`` (bisection on tokens)."""
    limit = int(gpu_gib * GIB)
    weights = max(weight_bytes_per_rank(model, tp, kwargs.get("dtype_bytes", 2)))
    kwargs["weights"] = weights
    lo = kwargs.get("new_tokens", 128) + 1
    if rank_memory(model, tp, lo, **kwargs).total > limit:
        raise ValueError(f"not even {lo} tokens fit in {gpu_gib} GiB at tp={tp}: the weights alone need {weights / GIB:.1f} GiB")
    hi = 2 * lo
    while rank_memory(model, tp, hi, **kwargs).total <= limit:
        lo, hi = hi, hi * 2
        if hi > 2**26:
            break
    while hi - lo > 64:  # 64-token resolution keeps the policy planning cheap
        mid = (lo + hi) // 2
        if rank_memory(model, tp, mid, **kwargs).total <= limit:
            lo = mid
        else:
            hi = mid
    return rank_memory(model, tp, lo, **kwargs)


def print_plan(model: Any, tps: Sequence[int], *, budget: float, policy: str, gpu_gib: float, chunk: int, reserve_gib: float, out: Any = None) -> None:
    out = out if out is not None else sys.stdout
    layout1 = _layout(model, 1)
    g = layout1.geometry
    print(f"model: {g.layers} layers, {g.heads} heads ({g.kv_heads} KV), head_dim {g.head_dim}, hidden {g.hidden_size}", file=out)
    for tp in tps:
        layout = _layout(model, tp)
        w = weight_bytes_per_rank(model, tp)
        kv_tok = layout.kv_bytes_per_token(0)
        print(f"\n== tp {tp} ==", file=out)
        print(layout.describe(), file=out)
        print(f"weights per rank (16-bit): {', '.join(f'{b / GIB:.2f} GiB' for b in w)}", file=out)
        print(
            f"KV bytes per token per rank: 2 * {g.layers} * {layout[0].n_kv_heads} * {g.head_dim} * 2 = {kv_tok} "
            f"({kv_tok / 1024:.0f} KiB); store (positions+scores): {layout.store_bytes_per_token(0)} B",
            file=out,
        )
        for name in ("none", policy):
            m = max_context(model, tp, gpu_gib=gpu_gib, policy=name, budget=budget, chunk=chunk, reserve_gib=reserve_gib)
            label = "full cache (DynamicCache)" if name == "none" else f"{name} at {budget:.0%}"
            print(
                f"largest context on {gpu_gib:g} GiB, {label}: {m.context} tokens (holds {m.cached_tokens}): "
                f"weights {m.weights / GIB:.2f} + KV {m.kv / GIB:.2f} + store {m.store / GIB:.2f} + transient "
                f"{m.transient / GIB:.2f} + workspace {m.workspace / GIB:.2f} + reserve {m.reserve / GIB:.2f} "
                f"= {m.total / GIB:.2f} GiB",
                file=out,
            )


# ------------------------------------------------------------------------------------------------
# The run
# ------------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model", help="Llama-2-13B directory (or any Llama-family checkpoint) for from_pretrained")
    src.add_argument("--random-weights", action="store_true", help="random weights of Llama-2-13B's shape (smoke/throughput runs)")
    ap.add_argument("--policy", default="buzz", help="buzz, buzz_logn, h2o, streaming_llm, local, full, or none (DynamicCache baseline)")
    ap.add_argument("--budget", type=float, default=0.25, help="cache budget for the policy (default 0.25)")
    ap.add_argument("--tp", type=int, nargs="+", default=None, help="tensor-parallel size (default: WORLD_SIZE); several with --plan-only")
    prompt = ap.add_mutually_exclusive_group()
    prompt.add_argument("--prompt-file", type=Path, help="text file used as the prompt")
    prompt.add_argument("--context", type=int, default=4096, help="synthetic prompt of this many tokens (default 4096)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bf16", choices=["fp16", "bf16", "fp32"])
    ap.add_argument("--prefill-chunk", type=int, default=4096, help="prefill the prompt in chunks of this many tokens")
    ap.add_argument("--plan-only", action="store_true", help="print the memory arithmetic and exit (no GPU needed)")
    ap.add_argument("--gpu-gib", type=float, default=H100_USABLE_GIB,
                    help="GPU memory torch can use, for --plan-only (default 79.1: an 80 GB H100, see docs/deepspeed.md)")
    ap.add_argument("--reserve-gib", type=float, default=3.0, help="cuBLAS/NCCL workspaces, allocator slack and a chunk's activations, GiB (default 3)")
    ap.add_argument("--layers", type=int, default=None,
                    help="with --random-weights/--plan-only: this many layers instead of 40 (CPU smoke runs)")
    ap.add_argument("--head-dim", type=int, default=None,
                    help="with --random-weights/--plan-only: head_dim instead of 128; hidden = 40 x head_dim (CPU smoke runs)")
    ap.add_argument("--save-tokens", type=Path, default=None, help="rank 0 writes the generated tokens and first-step logits here (parity reference)")
    ap.add_argument("--compare-tokens", type=Path, default=None,
                    help="compare with a --save-tokens file: exit 3 if any generated token differs (the fp32 parity step)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # from the DeepSpeed launcher
    args = ap.parse_args(argv)
    if not args.plan_only and not (args.model or args.random_weights):
        ap.error("give --model PATH or --random-weights (or --plan-only)")
    if (args.layers or args.head_dim) and not (args.random_weights or args.plan_only):
        ap.error("--layers/--head-dim only apply to --random-weights and --plan-only")
    if not 0 < args.budget <= 1:
        ap.error("--budget must be in (0, 1]")
    return args


def _shape_overrides(args: argparse.Namespace) -> dict[str, int]:
    out = {}
    if args.layers:
        out["num_hidden_layers"] = args.layers
    if args.head_dim:
        out["head_dim"] = args.head_dim
    return out


def local_device() -> str:
    """This rank's device, from ``LOCAL_RANK`` (set by the launcher), made current.

    Read *before* building anything: ``accel.current_device_name()`` is ``cuda:0`` on every rank
    until something calls ``set_device``, so inputs would land on the wrong GPU."""
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    if accel.device_name() == "cpu":
        return "cpu"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    accel.set_device(local_rank)
    return accel.device_name(local_rank)


def random_fill(seed: int, device: str) -> Any:
    """``fill(name, shape)`` for :func:`kvpolicy.deepspeed.materialize_shards`: the *unsharded*
    parameter, seeded by ``seed`` and its name (so every rank and every tp size sees the same
    model), generated on ``device`` one parameter at a time: norms 1, the rest N(0, 0.02)."""
    import zlib

    import torch

    def fill(name: str, shape: tuple[int, ...]) -> Any:
        if name.endswith("norm.weight"):
            return torch.ones(shape, device=device)
        g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        return torch.empty(shape, device=device).normal_(0.0, 0.02, generator=g)

    return fill


def checkpoint_fill(model_dir: str | Path) -> Any:
    """``fill(name, shape)`` reading a safetensors checkpoint lazily: it returns a function of an
    index tuple, so a rank reads only its shard's bytes (memory-mapped), never the whole model."""
    import json

    from safetensors import safe_open

    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.exists():
        weight_map = {k: root / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    elif (root / "model.safetensors").exists():
        weight_map = None
    else:
        raise SystemExit(
            f"{root} has no model.safetensors or model.safetensors.index.json: this runbook reads safetensors "
            "shards per rank (meta-llama/Llama-2-13b-hf ships them; for .bin checkpoints convert first, e.g. "
            "AutoModelForCausalLM.from_pretrained(path).save_pretrained(out, safe_serialization=True))"
        )
    handles: dict[Path, Any] = {}

    def fill(name: str, shape: tuple[int, ...]) -> Any:
        file = (root / "model.safetensors") if weight_map is None else weight_map.get(name)
        if file is None and name == "lm_head.weight":  # tied embeddings
            name, file = "model.embed_tokens.weight", weight_map.get("model.embed_tokens.weight")  # type: ignore[union-attr]
        if file is None:
            raise SystemExit(f"{name} is not in the checkpoint {root}")
        if file not in handles:
            handles[file] = safe_open(str(file), framework="pt", device="cpu")
        part = handles[file].get_slice(name)
        if tuple(part.get_shape()) != tuple(shape):
            raise SystemExit(f"{name}: checkpoint shape {tuple(part.get_shape())}, model shape {tuple(shape)}")
        return lambda index: part[index]

    return fill


def build_engine(args: argparse.Namespace, dtype: Any, device: str, tp: int, rank: int, context: int) -> tuple[Any, int]:
    """``(engine, bytes this rank filled)``: the model is created on ``meta``,
    sharded there by AutoTP, given storage on this rank's device in ``dtype`` (``to_empty`` of
    the shard only) and filled parameter by parameter: seeded random values, or this rank's
    slices of the safetensors checkpoint. No rank ever holds the whole model, on device or host."""
    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    from kvpolicy import FullCache
    from kvpolicy.deepspeed import init_inference, materialize_shards
    from kvpolicy_tools.models import rebuild_rotary

    if args.random_weights:
        config = llama2_13b_config(**_shape_overrides(args), eos_token_id=None)
    else:
        config = AutoConfig.from_pretrained(args.model)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(dtype)
    model.set_attn_implementation("sdpa")
    full_shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    # FullCache is the probe policy; generate() plans --policy for --budget per run
    engine = init_inference(model, FullCache(), budget=args.budget, tp_size=tp, dtype=dtype, context_length=context)
    fill = random_fill(args.seed, device) if args.random_weights else checkpoint_fill(args.model)
    written = materialize_shards(engine.module, full_shapes, fill, tp_size=tp, rank=rank)
    rebuild_rotary(engine.module, device)
    engine.module.eval()
    placed = {str(p.device) for p in engine.module.parameters()}
    if placed != {device}:
        raise RuntimeError(f"rank {rank}: parameters on {sorted(placed)}, expected all on {device}")
    return engine, written


def prompt_ids(args: argparse.Namespace, tokenizer: Any, vocab: int) -> Any:
    """The prompt's token ids ``[1, n]``: ``--prompt-file`` tokenized; without a tokenizer,
    ``--context`` random ids below ``vocab`` (seeded by ``--seed``); else a long notes document
    with a question at its end, cut to ``--context`` tokens."""
    import torch

    if args.prompt_file is not None:
        return tokenizer(args.prompt_file.read_text(), return_tensors="pt")["input_ids"]
    if tokenizer is None:
        g = torch.Generator().manual_seed(args.seed)
        return torch.randint(3, vocab, (1, args.context), generator=g)
    # A long "notes" document with a question at the end, cut to --context tokens.
    question = " Question: how many blue boxes are in bay 17? Answer:"
    q_ids = tokenizer(question, add_special_tokens=False)["input_ids"]
    body, ids = [], []
    i = 0
    while len(ids) < args.context:
        body.append(f"Note {i}: the crate in bay {i} holds {i * 7 % 13} blue boxes.")
        i += 64
        if len(body) % 64 == 0 or len(ids) == 0:
            ids = tokenizer(" ".join(body), return_tensors="pt")["input_ids"][0].tolist()
    ids = ids[: max(1, args.context - len(q_ids))] + q_ids
    return torch.tensor([ids])


def run(args: argparse.Namespace) -> dict[str, Any]:
    import json

    import torch
    from deepspeed.accelerator import get_accelerator
    from transformers import DynamicCache

    from kvpolicy.deepspeed import check_launcher_env

    check_launcher_env()  # torchrun without LOCAL_SIZE: a clear error, not a segfault in the first all-reduce
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    rank = int(os.environ.get("RANK", "0"))
    tp = args.tp[0] if args.tp else int(os.environ.get("WORLD_SIZE", "1"))
    accel = get_accelerator()
    device = local_device()  # cuda:<LOCAL_RANK> (made current) or cpu
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)

    t0 = time.perf_counter()
    tokenizer, vocab = None, llama2_13b_config(**_shape_overrides(args)).vocab_size
    if not args.random_weights:
        from transformers import AutoConfig, AutoTokenizer

        vocab = AutoConfig.from_pretrained(args.model).vocab_size
        try:
            tokenizer = AutoTokenizer.from_pretrained(args.model)
        except (OSError, ValueError):  # a checkpoint without a tokenizer (the CPU smoke run's): random prompt ids
            if args.prompt_file is not None:
                raise SystemExit(f"--prompt-file needs a tokenizer, and {args.model} has none")
            say(f"[load] {args.model} has no tokenizer: a random {args.context}-token prompt")
    ids = prompt_ids(args, tokenizer, vocab)
    prompt_len = int(ids.shape[1])
    context = prompt_len + args.max_new_tokens
    engine, written = build_engine(args, dtype, device, tp, rank, context)
    say(f"[load] {time.perf_counter() - t0:.1f} s on {device}, {written / GIB:.2f} GiB of weights on rank 0; {engine.layout.describe()}")
    ids = ids.to(device)  # every rank: its own device
    gen: dict[str, Any] = dict(max_new_tokens=args.max_new_tokens, do_sample=False, min_new_tokens=args.max_new_tokens)
    gen.update(output_scores=True, return_dict_in_generate=True)
    if args.prefill_chunk and prompt_len > args.prefill_chunk:
        gen["prefill_chunk_size"] = args.prefill_chunk
    if args.policy == "none":
        gen["past_key_values"] = DynamicCache(config=engine.module.config)
    else:
        from kvpolicy import FullCache

        policy: Any = FullCache() if args.policy == "full" else args.policy
        gen["policy"] = engine.resolve_policy(prompt_len, args.max_new_tokens, policy)
        say(f"[policy] {gen['policy']!r}: capacity {gen['policy'].capacity} tokens per head and layer")

    stamps: list[float] = []

    class _Clock:  # a logits processor: called once per generated token, after its forward
        def __call__(self, input_ids: Any, scores: Any) -> Any:
            accel.synchronize()
            stamps.append(time.perf_counter())
            return scores

    if hasattr(accel, "reset_peak_memory_stats"):
        accel.reset_peak_memory_stats()
    accel.synchronize()
    t1 = time.perf_counter()
    out = engine.generate(ids, logits_processor=[_Clock()], **gen)
    accel.synchronize()
    tokens = out.sequences
    t_prefill = stamps[0] - t1  # the prompt's forward (all chunks) and the first token
    decode_tokens = len(stamps) - 1
    t_decode = stamps[-1] - stamps[0]
    peak = accel.max_memory_allocated() if hasattr(accel, "max_memory_allocated") else 0
    result = {
        "tp": tp, "rank": rank, "device": device, "policy": args.policy, "prompt_tokens": prompt_len,
        "new_tokens": tokens.shape[1] - prompt_len, "prefill_s": t_prefill, "prefill_tok_per_s": prompt_len / t_prefill,
        "decode_tok_per_s": decode_tokens / t_decode if decode_tokens else None, "peak_memory_gib": peak / GIB,
        "weights_gib": written / GIB,
    }  # fmt: skip
    cache = engine.last_cache if args.policy != "none" else None
    if cache is not None:
        result.update(cache_gib=cache.kv_bytes / GIB, full_cache_gib=cache.full_kv_bytes() / GIB, cached_tokens=cache.lengths()[0])
    say(f"[run] {result}")
    if tokenizer is not None:
        say("[text] " + tokenizer.decode(tokens[0, prompt_len:], skip_special_tokens=True))
    generated = tokens[0, prompt_len:].tolist()
    first_logits = out.scores[0][0].float().cpu()
    if args.save_tokens and rank == 0:
        args.save_tokens.write_text(json.dumps({"tp": tp, "dtype": args.dtype, "tokens": generated, "first_logits": first_logits.tolist()}))
        say(f"[parity] wrote {len(generated)} tokens to {args.save_tokens}")
    if args.compare_tokens:
        ref = json.loads(args.compare_tokens.read_text())
        same = next((i for i, (a, b) in enumerate(zip(generated, ref["tokens"])) if a != b), None)
        drift = float((first_logits - torch.tensor(ref["first_logits"])).abs().max())
        result.update(parity_first_difference=same, parity_logit_drift=drift)
        if same is not None or len(generated) != len(ref["tokens"]):
            say(f"[parity] FAILED: tp {tp} differs from tp {ref['tp']} at generated token {same} (first-step logits drift {drift:.2e})")
            raise SystemExit(3)
        say(f"[parity] OK: tp {tp} generated the same {len(generated)} tokens as tp {ref['tp']} ({args.dtype}); first-step logits differ by at most {drift:.2e}")
    return result


def main(argv: Sequence[str] | None = None) -> dict[str, Any] | None:
    args = parse_args(argv)
    if args.plan_only:
        model = meta_model(llama2_13b_config(**_shape_overrides(args)))
        print_plan(
            model, args.tp or [1, 2, 4, 8], budget=args.budget, policy="buzz" if args.policy == "none" else args.policy,
            gpu_gib=args.gpu_gib, chunk=args.prefill_chunk, reserve_gib=args.reserve_gib,
        )  # fmt: skip
        return None
    from kvpolicy.deepspeed import finish_distributed

    try:
        return run(args)
    finally:
        finish_distributed()  # every rank: communication threads joined before the interpreter exits


if __name__ == "__main__":
    main()
