"""Peer benchmark: kvpolicy's evicting caches against NVIDIA kvpress's presses, in one sitting.

For each prompt length ``N`` (``--contexts``) this driver (main ``.venv``, imports kvpolicy):

1. builds the prompt: the first ``N`` tokens of wikitext-2 (raw test, ``kvpolicy_tools.eval.data``)
   under the model's tokenizer, or seeded random ids (``--prompt random``, or a model without a
   tokenizer such as ``--model tiny``), and writes them to ``prompt-N.json``;
2. starts ``benchmarks/peers/kvpress_decode.py --serve`` in the kvpress virtual environment
   (``benchmarks/peers/setup_kvpress.sh``) on the same weights (the dequantized float32
   safetensors of ``kvpolicy_tools.models.load``, read from ``kvpolicy_tools.models.cache_path()``) and the
   same ids: kvpress prefills with its presses applied;
3. prefills our side once with ``DynamicCache`` and loads the prompt's keys and values into every
   candidate (``kvpolicy_tools.perf.decode.build_cache``: an evicting cache evicts once, with
   placeholder scores for the policies that read scores, so it holds exactly as many tokens as a
   real prefill would leave; decode speed depends on how many tokens are kept, not which);
4. alternates rounds: ours, theirs, ours, theirs, ... (``--rounds``), so machine load hits both
   sides alike. Within a round every candidate of a side decodes ``--steps`` greedy tokens, the
   candidates taking turns token by token in a rotated order; the ratio of each candidate to its
   own process's ``DynamicCache`` is taken per round and the median over rounds reported.

Our candidates (25% budget by default, ``--budget``; policies planned with
``kvpolicy.plan_policy(name, budget, context_length=N + S, prompt_length=N)``, ``S`` the decoded
tokens): transformers' ``DynamicCache`` (full), **the limit** (a ``DynamicCache`` holding only the
last ``round(N * budget)`` prompt tokens at their original positions, ``kvpolicy_tools.perf.decode``'s
``Candidate(keep_last=...)``: it attends to as many keys as a policy keeps and does no scoring and
no eviction), StreamingLLM, H2O, the local window and
BUZZ through ``EvictingCache``. kvpress's: ``DynamicCache`` (transformers 5.2), and
``StreamingLLMPress`` / ``KnormPress`` at ``compression_ratio = 1 - budget`` as prefill presses,
each combined with a ``DecodingPress`` of the same kind (``compression_interval`` 64) that brings
the cache back to the prefill's kept size every 64 decode steps.

``--steps`` defaults to 64 so that every kvpress round holds exactly one decode compression per
layer (a run shorter than 64 steps would never pay kvpress's decode compression).

Writes ``peers.json`` and ``peers.md`` (ms/step and ratios) into ``--out``. Without the kvpress
venv it prints why and exits 0 (``--ours-only`` measures our side alone).

Example (from the repository root)::

    benchmarks/peers/setup_kvpress.sh            # once: .venv-kvpress
    .venv/bin/python benchmarks/peers/run_peers.py --contexts 2048,4096   # uses this tree's kvpolicy
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # interleave.py, shared with kvpress's side
from interleave import timed_round  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
KVPRESS_SCRIPT = Path(__file__).resolve().with_name("kvpress_decode.py")
DEFAULT_VENV = ROOT / ".venv-kvpress"
DEFAULT_CONTEXTS = (512, 2048, 4096, 8192)
POLICIES = (("streaming_llm", "StreamingLLM"), ("h2o", "H2O"), ("local", "Local window"), ("buzz", "BUZZ"))
KVPRESS_PRESSES = ("StreamingLLMPress", "KnormPress")
INTERVAL = 64


def kvpress_python(venv: Path) -> Path | None:
    """The kvpress venv's interpreter, or ``None`` when the venv (or kvpress in it) is missing."""
    python = venv / "bin" / "python"
    if not python.is_file():
        return None
    found = subprocess.run([str(python), "-c", "import kvpress"], capture_output=True, text=True)
    return python if found.returncode == 0 else None


# ------------------------------------------------------------------------------------ prompt
def prompt_ids(tokenizer: Any, vocab: int, n: int, source: str, seed: int = 0) -> tuple[list[int], str]:
    """``n`` token ids and a description of where they come from.

    ``source="wikitext"``: the first ``n`` tokens of the wikitext-2 raw test articles joined by
    newlines (falls back to random ids, saying so, without a tokenizer or the data file).
    ``source="random"``: ``torch.randint(3, vocab)`` from a seeded generator, as
    ``kvpolicy_tools.perf.decode.prefill`` draws them.
    """
    import torch

    if source == "wikitext" and tokenizer is not None:
        from kvpolicy_tools.eval.data import load_wikitext

        try:
            docs = load_wikitext()
        except FileNotFoundError as exc:
            note = f"random ids (wikitext-2 not found: {exc})"
        else:
            ids = tokenizer("\n".join(d.text for d in docs), add_special_tokens=False)["input_ids"]
            if len(ids) >= n:
                return [int(t) for t in ids[:n]], f"wikitext-2 raw test, first {n} tokens"
            note = f"random ids (wikitext-2 has only {len(ids)} tokens)"
    else:
        note = "random ids" if source == "random" else "random ids (the model has no tokenizer)"
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(min(3, vocab - 1), vocab, (n,), generator=g)
    return [int(t) for t in ids], f"{note}, seed {seed}"


# ---------------------------------------------------------------------------------- our side
@dataclass(eq=False)
class Ours:
    """One of our candidates: its cache, next greedy token and position."""

    label: str
    cache: Any
    token: Any
    position: int
    capacity: int | None = None
    policy: str = "transformers.DynamicCache"


@dataclass
class OurSide:
    model: Any
    cands: list[Ours]
    prefill_s: float
    steps_done: int = 0
    kept_after_prefill: dict[str, float] = field(default_factory=dict)

    def step(self, cand: Ours) -> None:
        """One greedy decode step at the token's original position."""
        import torch

        from kvpolicy.hf import cache_kwargs
        from kvpolicy_tools.perf.decode import use_attention_for

        use_attention_for(self.model, cand.cache)
        pos = torch.tensor([[cand.position]])
        with torch.no_grad():
            out = self.model(
                input_ids=cand.token, **cache_kwargs(self.model, cand.cache), position_ids=pos, use_cache=True, logits_to_keep=1
            )
        cand.token = out.logits[:, -1:].argmax(-1)
        cand.position += 1

    def warmup(self, steps: int) -> None:
        for _ in range(steps):
            for c in self.cands:
                self.step(c)
        self.steps_done += steps

    def round(self, steps: int) -> dict[str, float]:
        """Seconds per step of every candidate over ``steps`` interleaved, rotated sweeps."""
        seconds = timed_round(self.cands, steps, self.step, self.steps_done)
        self.steps_done += steps
        return {c.label: s for c, s in zip(self.cands, seconds)}


def kept_tokens(cache: Any) -> float:
    """Mean kept tokens per layer of a ``DynamicCache`` or an ``EvictingCache``."""
    if hasattr(cache, "lengths"):
        lengths = cache.lengths()
        return sum(lengths) / len(lengths)
    return float(cache.layers[0].keys.shape[2])


def build_ours(model: Any, prompt: list[int], *, budget: float, decode_tokens: int) -> OurSide:
    """Prefill once, load every candidate (module docstring), first greedy token from the prefill."""
    import torch
    from transformers import DynamicCache

    from kvpolicy import plan_policy
    from kvpolicy.hf import cache_kwargs
    from kvpolicy_tools.perf.decode import Candidate, Prefill, build_cache

    n = len(prompt)
    ids = torch.tensor([prompt], dtype=torch.long)
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        full = DynamicCache(config=model.config)
        start = time.perf_counter()
        out = model(input_ids=ids, **cache_kwargs(model, full), use_cache=True, logits_to_keep=1)
        prefill_s = time.perf_counter() - start
        first = out.logits[:, -1:].argmax(-1)

    pre = Prefill([layer.keys for layer in full.layers], [layer.values for layer in full.layers], n, 1, prefill_s)
    # The limit: kvpolicy_tools.perf.decode's definition (a DynamicCache holding the last round(b x n)
    # prompt tokens, at their original positions), as in `kvpolicy bench --what decode`.
    limit = Candidate(f"limit {budget:.0%}", budget=budget, keep_last=max(1, round(budget * n)))
    cands = [Ours("DynamicCache", full, first, n), Ours(limit.label, build_cache(model, limit, pre), first.clone(), n)]
    for name, label in POLICIES:
        policy = plan_policy(name, budget, context_length=n + decode_tokens, prompt_length=n).policy
        cache = build_cache(model, Candidate(f"{label} {budget:.0%}", policy, budget), pre)
        cands.append(Ours(f"{label} {budget:.0%}", cache, first.clone(), n, policy.capacity, repr(policy)))
    del pre
    side = OurSide(model, cands, prefill_s)
    side.kept_after_prefill = {c.label: kept_tokens(c.cache) for c in cands}
    return side


# -------------------------------------------------------------------------------- their side
class Theirs:
    """``kvpress_decode.py --serve`` in the kvpress venv: one JSON line per command."""

    def __init__(self, python: Path, model_dir: Path, ids_file: Path, log: Path, args: argparse.Namespace):
        cmd = [
            str(python), str(KVPRESS_SCRIPT), "--serve", "--model-dir", str(model_dir), "--ids", str(ids_file),
            "--steps", str(args.steps), "--warmup", str(args.warmup), "--threads", str(args.threads),
            "--compression", str(1.0 - args.budget), "--interval", str(args.interval),
        ]
        self.command = cmd
        self.log = log
        self._log_file = open(log, "w")
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log_file, text=True, env=env
        )

    def _read(self, key: str) -> Any:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            self._log_file.flush()
            tail = self.log.read_text()[-3000:]
            raise RuntimeError(f"kvpress side exited ({self.proc.returncode}) before sending {key!r}:\n{tail}")
        msg = json.loads(line)
        if key not in msg:
            raise RuntimeError(f"kvpress side answered {msg!r}, expected {key!r}")
        return msg[key]

    def ready(self) -> dict[str, Any]:
        return self._read("ready")

    def send(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def round(self) -> dict[str, float]:
        self.send("round")
        return self._read("round")

    def finish(self) -> dict[str, Any]:
        self.send("quit")
        summary = self._read("summary")
        self.proc.wait()
        self._log_file.close()
        return summary

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log_file.close()


# ----------------------------------------------------------------------------------- results
def summarize(rounds: Sequence[dict[str, float]], reference: str) -> dict[str, dict[str, Any]]:
    """Median ms/step and median per-round ratio ``reference / candidate`` (> 1: faster)."""
    out = {}
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


def share_of_limit(rounds_limit: Sequence[float], rounds_cand: Sequence[float]) -> float:
    """Median over rounds of limit s/step over candidate s/step (1.0: as fast as the limit)."""
    return statistics.median(a / b for a, b in zip(rounds_limit, rounds_cand))


def measure_context(
    model: Any, tokenizer: Any, n: int, args: argparse.Namespace, python: Path | None, model_dir: Path | None
) -> dict[str, Any]:
    vocab = int(model.config.get_text_config().vocab_size)
    prompt, prompt_note = prompt_ids(tokenizer, vocab, n, args.prompt, seed=args.seed)
    out_dir = Path(args.out)
    ids_file = out_dir / f"prompt-{n}.json"
    ids_file.write_text(json.dumps(prompt))
    decode_tokens = args.warmup + args.rounds * args.steps

    theirs = None
    if python is not None and model_dir is not None:  # start first: its prefills overlap ours
        theirs = Theirs(python, model_dir, ids_file, out_dir / f"kvpress-{n}.log", args)
    try:
        say(f"[{n}] prefilling ({prompt_note})")
        ours = build_ours(model, prompt, budget=args.budget, decode_tokens=decode_tokens)
        ours.warmup(args.warmup)
        their_info = theirs.ready() if theirs is not None else None
        our_rounds: list[dict[str, float]] = []
        their_rounds: list[dict[str, float]] = []
        for r in range(args.rounds):
            start = time.perf_counter()
            our_rounds.append(ours.round(args.steps))
            if theirs is not None:
                their_rounds.append(theirs.round())
            say(f"[{n}] round {r + 1}/{args.rounds}: {time.perf_counter() - start:.0f} s")
        their_summary = theirs.finish() if theirs is not None else None
    except BaseException:
        if theirs is not None:
            theirs.kill()
        raise

    limit_label = ours.cands[1].label
    limit_rounds = [r[limit_label] for r in our_rounds]
    rows = []
    ours_summary = summarize(our_rounds, "DynamicCache")
    for c in ours.cands:
        s = ours_summary[c.label]
        rows.append({
            "side": "kvpolicy", "label": c.label, "policy": c.policy, "capacity": c.capacity,
            "kept_after_prefill": ours.kept_after_prefill[c.label], "kept_at_end": kept_tokens(c.cache),
            **s, "share_of_limit": share_of_limit(limit_rounds, [r[c.label] for r in our_rounds]),
        })
    if their_summary is not None:
        ready = their_info["candidates"]
        end = their_summary["info"]["candidates"]
        for label, s in summarize(their_rounds, "DynamicCache").items():
            rows.append({
                "side": "kvpress", "label": label, "policy": ready[label]["press"], "capacity": None,
                "kept_after_prefill": ready[label]["kept_after_prefill"], "kept_at_end": end[label]["kept"], **s,
                # the limit ran in the other process, in the round just before this one
                "share_of_limit": share_of_limit(limit_rounds, [r[label] for r in their_rounds]),
                "ratio_vs_our_dynamic": statistics.median(
                    o["DynamicCache"] / t[label] for o, t in zip(our_rounds, their_rounds)
                ),
            })
    return {
        "context": n,
        "prompt": prompt_note,
        "decode_tokens": decode_tokens,
        "prefill_s": {"kvpolicy DynamicCache": ours.prefill_s,
                      **({f"kvpress {k}": v["prefill_s"] for k, v in their_info["candidates"].items()}
                         if their_info else {})},
        "kvpress": {"command": theirs.command, "info": their_summary["info"]} if theirs is not None else None,
        "rows": rows,
        "rounds": {"kvpolicy": our_rounds, "kvpress": their_rounds},
    }


def markdown(report: dict[str, Any]) -> str:
    """One table per context: ms/step, ratio to the same process's DynamicCache, share of the limit."""
    lines = [
        "# Peers: kvpolicy against kvpress",
        "",
        f"Model {report['model']}, float32, {report['threads']} torch thread(s), batch 1, budget "
        f"{report['budget']:.0%}; {report['rounds']} rounds x {report['steps']} greedy decode steps per "
        f"candidate (+{report['warmup']} warm-up), rounds alternating kvpolicy / kvpress. "
        f"kvpolicy: torch {report['versions']['torch']}, transformers {report['versions']['transformers']}; "
        f"kvpress: {report.get('kvpress_versions') or 'not run'}.",
        "",
        "*x DynamicCache*: median over rounds of (that process's `DynamicCache` s/step) / (the "
        "candidate's), with the range over rounds; > 1 is faster. *share of the limit*: median over "
        "rounds of (the limit's s/step) / (the candidate's); for kvpress rows the limit ran in the "
        "other process, in the adjacent round.",
    ]
    for ctx in report["contexts"]:
        lines += [
            "",
            f"## {ctx['context']:,}-token prompt ({ctx['prompt']})",
            "",
            "| side | cache | kept (after prefill -> end) | ms/step | x DynamicCache | share of the limit |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for r in ctx["rows"]:
            kept = f"{r['kept_after_prefill']:.0f} -> {r['kept_at_end']:.0f}"
            ratio = f"{r['ratio_vs_dynamic']:.2f}x ({r['ratio_min']:.2f}-{r['ratio_max']:.2f})"
            lines.append(
                f"| {r['side']} | {r['label']} | {kept} | {r['ms_per_step']:.1f} | {ratio} | {r['share_of_limit']:.0%} |"
            )
    return "\n".join(lines) + "\n"


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def parse_contexts(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(v < 8 for v in values):
        raise argparse.ArgumentTypeError(f"--contexts must be comma-separated integers >= 8, got {text!r}")
    return values


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=parse_contexts, default=list(DEFAULT_CONTEXTS),
                        help="prompt lengths, comma-separated (default 512,2048,4096,8192)")
    parser.add_argument("--steps", type=int, default=INTERVAL, help="greedy decode steps per candidate per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per side, alternating")
    parser.add_argument("--warmup", type=int, default=2, help="untimed decode steps per candidate")
    parser.add_argument("--budget", type=float, default=0.25, help="kept fraction (kvpress: 1 - compression)")
    parser.add_argument("--interval", type=int, default=INTERVAL, help="kvpress DecodingPress compression_interval")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, both sides")
    parser.add_argument("--model", default="smollm2-135m", help="'smollm2-135m' (default) or 'tiny' (tests)")
    parser.add_argument("--prompt", choices=("wikitext", "random"), default="wikitext")
    parser.add_argument("--seed", type=int, default=0, help="seed of random prompt ids")
    parser.add_argument("--kvpress-venv", default=str(DEFAULT_VENV), help="the kvpress virtual environment")
    parser.add_argument("--ours-only", action="store_true", help="measure kvpolicy's side without kvpress")
    parser.add_argument("--out", default=str(ROOT / "bench-results" / "peers"), help="results folder")
    args = parser.parse_args(argv)
    for name in ("steps", "rounds", "threads", "interval"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    if not 0.0 < args.budget < 1.0:
        parser.error(f"--budget must be in (0, 1), got {args.budget}")

    for path in (ROOT / "integrations", ROOT):  # measure this tree's kvpolicy, whatever is installed
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))

    python = None
    if not args.ours_only:
        python = kvpress_python(Path(args.kvpress_venv))
        if python is None:
            say(f"skipped: no kvpress virtual environment at {args.kvpress_venv} "
                "(create it with benchmarks/peers/setup_kvpress.sh, or pass --ours-only)")
            return 0

    import torch
    import transformers

    import kvpolicy_tools.models as models

    torch.set_num_threads(args.threads)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.model == "tiny":
        model, tokenizer = models.tiny_llama(), None
        model_dir = out_dir / "tiny-model"
        if python is not None:
            model.save_pretrained(model_dir)
    else:
        model, tokenizer = models.load(args.model, dtype="float32")
        if args.model.lower() in models.EMBEDDED_ALIASES:
            model_dir = models.cache_path(models.EMBEDDED_MODEL)
        elif Path(args.model).is_dir():
            model_dir = Path(args.model)
        else:
            model_dir = None
            if python is not None:
                say(f"kvpress side skipped: {args.model!r} is neither the embedded model nor a local folder")
                python = None

    report: dict[str, Any] = {
        "model": args.model, "budget": args.budget, "steps": args.steps, "rounds": args.rounds,
        "warmup": args.warmup, "interval": args.interval, "threads": args.threads,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "load_at_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None},
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": [sys.executable, *sys.argv] if argv is None else ["run_peers.py", *argv],
        "contexts": [],
    }
    for n in args.contexts:
        report["contexts"].append(measure_context(model, tokenizer, n, args, python, model_dir))
        kp = report["contexts"][-1]["kvpress"]
        if kp is not None:
            report["kvpress_versions"] = ", ".join(f"{k} {v}" for k, v in kp["info"]["versions"].items())
        (out_dir / "peers.json").write_text(json.dumps(report, indent=2))  # after every context
        (out_dir / "peers.md").write_text(markdown(report))
    report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    (out_dir / "peers.json").write_text(json.dumps(report, indent=2))
    (out_dir / "peers.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
