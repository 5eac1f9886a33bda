"""Worker for tests/integrations/test_deepspeed_multi.py: run under the DeepSpeed launcher, one process per rank.

    deepspeed --num_gpus 2 tests/ds_worker.py --out DIR --tp 2

(DeepSpeed picks its CPU accelerator and the gloo/shm backend on a machine without GPUs.)

For each model (a tiny *random* Llama with 8 query / 4 KV heads, and the real SmolLM2-135M with
9 query / 3 KV heads, which AutoTP splits 6+3 / 2+1 over two ranks) and each case (full cache,
BUZZ and H2O at 30%, H2O with shared selection at 30%, the key statistics, AdaKV over H2O, KeyDiff
and SnapKV at 30%), rank 0 first runs the single-process
reference with plain transformers, then every rank runs the same greedy generation through
``kvpolicy.deepspeed.init_inference``. Every rank writes its generated tokens and each layer's
kept positions (its local KV heads) to ``DIR``; the pytest process compares them.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from kvpolicy import FullCache, make_policy
from kvpolicy.deepspeed import init_inference, local_heads, weight_numel_per_rank
from kvpolicy.hf import EvictingCache, cache_kwargs
from kvpolicy_tools.models import load, tiny_llama

PROMPT = (
    "Read the notes and answer. "
    + " ".join(f"Note {i}: the crate in bay {i} holds {i * 7 % 13} blue boxes." for i in range(8))
    + " How many blue boxes are in bay 5?"
)


def cases(prompt_length: int, new_tokens: int) -> dict[str, object]:
    run = {"context_length": prompt_length + new_tokens, "prompt_length": prompt_length}
    return {
        "full": FullCache(),
        "buzz30": make_policy("buzz", 0.3, **run),
        "h2o30": make_policy("h2o", 0.3, **run),
        "h2o30shared": make_policy("h2o", 0.3, selection="shared", **run),
        "pyramid30": make_policy("pyramid_h2o", 0.3, **run),  # per-layer budgets (PyramidKV schedule)
        "knorm30": make_policy("knorm", 0.3, **run),  # scores from keys: no capture, each rank its heads
        "keydiff30": make_policy("keydiff", 0.3, **run),
        "ea30": make_policy("expected_attention", 0.3, **run),  # + each rank's own query heads' moments
        # head-wise budgets: one top-k over all of a layer's KV heads, each rank gathering the others' scores
        "adakv_h2o30": make_policy("adakv_h2o", 0.3, **run),
        "adakv_keydiff30": make_policy("adakv_keydiff", 0.3, **run),
        "adakv_snapkv30": make_policy("adakv_snapkv", 0.3, **run),
    }


def extra_cases(spec: str):
    """``FILE::FUNCTION`` -> the function (loaded from the file, which need not be importable)."""
    import importlib.util

    path, sep, function = spec.partition("::")
    if not sep:
        raise ValueError(f"--extra-cases takes FILE::FUNCTION, got {spec!r}")
    module_spec = importlib.util.spec_from_file_location("ds_extra_cases", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return getattr(module, function)


def build(name: str) -> tuple[torch.nn.Module, torch.Tensor, int]:
    """(model, prompt ids, new tokens)."""
    if name == "tiny":  # random weights: checks wiring and numerics, not language
        model = tiny_llama(num_layers=2, heads=8, kv_heads=4, head_dim=16, vocab=128, seed=0)
        return model, torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(1)), 16
    if name == "smollm2":  # real weights; AutoTP splits its 3 KV heads 2 + 1
        model, tok = load("smollm2-135m", dtype="float32")
        return model, tok(PROMPT, return_tensors="pt")["input_ids"], 10
    raise ValueError(name)


def positions(cache) -> list[np.ndarray]:
    return [layer.store.positions.cpu().numpy() for layer in cache.layers]


def save(path: Path, tokens: torch.Tensor, cache=None, **extra) -> None:
    arrays = {"tokens": tokens.cpu().numpy()}
    if cache is not None:
        arrays.update({f"layer{i}": p for i, p in enumerate(positions(cache))})
    np.savez(path, **arrays, **{k: np.asarray(v) for k, v in extra.items()})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--models", default="tiny,smollm2")
    ap.add_argument("--no-reference", action="store_true", help="skip the single-process reference (already written)")
    ap.add_argument("--extra-cases", default=None,
                    help="FILE::FUNCTION giving more cases, FUNCTION(prompt_length, new_tokens) -> {name: policy} "
                         "(a test file's own policies, e.g. tests/core/test_declared_score.py)")
    ap.add_argument("--only-extra", action="store_true", help="run the --extra-cases alone (no built-in case, no controls)")
    ap.add_argument("--local_rank", type=int, default=0)  # passed by the launcher
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    rank = int(os.environ.get("RANK", "0"))
    timings: dict[str, float] = {}

    for name in args.models.split(","):
        model, ids, new = build(name)
        policies = {} if args.only_extra else cases(ids.shape[1], new)
        if args.extra_cases:
            policies.update(extra_cases(args.extra_cases)(ids.shape[1], new))
        gen = {"max_new_tokens": new, "do_sample": False}
        if rank == 0 and not args.no_reference:  # the single-process reference, plain transformers
            reference_model = copy.deepcopy(model)
            t = time.perf_counter()
            with torch.no_grad():
                plain = reference_model.generate(ids, attention_mask=torch.ones_like(ids), **gen)
            save(out / f"{name}_plain.npz", plain)
            for case, policy in policies.items():
                cache = EvictingCache(policy, reference_model)
                with torch.no_grad():
                    toks = reference_model.generate(ids, attention_mask=torch.ones_like(ids), **cache_kwargs(reference_model, cache), **gen)
                save(out / f"{name}_{case}_ref.npz", toks, cache)
            timings[f"{name}_reference"] = time.perf_counter() - t
            del reference_model

        t = time.perf_counter()
        predicted = weight_numel_per_rank(model, args.tp)
        engine = init_inference(model, FullCache(), tp_size=args.tp, dtype=torch.float32, context_length=4096)
        assert engine.context_length == 4096  # (DeepSpeed's max_out_tokens)
        q, kv = local_heads(engine.module)
        shard = engine.shard
        actual_numel = sum(p.numel() for p in engine.module.parameters())
        for case, policy in policies.items():
            toks = engine.generate(ids, policy=policy, **gen)
            save(
                out / f"{name}_{case}_tp{args.tp}_rank{rank}.npz", toks, engine.last_cache,
                kv_start=shard.kv_start, kv_stop=shard.kv_stop,
            )  # fmt: skip
            if case == "h2o30shared" or case.startswith("adakv"):  # the gathered view agrees with the local one
                gathered = engine.last_cache.gather_positions()
                np.savez(out / f"{name}_{case}_tp{args.tp}_rank{rank}_gathered.npz",
                         **{f"layer{i}": g.numpy() for i, g in enumerate(gathered)})  # fmt: skip
        if args.only_extra:
            pass
        elif args.tp > 1:  # negative control: shared selection *without* the all-reduce
            cache = EvictingCache(policies["h2o30shared"], engine.module)
            with torch.no_grad():
                toks = engine.module.generate(ids, attention_mask=torch.ones_like(ids), **cache_kwargs(engine.module, cache), **gen)
            save(out / f"{name}_h2o30noreduce_tp{args.tp}_rank{rank}.npz", toks, cache)
            # negative control: AdaKV on each rank's own heads alone (no gather of the others' scores)
            cache = EvictingCache(policies["adakv_keydiff30"], engine.module)
            with torch.no_grad():
                toks = engine.module.generate(ids, attention_mask=torch.ones_like(ids), **cache_kwargs(engine.module, cache), **gen)
            save(out / f"{name}_adakv_keydiff30local_tp{args.tp}_rank{rank}.npz", toks, cache)
            # a batch of two under sharded head-wise budgets: refused alike on every rank (no rank left waiting)
            try:
                engine.generate(ids.repeat(2, 1), policy=policies["adakv_keydiff30"], **gen)
                refused = ""
            except ValueError as e:
                refused = str(e)
            (out / f"{name}_adakv_batch2_tp{args.tp}_rank{rank}.txt").write_text(refused)
        if not args.only_extra:  # engine.module.generate with a cache from make_cache (the do-it-yourself path)
            buzz = policies["buzz30"]
            cache = engine.make_cache(buzz)
            with torch.no_grad():
                toks = engine.module.generate(ids, attention_mask=torch.ones_like(ids), **cache_kwargs(engine.module, cache), **gen)
            save(out / f"{name}_buzz30module_tp{args.tp}_rank{rank}.npz", toks, cache,
                 kv_start=shard.kv_start, kv_stop=shard.kv_stop)  # fmt: skip
        timings[f"{name}_deepspeed"] = time.perf_counter() - t
        meta = {
            "local_q_heads": q, "local_kv_heads": kv,
            "shard": [shard.q_start, shard.q_stop, shard.kv_start, shard.kv_stop],
            "predicted_numel": predicted[rank], "actual_numel": actual_numel,
            "timings": timings,
        }  # fmt: skip
        (out / f"{name}_tp{args.tp}_rank{rank}.json").write_text(json.dumps(meta))
        print(f"[ds_worker rank {rank}] {name}: {meta}", flush=True)
    (out / f"done_tp{args.tp}_rank{rank}").write_text("ok")


if __name__ == "__main__":
    from kvpolicy.deepspeed import finish_distributed

    try:
        main()
    finally:
        finish_distributed()
