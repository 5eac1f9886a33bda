"""Is the limit fair? The decode limit of ``kvpolicy bench`` is a ``DynamicCache`` holding the
budget's share of the prompt, which then keeps every decoded token; this runs it beside the same
cache held at the policy's capacity (transformers' ``DynamicSlidingWindowLayer``) and the policy,
interleaved round by round on the embedded SmolLM2-135M, and prints the policy's share of each.

    .venv/bin/python benchmarks/limit_variants.py --context 512 --policy h2o --rounds 16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers.cache_utils import DynamicCache, DynamicSlidingWindowLayer

from kvpolicy import plan_policy
from kvpolicy_tools import models
from kvpolicy_tools.perf.decode import Candidate, build_cache, decode, prefill


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--policy", default="h2o")
    p.add_argument("--budget", type=float, default=0.25)
    p.add_argument("--rounds", type=int, default=16)
    p.add_argument("--steps", type=int, default=6, help="decode steps per candidate and round")
    args = p.parse_args()
    torch.set_num_threads(1)
    model, _ = models.load()
    pre = prefill(model, args.context)
    policy = plan_policy(args.policy, args.budget, context_length=args.context + 100, prompt_length=args.context).policy
    held = DynamicCache(config=model.config)
    held.layers = [DynamicSlidingWindowLayer(sliding_window=policy.capacity) for _ in model.model.layers]
    with torch.no_grad():
        for i, (k, v) in enumerate(zip(pre.keys, pre.values)):
            keep = policy.capacity - 1
            held.update(k[:, :, -keep:].contiguous(), v[:, :, -keep:].contiguous(), i)
    caches = {
        "limit (grows)": build_cache(model, Candidate("limit", keep_last=round(args.budget * args.context)), pre),
        args.policy: build_cache(model, Candidate(args.policy, policy=policy), pre),
        "limit (held)": held,
    }
    ids = torch.randint(5, 1000, (1, args.steps), generator=torch.Generator().manual_seed(0))
    pos = {k: decode(model, c, ids[:, :2], args.context) for k, c in caches.items()}  # warm-up
    times: dict[str, list[float]] = {k: [] for k in caches}
    for _ in range(args.rounds):
        for k, cache in caches.items():
            start = time.perf_counter()
            pos[k] = decode(model, cache, ids, pos[k])
            times[k].append((time.perf_counter() - start) / args.steps)
    print(f"policy capacity {policy.capacity}")
    for k, t in times.items():
        print(f"{k:16s} {statistics.median(t) * 1e3:7.2f} ms/step")
    for ref in ("limit (grows)", "limit (held)"):
        share = statistics.median(a / b for a, b in zip(times[ref], times[args.policy]))
        print(f"{args.policy} share of {ref}: {share:.3f}")
    ratio = statistics.median(a / b for a, b in zip(times["limit (held)"], times["limit (grows)"]))
    print(f"held / grows, time per round: {ratio:.3f}")


if __name__ == "__main__":
    main()
