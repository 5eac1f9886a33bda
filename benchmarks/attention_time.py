"""Where a decode step's time goes against the limit: each layer's attention module (``self_attn``:
projections, RoPE, cache update, attention, eviction) timed with forward hooks, split into the
cache's ``update``, the attention function (transformers' SDPA for the limit, kvpolicy's attention,
scores and eviction for a policy) and the rest of the module (projections, RoPE, output
projection), and the rest of the step, for the limit (a ``DynamicCache`` held at the policies'
count before every round, as ``kvpolicy bench`` holds it) and evicting policies on the embedded
SmolLM2-135M, candidates interleaved round by round.

    .venv/bin/python benchmarks/attention_time.py --context 512 --policies h2o,streaming_llm,tova --rounds 12

The split shows where a policy's extra time lands inside the model, not what each part costs
alone: the model's weights stream through the CPU's caches between two layers, so every call runs
cold, and a cost can land on the call after the one that caused it (in some runs the output
projection after kvpolicy's attention read up to 80 us a layer slower than the limit's).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvpolicy import plan_policy
from kvpolicy_tools import models
from kvpolicy_tools.perf.decode import Candidate, build_cache, decode, hold_last, prefill
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

PARTS = ("attention", "update", "attention_fn")


def timed(fn, spent: dict[str, float], part: str):  # type: ignore[no-untyped-def]
    """``fn`` with its wall time added to ``spent[part]``."""

    def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[part] += time.perf_counter() - start

    return wrapper


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--policies", default="h2o,streaming_llm,tova")
    p.add_argument("--budget", type=float, default=0.25)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--steps", type=int, default=5, help="decode steps per candidate and round")
    args = p.parse_args()
    torch.set_num_threads(1)
    model, _ = models.load()
    pre = prefill(model, args.context)
    caches = {"limit": build_cache(model, Candidate("limit", keep_last=round(args.budget * args.context)), pre)}
    for name in args.policies.split(","):
        policy = plan_policy(name, args.budget, context_length=args.context + 200, prompt_length=args.context).policy
        caches[name] = build_cache(model, Candidate(name, policy=policy), pre)
    spent = dict.fromkeys(PARTS, 0.0)
    for cache in caches.values():  # (the model calls cache.update(...): an instance attribute serves it)
        cache.update = timed(cache.update, spent, "update")
    # every attention function registered so far (SDPA, kvpolicy's), wrapped where the model looks them up
    for name in list(ALL_ATTENTION_FUNCTIONS.keys()):
        AttentionInterface.register(name, timed(ALL_ATTENTION_FUNCTIONS[name], spent, "attention_fn"))
    started = [0.0]

    def before(module, args_, kwargs):  # type: ignore[no-untyped-def]
        started[0] = time.perf_counter()

    def after(module, args_, kwargs, output):  # type: ignore[no-untyped-def]
        spent["attention"] += time.perf_counter() - started[0]

    layers = model.model.layers
    for layer in layers:
        layer.self_attn.register_forward_pre_hook(before, with_kwargs=True)
        layer.self_attn.register_forward_hook(after, with_kwargs=True)
    ids = torch.randint(5, 1000, (1, args.steps), generator=torch.Generator().manual_seed(0))
    pos = {k: decode(model, c, ids[:, :2], args.context) for k, c in caches.items()}  # warm-up
    step: dict[str, list[float]] = {k: [] for k in caches}
    parts: dict[str, dict[str, list[float]]] = {k: {part: [] for part in PARTS} for k in caches}
    held = [c for k, c in caches.items() if k != "limit"]
    for _ in range(args.rounds):
        if held:
            hold_last(caches["limit"], max(max(c.lengths()) for c in held))
        for k, cache in caches.items():
            for part in PARTS:
                spent[part] = 0.0
            start = time.perf_counter()
            pos[k] = decode(model, cache, ids, pos[k])
            step[k].append((time.perf_counter() - start) / args.steps)
            for part in PARTS:
                parts[k][part].append(spent[part] / args.steps)
    per_layer = 1e6 / len(layers)
    print(f"{'':16s} {'step ms':>8s} {'attention modules ms':>21s}   us a layer: {'update':>7s} {'attention fn':>12s} {'rest':>6s}")
    for k in caches:
        total = statistics.median(step[k])
        attn, update, fn = (statistics.median(parts[k][part]) for part in PARTS)
        print(f"{k:16s} {total * 1e3:8.2f} {attn * 1e3:21.2f}   {'':11s} {update * per_layer:7.0f} "
              f"{fn * per_layer:12.0f} {(attn - update - fn) * per_layer:6.0f}   (rest of the step {(total - attn) * 1e3:.2f} ms)")


if __name__ == "__main__":
    main()
