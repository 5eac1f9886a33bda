"""``torch.compile`` of a decode step with an evicting cache (CPU, inductor), against eager.

A SmolLM2-shaped random model (9 query / 3 KV heads, head_dim 64; ``--layers`` of them), a
``--context``-token prompt, then ``--steps`` greedy decode steps with ``EvictingCache(...,
static_shapes=True)`` (every decode step attends all allocated slots, holes masked, so its shapes
never change). Eager and compiled runs decode the same tokens from the same prompt; the script
prints the median ms per step (after ``--skip`` steps), the first (compiling) call, and whether
both produced the same tokens.

    python benchmarks/compile_decode.py --policies h2o,streaming_llm --layers 4 --context 512

The cache's host-side bookkeeping (Python ints: whether to evict, the victim slot of a
``"oldest"`` eviction, the frontier) stays outside the graph: dynamo breaks the graph at the
cache's ``update`` and the attention function and compiles the model code between them.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main(argv: list[str] | None = None) -> int:
    import torch

    from kvpolicy import plan_policy
    from kvpolicy.models import tiny_llama
    from kvpolicy_integrations.hf import EvictingCache, cache_kwargs

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policies", default="h2o,streaming_llm")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--budget", type=float, default=0.25)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--skip", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = tiny_llama(num_layers=args.layers, heads=9, kv_heads=3, head_dim=64, vocab=256, seed=0,
                       max_position_embeddings=args.context + args.steps + 8)
    ids = torch.randint(3, 256, (1, args.context), generator=torch.Generator().manual_seed(0))
    name = next(iter(cache_kwargs(model, None)))  # 'cache' (transformers >= 5.24) or 'past_key_values', decided outside the compiled step

    def kwarg(cache):
        return {name: cache}

    def step(tok, cache, position):
        with torch.no_grad():
            return model(tok, **kwarg(cache), position_ids=torch.tensor([[position]]), logits_to_keep=1).logits

    compiled = torch.compile(step)
    for name in args.policies.split(","):
        policy = plan_policy(name, args.budget, context_length=args.context + args.steps, prompt_length=args.context).policy
        runs = {}
        for label, fn in (("eager", step), ("compiled", compiled)):
            cache = EvictingCache(policy, model, static_shapes=True)
            with torch.no_grad():
                tok = model(ids, **kwarg(cache)).logits[:, -1:].argmax(-1)
            tokens, times = [], []
            for i in range(args.steps):
                t = time.perf_counter()
                tok = fn(tok, cache, args.context + i)[:, -1:].argmax(-1)
                times.append(time.perf_counter() - t)
                tokens.append(int(tok))
            runs[label] = (tokens, statistics.median(times[args.skip :]) * 1e3, times[0])
            print(f"{name} {label}: {runs[label][1]:.2f} ms/step (median), first call {times[0]:.2f} s")
        print(f"{name}: compiled / eager {runs['compiled'][1] / runs['eager'][1]:.2f}, same tokens: {runs['eager'][0] == runs['compiled'][0]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
