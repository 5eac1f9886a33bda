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
PRESSES = ("streaming_llm", "snapkv", "tova", "knorm", "keydiff", "expected_attention", "adakv_snapkv",
           "adakv_expected_attention")


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
        t = s.target
        rows.append({"id": s.id, "subtask": t["subtask"], "context_ids": s.input_ids[:n],
                     "question_ids": s.input_ids[n:], "answers": t["answers"], "metric": t["metric"],
                     "max_new_tokens": s.max_new_tokens, "context": t["context"], "question": t["question"],
                     "answer_prefix": t["answer_prefix"]})
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump({"flags": vars(args) | {"func": None}, "samples": rows}, fh)
    print(f"{len(rows)} samples -> {args.out}")
    return 0


def run(args: argparse.Namespace) -> int:
    """Step 2 (kvpress's venv): each sample through kvpress's own ``KVPressTextGenerationPipeline``,
    without a press and with each press at each ratio (``query_aware=False``: the question is not
    part of the compressed context). The pipeline is given the sample's text (context, question,
    answer prefix) and tokenises it itself; its token ids are checked against the ones kvpolicy
    fed (the export's), so both libraries run the same tokens."""
    import torch
    from kvpress import (
        AdaKVPress, ExpectedAttentionPress, KeyDiffPress, KnormPress, SnapKVPress, StreamingLLMPress, TOVAPress,
    )
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, pipeline
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    samples = json.load(open(args.samples_json, encoding="utf-8"))["samples"]
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    ratios = [float(r) for r in args.ratios.split(",")]
    make = {"streaming_llm": lambda r: StreamingLLMPress(compression_ratio=r),
            "snapkv": lambda r: SnapKVPress(compression_ratio=r),
            "tova": lambda r: TOVAPress(compression_ratio=r),
            "knorm": lambda r: KnormPress(compression_ratio=r),
            "keydiff": lambda r: KeyDiffPress(compression_ratio=r),
            "expected_attention": lambda r: ExpectedAttentionPress(compression_ratio=r),
            "adakv_snapkv": lambda r: AdaKVPress(SnapKVPress(compression_ratio=r)),
            "adakv_expected_attention": lambda r: AdaKVPress(ExpectedAttentionPress(compression_ratio=r))}
    unknown = sorted(set(args.presses.split(",")) - set(make))
    if unknown:
        raise SystemExit(f"--presses: unknown {unknown}; choose from {', '.join(make)}")
    configs = [("full", 0.0)] + [(p, r) for p in args.presses.split(",") for r in ratios]
    out: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for k, s in enumerate(samples):
        ids = pipe.preprocess(s["context"], [s["question"]], s["answer_prefix"], max_context_length=10**9)
        fed = (ids["context_ids"][0].tolist(), ids["questions_ids"][0][0].tolist())
        if fed != (s["context_ids"], s["question_ids"]):
            raise SystemExit(f"{s['id']}: kvpress's pipeline tokenises the sample differently from kvpolicy's export "
                             f"(context {len(fed[0])} vs {len(s['context_ids'])} ids, question {len(fed[1])} vs "
                             f"{len(s['question_ids'])}): not the same tokens, nothing to compare")
        for name, ratio in configs:
            cache = DynamicCache()
            press = None if name == "full" else make[name](ratio)
            with torch.no_grad():
                answer = pipe(s["context"], question=s["question"], answer_prefix=s["answer_prefix"], press=press,
                              max_new_tokens=s["max_new_tokens"], cache=cache)["answer"]
            # (the pipeline cuts the answer back out of the cache: what is left is the compressed context)
            kept = int(cache.layers[0].keys.shape[2])
            out.append({"id": s["id"], "subtask": s["subtask"], "press": name, "ratio": ratio, "kept_context": kept,
                        "context": len(s["context_ids"]), "text": answer})
        print(f"[{k + 1}/{len(samples)}] {s['id']} {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        _write(args.out, out, args.threads, time.perf_counter() - t0)  # after every sample: a cut run keeps its part
    print(f"{len(out)} outputs -> {args.out}")
    return 0


def _write(path: str, outputs: list[dict[str, Any]], threads: int, seconds: float) -> None:
    from importlib.metadata import version

    with open(path, "w", encoding="utf-8") as fh:
        json.dump({"kvpress": version("kvpress"), "threads": threads, "seconds": seconds, "outputs": outputs}, fh)


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
        same, total, differ = identical_answers(ours, outputs)
        print(f"\nThe same answer as kvpress's pipeline (text equal, per sample, method and ratio): {same} of {total}"
              + (f" ({100 * same / total:.1f}%)" if total else ""))
        for line in differ:
            print(f"- differs: {line}")
    return 0


def identical_answers(cells: list[dict[str, Any]], outputs: list[dict[str, Any]]) -> tuple[int, int, list[str]]:
    """``(same, total, differing)``: of the (sample, method, ratio) triples both runs have, how many
    answers are the same text; ``differing`` names the others (with both texts' starts). The
    ratio of a kvpolicy cell is ``1 - requested_budget`` (run with ``--ruler-protocol kvpress``).

    Example:
        >>> cells = [{"kind": "budget", "policy": "knorm", "requested_budget": 0.75, "samples": [{"id": "a", "text": "x"}]}]
        >>> identical_answers(cells, [{"id": "a", "press": "knorm", "ratio": 0.25, "text": "x"}])
        (1, 1, [])
    """
    theirs = {(o["id"], o["press"], round(float(o["ratio"]), 6)): o["text"] for o in outputs}
    same, total, differ = 0, 0, []
    for c in cells:
        if c["kind"] != "budget" or c["policy"] not in PRESSES:
            continue
        ratio = round(1 - c["requested_budget"], 6)
        for e in c["samples"]:
            other = theirs.get((e["id"], c["policy"], ratio))
            if other is None or "text" not in e:
                continue
            total += 1
            if e["text"] == other:
                same += 1
            else:
                differ.append(f"{e['id']} {c['policy']} {ratio:g}: kvpolicy {e['text'][:40]!r}, kvpress {other[:40]!r}")
    return same, total, differ


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
