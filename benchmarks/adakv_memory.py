"""Kept against allocated bytes under AdaKV's head-wise budgets, on the embedded SmolLM2-135M.

    PYTHONPATH=.:integrations .venv/bin/python benchmarks/adakv_memory.py --prompt 512 --new 32 --budget 0.25

One greedy generation per policy (a wikitext-2 prompt of ``--prompt`` tokens, ``--new`` tokens),
then, summed over the 30 layers of the evicting cache: the keys and values the layers keep
(``LayerCache.kv_bytes``: the budget) and what their storage allocates (``LayerCache.nbytes``:
keys, values, positions, scores and bias of every slot, holes included), for AdaKV over H2O and
over SnapKV at ``alpha_safeguard`` 0.2 beside the same scorers per head (same budget). Also each
layer's widest head against its mean (how far heads' shares spread). ``--static``: the caches with
``static_shapes=True`` (the compiled step's layout, run eagerly here). Not a timing benchmark: one
run, exact byte counts; docs/design.md ("Head-wise budgets") and docs/performance.md (section 5)
quote them.
"""

from __future__ import annotations

import argparse
import json

import torch

from kvpolicy import AdaKV, make_policy
from kvpolicy_tools.eval.data import load_wikitext
from kvpolicy.hf import EvictingCache, cache_kwargs
from kvpolicy_tools.models import load


def measure(model, ids: torch.Tensor, policy, new: int, static: bool = False) -> dict:
    cache = EvictingCache(policy, model, static_shapes=static)
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, **cache_kwargs(model, cache))  # fmt: skip
    stores = [layer.store for layer in cache.layers]
    held = [(s.positions[0] >= 0).sum(-1) for s in stores]  # [kv_heads] per layer
    return {
        "policy": repr(policy),
        "static_shapes": cache.layers[0].store.static_shapes,
        "kept_kv_bytes": sum(s.kv_bytes for s in stores),
        "allocated_bytes": sum(s.nbytes for s in stores),
        # keys and values of every slot (holes included): slots x kv_heads x (a token's bytes)
        "allocated_kv_bytes": sum(s.slots * int(h.numel()) * s.kv_bytes // int(h.sum()) for s, h in zip(stores, held)),
        "slots": [s.slots for s in stores],
        "widest_over_mean": max(float(h.max()) / float(h.float().mean()) for h in held),
        "tokens_per_head": [h.tolist() for h in held[:3]],
    }


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--budget", type=float, default=0.25)
    ap.add_argument("--static", action="store_true", help="static_shapes=True (the compiled step's layout)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model, tok = load("smollm2-135m", dtype="float32")
    text = "\n".join(d.text for d in load_wikitext(limit=4))
    ids = tok(text, return_tensors="pt")["input_ids"][:, : args.prompt]
    run = {"context_length": args.prompt + args.new, "prompt_length": args.prompt}
    rows = []
    for scorer in ("h2o", "snapkv"):
        alone = make_policy(scorer, args.budget, **run)
        for policy in (alone, AdaKV(make_policy(scorer, args.budget, selection="per_head", **run), 0.2)):
            if args.static and policy.ragged_heads and policy.headwise_eviction is None:
                print(f"{policy!r}: no static layout (no declared head-wise decode eviction), skipped")
                continue
            rows.append(measure(model, ids, policy, args.new, args.static))
            r = rows[-1]
            print(f"{r['policy']}: kept K/V {r['kept_kv_bytes'] / 2**20:.3f} MiB, allocated K/V "
                  f"{r['allocated_kv_bytes'] / 2**20:.3f} MiB ({r['allocated_kv_bytes'] / r['kept_kv_bytes']:.2f}x), "
                  f"all storage {r['allocated_bytes'] / 2**20:.3f} MiB; widest head / mean {r['widest_over_mean']:.2f}; "
                  f"layers 0-2 tokens per head {r['tokens_per_head']}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
