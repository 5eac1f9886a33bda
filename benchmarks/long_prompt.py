"""A long prompt's time to first token and peak memory, one candidate per process (issue 40).

    PYTHONPATH=.:integrations taskset -c 1 .venv/bin/python benchmarks/long_prompt.py \\
        --lengths 16384 32768 --candidates plain h2o streaming_llm --json long.json

Each candidate runs in a process of its own (this script starts them), so the process's peak
resident memory (``ru_maxrss``) is that candidate's: the model's weights, the activations of its
forwards and its cache. On the embedded SmolLM2-135M (fp32, one thread), the first ``n`` tokens of
a wikitext-2 prompt (:func:`prefill_time.prompt_ids`, the same text as ``prefill_time.py``):

* ``plain``: one forward of the whole prompt with a ``DynamicCache`` and transformers' SDPA (the
  full cache, the causal kernel);
* a policy name (planned for ``--budget`` of the prompt by :func:`kvpolicy.make_policy`; one that
  keeps every token, ``full``, at 1.0):
  :func:`kvpolicy.hf.greedy_decode` with one new token, which prefills a prompt longer than
  ``--chunk`` (default :data:`~kvpolicy.hf.PREFILL_CHUNK`, 512) in chunks of that many tokens
  through an ``EvictingCache`` that holds at most its storage plus one chunk (KVzip: the whole
  prompt until its context reconstruction, which ``greedy_decode`` runs after it and which the
  time includes).

Reported per candidate and length: the process CPU time of the prefill (one thread: its work,
not the time other jobs held the core) and its wall time, the peak resident memory of the
process, and the cache's peak bytes (``EvictingCache``: each layer's storage peak summed; plain:
its keys and values) against the full cache's keys and values.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def run_one(candidate: str, n: int, budget: float, chunk: int, text: Path) -> dict[str, Any]:
    """Prefill ``n`` prompt tokens with ``candidate`` in this process: its figures (see the module docstring)."""
    import torch
    from transformers import DynamicCache

    from kvpolicy import make_policy
    from kvpolicy.hf import EvictingCache, cache_kwargs, greedy_decode
    from kvpolicy_integrations.reconstruction import reconstruct, repeat_prompts
    from kvpolicy_tools.eval.tasks.base import is_reference
    from kvpolicy_tools.models import load
    from kvpolicy_tools.perf.decode import cache_bytes

    sys.path.insert(0, str(HERE))
    from prefill_time import prompt_ids

    torch.set_num_threads(1)
    model, tok = load()
    ids = prompt_ids(tok, text, n)
    # (a policy that keeps every token, `full`, is planned at 1.0: its row is the chunked prefill's
    # own cost, the cache the full one)
    planned = 1.0 if candidate != "plain" and is_reference(candidate) else budget
    start_cpu, start_wall = time.process_time(), time.perf_counter()
    with torch.inference_mode():
        if candidate == "plain":
            cache: Any = DynamicCache(config=model.config)
            model(input_ids=ids, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
        else:
            policy = make_policy(candidate, planned, context_length=n + 1, prompt_length=n)
            cache = EvictingCache(policy, model, prefill_chunk=chunk)
            after = None
            if policy.needs_reconstruction:  # (KVzip: its context reconstruction before the first token, as generate runs it)
                prompts = repeat_prompts(tok)
                after = lambda: reconstruct(model, cache, ids, prompts)  # noqa: E731
            greedy_decode(model, ids, cache, 1, prefill_chunk=chunk, after_prompt=after)
    cpu, wall = time.process_time() - start_cpu, time.perf_counter() - start_wall
    held, _ = cache_bytes(cache)
    if candidate == "plain":  # (the full cache: what it holds is its peak)
        peak = full_kv = held
    else:
        peak = sum(layer.store.peak_bytes for layer in cache.layers)
        full_kv = cache.full_kv_bytes()
    return {
        "candidate": candidate, "tokens": n, "budget": None if candidate == "plain" else planned,
        "chunk": None if candidate == "plain" else chunk, "cpu_seconds": cpu, "wall_seconds": wall,
        # ru_maxrss is in KiB on Linux
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "cache_peak_mib": peak / 2**20, "kv_held_mib": held / 2**20, "full_kv_mib": full_kv / 2**20,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768])
    ap.add_argument("--candidates", nargs="+", default=["plain", "h2o", "streaming_llm"],
                    help="'plain' (DynamicCache, one forward) or registered policy names (chunked prefill)")
    ap.add_argument("--budget", type=float, default=0.25)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--text", type=Path, default=HERE.parent.parent / "shared" / "data" / "wikitext-2-raw-test.txt")
    ap.add_argument("--json", type=Path, default=None, help="write the rows here")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # (a child: one candidate, one length)
    args = ap.parse_args()
    for name, value, low in (("lengths", min(args.lengths), 2), ("chunk", args.chunk, 1)):
        if value < low:
            raise ValueError(f"--{name} must be >= {low}, got {value}")
    if not 0 < args.budget <= 1:
        raise ValueError(f"--budget must be in (0, 1], got {args.budget}")
    if args.one:
        print(json.dumps(run_one(args.candidates[0], args.lengths[0], args.budget, args.chunk, args.text)))
        return
    rows = []
    for n in args.lengths:
        for candidate in args.candidates:
            cmd = [sys.executable, __file__, "--one", "--lengths", str(n), "--candidates", candidate,
                   "--budget", str(args.budget), "--chunk", str(args.chunk), "--text", str(args.text)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:  # (the child's own error, not only its exit status)
                raise RuntimeError(f"{candidate} at {n} tokens failed:\n{done.stderr[-4000:]}")
            out = done.stdout
            row = json.loads(out.strip().splitlines()[-1])
            rows.append(row)
            print(f"{n:>6} {candidate:>14}: {row['cpu_seconds']:8.1f} s CPU ({row['wall_seconds']:.1f} s wall), "
                  f"peak RSS {row['peak_rss_mib']:7.1f} MiB, cache peak {row['cache_peak_mib']:7.1f} MiB "
                  f"(full K+V {row['full_kv_mib']:.1f} MiB)", flush=True)
            if args.json is not None:
                args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
