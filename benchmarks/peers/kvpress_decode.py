"""Decode speed of NVIDIA kvpress's presses: the peer side of ``benchmarks/peers/run_peers.py``.

Runs INSIDE the kvpress virtual environment (``benchmarks/peers/setup_kvpress.sh``: kvpress 0.5.5,
transformers 5.2, torch 2.13.0). It does not import kvpolicy (not installed there): the model is
read from a directory (the dequantized SmolLM2-135M float32 safetensors that
``kvpolicy_tools.models.load("smollm2-135m")`` writes into ``kvpolicy_tools.models.cache_path()``) and the
prompt from a JSON file of token ids, both given by the driver.

Candidates (each on its own copy of the model, so every press stays applied for the whole run,
as kvpress's own pipeline applies it; the copies are equally cold, a decode step streams all
weights anyway):

* ``DynamicCache``: no press, transformers' ``DynamicCache``: the reference of the ratios.
* ``StreamingLLMPress`` and ``KnormPress``: ``PrefillDecodingPress(prefilling_press=P(0.75),
  decoding_press=DecodingPress(P(), compression_interval=64, target_size=kept))``: the prompt is
  compressed to 25% at prefill (``kept = int(n * 0.25)``, kvpress's ``compute_n_kept``) and, during
  decoding, compressed back to ``kept`` tokens every 64 steps. ``hidden_states_buffer_size=0``:
  neither press scores with hidden states, so buffering them would only add work.

Method (as kvpolicy's own decode benchmark): one prefill per candidate (kvpress compresses inside
the prefill forward, so it cannot be shared), then greedy decoding; the candidates take turns
token by token in an order rotated at every step; a round is ``steps`` such sweeps; per round the
mean seconds per step of each candidate and its ratio to ``DynamicCache`` are recorded, and the
median over rounds is reported. float32, one torch thread (``--threads``).

With ``--serve`` it prefills, prints one JSON line (``{"ready": ...}``), then runs one round per
``round`` line read on stdin and answers with one JSON line each; ``quit`` (or end of input) prints
the summary line and exits. The driver uses this to alternate its own rounds with kvpress's in
one sitting. Without ``--serve`` it runs ``--rounds`` rounds and prints (or writes, ``--out``)
the summary.

Example (from the repository root)::

    .venv-kvpress/bin/python benchmarks/peers/kvpress_decode.py \
        --model-dir ~/.cache/kvpolicy/models/smollm2-135m --ids prompt.json --steps 64 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

from interleave import timed_round  # the script's folder is on sys.path: run as a script

#: Fraction of the prompt each press removes (0.75: 25% of the tokens kept).
COMPRESSION = 0.75
#: DecodingPress: compress back to the kept size every this many decode steps.
INTERVAL = 64


@dataclass
class Candidate:
    label: str
    model: Any
    press: Any  # None: no press
    cache: Any = None
    token: Any = None  # the next input token [1, 1]
    position: int = 0
    prefill_s: float = 0.0
    kept_after_prefill: int = 0


def kept_tokens(n: int, compression: float) -> int:
    """How many prompt tokens a kvpress ScorerPress keeps (``kvpress.utils.compute_n_kept``)."""
    return int(n * (1 - compression))


def build_press(name: str, n_prompt: int, compression: float, interval: int) -> Any:
    """A prefill press plus a DecodingPress of the same kind (see the module docstring)."""
    from kvpress import DecodingPress, KnormPress, PrefillDecodingPress, StreamingLLMPress

    cls = {"StreamingLLMPress": StreamingLLMPress, "KnormPress": KnormPress}[name]
    return PrefillDecodingPress(
        prefilling_press=cls(compression_ratio=compression),
        decoding_press=DecodingPress(
            base_press=cls(),
            compression_interval=interval,
            target_size=kept_tokens(n_prompt, compression),
            hidden_states_buffer_size=0,
        ),
    )


def load_model(model_dir: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a bar per load would bury the driver's log
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval()


def cache_length(cache: Any) -> int:
    return int(cache.layers[0].keys.shape[2])


def cache_bytes(cache: Any) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def prefill(cand: Candidate, ids: Any) -> None:
    """Prefill the prompt with the candidate's press applied; keep the greedy first token."""
    import torch
    from transformers import DynamicCache

    cand.cache = DynamicCache()
    start = time.perf_counter()
    with torch.no_grad():
        out = cand.model(input_ids=ids, past_key_values=cand.cache, use_cache=True, logits_to_keep=1)
    cand.prefill_s = time.perf_counter() - start
    cand.kept_after_prefill = cache_length(cand.cache)
    cand.token = out.logits[:, -1:].argmax(-1)
    cand.position = ids.shape[1]


def step(cand: Candidate) -> None:
    """One greedy decode step at the token's original position (as kvpress's pipeline does)."""
    import torch

    pos = torch.tensor([[cand.position]])
    with torch.no_grad():
        out = cand.model(input_ids=cand.token, past_key_values=cand.cache, position_ids=pos, use_cache=True)
    cand.token = out.logits[:, -1:].argmax(-1)
    cand.position += 1


class Bench:
    """The candidates, prefilled, with the presses applied (enter with ``with``)."""

    def __init__(self, model_dir: str, prompt: list[int], presses: list[str], *, compression: float, interval: int):
        import contextlib

        import torch

        self.ids = torch.tensor([prompt], dtype=torch.long)
        n = self.ids.shape[1]
        self.cands = [Candidate("DynamicCache", load_model(model_dir), None)]
        self.cands += [
            Candidate(p, load_model(model_dir), build_press(p, n, compression, interval)) for p in presses
        ]
        self.stack = contextlib.ExitStack()
        self.rounds_done = 0
        self.steps_done = 0

    def __enter__(self) -> "Bench":
        for c in self.cands:
            if c.press is not None:
                self.stack.enter_context(c.press(c.model))
            prefill(c, self.ids)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stack.close()

    def warmup(self, steps: int) -> None:
        for _ in range(steps):
            for c in self.cands:
                step(c)
        self.steps_done += steps

    def round(self, steps: int) -> dict[str, float]:
        """Seconds per step of every candidate over one round of ``steps`` interleaved sweeps."""
        seconds = timed_round(self.cands, steps, step, self.steps_done)
        self.steps_done += steps
        self.rounds_done += 1
        return {c.label: s for c, s in zip(self.cands, seconds)}

    def info(self) -> dict[str, Any]:
        import kvpress
        import torch
        import transformers

        return {
            "prompt_tokens": int(self.ids.shape[1]),
            "versions": {
                "kvpress": getattr(kvpress, "__version__", None) or _dist_version("kvpress"),
                "transformers": transformers.__version__,
                "torch": torch.__version__,
            },
            "threads": torch.get_num_threads(),
            "candidates": {
                c.label: {
                    "press": repr(c.press) if c.press is not None else None,
                    "prefill_s": c.prefill_s,
                    "kept_after_prefill": c.kept_after_prefill,
                    "kept": cache_length(c.cache),
                    "kv_bytes": cache_bytes(c.cache),
                }
                for c in self.cands
            },
        }


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def summarize(rounds: list[dict[str, float]], reference: str = "DynamicCache") -> dict[str, Any]:
    """Median ms/step and median per-round ratio to ``reference`` (> 1: faster than it)."""
    out: dict[str, Any] = {}
    for label in rounds[0]:
        ratios = [r[reference] / r[label] for r in rounds]
        out[label] = {
            "ms_per_step": statistics.median(r[label] for r in rounds) * 1e3,
            "ms_per_round": [r[label] * 1e3 for r in rounds],
            "ratio_vs_dynamic": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
        }
    return out


def emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", required=True, help="folder with config.json and *.safetensors")
    parser.add_argument("--ids", required=True, help="JSON file: the prompt's token ids, a list of ints")
    parser.add_argument("--steps", type=int, default=64, help="decode steps per candidate per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (without --serve)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed decode steps per candidate")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--compression", type=float, default=COMPRESSION, help="fraction removed")
    parser.add_argument("--interval", type=int, default=INTERVAL, help="DecodingPress compression_interval")
    parser.add_argument("--presses", default="StreamingLLMPress,KnormPress", help="comma-separated")
    parser.add_argument("--serve", action="store_true", help="one round per 'round' line on stdin")
    parser.add_argument("--out", help="write the summary JSON here (default: stdout)")
    args = parser.parse_args(argv)
    for name in ("steps", "rounds", "threads", "interval"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    if not 0.0 <= args.compression < 1.0:
        parser.error(f"--compression must be in [0, 1), got {args.compression}")

    import torch

    torch.set_num_threads(args.threads)
    with open(args.ids) as f:
        prompt = [int(t) for t in json.load(f)]
    presses = [p for p in args.presses.split(",") if p]

    rounds: list[dict[str, float]] = []
    with Bench(args.model_dir, prompt, presses, compression=args.compression, interval=args.interval) as bench:
        bench.warmup(args.warmup)
        if args.serve:
            emit({"ready": bench.info()})
            for line in sys.stdin:
                command = line.strip()
                if command == "round":
                    rounds.append(bench.round(args.steps))
                    emit({"round": rounds[-1]})
                elif command in ("quit", ""):
                    break
                else:
                    emit({"error": f"unknown command {command!r} (use 'round' or 'quit')"})
        else:
            for _ in range(args.rounds):
                rounds.append(bench.round(args.steps))
        summary = {
            "info": bench.info(),
            "steps": args.steps,
            "warmup": args.warmup,
            "interval": args.interval,
            "compression": args.compression,
            "rounds": rounds,
            "results": summarize(rounds) if rounds else {},
        }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)
    else:
        emit({"summary": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
