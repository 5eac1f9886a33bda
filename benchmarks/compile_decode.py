"""Compiled decode steps against the compiled limit, in one process (issue 25).

For each context, a prompt of random tokens is prefilled once (``kvpolicy_tools.perf.decode.prefill``);
every candidate cache is built from those keys and values (``build_cache``) and then decodes
greedy tokens one step at a time. Candidates:

* ``limit (compiled)``: transformers' ``StaticCache`` holding as many tokens as the policies keep
  (``round(budget x context) + 1`` slots), its decode step ``torch.compile(model, fullgraph=True,
  dynamic=False)``: the compiled limit;
* ``limit (eager)``: a ``DynamicCache`` held at the last ``round(budget x context)`` tokens before
  every round (``hold_last``, untimed), eager;
* for each policy: ``EvictingCache(policy, model, static_shapes=True)`` compiled the same way
  (BUZZ's host-side evictions run between steps: ``EvictingCache.settle``), and the eager
  ``EvictingCache`` (the default layout).

Rounds are interleaved (round r runs ``--steps`` steps of every candidate, each continuing where
it stopped), and a candidate's figure is its median step time; shares are the limit's median
over the candidate's. Compiling (inductor) happens in a warm-up before the first round and is
reported separately.

    .venv/bin/python benchmarks/compile_decode.py --contexts 512,2048,8192 --budget 0.25 \\
        --policies h2o,streaming_llm,local,tova,buzz --threads 1 --out docs/performance/compiled.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Callable


def main(argv: list[str] | None = None) -> int:
    import torch
    from transformers import DynamicCache, StaticCache

    from kvpolicy import plan_policy
    from kvpolicy.hf import EvictingCache, cache_kwargs, compile_decode_step
    from kvpolicy_tools.models import load, tiny_llama
    from kvpolicy_tools.perf.decode import Candidate, build_cache, hold_last, prefill
    from kvpolicy_tools.perf.bench import decoding_policy_names
    from kvpolicy_torch.checks import check_layer

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="'smollm2-135m' (the embedded model) or 'tiny'")
    p.add_argument("--contexts", default="512,2048,8192")
    p.add_argument("--budget", type=float, default=0.25)
    p.add_argument("--policies", default="h2o,streaming_llm,local,tova,buzz", help="comma-separated names, or 'all' (every registered policy that evicts during decode and runs with static shapes: AdaKV's head-wise budgets where their decode eviction is declared)")
    p.add_argument("--steps", type=int, default=16, help="decode steps per candidate and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--backend", default="inductor")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    args = p.parse_args(argv)
    if not 0 < args.budget < 1:
        raise SystemExit(f"--budget must lie in (0, 1), got {args.budget}")
    torch.set_num_threads(args.threads)
    torch._dynamo.config.cache_size_limit = 64  # one graph per (policy, context): more than dynamo's default 8
    if args.model == "tiny":
        model = tiny_llama(num_layers=4, heads=9, kv_heads=3, head_dim=64, vocab=256, seed=0, max_position_embeddings=16384)
    else:
        model, _ = load(args.model, dtype=torch.float32)
    model.eval()
    # dynamic=False: each (policy, context) its own specialised graph, as measured in docs/performance.md
    compiled = compile_decode_step(model, backend=args.backend, dynamic=False)
    total = args.rounds * args.steps + 2  # warm-up steps included
    results: list[dict[str, Any]] = []
    for context in [int(c) for c in args.contexts.split(",")]:
        keep = max(2, round(args.budget * context))
        if total >= keep:
            raise SystemExit(f"--rounds x --steps + 2 = {total} decode steps must stay below the {keep} tokens kept at "
                             f"context {context} (the compiled limit holds that many slots)")
        pre = prefill(model, context)
        runs: dict[str, Callable[[], float]] = {}

        def stepper(cache: Any, fn: Callable[..., Any], settle: bool) -> Callable[[], float]:
            state = {"pos": context, "tok": torch.tensor([[5]])}

            def run() -> float:
                with torch.no_grad():
                    start = time.perf_counter()
                    out = fn(input_ids=state["tok"], position_ids=torch.tensor([[state["pos"]]]), use_cache=True,
                             logits_to_keep=1, **cache_kwargs(model, cache)).logits
                    if settle:
                        cache.settle()
                    state["tok"] = out[:, -1:].argmax(-1)
                    seconds = time.perf_counter() - start
                state["pos"] += 1
                return seconds

            return run

        static = StaticCache(config=model.config, max_cache_len=keep + 1)
        with torch.no_grad():
            for i, (k, v) in enumerate(zip(pre.keys, pre.values)):
                static.update(k[:, :, -(keep + 1 - total):].contiguous(), v[:, :, -(keep + 1 - total):].contiguous(), i)
        runs["limit (compiled)"] = stepper(static, compiled, False)
        # the eager limit is built from the whole prompt and held at `keep` tokens before every round
        # (untimed, as `kvpolicy bench` holds its limit): left to grow by every decoded token it
        # would end a run 100 tokens larger than the compiled limit and the policies
        eager_limit = build_cache(model, Candidate("limit"), pre)
        hold_last(eager_limit, keep)
        runs["limit (eager)"] = stepper(eager_limit, model, False)
        names = decoding_policy_names() if args.policies == "all" else args.policies.split(",")
        for name in names:
            policy = plan_policy(name, args.budget, context_length=context + total, prompt_length=context).policy
            if args.policies == "all":  # (a named one fails loudly instead)
                try:
                    check_layer(policy, static_shapes=True, key_shift=None, group=None)  # (what a static layer refuses)
                except ValueError as refused:
                    print(f"{name}: not compiled, skipped: {refused}")
                    continue
            cache = build_cache(model, Candidate(name, policy=policy, cache_options={"static_shapes": True}), pre)
            assert isinstance(cache, EvictingCache)
            runs[f"{name} (compiled)"] = stepper(cache, compiled, cache.needs_settle)
            runs[f"{name} (eager)"] = stepper(build_cache(model, Candidate(name, policy=policy), pre), model, False)
        first = {label: run() for label, run in runs.items()}  # compiles
        first2 = {label: run() for label, run in runs.items()}
        times: dict[str, list[float]] = {label: [] for label in runs}
        for _ in range(args.rounds):
            hold_last(eager_limit, keep)
            for label, run in runs.items():
                times[label] += [run() for _ in range(args.steps)]
        med = {label: statistics.median(t) for label, t in times.items()}
        row = {"context": context, "kept": keep, "ms_per_step": {k: 1e3 * v for k, v in med.items()},
               "first_call_s": first, "second_call_ms": {k: 1e3 * v for k, v in first2.items()},
               "share_of_compiled_limit": {k: med["limit (compiled)"] / v for k, v in med.items() if "(compiled)" in k},
               "share_of_eager_limit": {k: med["limit (eager)"] / v for k, v in med.items() if "(eager)" in k},
               "compiled_over_eager": {k.split(" ")[0]: med[k.replace("(compiled)", "(eager)")] / med[k]
                                       for k in med if "(compiled)" in k and not k.startswith("limit")}}
        results.append(row)
        print(f"context {context}, {keep} kept, ms per step (median of {args.rounds} x {args.steps}):")
        for label, ms in row["ms_per_step"].items():
            share = row["share_of_compiled_limit"].get(label) or row["share_of_eager_limit"].get(label)
            print(f"  {label:28s} {ms:8.2f} ms  {share:6.1%} of its limit   (first call {first[label]:.1f} s)")
        del pre, runs, eager_limit
    doc = {"command": "benchmarks/compile_decode.py " + " ".join(argv if argv is not None else __import__("sys").argv[1:]),
           "threads": args.threads, "model": args.model, "budget": args.budget, "backend": args.backend,
           "torch": torch.__version__, "time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "results": results}
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
