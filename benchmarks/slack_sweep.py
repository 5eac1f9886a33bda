"""Decode speed of H2O (25% budget) on the embedded SmolLM2-135M against the limit, for several
floors of LayerCache's spare slots (``LayerCache.min_slack``), all candidates interleaved token by
token in one run. What chose the floor of 64 (docs/performance-history.md, "Decode against the
limit, sitting by sitting").

    .venv/bin/python benchmarks/slack_sweep.py --context 512 --floors 0,32,64 --steps 150
"""

from __future__ import annotations

import argparse
import time

import torch

from kvpolicy_tools import models
from kvpolicy_tools.perf.decode import build_cache, decode, prefill, standard_candidates
from kvpolicy_torch import LayerCache


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--floors", default="0,32,64", help="values of LayerCache.min_slack (0: capacity // 8 alone)")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--policy", default="h2o")
    args = p.parse_args()
    torch.set_num_threads(1)
    model, _ = models.load()
    pre = prefill(model, args.context)
    limit, cand = [c for c in standard_candidates(args.context, 64, policies=(args.policy,), budgets=(0.25,),
                                                  capture_only=False, full=False) if c.label != "DynamicCache"]
    caches, labels, default = [build_cache(model, limit, pre)], ["limit 25%"], LayerCache.min_slack
    try:
        for floor in (int(x) for x in args.floors.split(",")):
            LayerCache.min_slack = floor
            cache = build_cache(model, cand, pre)
            caches.append(cache)
            labels.append(f"{cand.label}, min_slack {floor} (slots {cache.layers[0].store.slots})")
    finally:
        LayerCache.min_slack = default
    ids = torch.randint(5, 1000, (1, args.steps + 2), generator=torch.Generator().manual_seed(0))
    pos, spent = [args.context] * len(caches), [0.0] * len(caches)
    for i, c in enumerate(caches):
        pos[i] = decode(model, c, ids[:, :2], pos[i])  # warm-up
    n = len(caches)
    for t in range(args.steps):
        for i in list(range(t % n, n)) + list(range(t % n)):  # a rotated order each token
            start = time.perf_counter()
            pos[i] = decode(model, caches[i], ids[:, 2 + t : 3 + t], pos[i])
            spent[i] += time.perf_counter() - start
    for label, s in zip(labels, spent):
        print(f"{label:55s} {s / args.steps * 1e3:6.2f} ms/step  share of the limit {spent[0] / s:6.1%}")


if __name__ == "__main__":
    main()
