"""Prefill time with and without score capture, on a SmolLM2-135M-shaped random model.

    PYTHONPATH=.:integrations .venv/bin/python benchmarks/prefill_scores.py --lengths 2048 4096 8192 16384

Per prompt length, one process, interleaved repeats (the median is reported):

* ``DynamicCache``: transformers' own SDPA prefill, no kvpolicy;
* ``no scores``: an ``EvictingCache`` with ``FullCache`` (``kvpolicy_sdpa``, no score product);
* ``scores``: an ``EvictingCache`` with an H2O large enough never to evict, so the time is the
  prompt's attention with its score capture, no eviction: ``prefill_attention``'s one fused pass
  (SDPA plus ``received_attention``'s second pass before ``3815b9b``: the history's figures).

The model has SmolLM2-135M's attention and MLP shapes (9 query / 3 KV heads of 64, hidden 576,
intermediate 1536) with ``--layers`` layers (default 2: every layer costs the same, so the ratio
does not depend on it) and random weights. The ratios are what docs/performance-history.md quotes ("Prefill with and without score capture").
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import DynamicCache

from kvpolicy import H2O, FullCache
from kvpolicy.hf import EvictingCache, cache_kwargs
from kvpolicy_tools.models import tiny_llama


def smollm2_shaped(layers: int) -> torch.nn.Module:
    return tiny_llama(
        num_layers=layers, heads=9, kv_heads=3, head_dim=64, vocab=49152, seed=0,
        intermediate_size=1536, max_position_embeddings=32768, rope_theta=100000.0,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = smollm2_shaped(args.layers)
    variants = {
        "DynamicCache": lambda n: DynamicCache(config=model.config),
        "no scores": lambda n: EvictingCache(FullCache(), model),
        "scores": lambda n: EvictingCache(H2O(heavy=n, recent=64), model),
    }
    results = {"layers": args.layers, "threads": torch.get_num_threads(), "rows": []}
    print(f"| prompt | {' | '.join(variants)} | scores / no scores | scores / DynamicCache |")
    print("|---:|" + "---:|" * (len(variants) + 2))
    for n in args.lengths:
        ids = torch.randint(3, 49152, (1, n), generator=torch.Generator().manual_seed(n))
        times: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(args.repeats):
            for name, make in variants.items():
                cache = make(n)
                t = time.perf_counter()
                with torch.no_grad():
                    model(ids, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
                times[name].append(time.perf_counter() - t)
                del cache
        med = {k: statistics.median(v) for k, v in times.items()}
        row = {"prompt": n, **{k: round(v, 3) for k, v in med.items()}}
        results["rows"].append(row)
        print(
            f"| {n} | " + " | ".join(f"{med[k]:.2f} s" for k in variants)
            + f" | {med['scores'] / med['no scores']:.2f} | {med['scores'] / med['DynamicCache']:.2f} |",
            flush=True,
        )  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
