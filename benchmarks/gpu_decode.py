"""GPU decode benchmark: a Llama-2-7B-shaped model with random bf16 weights.

For each batch size (1, 4, 8) and context (2k ... 32k): prefill time, decode tokens/s (steps
that evict and steps that do not, apart), KV bytes and peak memory beyond the weights of
transformers' ``DynamicCache`` (through transformers' own SDPA attention), kvpolicy's
``FullCache``, and BUZZ / H2O / StreamingLLM at 25%, plus the memory-bandwidth floor of every
candidate: the bytes one decode step must read (all weights, and the keys and values the cache
holds) divided by the device's measured copy bandwidth. Targets (issue 7): BUZZ at 25% within
1.5x of its floor, and at 32k at least 2x the tokens/s of the full cache.

Run it on a machine with a GPU (about 13 GiB of weights; the full caches at 32k need 16 GiB per
batch row, so the batch x context points that do not fit are skipped, from each candidate's own
planned bytes against the free memory after ``empty_cache()``)::

    python benchmarks/gpu_decode.py --out gpu-results            # the grid of the issue
    python benchmarks/gpu_decode.py --batches 1 --contexts 2048,32768 --steps 16

and paste ``gpu-results/report.md`` into ``docs/performance.md``. ``--tiny --device cpu`` runs
every code path on a 2-layer model with small contexts (tests/benchmarks/test_gpu_decode.py does).

How a run goes, per candidate: the model is built on the meta device, materialised on the device
in the target dtype, and its rotary embedding rebuilt by transformers' own constructor (the meta
build leaves ``inv_freq`` uninitialised). A random prompt (the weights are random) is prefilled
through the model in ``--prefill-chunk`` chunks, so the evicting caches capture real scores and
evict as in a real run; ``prefill_s`` times it. Then ``--warmup`` decode steps and at least
``--steps`` timed ones, extended (up to ``--max-steps``) until the policy has evicted during
the timed steps at least once. Each step is timed on its own (CUDA events, one sync at the
end), and the caches' eviction counters (host ints) say which steps evicted.
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

    from kvpolicy_tools.models import rebuild_rotary

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
    rebuild_rotary(model, device)  # to_empty left inv_freq uninitialised
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


#: The policies of the default grid (registered names); ``--policies`` picks others.
DEFAULT_POLICIES = ("buzz", "h2o", "streaming_llm")


def candidates(
    context: int, decode_tokens: int, budget: float, unfused: bool = False, policies: Sequence[str] = DEFAULT_POLICIES,
    layers: int | None = None,
) -> list[tuple[str, Any]]:
    """``(label, policy)`` rows of one grid point: ``DynamicCache`` (``None``), ``FullCache``, then each
    registered name in ``policies`` planned at ``budget`` for ``context`` prompt tokens and
    ``decode_tokens`` new ones (over ``layers`` layers where a policy's budget varies by layer)."""
    from kvpolicy import FullCache, plan_policy
    from kvpolicy_tools.eval.display import policy_name

    total = context + decode_tokens
    out: list[tuple[str, Any]] = [("DynamicCache", None), ("FullCache", FullCache())]
    planned = {name: plan_policy(name, budget, context_length=total, prompt_length=context, layers=layers).policy for name in policies}
    out += [(f"{policy_name(name)} {budget:.0%}", policy) for name, policy in planned.items()]
    if unfused and "buzz" in planned:
        out.append((f"{policy_name('buzz')} {budget:.0%} (unfused)", planned["buzz"]))
    return out


def make_cache(model: Any, policy: Any, *, fused_decode: bool = True, static_tokens: int | None = None) -> Any:
    """``DynamicCache`` (``policy=None``) with transformers' own SDPA attention, else an
    ``EvictingCache`` (kvpolicy's attention during its own forwards only). ``static_tokens``: the
    compiled rows' caches, with fixed shapes: transformers' ``StaticCache`` of that many tokens,
    or an ``EvictingCache(static_shapes=True)``."""
    from transformers import DynamicCache, StaticCache

    from kvpolicy_integrations.hf import EvictingCache

    if static_tokens is not None:
        if policy is None:
            return StaticCache(config=model.config, max_cache_len=static_tokens)
        return EvictingCache(policy, model, static_shapes=True, max_tokens=static_tokens)
    if policy is None:
        return DynamicCache(config=model.config)
    return EvictingCache(policy, model, fused_decode=fused_decode)


def evictions(cache: Any) -> int:
    """Eviction rounds so far, all layers (host ints; 0 for a ``DynamicCache``)."""
    return sum(getattr(getattr(layer, "store", None), "evictions", 0) for layer in cache.layers)


def prefill(model: Any, cache: Any, ids: Any, chunk: int) -> int:
    """Run the prompt through the model in chunks of ``chunk`` tokens; returns the forwards run."""
    import torch

    from kvpolicy_integrations.hf import cache_kwargs

    batch, n = ids.shape
    forwards = 0
    with torch.no_grad():
        for start in range(0, n, chunk):
            part = ids[:, start : start + chunk]
            pos = torch.arange(start, start + part.shape[1], device=ids.device).expand(batch, -1)
            model(input_ids=part, **cache_kwargs(model, cache), position_ids=pos, use_cache=True, logits_to_keep=1)
            forwards += 1
    return forwards


def _mark(device: str) -> Any:
    import torch

    if torch.device(device).type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def _elapsed(a: Any, b: Any) -> float:
    return a.elapsed_time(b) / 1e3 if hasattr(a, "elapsed_time") else b - a


def decode_steps(
    model: Any, cache: Any, ids: Any, position: int, *, min_steps: int | None = None, until_eviction: bool = False,
    step: Any = None,
) -> tuple[list[float], list[bool]]:
    """Decode steps from ``position``, one per column of ``ids`` (``[batch, steps]``): each step's
    seconds (one sync at the end) and whether it evicted (the caches' eviction counters, host
    ints). With ``until_eviction`` it stops after ``min_steps`` once a step has evicted (or at
    the last column). ``step``: the callable that runs a step (a compiled model; default the
    model); a static-shaped cache's host-side evictions run between steps (``settle``), inside
    the step's time, and its device-side evictions are not counted (no host read)."""
    import torch

    from kvpolicy_integrations.hf import cache_kwargs

    device = str(ids.device)
    batch, steps = ids.shape
    step = step if step is not None else model
    settle = getattr(cache, "needs_settle", False)
    marks, evicted = [_mark(device)], []
    with torch.no_grad():
        for t in range(steps):
            before = evictions(cache)
            pos = torch.full((batch, 1), position + t, dtype=torch.long, device=ids.device)
            step(input_ids=ids[:, t : t + 1], **cache_kwargs(model, cache), position_ids=pos, use_cache=True, logits_to_keep=1)
            if settle:
                cache.settle()
            evicted.append(evictions(cache) > before)
            marks.append(_mark(device))
            if min_steps is not None and t + 1 >= min_steps and (not until_eviction or any(evicted)):
                break
    _sync(device)
    return [_elapsed(marks[i], marks[i + 1]) for i in range(len(evicted))], evicted


def held_kv_bytes(cache: Any) -> int:
    """Bytes of keys and values a cache holds now."""
    if hasattr(cache, "kv_bytes"):
        return int(cache.kv_bytes)
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def kv_bytes_per_token(model: Any, batch: int) -> int:
    cfg = model.config
    esize = next(model.parameters()).element_size()
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * esize * batch


def planned_bytes(model: Any, policy: Any, batch: int, context: int, new_tokens: int, chunk: int) -> int:
    """Device bytes a candidate needs besides the weights (the memory gate; an upper estimate).

    Cache: ``DynamicCache`` holds every token plus, for a moment, one layer's ``torch.cat`` copy;
    an evicting cache allocates its policy's ``capacity`` (``FullCache``: every token) for keys,
    values, int64 positions and float32 scores, plus one layer's overflow and gathered copy
    while a prefill chunk exceeds the capacity. Workspace: the score capture's logits
    (``kvpolicy_torch.scores.DEFAULT_WORKSPACE_BYTES``), one chunk's activations
    (hidden and MLP, float32 upper bound) and its SDPA mask.
    """
    from kvpolicy_torch.scores import DEFAULT_WORKSPACE_BYTES

    cfg = model.config
    layers = cfg.num_hidden_layers
    kv_tok = kv_bytes_per_token(model, batch)
    total = context + new_tokens
    c = min(chunk, context)
    if policy is None:
        cache = kv_tok * total + kv_tok * total // layers
        scores = 0
    else:
        slots = policy.capacity if policy.capacity is not None else total
        store_tok = batch * layers * cfg.num_key_value_heads * (8 + 4)
        per_tok = kv_tok + store_tok
        cache = per_tok * slots + 2 * (min(slots, total) + c) * per_tok // layers
        scores = DEFAULT_WORKSPACE_BYTES if policy.uses_scores else 0
    activations = batch * c * (4 * cfg.hidden_size + 3 * cfg.intermediate_size) * 4
    mask = batch * c * (total + c) * 4
    return cache + scores + activations + mask


def free_device_bytes(device: str) -> float:
    """Free device memory after returning the allocator's cached blocks (``inf`` on CPU)."""
    import torch

    if torch.device(device).type != "cuda":
        return math.inf
    torch.cuda.empty_cache()
    return float(torch.cuda.mem_get_info(device)[0])


def run(args: argparse.Namespace) -> dict[str, Any]:
    import statistics

    import torch

    from kvpolicy_tools.perf.report import machine, machine_line, markdown_table

    device = args.device
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    shape = dict(TINY if args.tiny else LLAMA2_7B)
    model = build_model(shape, device, dtype)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bandwidth = copy_bandwidth(device, nbytes=(1 << 24) if args.tiny else (1 << 30))
    host = machine(shared=None)
    cuda = torch.device(device).type == "cuda"
    if cuda:
        host["gpu"] = torch.cuda.get_device_name(device)
    rows: list[dict[str, Any]] = []
    vocab = shape["vocab_size"]
    planned_new = args.warmup + args.steps
    from kvpolicy_integrations.hf import compile_decode_step

    # one compiled model per mode, shared by the compiled rows (each cache shape compiles its own
    # specialised graph: dynamic=False, as measured in docs/performance.md)
    compiled = {mode: compile_decode_step(model, mode=None if mode == "default" else mode, backend=args.compile_backend,
                                          dynamic=False)
                for mode in args.compile_modes}
    torch._dynamo.config.cache_size_limit = 256
    started = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    layers = shape["num_hidden_layers"]
    # The jobs in the order they run: by default every eager row of the grid first, then the compiled
    # rows (each compiles its own graph, a minute or more on a large model), so a --deadline cuts the
    # costliest last; --order names the grid points (and which of them run compiled) explicitly.
    def eager_rows(batch: int, context: int) -> list[tuple[int, int, str, Any, str | None]]:
        return [(batch, context, label, policy, None)
                for label, policy in candidates(context, planned_new, args.budget, args.unfused, args.policies, layers)]

    def compiled_rows(batch: int, context: int, mode: str) -> list[tuple[int, int, str, Any, str | None]]:
        rows_at = [(batch, context, f"StaticCache (compiled, {mode})", None, mode)]
        return rows_at + [(batch, context, f"{label} (compiled, {mode})", policy, mode) for _, _, label, policy, _ in eager_rows(batch, context)
                          if policy is not None and policy.capacity is not None and "unfused" not in label]

    jobs: list[tuple[int, int, str, Any, str | None]] = []
    if args.order is None:
        points = [(b, c) for b in args.batches for c in args.contexts]
        jobs = [job for b, c in points for job in eager_rows(b, c)]
        jobs += [job for mode in args.compile_modes for b, c in points for job in compiled_rows(b, c, mode)]
    else:
        for batch, context, compiled_point in args.order:
            jobs += ([job for mode in args.compile_modes for job in compiled_rows(batch, context, mode)] if compiled_point
                     else eager_rows(batch, context))
    for batch, context, label, policy, mode in jobs:
        row: dict[str, Any] = {"batch": batch, "context": context, "label": label, "policy": repr(policy) if policy else "DynamicCache"}
        if args.deadline is not None and time.monotonic() - started > args.deadline:
            row["skipped"] = f"not run: past the {args.deadline:.0f} s deadline"
            rows.append(row)
            continue
        g = torch.Generator().manual_seed(context * 100 + batch)
        prompt = torch.randint(3, vocab, (batch, context), generator=g).to(device)
        # (a compiled step's one-token evictions happen on the device: not counted, so no waiting for one)
        evicts = policy is not None and policy.capacity is not None and mode is None
        steps = max(args.steps, args.max_steps) if evicts else args.steps  # at most; stops at the first eviction
        need = planned_bytes(model, policy, batch, context, args.warmup + steps, args.prefill_chunk)
        free = free_device_bytes(device)
        row["planned_bytes"] = need
        if need > 0.95 * free:
            row["skipped"] = f"needs ~{need / 2**30:.1f} GiB beyond the weights, {free / 2**30:.1f} GiB free"
            rows.append(row)
            print(f"b{batch} {context} {label}: skipped ({row['skipped']})", file=sys.stderr)
            continue
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device) if cuda else 0
        ids = torch.randint(3, vocab, (batch, args.warmup + steps), generator=g).to(device)
        cache = None
        row_started = time.monotonic()
        try:
            static_tokens = context + args.warmup + steps + 1 if mode is not None else None
            cache = make_cache(model, policy, fused_decode="unfused" not in label, static_tokens=static_tokens)
            step = compiled[mode] if mode is not None else None
            _sync(device)
            stop = _timer(device)
            forwards = prefill(model, cache, prompt, args.prefill_chunk)
            prefill_s = stop()
            # warm-up, untimed (the compiled rows compile here, and capture their CUDA graphs)
            decode_steps(model, cache, ids[:, : args.warmup], context, step=step)
            seconds, evicted = decode_steps(
                model, cache, ids[:, args.warmup :], context + args.warmup, min_steps=args.steps, until_eviction=evicts,
                step=step,
            )
        except Exception as e:  # one row's failure (out of memory, a cache the compiled step refuses) is its row's note
            row["skipped"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            rows.append(row)
            print(f"b{batch} {context} {label}: {row['skipped']}", file=sys.stderr)
            del cache
            continue
        held = held_kv_bytes(cache)
        floor = (weight_bytes + held) / bandwidth
        quiet = [s for s, e in zip(seconds, evicted) if not e]
        busy = [s for s, e in zip(seconds, evicted) if e]
        per_step = sum(seconds) / len(seconds)
        row.update(
            prefill_s=prefill_s,
            prefill_tokens_per_s=batch * context / prefill_s,
            decode_steps=len(seconds),
            forwards=forwards + args.warmup + len(seconds),
            evicting_steps=len(busy),
            tokens_per_s=batch / per_step,
            seconds_per_step=per_step,
            step_s_no_eviction=statistics.median(quiet) if quiet else None,
            step_s_eviction=statistics.mean(busy) if busy else None,
            kv_bytes=held,
            allocated_bytes=int(getattr(cache, "allocated_bytes", held)),
            peak_beyond_weights=(torch.cuda.max_memory_allocated(device) - baseline) if cuda else None,
            floor_seconds=floor,
            floor_tokens_per_s=batch / floor,
            over_floor=per_step / floor,
            wall_s=time.monotonic() - row_started,
        )
        rows.append(row)
        print(
            f"b{batch} {context} {label}: prefill {prefill_s:.2f} s, {row['tokens_per_s']:.1f} tok/s, "
            f"{len(busy)}/{len(seconds)} steps evicted, {row['over_floor']:.2f}x floor ({row['wall_s']:.0f} s)",
            file=sys.stderr, flush=True,
        )
        del cache
        # the raw rows so far, so a run cut short still leaves what it measured
        (out / "rows.partial.json").write_text(json.dumps(rows, indent=1, default=str))
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
    (out / "results.json").write_text(json.dumps(result, indent=1, default=str))
    gib = lambda b: "-" if b is None else f"{b / 2**30:.2f}"  # noqa: E731
    ms = lambda s: "-" if s is None else f"{s * 1e3:.1f}"  # noqa: E731
    table = []
    for r in rows:
        if "skipped" in r:
            table.append([r["batch"], r["context"], r["label"], *["-"] * 11, r["skipped"]])
            continue
        table.append([
            r["batch"], r["context"], r["label"], f"{r['prefill_s']:.2f}", f"{r['tokens_per_s']:.1f}",
            f"{r.get('vs_DynamicCache', float('nan')):.2f}", f"{r.get('vs_FullCache', float('nan')):.2f}",
            ms(r["step_s_no_eviction"]), ms(r["step_s_eviction"]), f"{r['evicting_steps']}/{r['decode_steps']}",
            gib(r["kv_bytes"]), gib(r["peak_beyond_weights"]), f"{r['floor_tokens_per_s']:.1f}", f"{r['over_floor']:.2f}", "",
        ])  # fmt: skip
    lines = [
        "# GPU decode benchmark",
        "",
        f"Command: `{result['command']}`",
        "",
        f"Machine: {machine_line(host)}. Model: {result['shape']} shape, random {args.dtype} weights "
        f"({weight_bytes / 2**30:.2f} GiB); copy bandwidth {bandwidth / 1e9:.0f} GB/s; budget {args.budget:.0%}; "
        f"prefill in chunks of {args.prefill_chunk}; at least {args.steps} timed decode steps after {args.warmup}, "
        f"more (up to {args.max_steps}) until each policy has evicted during decode. Step times: median of the steps "
        "that did not evict, mean of those that did. Peak: the allocator's peak during the candidate, minus what was "
        "allocated before it (the weights).",
        "",
        markdown_table(
            ["batch", "context", "cache", "prefill s", "tokens/s", "x Dynamic", "x FullCache", "step ms", "evicting step ms",
             "evicting steps", "KV GiB", "peak GiB beyond weights", "floor tok/s", "time / floor", "note"],
            table,
            "rrl" + "r" * 11 + "l",
        ),  # fmt: skip
        "",
    ]
    (out / "report.md").write_text("\n".join(lines))
    print(f"wrote {out / 'report.md'}", file=sys.stderr)
    return result


def parse_order(text: str) -> list[tuple[int, int, bool]]:
    """``--order``: ``"1x2048,1x2048c"`` -> ``[(1, 2048, False), (1, 2048, True)]``.

    Example:
        >>> parse_order("1x2048, 8x32768c")
        [(1, 2048, False), (8, 32768, True)]
    """
    out = []
    for item in (x.strip() for x in text.split(",")):
        compiled = item.endswith("c")
        batch, sep, context = item.removesuffix("c").partition("x")
        if not (sep and batch.isdigit() and context.isdigit() and int(batch) > 0 and int(context) > 0):
            raise argparse.ArgumentTypeError(f"--order takes BATCHxCONTEXT points (a trailing 'c': compiled), e.g. 1x2048c; got {item!r}")
        out.append((int(batch), int(context), compiled))
    return out


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 8])
    p.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")], default=[2048, 4096, 8192, 16384, 32768])
    p.add_argument("--budget", type=float, default=0.25)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--max-steps", type=int, default=4096, help="cap on the decode steps run to see a policy evict (default 4096)")
    p.add_argument("--prefill-chunk", type=int, default=4096, help="prefill the prompt in chunks of this many tokens (default 4096)")
    p.add_argument("--policies", type=lambda s: [x for x in s.split(",") if x], default=list(DEFAULT_POLICIES),
                   help=f"registered policies planned at --budget (default {','.join(DEFAULT_POLICIES)})")
    p.add_argument("--order", type=parse_order, default=None,
                   help="the grid points in the order to run them, e.g. '1x2048,1x2048c,8x32768': BATCHxCONTEXT runs its "
                        "eager rows, a trailing 'c' its compiled rows (default: every eager row, then every compiled row)")
    p.add_argument("--deadline", type=float, default=None,
                   help="seconds after which the remaining rows are recorded as not run (default: none)")
    p.add_argument("--unfused", action="store_true", help="also BUZZ with fused_decode=False (SDPA + the extra score product)")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model (tests the logic on CPU)")
    p.add_argument("--compile-modes", type=lambda s: [m for m in s.split(",") if m], default=None,
                   help="compiled rows, one set per torch.compile mode: 'default' (inductor), 'reduce-overhead' (CUDA "
                        "graphs); default 'default,reduce-overhead' on CUDA, none elsewhere; '' for none")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend of the compiled rows (default inductor)")
    p.add_argument("--out", default="gpu-results")
    args = p.parse_args(argv)
    if args.compile_modes is None:
        args.compile_modes = ["default", "reduce-overhead"] if args.device.startswith("cuda") else []
    return args


def main(argv: Sequence[str] | None = None) -> int:
    run(parse(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
