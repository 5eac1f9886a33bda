"""Llama-2-13B under DeepSpeed AutoTP with a kvpolicy cache: the workload of docs/deepspeed.md.

Launch one process per GPU (every rank runs this script with the same arguments)::

    deepspeed --num_gpus 4 examples/deepspeed_llama2_13b.py --model /models/Llama-2-13b-hf \\
        --policy buzz --budget 0.25 --context 16384 --max-new-tokens 128

    # the memory arithmetic only (no GPU, no weights, no DeepSpeed launch):
    python examples/deepspeed_llama2_13b.py --plan-only --tp 2 4 8

    # a smoke run with random weights of Llama-2-13B's shape (no checkpoint needed);
    # --layers/--head-dim shrink it for a CPU machine:
    deepspeed --num_gpus 2 examples/deepspeed_llama2_13b.py --random-weights --context 4096

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
        # received_attention: two live [q_heads, min(chunk, 512), keys] fp32 blocks, plus an fp32
        # copy of the layer's keys; SDPA's mask as above.
        workspace = keys * (2 * shard.n_q_heads * min(c, 512) * 4 + shard.n_kv_heads * g.head_dim * 4 + mask)
    return RankMemory(tp, policy, context, cached, weights, kv, store, transient, workspace, int(reserve_gib * GIB))


def max_context(model: Any, tp: int, *, gpu_gib: float = 80.0, **kwargs: Any) -> RankMemory:
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
    ap.add_argument("--gpu-gib", type=float, default=80.0, help="GPU memory for --plan-only (default 80)")
    ap.add_argument("--reserve-gib", type=float, default=3.0, help="CUDA context + allocator + activations reserve (default 3)")
    ap.add_argument("--layers", type=int, default=None, help="with --random-weights: fewer layers (CPU smoke tests)")
    ap.add_argument("--head-dim", type=int, default=None, help="with --random-weights: smaller heads (CPU smoke tests)")
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


def _random_model(args: argparse.Namespace, dtype: Any, device: str) -> Any:
    """Llama-2-13B-shaped, random weights, built directly on ``device`` (same seed on every rank,
    so the replicated weights agree)."""
    import torch
    from transformers import LlamaForCausalLM

    config = llama2_13b_config(**_shape_overrides(args), eos_token_id=None, attn_implementation="sdpa")
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    return model.eval()


def _prompt_ids(args: argparse.Namespace, tokenizer: Any, vocab: int) -> Any:
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
    import torch
    from deepspeed.accelerator import get_accelerator
    from transformers import DynamicCache

    from kvpolicy.deepspeed import init_inference

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    rank = int(os.environ.get("RANK", "0"))
    tp = args.tp[0] if args.tp else int(os.environ.get("WORLD_SIZE", "1"))
    accel = get_accelerator()
    device = accel.current_device_name()
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)

    tokenizer = None
    t0 = time.perf_counter()
    if args.random_weights:
        model = _random_model(args, dtype, device)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation="sdpa").eval()
    ids = _prompt_ids(args, tokenizer, model.config.vocab_size)
    prompt_len = int(ids.shape[1])
    context = prompt_len + args.max_new_tokens
    from kvpolicy import FullCache

    policy: Any = FullCache() if args.policy in ("none", "full") else args.policy
    engine = init_inference(model, policy, budget=args.budget, tp_size=tp, dtype=dtype, context_length=context)
    say(f"[load] {time.perf_counter() - t0:.1f} s; {engine.layout.describe()}")
    ids = ids.to(device)
    gen: dict[str, Any] = dict(max_new_tokens=args.max_new_tokens, do_sample=False, min_new_tokens=args.max_new_tokens)
    if args.prefill_chunk and prompt_len > args.prefill_chunk:
        gen["prefill_chunk_size"] = args.prefill_chunk
    if args.policy == "none":
        gen["past_key_values"] = DynamicCache(config=engine.module.config)
    else:
        gen["policy"] = engine.resolve_policy(prompt_len, args.max_new_tokens)
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
    t_prefill = stamps[0] - t1  # the prompt's forward (all chunks) and the first token
    decode_tokens = len(stamps) - 1
    t_decode = stamps[-1] - stamps[0]
    peak = accel.max_memory_allocated() if hasattr(accel, "max_memory_allocated") else 0
    result = {
        "tp": tp, "rank": rank, "policy": args.policy, "prompt_tokens": prompt_len, "new_tokens": out.shape[1] - prompt_len,
        "prefill_s": t_prefill, "prefill_tok_per_s": prompt_len / t_prefill,
        "decode_tok_per_s": decode_tokens / t_decode if decode_tokens else None, "peak_memory_gib": peak / GIB,
    }  # fmt: skip
    cache = engine.last_cache if args.policy != "none" else None
    if cache is not None:
        result.update(cache_gib=cache.kv_bytes / GIB, full_cache_gib=cache.full_kv_bytes() / GIB, cached_tokens=cache.lengths()[0])
    say(f"[run] {result}")
    if tokenizer is not None:
        say("[text] " + tokenizer.decode(out[0, prompt_len:], skip_special_tokens=True))
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
    return run(args)


if __name__ == "__main__":
    main()
