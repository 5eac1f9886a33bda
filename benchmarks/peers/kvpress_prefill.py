"""Time to first token with NVIDIA kvpress's prefill presses: the peer side of
``benchmarks/prefill_time.py`` (docs/performance.md, section 8; issue 40).

Runs INSIDE the kvpress virtual environment (``benchmarks/peers/setup_kvpress.sh``: kvpress 0.5.5,
transformers 5.2, torch 2.13.0); it does not import kvpolicy. The model is the dequantized
SmolLM2-135M float32 folder that ``kvpolicy_tools.models.load("smollm2-135m")`` writes
(``kvpolicy_tools.models.cache_path()``, its tokenizer included), the prompt the first ``n``
tokens of the same wikitext-2 text as ``prefill_time.py`` (repeated if shorter), tokenised by
that folder's tokenizer: the same ids as kvpolicy's side.

For each prompt length, one forward of the whole prompt (``logits_to_keep=1``, as ``generate``
asks for the first token) with a plain ``DynamicCache`` and SDPA (``plain``), and with each press
applied (``with press(model):``, kvpress's own way: the press compresses each layer's cache inside
the forward, to ``int(n (1 - r))`` tokens at ``--compression`` ``r``). Runs are interleaved (plain,
every press, plain, ...), the fastest of ``--repeats`` kept, and each press's time is printed as a
ratio to the plain forward's; ``--clock process`` (default) times the process's CPU time (one
torch thread: the forward's work, not the time other jobs held the core).

Example (from the repository root)::

    .venv-kvpress/bin/python benchmarks/peers/kvpress_prefill.py \\
        --model-dir ~/.cache/kvpolicy/models/smollm2-135m --lengths 2048 --repeats 2 \\
        --presses snapkv,knorm,tova,streaming_llm,expected_attention,keydiff
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path
from typing import Any, Callable

DEFAULT_TEXT = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "wikitext-2-raw-test.txt"
#: kvpress's press for each kvpolicy registry name that keeps the same tokens after a prompt
#: (docs/results.md, section 9), with its defaults.
PRESSES = ("streaming_llm", "knorm", "keydiff", "snapkv", "tova", "expected_attention")
CLOCKS: dict[str, Callable[[], float]] = {"process": time.process_time, "wall": time.perf_counter}


def build_press(name: str, compression: float) -> Any:
    """kvpress's press for ``name`` (one of :data:`PRESSES`) at ``compression``."""
    if name not in PRESSES:
        raise ValueError(f"press must be one of {', '.join(PRESSES)}, got {name!r}")
    import kvpress

    classes = {"streaming_llm": kvpress.StreamingLLMPress, "knorm": kvpress.KnormPress, "keydiff": kvpress.KeyDiffPress,
               "snapkv": kvpress.SnapKVPress, "tova": kvpress.TOVAPress, "expected_attention": kvpress.ExpectedAttentionPress}
    return classes[name](compression_ratio=compression)


def prompt_ids(tokenizer: Any, path: Path, n: int) -> Any:
    """The first ``n`` tokens of the text at ``path`` (repeated if shorter), ``[1, n]``: what
    ``benchmarks/prefill_time.py`` feeds."""
    import torch

    ids = tokenizer(path.read_text(encoding="utf-8"), return_tensors="pt")["input_ids"][0]
    while ids.shape[0] < n:
        ids = torch.cat([ids, ids])
    return ids[:n][None]


def forward(model: Any, ids: Any, press: Any, clock: Callable[[], float]) -> tuple[float, int]:
    """Seconds of one prompt forward (with ``press`` applied, unless ``None``) and the tokens layer
    0 holds after it."""
    import contextlib

    import torch
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    t = clock()
    with torch.no_grad(), (press(model) if press is not None else contextlib.nullcontext()):
        model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    seconds = clock() - t
    return seconds, int(cache.layers[0].keys.shape[2])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", required=True, help="folder with config.json, *.safetensors and the tokenizer")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048])
    ap.add_argument("--presses", default=",".join(PRESSES), help="comma-separated, of " + ", ".join(PRESSES))
    ap.add_argument("--compression", type=float, default=0.75, help="kvpress's compression_ratio (0.75: 25%% kept)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="process")
    ap.add_argument("--plain", action=argparse.BooleanOptionalAction, default=True,
                    help="time the plain forward too (--no-plain: the presses alone, so the process's peak "
                         "resident memory is theirs; no ratios)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    if not 0.0 <= args.compression < 1.0:
        raise SystemExit(f"--compression must be in [0, 1), got {args.compression}")
    if args.repeats < 1 or args.threads < 1 or any(n < 1 for n in args.lengths):
        raise SystemExit("--repeats, --threads and --lengths must be >= 1")
    unknown = sorted(set(p for p in args.presses.split(",") if p) - set(PRESSES))
    if unknown:
        raise SystemExit(f"--presses: unknown {', '.join(unknown)}; choose among {', '.join(PRESSES)}")
    import kvpress
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # (a bar per load would bury the table)
    torch.set_num_threads(args.threads)
    clock = CLOCKS[args.clock]
    names = [p for p in args.presses.split(",") if p]
    presses = {name: build_press(name, args.compression) for name in names}
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    results: dict[str, Any] = {"kvpress": kvpress.__version__ if hasattr(kvpress, "__version__") else None,
                               "threads": args.threads, "compression": args.compression, "clock": args.clock,
                               "load": os.getloadavg(), "rows": []}
    print(f"load average {os.getloadavg()}, {args.threads} thread(s), best of {args.repeats}, {args.clock} time, "
          f"compression_ratio {args.compression}")
    print("| prompt | plain | " + " | ".join(names) + " |")
    print("|---:|---:|" + "---:|" * len(names))
    for n in args.lengths:
        ids = prompt_ids(tokenizer, args.text, n)
        forward(model, ids[:, :256], None, clock)  # (warm-up)
        times: dict[str, list[float]] = {k: [] for k in (["plain"] if args.plain else []) + names}
        kept: dict[str, int] = {}
        for _ in range(args.repeats):
            for name in times:
                seconds, kept[name] = forward(model, ids, presses.get(name), clock)
                times[name].append(seconds)
        best = {k: min(v) for k, v in times.items()}
        # ru_maxrss (KiB on Linux): the process's peak so far, the model and every forward before included
        peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        ratio = {k: best[k] / best["plain"] for k in best} if args.plain else None
        results["rows"].append({"prompt": n, "seconds": best, "ratio": ratio, "kept_layer0": kept,
                                "peak_rss_mib": peak_rss})
        cells = [f"{best[k] / best['plain']:.2f}x" if args.plain else f"{best[k]:.2f} s" for k in names]
        plain = f"{best['plain']:.2f} s" if args.plain else "-"
        print(f"| {n} | {plain} | " + " | ".join(cells) + f" |  (peak RSS {peak_rss:.0f} MiB)", flush=True)
    results["load_after"] = os.getloadavg()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
