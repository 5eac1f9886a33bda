"""GPU decode benchmark: a Llama-2-7B-shaped model with random bf16 weights.

For each batch size (1, 4, 8) and context (2k ... 32k): tokens/s and peak memory of
transformers' ``DynamicCache``, kvpolicy's ``FullCache``, and BUZZ / H2O / StreamingLLM at 25%,
plus the memory-bandwidth floor of every candidate: the bytes one decode step must read (all
weights, and the keys and values the cache holds) divided by the device's measured copy
bandwidth. Targets (issue 7): BUZZ at 25% within 1.5x of its floor, and at 32k at least 2x the
tokens/s of the full cache.

Run it on a machine with a GPU (about 14 GB of weights; the full caches at 32k need 17 GB per
batch row, so the largest batch x context points are skipped when they do not fit)::

    python benchmarks/gpu_decode.py --out gpu-results            # the grid of the issue
    python benchmarks/gpu_decode.py --batches 1 --contexts 2048,32768 --steps 16

and paste ``gpu-results/report.md`` into ``docs/performance.md``. ``--tiny`` runs the same logic
on a 2-layer model with small contexts (the test suite does that on CPU).

How a cache is filled: the model's weights are random, so the prompt is random too; its keys and
values are drawn layer by layer (never the whole model's at once) and loaded into each cache, an
evicting cache then evicts once, as after a one-shot prefill: decode speed depends on how many
tokens a cache holds, not on which. Candidates run one after another (a GPU's timing noise is
small; memory does not allow holding every cache at once); each is timed with CUDA events over
``--steps`` decode steps after ``--warmup`` steps.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "integrations"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

LLAMA2_7B = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "head_dim": 128,
    "max_position_embeddings": 32768 + 1024,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
TINY = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}


def build_model(shape: dict[str, Any], device: str, dtype: Any, seed: int = 0) -> Any:
    """A random ``LlamaForCausalLM`` of ``shape``, initialised directly on ``device`` in ``dtype``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape, attn_implementation="sdpa", pad_token_id=0, bos_token_id=1, eos_token_id=2)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device=device).to(dtype)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
        for module in model.modules():  # buffers the meta init left empty (rotary inv_freq)
            if hasattr(module, "inv_freq") and hasattr(module, "rope_init_fn"):
                inv_freq, scaling = module.rope_init_fn(module.config, device)
                module.inv_freq = inv_freq
                module.original_inv_freq = inv_freq
                module.attention_scaling = scaling
    return model.eval()


def copy_bandwidth(device: str, nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Bytes per second of a device-to-device copy (read + write counted), the floor's yardstick."""
    import torch

    n = max(1, nbytes // 2)
    src = torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    best = math.inf
    for _ in range(repeats):
        t = _timer(device)
        dst.copy_(src)
        best = min(best, t())
    del src, dst
    return 2 * n * 2 / best


def _sync(device: str) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _timer(device: str) -> Any:
    """Start a timer; calling the result returns the elapsed seconds (CUDA events on a GPU)."""
    import torch

    if torch.device(device).type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()

        def stop() -> float:
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3

        return stop
    t0 = time.perf_counter()
    return lambda: time.perf_counter() - t0


def candidates(context: int, decode_tokens: int, budget: float, unfused: bool = False) -> list[tuple[str, Any]]:
    from kvpolicy import FullCache, plan_policy

    total = context + decode_tokens
    out: list[tuple[str, Any]] = [("DynamicCache", None), ("FullCache", FullCache())]
    for name, label in (("buzz", "BUZZ"), ("h2o", "H2O"), ("streaming_llm", "StreamingLLM")):
        out.append((f"{label} {budget:.0%}", plan_policy(name, budget, context_length=total, prompt_length=context).policy))
    if unfused:
        out.append((f"BUZZ {budget:.0%} (unfused)", out[2][1]))
    return out


def fill_cache(model: Any, policy: Any, batch: int, context: int, seed: int = 0, **options: Any) -> Any:
    """A cache of ``policy`` (``None``: ``DynamicCache``) holding a random ``context``-token prompt."""
    import torch
    from transformers import DynamicCache

    from kvpolicy_integrations.hf import EvictingCache

    cfg = model.config
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    kv, d = cfg.num_key_value_heads, cfg.head_dim
    g = torch.Generator(device=device).manual_seed(seed)
    cache = DynamicCache(config=cfg) if policy is None else EvictingCache(policy, model, **options)
    with torch.no_grad():
        for i in range(cfg.num_hidden_layers):
            k = torch.randn(batch, kv, context, d, generator=g, device=device, dtype=dtype)
            v = torch.randn(batch, kv, context, d, generator=g, device=device, dtype=dtype)
            if policy is None:
                cache.update(k, v, i)
                continue
            layer = cache.layers[i]
            layer.lazy_initialization(k, v)
            layer.store.append(k, v)
            if policy.uses_scores:
                layer.store.accumulate(torch.rand(layer.store.scores.shape, generator=g, device=device))
            layer.store.evict()
            del k, v
    return cache


def held_kv_bytes(cache: Any) -> int:
    if hasattr(cache, "kv_bytes"):
        return int(cache.kv_bytes)
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def decode_steps(model: Any, cache: Any, batch: int, position: int, steps: int, vocab: int) -> int:
    import torch

    device = next(model.parameters()).device
    ids = torch.randint(3, vocab, (batch, steps), device=device)
    with torch.no_grad():
        for t in range(steps):
            pos = torch.full((batch, 1), position + t, dtype=torch.long, device=device)
            model(input_ids=ids[:, t : t + 1], past_key_values=cache, position_ids=pos, use_cache=True, logits_to_keep=1)
    return position + steps


def kv_bytes_per_token(model: Any, batch: int) -> int:
    cfg = model.config
    esize = next(model.parameters()).element_size()
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * esize * batch


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from kvpolicy.perf.report import machine, machine_line, markdown_table

    device = args.device
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    shape = dict(TINY if args.tiny else LLAMA2_7B)
    model = build_model(shape, device, dtype)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bandwidth = copy_bandwidth(device, nbytes=(1 << 24) if args.tiny else (1 << 30))
    host = machine(shared=None)
    if torch.device(device).type == "cuda":
        host["gpu"] = torch.cuda.get_device_name(device)
    rows: list[dict[str, Any]] = []
    vocab = shape["vocab_size"]
    cuda = torch.device(device).type == "cuda"
    for batch in args.batches:
        for context in args.contexts:
            full_need = kv_bytes_per_token(model, batch) * (context + args.warmup + args.steps)
            for label, policy in candidates(context, args.warmup + args.steps, args.budget, args.unfused):
                row: dict[str, Any] = {"batch": batch, "context": context, "label": label, "policy": repr(policy) if policy else "DynamicCache"}
                free = torch.cuda.mem_get_info(device)[0] if cuda else math.inf
                need = full_need * (2 if policy is None else 1) + (kv_bytes_per_token(model, batch) * context if policy is not None else 0)
                if need > free * 0.9:  # DynamicCache's torch.cat holds two copies for a moment
                    row["skipped"] = f"needs ~{need / 2**30:.0f} GiB, {free / 2**30:.0f} GiB free"
                    rows.append(row)
                    print(f"b{batch} {context} {label}: skipped ({row['skipped']})", file=sys.stderr)
                    continue
                if cuda:
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats(device)
                try:
                    cache = fill_cache(model, policy, batch, context, **({"fused_decode": False} if "unfused" in label else {}))
                    pos = decode_steps(model, cache, batch, context, args.warmup, vocab)
                    _sync(device)
                    stop = _timer(device)
                    decode_steps(model, cache, batch, pos, args.steps, vocab)
                    seconds = stop() / args.steps
                except torch.OutOfMemoryError as e:  # pragma: no cover - GPU only
                    row["skipped"] = f"out of memory: {str(e).splitlines()[0]}"
                    rows.append(row)
                    cache = None
                    continue
                held = held_kv_bytes(cache)
                floor = (weight_bytes + held) / bandwidth
                row.update(
                    tokens_per_s=batch / seconds,
                    seconds_per_step=seconds,
                    kv_bytes=held,
                    peak_bytes=torch.cuda.max_memory_allocated(device) if cuda else None,
                    floor_seconds=floor,
                    floor_tokens_per_s=batch / floor,
                    over_floor=seconds / floor,
                )
                rows.append(row)
                print(f"b{batch} {context} {label}: {row['tokens_per_s']:.1f} tok/s, {row['over_floor']:.2f}x floor", file=sys.stderr)
                del cache
    # ratios to the full cache (ours and transformers') within each (batch, context)
    for r in rows:
        if "tokens_per_s" not in r:
            continue
        same = {x["label"]: x for x in rows if x["batch"] == r["batch"] and x["context"] == r["context"] and "tokens_per_s" in x}
        for ref in ("DynamicCache", "FullCache"):
            if ref in same:
                r[f"vs_{ref}"] = r["tokens_per_s"] / same[ref]["tokens_per_s"]
    result = {
        "machine": host,
        "device": device,
        "dtype": args.dtype,
        "shape": "tiny" if args.tiny else "llama-2-7b",
        "weight_bytes": weight_bytes,
        "copy_bandwidth_bytes_per_s": bandwidth,
        "command": "python benchmarks/gpu_decode.py " + " ".join(sys.argv[1:]),
        "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1, default=str))
    table = []
    for r in rows:
        if "skipped" in r:
            table.append([r["batch"], r["context"], r["label"], "-", "-", "-", "-", "-", "-", r["skipped"]])
            continue
        table.append([
            r["batch"], r["context"], r["label"], f"{r['tokens_per_s']:.1f}",
            f"{r.get('vs_DynamicCache', float('nan')):.2f}", f"{r.get('vs_FullCache', float('nan')):.2f}",
            f"{r['kv_bytes'] / 2**30:.2f}", "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**30:.2f}",
            f"{r['floor_tokens_per_s']:.1f}", f"{r['over_floor']:.2f}",
        ])
    lines = [
        "# GPU decode benchmark",
        "",
        f"Command: `{result['command']}`",
        "",
        f"Machine: {machine_line(host)}. Model: {result['shape']} shape, random {args.dtype} weights "
        f"({weight_bytes / 2**30:.2f} GiB); copy bandwidth {bandwidth / 1e9:.0f} GB/s; budget {args.budget:.0%}; "
        f"{args.steps} timed decode steps after {args.warmup}.",
        "",
        markdown_table(
            ["batch", "context", "cache", "tokens/s", "x Dynamic", "x FullCache", "KV GiB", "peak GiB", "floor tok/s", "time / floor"],
            table,
            "rrl" + "r" * 7,
        ),
        "",
    ]
    (out / "report.md").write_text("\n".join(lines))
    print(f"wrote {out / 'report.md'}", file=sys.stderr)
    return result


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 8])
    p.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")], default=[2048, 4096, 8192, 16384, 32768])
    p.add_argument("--budget", type=float, default=0.25)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--unfused", action="store_true", help="also BUZZ with fused_decode=False (SDPA + the extra score product)")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model (tests the logic on CPU)")
    p.add_argument("--out", default="gpu-results")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    run(parse(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
