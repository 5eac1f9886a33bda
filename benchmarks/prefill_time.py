"""Time to first token: a one-shot prompt forward through ``EvictingCache`` against a plain SDPA one.

    PYTHONPATH=.:integrations taskset -c 0 .venv/bin/python benchmarks/prefill_time.py \\
        --lengths 2048 4096 --repeats 2 --json prefill.json

On the embedded SmolLM2-135M (fp32, ``torch.set_num_threads(1)``), a wikitext-2 prompt
(``--text``, default ``../shared/data/wikitext-2-raw-test.txt``; the first ``n`` tokens) goes
through the model in one forward (``logits_to_keep=1``, as ``generate`` asks for the first token):

* ``plain``: a ``DynamicCache`` with transformers' own SDPA attention (the causal kernel);
* each policy (``--policies``; planned for ``--budget`` of the prompt with
  :func:`kvpolicy.make_policy`, ``full`` is ``FullCache``): an ``EvictingCache`` of it, the
  forward including the prefill eviction (KVzip's: its context reconstruction after the prompt,
  :func:`kvpolicy_integrations.reconstruction.reconstruct`, as ``generate`` runs it before the
  first token).

Runs are interleaved (plain, every policy, plain, ... per repeat), the fastest of ``--repeats``
is kept, and each policy's time is reported as a ratio to the plain forward's. ``--clock
process`` (default) times the process's CPU time, which on a shared machine leaves out the time
other jobs held the core (one torch thread: the process's CPU time is the forward's work);
``--clock wall`` times the wall clock. ``--chunk N`` feeds
the policies' prompt in chunks of ``N`` tokens (as ``greedy_decode`` does by default) instead.
``--profile POLICY`` prints torch.profiler's top operators of one forward of that policy and of
the plain one at the first length, and exits.

``--memory`` measures instead the cache bytes of a prefill of each length (no model, no time:
bytes do not depend on values): one :class:`kvpolicy_torch.LayerCache` per layer of
SmolLM2-135M's cache shape (30 layers, 3 KV heads of 64, float32) given random keys and received
attention, the prompt in one append or in ``--chunk`` chunks (default 512) with the room for one
chunk (``prompt_chunk``), against the full cache's keys and values; the peak is
:attr:`~kvpolicy_torch.LayerCache.peak_bytes` summed over the layers (for a one-shot prefill an
upper bound: each layer's prompt is transient only during its own eviction).

    PYTHONPATH=.:integrations .venv/bin/python benchmarks/prefill_time.py --memory --lengths 16384 32768
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any, Callable

import torch
from transformers import DynamicCache

from kvpolicy import FullCache, make_policy
from kvpolicy.hf import EvictingCache, cache_kwargs
from kvpolicy_integrations.reconstruction import RepeatPrompts, reconstruct, repeat_prompts
from kvpolicy_tools.models import load

DEFAULT_POLICIES = ("full", "streaming_llm", "local", "knorm", "keydiff", "h2o", "tova", "buzz", "snapkv_h2o")
DEFAULT_TEXT = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "wikitext-2-raw-test.txt"


def prompt_ids(tok: Any, path: Path, n: int) -> torch.Tensor:
    """The first ``n`` tokens of the text at ``path`` (repeated if it is shorter), ``[1, n]``."""
    text = path.read_text(encoding="utf-8")
    ids = tok(text, return_tensors="pt")["input_ids"][0]
    while ids.shape[0] < n:
        ids = torch.cat([ids, ids])
    return ids[:n][None]


CLOCKS = {"process": time.process_time, "wall": time.perf_counter}
clock = CLOCKS["process"]


def forward(model: torch.nn.Module, ids: torch.Tensor, cache: Any, chunk: int | None,
            prompts: RepeatPrompts | None = None) -> float:
    """Seconds of the prompt forward(s) through ``cache``, and of KVzip's context reconstruction
    (with its repeat ``prompts``) where the cache's policy scores by one."""
    n = ids.shape[1]
    step = n if not chunk else chunk
    t = clock()
    with torch.no_grad():
        for lo in range(0, n, step):
            part = ids[:, lo : lo + step]
            positions = torch.arange(lo, lo + part.shape[1])[None]
            model(input_ids=part, position_ids=positions, use_cache=True, logits_to_keep=1, **cache_kwargs(model, cache))
        if isinstance(cache, EvictingCache) and cache.policy.needs_reconstruction:
            if prompts is None:
                raise ValueError(f"{cache.policy!r} scores the prompt by a context reconstruction: give prompts")
            reconstruct(model, cache, ids, prompts)
    return clock() - t


def makers(model: torch.nn.Module, names: list[str], n: int, budget: float) -> dict[str, Callable[[], Any]]:
    """A cache factory per variant: ``plain`` first."""
    out: dict[str, Callable[[], Any]] = {"plain": lambda: DynamicCache(config=model.config)}
    layers = model.config.num_hidden_layers
    for name in names:
        if name == "full":
            out[name] = lambda: EvictingCache(FullCache(), model)
        else:
            policy = make_policy(name, budget, context_length=n + 1, prompt_length=n, layers=layers)
            out[name] = lambda policy=policy: EvictingCache(policy, model)
    return out


def memory(lengths: list[int], names: list[str], budget: float, chunk: int, layers: int = 30) -> list[dict[str, Any]]:
    """Peak cache MiB of a one-shot and a chunked prefill per policy and length (see the module docstring)."""
    from kvpolicy_torch import LayerCache

    rows = []
    print("| prompt | policy | capacity | full KV MiB | one-shot peak MiB | chunked peak MiB | storage + one chunk, MiB |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for n in lengths:
        g = torch.Generator().manual_seed(n)
        full = layers * n * 2 * 3 * 64 * 4
        for name in names:
            if name == "full":
                continue
            policy = make_policy(name, budget, context_length=n + 1, prompt_length=n, layers=layers)
            peaks = {}
            for mode, size in (("one-shot", n), ("chunked", chunk)):
                total = 0
                for _ in range(layers):  # (one layer at a time: the same bytes, a 30th of the memory)
                    layer = LayerCache(policy.for_layer(0, layers), prompt_chunk=chunk if mode == "chunked" else None)
                    for lo in range(0, n, size):
                        q = min(size, n - lo)
                        keys = torch.randn(1, 3, q, 64, generator=g)
                        kept, _ = layer.append(keys, keys)
                        layer.accumulate(torch.rand(1, 3, kept.shape[2], generator=g))
                        layer.evict()
                    total += layer.peak_bytes
                    if mode == "one-shot":  # the storage without a chunk's room: capacity and spare slots
                        storage, slot_bytes = layer.slots, layer.nbytes // layer.slots
                peaks[mode] = total
            bound = layers * slot_bytes * (storage + chunk)
            row = {"prompt": n, "policy": name, "capacity": policy.capacity, "full_kv": full, **peaks, "storage_slots": storage, "storage_plus_chunk": bound}
            rows.append(row)
            mib = 2**20
            print(f"| {n} | {name} | {policy.capacity} | {full / mib:.1f} | {peaks['one-shot'] / mib:.1f} | {peaks['chunked'] / mib:.1f} "
                  f"| {bound / mib:.1f} |", flush=True)
    return rows


def profile(model: torch.nn.Module, ids: torch.Tensor, make: Callable[[], Any], label: str, rows: int) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        forward(model, ids, make(), None)
    print(f"--- {label}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--policies", nargs="+", default=list(DEFAULT_POLICIES))
    ap.add_argument("--budget", type=float, default=0.25)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--chunk", type=int, default=0, help="prefill the policies' prompt in chunks of this many tokens")
    ap.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    ap.add_argument("--profile", default=None, help="profile one forward of this policy (and the plain one), then exit")
    ap.add_argument("--memory", action="store_true", help="cache bytes of a one-shot and a chunked prefill instead (no model)")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="process", help="process CPU time (default) or wall clock")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    global clock
    clock = CLOCKS[args.clock]
    torch.set_num_threads(args.threads)
    if args.memory:
        rows = memory(args.lengths, args.policies, args.budget, args.chunk or 512)
        if args.json:
            Path(args.json).write_text(json.dumps({"budget": args.budget, "chunk": args.chunk or 512, "rows": rows}, indent=1))
        return {"rows": rows}
    model, tok = load("smollm2-135m", dtype="float32", progress=False)
    if args.profile:
        n = args.lengths[0]
        ids = prompt_ids(tok, args.text, n)
        make = makers(model, [args.profile], n, args.budget)
        forward(model, ids, make["plain"](), None)  # (warm-up)
        for label in ("plain", args.profile):
            profile(model, ids, make[label], f"{label} at {n}", 25)
        return {}
    results: dict[str, Any] = {"threads": args.threads, "budget": args.budget, "chunk": args.chunk or None, "clock": args.clock,
                               "load": os.getloadavg(), "rows": []}
    print(f"load average {os.getloadavg()}, {args.threads} thread(s), best of {args.repeats}, {args.clock} time")
    print("| prompt | plain | " + " | ".join(args.policies) + " |")
    print("|---:|---:|" + "---:|" * len(args.policies))
    prompts = repeat_prompts(tok)  # (KVzip's reconstruction)
    for n in args.lengths:
        ids = prompt_ids(tok, args.text, n)
        make = makers(model, args.policies, n, args.budget)
        forward(model, ids[:, :256], make["plain"](), None)  # (warm-up)
        times: dict[str, list[float]] = {k: [] for k in make}
        for _ in range(args.repeats):
            for name, factory in make.items():
                times[name].append(forward(model, ids, factory(), None if name == "plain" else args.chunk or None, prompts))
        best = {k: min(v) for k, v in times.items()}
        results["rows"].append({"prompt": n, "seconds": best, "ratio": {k: best[k] / best["plain"] for k in best}})
        print(f"| {n} | {best['plain']:.2f} s | " + " | ".join(f"{best[k] / best['plain']:.2f}x" for k in args.policies) + " |",
              flush=True)
    results["load_after"] = os.getloadavg()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
