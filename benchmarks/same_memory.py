"""How many sequences a policy decodes in the KV memory of a few full caches, and how fast (issue 43).

    PYTHONPATH=.:integrations taskset -c 0 .venv/bin/python benchmarks/same_memory.py \\
        --policy h2o --budget 0.25 --prompt 512 --steps 32 --full-batch 2 --json same-memory.json

On the embedded SmolLM2-135M (fp32, one thread), ``--full-batch`` wikitext-2 prompts of ``--prompt``
tokens each (consecutive segments of the text, :func:`prefill_time.prompt_ids`) are prefilled in one
forward and decoded greedily for ``--steps`` tokens with a plain ``DynamicCache``: the KV bytes it
holds at the end (``prompt + steps`` tokens a sequence) are the memory budget. The policy (planned by
:func:`kvpolicy.make_policy` for ``--budget`` of the prompt) then decodes one sequence the same way,
the bytes its ``EvictingCache`` allocates after the decode (every layer's storage: keys, values,
positions, scores, bias and spare slots) being what a sequence costs (the one-shot prompt's transient
peak, :attr:`~kvpolicy_torch.LayerCache.peak_bytes`, is reported beside it); as many sequences as fit
in the budget decode as one batch, whose allocated and held bytes are reported beside the budget. Reported: the sequences that fit, the bytes, and the decode throughput (tokens a second of
process CPU time, all sequences together) of the policy's batch over the full caches' batch.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def decode_batch(model: Any, ids: Any, cache: Any, steps: int) -> float:
    """Prefill ``ids`` ``[batch, prompt]`` in one forward, then ``steps`` greedy tokens a row;
    returns the decode's process CPU seconds (the prefill left out)."""
    import torch

    from kvpolicy.hf import cache_kwargs

    b, n = ids.shape
    with torch.inference_mode():
        out = model(input_ids=ids, **cache_kwargs(model, cache), position_ids=torch.arange(n)[None].expand(b, n),
                    use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1:].argmax(-1)
        start = time.process_time()
        for t in range(steps):
            pos = torch.full((b, 1), n + t, dtype=torch.long)
            out = model(input_ids=token, **cache_kwargs(model, cache), position_ids=pos, use_cache=True, logits_to_keep=1)
            token = out.logits[:, -1:].argmax(-1)
    return time.process_time() - start


def run(policy_name: str, budget: float, prompt: int, steps: int, full_batch: int, text: Path,
        max_batch: int = 64) -> dict[str, Any]:
    """The figures of the module docstring, as a dict."""
    import torch
    from transformers import DynamicCache

    from kvpolicy import make_policy
    from kvpolicy.hf import EvictingCache
    from kvpolicy_tools.models import load
    from kvpolicy_tools.perf.decode import cache_bytes

    sys.path.insert(0, str(HERE))
    from prefill_time import prompt_ids

    torch.set_num_threads(1)
    model, tok = load()
    ids = prompt_ids(tok, text, prompt * max_batch).view(max_batch, prompt)  # consecutive segments of the text

    full = DynamicCache(config=model.config)
    full_seconds = decode_batch(model, ids[:full_batch], full, steps)
    memory, _ = cache_bytes(full)

    policy = make_policy(policy_name, budget, context_length=prompt + steps, prompt_length=prompt)

    one = EvictingCache(policy, model)
    decode_batch(model, ids[:1], one, steps)
    _, per_sequence = cache_bytes(one)
    prompt_peak = sum(layer.store.peak_bytes for layer in one.layers)
    fits = min(max_batch, memory // per_sequence)
    if fits < 1:
        raise ValueError(f"one sequence of {policy_name} allocates {per_sequence} bytes, over the budget of {memory}")
    batch = EvictingCache(policy, model)
    seconds = decode_batch(model, ids[:fits], batch, steps)
    held, allocated = cache_bytes(batch)
    return {
        "policy": policy_name, "budget": budget, "prompt": prompt, "steps": steps, "full_batch": full_batch,
        "memory_bytes": memory, "per_sequence_bytes": per_sequence, "sequences": fits,
        "batch_allocated_bytes": allocated, "batch_held_bytes": held, "prompt_peak_bytes": prompt_peak,
        "full_tokens_per_second": full_batch * steps / full_seconds, "tokens_per_second": fits * steps / seconds,
        "throughput_ratio": (fits * steps / seconds) / (full_batch * steps / full_seconds),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="h2o")
    ap.add_argument("--budget", type=float, default=0.25)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--full-batch", type=int, default=2, help="full caches whose KV memory is the budget")
    ap.add_argument("--text", type=Path, default=HERE.parent.parent / "shared" / "data" / "wikitext-2-raw-test.txt")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    for name, value, low in (("prompt", args.prompt, 2), ("steps", args.steps, 1), ("full-batch", args.full_batch, 1)):
        if value < low:
            raise ValueError(f"--{name} must be >= {low}, got {value}")
    if not 0 < args.budget <= 1:
        raise ValueError(f"--budget must be in (0, 1], got {args.budget}")
    row = run(args.policy, args.budget, args.prompt, args.steps, args.full_batch, args.text)
    mib = 2**20
    print(f"{args.full_batch} full caches of {args.prompt + args.steps} tokens: {row['memory_bytes'] / mib:.1f} MiB of KV; "
          f"{args.policy} {args.budget:.0%}: {row['per_sequence_bytes'] / mib:.2f} MiB allocated a sequence, "
          f"{row['sequences']} sequences fit (their batch allocates {row['batch_allocated_bytes'] / mib:.1f} MiB, "
          f"holds {row['batch_held_bytes'] / mib:.1f}); "
          f"decode {row['tokens_per_second']:.1f} tokens/s against {row['full_tokens_per_second']:.1f}: "
          f"{row['throughput_ratio']:.2f}x")
    if args.json is not None:
        args.json.write_text(json.dumps(row, indent=1))
    return row


if __name__ == "__main__":
    main()
