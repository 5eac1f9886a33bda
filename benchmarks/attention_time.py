"""Where a decode step's time goes against the limit: each layer's attention module (``self_attn``:
projections, RoPE, cache update, attention, eviction) timed with forward hooks, and the rest of
the step, for the limit (a ``DynamicCache`` holding the budget's share of the prompt) and
evicting policies on the embedded SmolLM2-135M, candidates interleaved round by round.

    .venv/bin/python benchmarks/attention_time.py --context 512 --policies h2o,streaming_llm,tova --rounds 12
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvpolicy import plan_policy
from kvpolicy_tools import models
from kvpolicy_tools.perf.decode import Candidate, build_cache, decode, prefill


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
    spent = {"attention": 0.0}
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
    attention: dict[str, list[float]] = {k: [] for k in caches}
    for _ in range(args.rounds):
        for k, cache in caches.items():
            spent["attention"] = 0.0
            start = time.perf_counter()
            pos[k] = decode(model, cache, ids, pos[k])
            step[k].append((time.perf_counter() - start) / args.steps)
            attention[k].append(spent["attention"] / args.steps)
    for k in caches:
        total, attn = statistics.median(step[k]) * 1e3, statistics.median(attention[k]) * 1e3
        print(f"{k:16s} step {total:6.2f} ms  attention modules {attn:6.2f} ms "
              f"({attn / len(layers) * 1e3:5.0f} us a layer)  rest {total - attn:6.2f} ms")


if __name__ == "__main__":
    main()
