"""The RULER samples of ``kvpolicy compare --tasks ruler`` through NVIDIA kvpress's presses (StreamingLLM,
SnapKV, TOVA, Knorm, KeyDiff, Expected Attention: the methods both libraries ship).

Three steps, two virtual environments (kvpolicy is not installed in kvpress's):

1. ``export`` (kvpolicy's venv): build the samples exactly as ``kvpolicy compare --tasks ruler``
   does with the same flags (same tokenizer, chat template, seed, length), and write each one's
   context ids (what is prefilled and compressed), question ids (the question, the template's end
   and the answer prefix), reference answers, metric and tokens to generate as JSON.
2. ``run`` (kvpress's venv, ``benchmarks/peers/setup_kvpress.sh``): for every sample, no press and
   each press at each compression ratio, as kvpress's ``KVPressTextGenerationPipeline`` does with
   ``query_aware=False``: the context is prefilled inside the press (compressed to ``1 - ratio``
   of its tokens), then the question is fed in one forward without compression and the answer is
   decoded greedily (positions continue after the full context) up to the sample's tokens or EOS.
   Writes the decoded outputs as JSON.
3. ``score`` (kvpolicy's venv): RULER's string match of every output, the mean per press and ratio
   and per subtask, next to a ``kvpolicy compare`` results.json of the same samples, with paired
   standard errors of the per-sample difference to the full cache.

Example (from the repository root; the model folder is ``kvpolicy_tools.models.cache_path()``)::

    PYTHONPATH=.:integrations .venv/bin/python benchmarks/peers/ruler_kvpress.py export \
        --out /tmp/ruler-samples.json --samples 2 --max-new-tokens 48 --ruler-length 1024 --data-dir ../shared/data
    .venv-kvpress/bin/python benchmarks/peers/ruler_kvpress.py run --samples-json /tmp/ruler-samples.json \
        --model-dir ~/.cache/kvpolicy/models/smollm2-135m --ratios 0.25,0.5,0.75 --out /tmp/ruler-kvpress.json
    PYTHONPATH=.:integrations .venv/bin/python benchmarks/peers/ruler_kvpress.py score \
        --outputs /tmp/ruler-kvpress.json --ours kvpolicy-report/results.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any

#: kvpress presses by the name of the kvpolicy policy that keeps the same tokens (docs/results.md, section 9)
PRESSES = ("streaming_llm", "snapkv", "tova", "knorm", "keydiff", "expected_attention")


def export(args: argparse.Namespace) -> int:
    """Step 1: the samples of ``kvpolicy compare --tasks ruler`` with these flags, as JSON."""
    from kvpolicy_tools.eval import compare
    from kvpolicy_tools.eval.tasks import DataSources, TaskOptions, TokenizerAdapter, make_tasks, task_registry
    from kvpolicy_tools.models import load

    parser = compare.build_parser()
    cargs = parser.parse_args(["--tasks", "ruler", "--samples", str(args.samples), "--max-new-tokens",
                               str(args.max_new_tokens), "--ruler-length", str(args.ruler_length), "--seed", str(args.seed)]
                              + (["--data-dir", args.data_dir] if args.data_dir else [])
                              + (["--ruler-subtasks", args.ruler_subtasks] if args.ruler_subtasks else []))
    opts = task_registry()["ruler"].options_from_args(cargs)
    sources = DataSources(data_dir=args.data_dir)
    task = make_tasks(["ruler"], TaskOptions(samples=args.samples, max_new_tokens=args.max_new_tokens, seed=args.seed),
                      sources, {"ruler": opts})[0]
    _, tokenizer = load("smollm2-135m", dtype="float32")
    rows = []
    for s in task.samples(TokenizerAdapter(tokenizer)):
        n = s.prompt_length - (s.question_length or 0)
        if not s.question_length:
            raise ValueError("export needs the question after the compression (--ruler-question after)")
        rows.append({"id": s.id, "subtask": s.target["subtask"], "context_ids": s.input_ids[:n],
                     "question_ids": s.input_ids[n:], "answers": s.target["answers"], "metric": s.target["metric"],
                     "max_new_tokens": s.max_new_tokens})
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump({"flags": vars(args) | {"func": None}, "samples": rows}, fh)
    print(f"{len(rows)} samples -> {args.out}")
    return 0


def run(args: argparse.Namespace) -> int:
    """Step 2 (kvpress's venv): each sample without a press and through each press and ratio."""
    import torch
    from kvpress import (
        ExpectedAttentionPress, KeyDiffPress, KnormPress, SnapKVPress, StreamingLLMPress, TOVAPress,
    )
    from transformers import AutoModelForCausalLM, DynamicCache
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    samples = json.load(open(args.samples_json, encoding="utf-8"))["samples"]
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    ratios = [float(r) for r in args.ratios.split(",")]
    make = {"streaming_llm": lambda r: StreamingLLMPress(compression_ratio=r),
            "snapkv": lambda r: SnapKVPress(compression_ratio=r),
            "tova": lambda r: TOVAPress(compression_ratio=r),
            "knorm": lambda r: KnormPress(compression_ratio=r),
            "keydiff": lambda r: KeyDiffPress(compression_ratio=r),
            "expected_attention": lambda r: ExpectedAttentionPress(compression_ratio=r)}
    configs = [("full", 0.0)] + [(p, r) for p in args.presses.split(",") for r in ratios]
    out: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for k, s in enumerate(samples):
        ctx = torch.tensor([s["context_ids"]])
        q = torch.tensor([s["question_ids"]])
        for name, ratio in configs:
            cache = DynamicCache()
            press = None if name == "full" else make[name](ratio)
            with torch.no_grad():
                if press is None:
                    model.model(input_ids=ctx, past_key_values=cache)
                else:
                    with press(model):
                        model.model(input_ids=ctx, past_key_values=cache)
                kept = int(cache.layers[0].keys.shape[2])
                pos = torch.arange(ctx.shape[1], ctx.shape[1] + q.shape[1])[None]
                logits = model(input_ids=q, past_key_values=cache, position_ids=pos, logits_to_keep=1).logits
                ids = [int(logits[0, -1].argmax())]
                nxt = pos[:, -1:] + 1
                for i in range(s["max_new_tokens"] - 1):
                    if ids[-1] in eos:
                        break
                    logits = model(input_ids=torch.tensor([[ids[-1]]]), past_key_values=cache, position_ids=nxt + i).logits
                    ids.append(int(logits[0, -1].argmax()))
            text = args_tokenizer_decode(args.model_dir, ids)
            out.append({"id": s["id"], "subtask": s["subtask"], "press": name, "ratio": ratio, "kept_context": kept,
                        "context": int(ctx.shape[1]), "text": text})
        print(f"[{k + 1}/{len(samples)}] {s['id']} {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        _write(args.out, out, args.threads, time.perf_counter() - t0)  # after every sample: a cut run keeps its part
    print(f"{len(out)} outputs -> {args.out}")
    return 0


def _write(path: str, outputs: list[dict[str, Any]], threads: int, seconds: float) -> None:
    from importlib.metadata import version

    with open(path, "w", encoding="utf-8") as fh:
        json.dump({"kvpress": version("kvpress"), "threads": threads, "seconds": seconds, "outputs": outputs}, fh)


_TOKENIZERS: dict[str, Any] = {}


def args_tokenizer_decode(model_dir: str, ids: list[int]) -> str:
    """Decode ``ids`` with the model folder's tokenizer (special tokens skipped, as both sides do)."""
    if model_dir not in _TOKENIZERS:
        from transformers import AutoTokenizer

        _TOKENIZERS[model_dir] = AutoTokenizer.from_pretrained(model_dir)
    return str(_TOKENIZERS[model_dir].decode(ids, skip_special_tokens=True))


def score(args: argparse.Namespace) -> int:
    """Step 3: RULER's string match per press and ratio (and subtask), beside kvpolicy's cells."""
    from kvpolicy_tools.eval import ruler_data as R

    samples = {s["id"]: s for s in json.load(open(args.samples_json, encoding="utf-8"))["samples"]}
    outputs = json.load(open(args.outputs, encoding="utf-8"))["outputs"]
    per: dict[tuple[str, float], dict[str, float]] = {}
    for o in outputs:
        s = samples[o["id"]]
        per.setdefault((o["press"], o["ratio"]), {})[o["id"]] = R.string_match(o["text"], s["answers"], s["metric"])
    full = per[("full", 0.0)]
    subtasks = list(dict.fromkeys(samples[k]["subtask"] for k in full))
    header = ["kvpress press", "ratio", "mean", "vs full (paired s.e.)"] + subtasks
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for (press, ratio), vals in per.items():
        mean = sum(vals.values()) / len(vals)
        d = [vals[k] - full[k] for k in vals]
        se = _se(d)
        gap = "-" if press == "full" else f"{100 * sum(d) / len(d):+.1f} ({100 * se:.1f})"
        subs = [100 * _mean([v for k, v in vals.items() if samples[k]["subtask"] == t]) for t in subtasks]
        lines.append("| " + " | ".join([press, f"{ratio:g}", f"{100 * mean:.1f}", gap] + [f"{x:.0f}" for x in subs]) + " |")
    print("\n".join(lines))
    if args.ours:
        ours = json.load(open(args.ours, encoding="utf-8"))["tasks"]["ruler"]["cells"]
        print("\nkvpolicy (the same samples), mean string match; paired s.e. of the difference to kvpress's press "
              "at the same ratio:")
        for c in ours:
            if c["kind"] != "budget" or c["policy"] not in PRESSES:
                continue
            ratio = round(1 - c["requested_budget"], 6)
            mine = {e["id"]: e["scores"]["string_match"] for e in c["samples"]}
            theirs = per.get((c["policy"], ratio))
            if theirs is None:
                continue
            both = [k for k in mine if k in theirs]  # a cut kvpress run covers a prefix of the samples
            d = [mine[k] - theirs[k] for k in both]
            print(f"- {c['policy']} ratio {ratio:g} ({len(both)} samples): kvpolicy {100 * _mean([mine[k] for k in both]):.1f} "
                  f"(realised budget {100 * c['realised_budget']:.1f}% over the whole run), kvpress "
                  f"{100 * _mean([theirs[k] for k in both]):.1f}; difference {100 * _mean(d):+.1f} (s.e. {100 * _se(d):.1f})")
    return 0


def _mean(x: list[float]) -> float:
    return sum(x) / len(x) if x else math.nan


def _se(d: list[float]) -> float:
    if len(d) < 2:
        return math.nan
    m = _mean(d)
    return math.sqrt(sum((v - m) ** 2 for v in d) / (len(d) - 1) / len(d))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ruler_kvpress.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="step", required=True)
    e = sub.add_parser("export", help="kvpolicy's venv: the samples as JSON")
    e.add_argument("--out", required=True)
    e.add_argument("--samples", type=int, default=2, help="samples per subtask (default %(default)s)")
    e.add_argument("--max-new-tokens", type=int, default=48)
    e.add_argument("--ruler-length", type=int, default=1024)
    e.add_argument("--ruler-subtasks", default=None)
    e.add_argument("--data-dir", default=None)
    e.add_argument("--seed", type=int, default=0)
    e.set_defaults(func=export)
    r = sub.add_parser("run", help="kvpress's venv: the outputs of each press and ratio")
    r.add_argument("--samples-json", required=True)
    r.add_argument("--model-dir", required=True)
    r.add_argument("--ratios", default="0.25,0.5,0.75")
    r.add_argument("--presses", default=",".join(PRESSES))
    r.add_argument("--threads", type=int, default=1)
    r.add_argument("--out", required=True)
    r.set_defaults(func=run)
    s = sub.add_parser("score", help="kvpolicy's venv: string match per press and ratio")
    s.add_argument("--samples-json", required=True)
    s.add_argument("--outputs", required=True)
    s.add_argument("--ours", default=None, help="a kvpolicy compare results.json of the same samples")
    s.set_defaults(func=score)
    args = p.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
