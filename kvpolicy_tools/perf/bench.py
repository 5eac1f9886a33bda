"""``kvpolicy bench``: the CPU benchmarks, with a progress bar, written as Markdown and PNG plots.

Three parts (``--what``, default all):

* ``complexity``: the cost of one eviction and the amortised eviction cost per decoded token,
  against the cache size, every built-in policy, torch and NumPy backends
  (:mod:`kvpolicy_tools.perf.eviction`); log-log slopes are fitted per series.
* ``decode``: tokens/s and cache bytes of the model (default: the embedded SmolLM2-135M) for
  transformers' ``DynamicCache``, kvpolicy's ``FullCache``, a capture-only cache and the
  policies at each budget, measured interleaved; ratios to ``DynamicCache`` are taken within a
  round (:mod:`kvpolicy_tools.perf.decode`).
* ``breakdown``: where a decode step's time goes (attention, score product, accumulation,
  eviction, cache update, the rest of the model).
* ``prefill`` (not in the default set): the time to first token, a prompt's prefill through each
  policy's cache in one forward and in chunks of :data:`kvpolicy.hf.PREFILL_CHUNK` tokens against
  a plain ``DynamicCache`` one, with each cache's peak bytes, at each context and the budget
  nearest 25% (:mod:`kvpolicy_tools.perf.prefill`).

Output (``--out``, default ``bench-results``): ``report.md`` (tables, slopes, machine, command),
``results.json`` (every number) and PNG plots.

Policies (``--policy``, repeatable) are registry names, ``all`` (every registered policy that
evicts during decode, :func:`decoding_policy_names`), or ``package.module:Factory`` for a
third-party policy: an :class:`~kvpolicy.EvictionPolicy` subclass (or registry preset) with
``from_size`` is planned per budget like the built-ins; a policy *instance* is measured as is; any
other callable is called as ``Factory(budget=..., context_length=..., prompt_length=...)`` and
must return a policy. Third-party policies take part in ``decode`` and ``breakdown``; in
``complexity`` the built-ins are measured as always, and each other ``--policy`` that is a size
factory (a registered name outside the built-ins' table such as ``knorm``, or a
``package.module:Factory`` class or preset with ``from_size``, or a function of the cache size)
is timed by :func:`kvpolicy.testing.benchmark_policy` (its own table and
``complexity_<name>.png``); one that is not is named in the report with the reason.

This module imports only the standard library at import time (the CLI stays light).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import itertools
import json
import math
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from kvpolicy.budget import plan_policy
from kvpolicy.policy import EvictionPolicy
from kvpolicy.registry import Preset, available_policies, normalize_name
from kvpolicy.testing.timing import bench_report, bench_specs, bench_steps
from kvpolicy_tools.command import run_command
from kvpolicy_tools.perf.eviction import POLICIES, measure_complexity
from kvpolicy_tools.perf.report import machine, machine_line, markdown_table, plot_breakdown, plot_complexity, plot_decode, slopes

__all__ = ["add_arguments", "decoding_policy_names", "resolve_policy", "run"]

QUICK = {
    "sizes": "256,1024,4096",
    "configs": "1x8",
    "rounds": 3,
    "contexts": "512,1024",
    "budgets": "0.25",
    "steps": 4,
    "decode_rounds": 3,
}
FULL = {
    "sizes": ",".join(str(2**k) for k in range(8, 17)),
    "configs": "1x8,1x32,8x8,8x32",
    "rounds": 5,
    "contexts": "512,1024,2048,4096,8192",
    "budgets": "0.1,0.25,0.5",
    "steps": 8,
    "decode_rounds": 3,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``kvpolicy bench``."""
    parser.add_argument("--quick", action="store_true", help="small sizes, few rounds, short contexts (minutes)")
    parser.add_argument("--what", default="complexity,decode,breakdown", help="comma-separated parts to run (default: all three)")
    parser.add_argument("--out", type=Path, default=Path("bench-results"), help="output folder (default bench-results)")
    g = parser.add_argument_group("eviction complexity")
    g.add_argument("--sizes", default=None, help=f"cache sizes (default {FULL['sizes']}; quick {QUICK['sizes']})")
    g.add_argument("--configs", default=None, help=f"BATCHxHEADS list (default {FULL['configs']}; quick {QUICK['configs']})")
    g.add_argument("--rounds", type=int, default=None, help="timed rounds per point (default 5; quick 3)")
    g.add_argument("--backends", default="torch,numpy", help="torch,numpy (default both)")
    g.add_argument("--max-token-heads", type=int, default=2**21, help="skip torch points above batch*heads*size (default 2**21)")
    g = parser.add_argument_group("decode and breakdown")
    g.add_argument("--model", default="smollm2-135m", help="model for kvpolicy_tools.models.load (default the embedded smollm2-135m; tiny-llama: a 2-layer random model)")
    g.add_argument("--contexts", default=None, help=f"prompt lengths (default {FULL['contexts']}; quick {QUICK['contexts']})")
    g.add_argument("--budgets", default=None, help=f"budgets (default {FULL['budgets']}; quick {QUICK['budgets']})")
    g.add_argument(
        "--policy",
        action="append",
        default=None,
        metavar="NAME|MODULE:FACTORY",
        help="policy to measure (repeatable; default streaming_llm, h2o, buzz); 'all': every registered policy that "
        "evicts during decode; MODULE:FACTORY loads a third-party policy",
    )
    g.add_argument("--steps", type=int, default=None, help="decode steps per candidate per round (default 8; quick 4)")
    g.add_argument("--decode-rounds", type=int, default=None, help="interleaved rounds (default 3)")
    g.add_argument("--breakdown-contexts", default=None, help="contexts of the breakdown (default: the smallest and largest)")
    g.add_argument("--no-unfused", action="store_true", help="do not add the fused_decode=False variants (the before/after of the fused path)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's; use 1 on a shared machine)")
    parser.add_argument("--shared", choices=("yes", "no", "auto"), default="auto", help="record the machine as shared with other jobs (default: from the load average)")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


# ----------------------------------------------------------------------------------- helpers
def _ints(text: str, flag: str, minimum: int = 1) -> list[int]:
    """The comma-separated integers of ``flag``, each ``>= minimum``; an empty value is an error
    (it would have run the defaults, or nothing, without a word)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} expects comma-separated integers, got {text!r}") from None
    if not values:
        raise ValueError(f"{flag} is empty: give comma-separated integers >= {minimum}, or leave {flag} out for the default")
    low = [v for v in values if v < minimum]
    if low:
        raise ValueError(f"{flag} values must be >= {minimum}, got {low[0]} in {text!r}")
    return values


def _floats(text: str, flag: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} expects comma-separated numbers, got {text!r}") from None
    if not values:
        raise ValueError(f"{flag} is empty: give comma-separated numbers, or leave {flag} out for the default")
    return values


def _configs(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        b, sep, h = item.strip().lower().partition("x")
        if not sep or not b.isdigit() or not h.isdigit():
            raise ValueError(f"--configs are BATCHxHEADS, e.g. 1x8,8x32; got {item!r}")
        if int(b) < 1 or int(h) < 1:
            raise ValueError(f"--configs: batch and KV heads must be >= 1, got {item.strip()!r}")
        out.append((int(b), int(h)))
    return out


def decoding_policy_names() -> list[str]:
    """Every registered policy that evicts during decode (``--policy all``): the names whose policy,
    planned from a budget alone (25% of a 1,024-token prompt and 256 decoded tokens), holds a
    bounded cache. Left out: the full cache, the prompt-only compressions (SnapKV, PyramidKV,
    AdaKV over SnapKV, KVzip and its head-wise preset: unbounded during decode) and the generic names that plan only with a
    scorer or base named (``adakv``, ``compose``, ``pyramid``: their presets stand for them).
    Third-party policies registered by the time of the call are included by the same rule.

    Example:
        >>> names = decoding_policy_names()
        >>> "expected_attention" in names and "adakv_expected_attention" in names, "snapkv" in names, "full" in names
        (True, False, False)
    """
    names = []
    for name, entry in available_policies().items():
        try:
            policy = plan_policy(entry, 0.25, context_length=1024 + 256, prompt_length=1024).policy
        except ValueError:  # (needs a scorer or base named, or a budget of 1: see above)
            continue
        if policy.capacity is not None:
            names.append(name)
    return names


def resolve_policy(spec: str) -> Any:
    """A :class:`kvpolicy_tools.perf.decode.PolicySpec` for a registry name or ``module:Factory``."""
    from .decode import PolicySpec  # here: decode needs torch and transformers (the hf extra); every verb's parser imports this module

    if ":" not in spec:
        return PolicySpec.named(spec)
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import {module_name!r} for --policy {spec!r}: {e}") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{module_name!r} has no attribute {attr!r} (--policy {spec!r})")
        obj = getattr(obj, part)
    label = getattr(obj, "__name__", None) or type(obj).__name__
    if isinstance(obj, EvictionPolicy):
        return PolicySpec(repr(obj), lambda b, L, P, _p=obj: _p, budgeted=False)
    if isinstance(obj, Preset) or (isinstance(obj, type) and issubclass(obj, EvictionPolicy)):
        def planner(b: float | None, L: int, P: int, _e: Any = obj) -> Any:
            return plan_policy(_e, b, context_length=L, prompt_length=P).policy

        return PolicySpec(label, planner)
    if callable(obj):
        plans = _takes_keywords(obj) is not False  # (read once; a size factory is refused only when decode calls it)

        def call(b: float | None, L: int, P: int, _f: Any = obj) -> Any:
            if not plans:
                raise ValueError(
                    f"--policy {spec!r} takes no budget=, context_length=, prompt_length= (a factory of the cache "
                    "size serves --what complexity only): the decode benchmark plans a policy per budget and run"
                )
            policy = _f(budget=b, context_length=L, prompt_length=P)
            if not isinstance(policy, EvictionPolicy):
                raise ValueError(f"--policy {spec!r} returned {policy!r}, not an EvictionPolicy")
            return policy

        return PolicySpec(label, call)
    raise ValueError(f"--policy {spec!r} is neither an EvictionPolicy (class or instance) nor a factory")


def _takes_keywords(f: Any) -> bool | None:
    """Whether ``f`` accepts ``budget=``, ``context_length=`` and ``prompt_length=`` (``None``:
    its signature cannot be read)."""
    try:
        inspect.signature(f).bind(budget=None, context_length=1, prompt_length=0)
    except TypeError:
        return False
    except ValueError:
        return None
    return True


class _Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        self.bar = None
        if enabled:
            try:
                from tqdm.auto import tqdm  # optional: the eval extra (a progress bar)

                self.bar = tqdm(total=total, unit="step", dynamic_ncols=True, file=sys.stderr)
            except ImportError:  # pragma: no cover - tqdm is in the hf extra
                self.bar = None

    def __call__(self, label: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(label[:40], refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _fmt_us(seconds: float | None) -> str:
    if seconds is None or math.isnan(seconds):
        return "-"
    us = seconds * 1e6
    return f"{us:,.0f}" if us >= 100 else f"{us:.1f}"


def _fmt_slope(x: float) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{x:.2f}"


# ----------------------------------------------------------------------------------- parts
def _complexity(args: argparse.Namespace, progress: _Progress, sizes: list[int], configs: list[tuple[int, int]], rounds: int) -> dict[str, Any]:
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    rows = measure_complexity(
        sizes, configs, backends=backends, rounds=rounds, max_token_heads=args.max_token_heads, on_progress=progress
    )
    return {"rows": rows, "sizes": sizes, "configs": configs, "rounds": rounds, "backends": backends}


def _complexity_report(data: dict[str, Any], out: Path, plots: bool) -> list[str]:
    rows = data["rows"]
    big = [r for r in rows if r["size"] >= 4096]
    s_one, s_tok = slopes(rows, "one_eviction_s"), slopes(rows, "per_token_s")
    b_one, b_tok = slopes(big, "one_eviction_s"), slopes(big, "per_token_s")
    lines = ["### Log-log slopes (cost ~ size^k)", ""]
    table = []
    for key in s_one:
        backend, policy, batch, heads = key
        table.append(
            [backend, policy, batch, heads, _fmt_slope(s_one[key][0]), _fmt_slope(b_one.get(key, (math.nan, 0))[0]),
             _fmt_slope(s_tok.get(key, (math.nan, 0))[0]), _fmt_slope(b_tok.get(key, (math.nan, 0))[0]),
             f"{min(r['size'] for r in rows if (r['backend'], r['policy'], r['batch'], r['heads']) == key)}-"
             f"{max(r['size'] for r in rows if (r['backend'], r['policy'], r['batch'], r['heads']) == key)}"]
        )
    lines.append(markdown_table(
        ["backend", "policy", "batch", "KV heads", "one eviction k", "k (sizes >= 4096)", "per token k", "k (sizes >= 4096)", "sizes"],
        table, "lllrrrrrl"))
    lines.append("")
    for batch, heads in data["configs"]:
        sub = [r for r in rows if r["batch"] == batch and r["heads"] == heads]
        if not sub:
            continue
        lines += [f"### Microseconds, batch {batch}, {heads} KV heads, head_dim 64, float32", ""]
        sizes = sorted({r["size"] for r in sub})
        table = []
        for backend in data["backends"]:
            for policy in POLICIES:  # every measured policy, in kvpolicy_tools.perf.eviction's order
                for measure, name in (("one_eviction_s", "one eviction"), ("per_token_s", "per token")):
                    vals = {r["size"]: r[measure] for r in sub if r["backend"] == backend and r["policy"] == policy}
                    if vals:
                        table.append([backend, policy, name] + [_fmt_us(vals.get(s)) for s in sizes])
        lines.append(markdown_table(["backend", "policy", "measure"] + [f"{s:,}" for s in sizes], table, "lll" + "r" * len(sizes)))
        lines.append("")
        if plots:
            path = plot_complexity(rows, out / f"complexity_b{batch}_h{heads}.png", batch=batch, heads=heads)
            lines += [f"![eviction cost, batch {batch}, {heads} heads]({path.name})", ""]
    return lines


#: Untimed decode steps before the timed ones, and the breakdown's rounds.
_WARMUP = 2
_BREAKDOWN_ROUNDS = 2


def _decode_plan(
    args: argparse.Namespace,
    contexts: list[int],
    budgets: list[float],
    specs: list[Any],
    steps: int,
    rounds: int,
    breakdown_contexts: list[int],
    what: set[str],
) -> dict[int, tuple[list[Any], list[Any]]]:
    """Per context: the candidates the decode part times, and those the breakdown times (empty
    where it does not run there). Built once, before the run: the progress bar counts them."""
    # here: decode needs torch and transformers (the hf extra); every verb's parser imports this module
    from .decode import Candidate, standard_candidates

    plan = {}
    for ctx in contexts:
        tokens = _WARMUP + rounds * steps + _WARMUP + _BREAKDOWN_ROUNDS * steps  # decode + breakdown tokens
        cands = standard_candidates(ctx, tokens, policies=specs, budgets=budgets)
        if not args.no_unfused:
            unfused = [c for c in cands if c.label == "capture only" or (c.label.startswith("BUZZ ") and c.budget == 0.25)]
            cands += [Candidate(f"{c.label} (unfused)", c.policy, c.budget, {"fused_decode": False}) for c in unfused]
        sub = []
        if "breakdown" in what and ctx in breakdown_contexts:
            keep = {"DynamicCache", "FullCache", "capture only", "capture only (unfused)", "StreamingLLM 25%", "H2O 25%", "BUZZ 25%", "BUZZ 25% (unfused)"}
            sub = [c for c in cands if c.label in keep or (c.budget == 0.25 and c.label.split(" ")[0] not in ("StreamingLLM", "H2O", "BUZZ"))]
        plan[ctx] = (cands, sub)
    return plan


def _decode(
    args: argparse.Namespace,
    progress: _Progress,
    plan: dict[int, tuple[list[Any], list[Any]]],
    budgets: list[float],
    steps: int,
    rounds: int,
    what: set[str],
) -> dict[str, Any]:
    # here: decode needs torch and transformers (the hf extra); every verb's parser imports this module
    import torch

    from ..models import describe, load
    from .decode import breakdown, measure_decode, prefill

    if args.model == "tiny-llama":  # a 2-layer random model: exercises the pipeline in seconds
        from ..models import tiny_llama  # here: as above

        model = tiny_llama(num_layers=2, heads=4, kv_heads=2, head_dim=16, max_position_embeddings=8192)
    else:
        model, _ = load(args.model, progress=False)
    info = describe(model)
    results: list[dict[str, Any]] = []
    overheads: list[dict[str, Any]] = []
    breakdowns: dict[int, dict[str, dict[str, float]]] = {}
    prefills: dict[int, float] = {}
    for ctx, (cands, sub) in plan.items():
        pre = prefill(model, ctx)
        prefills[ctx] = pre.seconds
        progress(f"prefill {ctx}")
        if "decode" in what:
            # every candidate reports at the end of each round: the bar says which round of which context
            reported = itertools.count()
            res = measure_decode(model, pre, cands, rounds=rounds, steps=steps, warmup=_WARMUP,
                                 on_step=lambda _label: progress(f"decode {ctx}: round {next(reported) // len(cands) + 1}/{rounds}"))
            by = {r.label: r for r in res}
            for r in res:
                results.append(r.as_dict())
            if "FullCache" in by and "capture only" in by:
                full, cap = by["FullCache"], by["capture only"]
                per_round = [c / f for c, f in zip(cap.seconds_per_step, full.seconds_per_step)]
                row = {"context": ctx, "capture_over_full": statistics.median(per_round), "rounds": per_round}
                if "capture only (unfused)" in by:
                    un = by["capture only (unfused)"]
                    row["unfused_capture_over_full"] = statistics.median(
                        [c / f for c, f in zip(un.seconds_per_step, full.seconds_per_step)]
                    )
                overheads.append(row)
        if sub:
            breakdowns[ctx] = breakdown(model, pre, sub, steps=steps, rounds=_BREAKDOWN_ROUNDS, warmup=_WARMUP, on_step=progress)
        del pre
    return {
        "model": args.model,
        "model_info": info,
        "threads": torch.get_num_threads(),
        "results": results,
        "capture_overhead": overheads,
        "breakdown": {str(k): v for k, v in breakdowns.items()},
        "prefill_seconds": prefills,
        "steps": steps,
        "rounds": rounds,
        "budgets": budgets,
    }


def _prefill(args: argparse.Namespace, progress: _Progress, contexts: list[int], specs: list[Any], budgets: list[float],
             rounds: int) -> dict[str, Any]:
    """``--what prefill``: :func:`kvpolicy_tools.perf.prefill.measure_prefill` at the budget nearest 25%."""
    from kvpolicy.hf import PREFILL_CHUNK  # here: torch and transformers (the hf extra); every verb's parser imports this module

    from .prefill import measure_prefill  # here: as above

    if args.model == "tiny-llama":  # a 2-layer random model: exercises the pipeline in seconds
        from ..models import tiny_llama  # here: as above

        model = tiny_llama(num_layers=2, heads=4, kv_heads=2, head_dim=16, max_position_embeddings=8192)
    else:
        from ..models import load  # here: as above

        model, _ = load(args.model, progress=False)
    budget = min(budgets, key=lambda b: abs(b - 0.25))
    rows = measure_prefill(model, contexts, specs, budget=budget, rounds=rounds, chunk=PREFILL_CHUNK, on_step=progress)
    return {"rows": rows, "budget": budget, "chunk": PREFILL_CHUNK, "rounds": rounds}


def share_cell(share: float | None, interval: Sequence[float] | None) -> str:
    """A share of the limit as the decode table prints it: the median over rounds and, in
    brackets, its 95% confidence interval (:func:`~kvpolicy_tools.perf.report.median_interval`).

    Example:
        >>> share_cell(0.946, (0.931, 0.958)), share_cell(0.95, None), share_cell(None, None)
        ('94.6% (93.1-95.8)', '95.0%', '-')
    """
    if share is None:
        return "-"
    if interval is None:
        return f"{share:.1%}"
    return f"{share:.1%} ({interval[0] * 100:.1f}-{interval[1] * 100:.1f})"


def _decode_report(data: dict[str, Any], out: Path, plots: bool) -> list[str]:
    from .decode import BREAKDOWN_ORDER  # here: decode needs torch and transformers (the hf extra); every verb's parser imports this module

    lines: list[str] = []
    rows = data.get("results", [])
    if rows:
        info = data["model_info"]
        lines += [
            f"Model `{data['model']}` ({info['layers']} layers, {info['heads']} query / {info['kv_heads']} KV heads, "
            f"head_dim {info['head_dim']}, {info['dtype']}), batch 1, {data['rounds']} interleaved rounds of "
            f"{data['steps']} decode steps per candidate; ratio = median over rounds of DynamicCache s/step over the "
            "candidate's (> 1: faster); share of limit = median over rounds of the limit's s/step over the "
            "candidate's (the limit: a DynamicCache holding only the candidate's own count of the newest tokens, "
            "cut back to it before every round; the budget's limit row is held at the most its policies keep), with the 95% "
            "confidence interval of that median in brackets (distribution-free; none under 6 rounds).",
            "",
        ]
        for ctx in sorted({r["context"] for r in rows}):
            sub = [r for r in rows if r["context"] == ctx]
            lines += [f"### Context {ctx:,} (prefill {data['prefill_seconds'].get(ctx, data['prefill_seconds'].get(str(ctx), 0)):.0f} s, shared)", ""]
            table = []
            for r in sub:
                table.append([
                    r["label"], f"{r['tokens_per_s']:.2f}", f"{r['ratio_vs_dynamic']:.2f}",
                    f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}", share_cell(r.get("share_of_limit"), r.get("share_of_limit_interval")),
                    f"{r['kv_bytes'] / 2**20:.1f}",
                    f"{r['allocated_bytes'] / 2**20:.1f}", f"{r['memory_ratio']:.2f}", f"{r['kept']:.0f}",
                    "-" if r["capacity"] is None else r["capacity"], r["evictions"],
                ])
            lines.append(markdown_table(
                ["cache", "tokens/s", "x DynamicCache", "range", "share of limit", "KV MiB held", "MiB allocated",
                 "KV vs Dynamic", "kept/layer", "capacity", "evictions"],
                table, "l" + "r" * 10))
            lines.append("")
        if plots:
            path = plot_decode(rows, out / "decode.png", title=f"Decode on {data['model']} (CPU): speed relative to DynamicCache, and KV memory")
            lines += [f"![decode speed and memory]({path.name})", ""]
    overheads = data.get("capture_overhead", [])
    if overheads:
        lines += ["### Score-capture overhead (capture-only cache over FullCache, same rounds)", ""]
        table = [[o["context"], f"{(o['capture_over_full'] - 1) * 100:+.1f}%",
                  f"{(o['unfused_capture_over_full'] - 1) * 100:+.1f}%" if "unfused_capture_over_full" in o else "-"] for o in overheads]
        lines.append(markdown_table(["context", "fused (default)", "unfused (before)"], table, "lrr"))
        lines.append("")
    for ctx, table in data.get("breakdown", {}).items():
        lines += [f"### Breakdown of a decode step, context {int(ctx):,} (ms per step)", ""]
        cats = [c for c in BREAKDOWN_ORDER if any(row.get(c) for row in table.values())]
        body = [[label] + [f"{row.get(c, 0.0):.2f}" for c in cats] + [f"{row['step']:.2f}"] for label, row in table.items()]
        lines.append(markdown_table(["cache"] + cats + ["step"], body, "l" + "r" * (len(cats) + 1)))
        lines.append("")
        if plots:
            path = plot_breakdown(table, out / f"breakdown_{ctx}.png", order=BREAKDOWN_ORDER, title=f"Decode step breakdown, context {int(ctx):,}")
            lines += [f"![breakdown at {ctx}]({path.name})", ""]
    return lines


# ----------------------------------------------------------------------------------- run
def run(args: argparse.Namespace) -> int:
    """Run ``kvpolicy bench``; returns the exit status."""
    defaults = QUICK if args.quick else FULL
    what = {w.strip() for w in args.what.split(",") if w.strip()}
    unknown = what - {"complexity", "decode", "breakdown", "prefill"}
    if unknown or not what:
        raise ValueError(f"--what takes complexity, decode, breakdown, prefill; got {', '.join(sorted(unknown)) or repr(args.what)}")
    # a flag given empty is an error, not the default (`is None`: only a flag left out takes it)
    def given(value: str | None, key: str) -> str:
        return defaults[key] if value is None else value

    sizes = _ints(given(args.sizes, "sizes"), "--sizes", minimum=16)
    configs = _configs(given(args.configs, "configs"))
    rounds = args.rounds if args.rounds is not None else defaults["rounds"]  # (0 is an error below, not the default)
    contexts = _ints(given(args.contexts, "contexts"), "--contexts")
    budgets = _floats(given(args.budgets, "budgets"), "--budgets")
    steps = args.steps if args.steps is not None else defaults["steps"]
    decode_rounds = args.decode_rounds if args.decode_rounds is not None else defaults["decode_rounds"]
    if args.breakdown_contexts is not None:
        breakdown_contexts = _ints(args.breakdown_contexts, "--breakdown-contexts")
        missing = sorted(set(breakdown_contexts) - set(contexts))
        if missing:  # (the breakdown runs on the decode part's prefills: another context would be skipped)
            raise ValueError(f"--breakdown-contexts {missing[0]} is not among --contexts ({','.join(map(str, contexts))})")
    else:
        breakdown_contexts = sorted({min(contexts), max(contexts)})
    if any(not 0 < b < 1 for b in budgets):
        raise ValueError("--budgets must be in (0, 1)")
    if steps < 1 or decode_rounds < 1 or rounds < 1:
        raise ValueError("--steps, --rounds and --decode-rounds must be >= 1")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads} (leave it out for torch's default)")
    if args.max_token_heads < 1:
        raise ValueError(f"--max-token-heads must be >= 1, got {args.max_token_heads}")
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not backends or set(backends) - {"torch", "numpy"}:
        raise ValueError(f"--backends takes torch, numpy; got {args.backends!r}")
    names = args.policy or ["streaming_llm", "h2o", "buzz"]
    if "all" in names:  # every registered policy that evicts during decode, in the registry's order, once
        names = list(dict.fromkeys(n for p in names for n in (decoding_policy_names() if p == "all" else [p])))
    specs = [resolve_policy(p) for p in names]

    if args.threads is not None:
        import torch  # here: only when --threads is given

        torch.set_num_threads(args.threads)
    shared = None if args.shared == "auto" else args.shared == "yes"
    host = machine(shared=shared)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    n_series = 0
    # The --policy policies the complexity table does not measure (package.module:Factory, and
    # registered names outside POLICIES, e.g. knorm) are timed too, through kvpolicy.testing.timing.
    third_party = [p for p in (names if args.policy else []) if ":" in p or normalize_name(p) not in POLICIES]
    if "complexity" in what:
        # the complexity timing drives a layer with keys and scores only: a policy scoring from the
        # queries' moments (Expected Attention) has none there; the decode benchmark feeds them
        observing = [p for p in third_party if ":" not in p and plan_policy(p, 0.5, context_length=256).policy.observes_queries]
        if observing:
            raise ValueError(
                f"--what complexity cannot time {', '.join(observing)}: it scores from the queries' moments, which the "
                "complexity run does not draw; time it with --what decode (which gives it placeholder prompt queries)"
            )
    if "complexity" in what:
        n_series = len(POLICIES) * len(configs) * len(backends) + bench_steps(third_party, sizes, backends, rounds)
    plan = _decode_plan(args, contexts, budgets, specs, steps, decode_rounds, breakdown_contexts, what) if what & {"decode", "breakdown"} else {}
    # the bar counts what runs: a prefill per context, each candidate's rounds, the breakdown's
    total = n_series + len(plan)
    for cands, sub in plan.values():
        total += (len(cands) * decode_rounds if "decode" in what else 0) + len(sub) * _BREAKDOWN_ROUNDS
    if "prefill" in what:  # per context and round: the plain forward, each policy one-shot and chunked
        total += len(contexts) * decode_rounds * (1 + 2 * len(specs))
    progress = _Progress(total, not args.no_progress)
    started = time.time()
    data: dict[str, Any] = {"machine": host, "command": "kvpolicy bench " + " ".join(shlex.quote(a) for a in sys.argv[2:]) if len(sys.argv) > 1 and sys.argv[1] == "bench" else "kvpolicy bench"}
    try:
        if "complexity" in what:
            data["complexity"] = _complexity(args, progress, sizes, configs, rounds)
            if third_party:
                data["policy_complexity"] = bench_specs(
                    third_party, sizes=sizes, backends=backends, batch=configs[0][0], heads=configs[0][1], rounds=rounds, on_progress=progress
                )
        if what & {"decode", "breakdown"}:
            data["decode"] = _decode(args, progress, plan, budgets, steps, decode_rounds, what)
        if "prefill" in what:
            data["prefill"] = _prefill(args, progress, contexts, specs, budgets, decode_rounds)
    finally:
        progress.close()
    data["seconds"] = time.time() - started
    (out / "results.json").write_text(json.dumps(data, indent=1, default=str))

    plots = not args.no_plots
    lines = [
        "# kvpolicy bench",
        "",
        f"Command: `{data['command']}`" + (" (quick mode)" if args.quick else ""),
        "",
        f"Machine: {machine_line(host)}. Took {data['seconds'] / 60:.1f} min.",
        "",
    ]
    if "complexity" in data:
        lines += ["## Eviction cost against cache size", ""] + _complexity_report(data["complexity"], out, plots)
    if data.get("policy_complexity"):
        lines += ["## Eviction cost of the other --policy policies", ""] + bench_report(data["policy_complexity"], out, plots)
    if "decode" in data:
        lines += ["## Decode speed, memory and breakdown", ""] + _decode_report(data["decode"], out, plots)
    if "prefill" in data:
        from .prefill import prefill_report  # here: it needs torch and transformers (the hf extra)

        prefill = data["prefill"]
        lines += ["## Prefill (time to first token)", ""] + prefill_report(prefill["rows"], prefill["chunk"], prefill["budget"])
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / 'report.md'} and {out / 'results.json'}" + ("" if args.no_plots else " (+ PNG plots)"))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvpolicy_tools.perf.bench`` (the same as ``kvpolicy bench``)."""
    parser = argparse.ArgumentParser(prog="kvpolicy bench", description=__doc__.splitlines()[0])
    add_arguments(parser)

    return run_command("kvpolicy bench", run, parser.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
