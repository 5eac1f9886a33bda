"""One policy's eager decode speed as a share of the limit, in one process: the script behind
docs/performance.md's before/after comparisons of two commits.

The limit (a ``DynamicCache`` holding the budget's share of the prompt) and the policy decode the
same tokens, taking turns, the order rotating each round; the share is the median over rounds of
the limit's seconds per step over the policy's. Run it from two checkouts alternately, so that the
code measured is the checkout's (``PYTHONPATH`` first on the path):

    git worktree add /tmp/before <commit>^
    for i in 1 2 3; do for d in /tmp/before .; do
        PYTHONPATH=$d:$d/integrations .venv/bin/python benchmarks/share_of_limit.py --policy h2o --context 512 --rounds 60
    done; done

``--limit held`` (default) cuts the limit back to the policy's count before every round, as
``kvpolicy bench`` does (``hold_last``); ``--limit grows`` leaves it growing by every decoded token,
as the bench did before 2026-11-26 09:00 (the morning's before/after pairs were measured so; the
afternoon's with the limit held).

``--twin`` adds a second cache of the same policy, decoding in the same rounds (the order of the
three rotates): its own share, and the median of the two twins' time ratio, are what one process
reads for two identical candidates, the noise floor of a comparison made inside one process (H2O
at 512 tokens, 60 rounds, 2026-11-26 18:30 UTC, two runs: shares 94.45 / 94.70% and 94.55 / 94.17%,
twin ratios 1.0000 and 0.9999).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import kvpolicy_torch
from kvpolicy import plan_policy
from kvpolicy_tools import models
from kvpolicy_tools.perf.decode import Candidate, build_cache, decode, prefill


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policy", default="h2o")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--budget", type=float, default=0.25)
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--steps", type=int, default=3, help="decode steps per candidate and round")
    p.add_argument("--limit", choices=("held", "grows"), default="held")
    p.add_argument("--twin", action="store_true", help="also decode an identical second cache of the policy (the noise floor)")
    p.add_argument("--static", action="store_true",
                   help="also decode a cache of the policy with static_shapes=True, eagerly (the compiled step's layout)")
    args = p.parse_args()
    torch.set_num_threads(1)
    model, _ = models.load()
    pre = prefill(model, args.context)
    policy = plan_policy(args.policy, args.budget, context_length=args.context + 200, prompt_length=args.context).policy
    # a held limit is built from the whole prompt, so that it can be held at the policy's count
    keep_last = None if args.limit == "held" else round(args.budget * args.context)
    caches = {"policy": build_cache(model, Candidate(args.policy, policy=policy), pre),
              "limit": build_cache(model, Candidate("limit", keep_last=keep_last), pre)}
    if args.twin:
        caches["twin"] = build_cache(model, Candidate(args.policy, policy=policy), pre)
    if args.static:
        caches["static"] = build_cache(model, Candidate(args.policy, policy=policy, cache_options={"static_shapes": True}), pre)
    position = dict.fromkeys(caches, args.context)
    token = torch.tensor([[5]])
    for name, cache in caches.items():  # warm-up
        position[name] = decode(model, cache, token.expand(1, 2), position[name])
    seconds: dict[str, list[float]] = {name: [] for name in caches}
    if args.limit == "held":
        # (imported here: a checkout from before hold_last can still run --limit grows)
        from kvpolicy_tools.perf.decode import hold_last
    names = list(caches)
    for r in range(args.rounds):
        if args.limit == "held":
            hold_last(caches["limit"], max(caches["policy"].lengths()))
        for name in names[r % len(names):] + names[:r % len(names)]:  # (the order rotates: each one first as often)
            start = time.perf_counter()
            position[name] = decode(model, caches[name], token.expand(1, args.steps), position[name])
            seconds[name].append((time.perf_counter() - start) / args.steps)
    share = statistics.median(lim / pol for lim, pol in zip(seconds["limit"], seconds["policy"]))
    where = kvpolicy_torch.__file__.rsplit("/kvpolicy_torch", 1)[0]
    # (the median hides a step that comes every N steps, a refresh interval's scoring: the ratio
    # of the total times counts it once per N steps, as a long decode pays it)
    amortized = sum(seconds["limit"]) / sum(seconds["policy"])
    print(f"{where}: {args.policy} at {args.context} tokens, {args.rounds} rounds, limit {args.limit}: share of the limit {share:.4f}"
          f" (amortized over {args.rounds * args.steps} steps: {amortized:.4f})")
    if args.twin:
        twin = statistics.median(lim / pol for lim, pol in zip(seconds["limit"], seconds["twin"]))
        ratio = statistics.median(a / b for a, b in zip(seconds["policy"], seconds["twin"]))
        print(f"  its twin (the same policy, a second cache): share {twin:.4f}; policy/twin time ratio {ratio:.4f}")
    if args.static:
        static = statistics.median(lim / pol for lim, pol in zip(seconds["limit"], seconds["static"]))
        print(f"  static_shapes=True, eager: share {static:.4f}")


if __name__ == "__main__":
    main()
