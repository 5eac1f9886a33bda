"""Does keeping a decode step's views per range pay (``Storage.range_views``)? A/B on the embedded
SmolLM2-135M: two caches of the same policy, one keeping its views (the default) and one making
them at every step (``kept_ranges = 0``), decoding the same tokens in interleaved rounds whose
order alternates (the first candidate of a round runs on a cache the other left). Prints each
candidate's median step time, its share of the limit (a ``DynamicCache`` holding the policy's
budget) and the gain as the mean log ratio of the two per round with its standard error.

    .venv/bin/python benchmarks/range_views.py --context 512 --policy h2o --rounds 300
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from kvpolicy import plan_policy
from kvpolicy_tools import models
from kvpolicy_tools.perf.decode import Candidate, build_cache, decode, prefill


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--policy", default="h2o")
    p.add_argument("--budget", type=float, default=0.25)
    p.add_argument("--rounds", type=int, default=300)
    p.add_argument("--steps", type=int, default=3, help="decode steps per candidate and round")
    args = p.parse_args()
    torch.set_num_threads(1)
    model, _ = models.load()
    pre = prefill(model, args.context)
    policy = plan_policy(args.policy, args.budget, context_length=args.context + 64, prompt_length=args.context).policy
    labels = ["limit", "views kept", "views made each step"]
    caches = [build_cache(model, Candidate("limit", keep_last=round(args.budget * args.context)), pre),
              build_cache(model, Candidate(args.policy, policy=policy), pre),
              build_cache(model, Candidate(args.policy, policy=policy), pre)]
    for layer in caches[2].layers:
        layer.store.synced().store.kept_ranges = 0  # (the storage's public knob: views made at every call)
    ids = torch.randint(5, 1000, (1, args.steps), generator=torch.Generator().manual_seed(0))
    pos = [args.context] * 3
    for i, cache in enumerate(caches):
        pos[i] = decode(model, cache, ids[:, :2], pos[i])  # warm-up
    times: list[list[float]] = [[], [], []]
    for r in range(args.rounds):
        order = [0, 1, 2] if r % 2 == 0 else [0, 2, 1]
        for i in order:
            start = time.perf_counter()
            pos[i] = decode(model, caches[i], ids, pos[i])
            times[i].append((time.perf_counter() - start) / args.steps)
    for label, t in zip(labels, times):
        share = statistics.median(a / b for a, b in zip(times[0], t))
        print(f"{label:22s} {statistics.median(t) * 1e3:7.2f} ms/step  share of the limit {share:6.1%}")
    logs = [math.log(b / a) for a, b in zip(times[1], times[2])]
    se = statistics.stdev(logs) / math.sqrt(len(logs))
    print(f"views kept: faster by {statistics.mean(logs):+.2%} +- {se:.2%} (mean log ratio over {len(logs)} rounds, one s.e.)")


if __name__ == "__main__":
    main()
