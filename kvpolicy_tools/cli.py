"""The ``kvpolicy`` command line.

Verbs (each one a ``_cmd_<verb>(args)`` function, registered once in :data:`VERBS`):

* ``kvpolicy policies``: the registered policies, their parameters and defaults;
* ``kvpolicy plan NAME --budget 0.3 --context 4096``: the parameters a budget resolves to, the
  capacity and the expected average cache size;
* ``kvpolicy trace NAME --budget 0.3 --steps 200 --out trace.png``: replay the policy on
  synthetic (or given) attention logits and draw which positions are kept at every step (a policy
  that scores tokens from their keys - Knorm, KeyDiff, Expected Attention - gets synthetic keys,
  queries and values too, or ``--keys``/``--queries``/``--values`` files with ``--logits``).

Errors in the arguments (a ``ValueError`` from the library) print ``kvpolicy: error: ...`` and
exit with status 2, like argparse's own usage errors.
"""

from __future__ import annotations

import argparse
import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from kvpolicy import __version__
from kvpolicy.budget import make_policy, plan_policy
from kvpolicy.policy import KEY_STATISTICS, EvictionPolicy
from kvpolicy.registry import Preset, available_policies, create_policy, get_policy, signature_of
from kvpolicy_numpy import replay

from .command import CLIError, check_output_file, describe_os_error, run_command
from .eval import compare
from .perf import bench

__all__ = ["VERBS", "Verb", "main", "build_parser", "synthetic_logits", "synthetic_vectors", "draw_trace"]


# ============================================================================ helpers
def _parse_value(text: str) -> Any:
    """``--set`` values: int, float, true/false, none, else the string itself."""
    low = text.strip().lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    if low in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _parse_sets(items: Sequence[str] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise CLIError(f"--set expects key=value, got {item!r}")
        out[key] = _parse_value(value)
    return out


def _entry_params(entry: Any) -> list[tuple[str, Any, bool]]:
    """``(name, default, required)`` for every constructor parameter of a registry entry."""
    cls = entry.cls if isinstance(entry, Preset) else entry
    fixed = entry.fixed if isinstance(entry, Preset) else {}
    sig = inspect.signature(cls.__init__).parameters
    out = []
    for name, default in signature_of(entry):
        required = sig[name].default is inspect.Parameter.empty and name not in fixed
        out.append((name, default, required))
    return out


def _check_overrides(name: str, overrides: dict[str, Any]) -> Any:
    """The registry entry for ``name``, after checking ``overrides`` name its parameters."""
    entry = get_policy(name)
    known = [p for p, _, _ in _entry_params(entry)]
    unknown = sorted(set(overrides) - set(known))
    # a policy over a scorer (AdaKV's presets) hands its scorer the parameters it does not take
    # itself, as make_policy does: the planner checks those against the scorer
    if unknown and "scorer" not in known:
        raise CLIError(
            f"unknown parameter{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} for policy "
            f"{name!r}; its parameters: {', '.join(known) or '(none)'}"
        )
    return entry


def _first_line(text: str | None) -> str:
    return (text or "").strip().splitlines()[0] if (text or "").strip() else ""


# ============================================================================ policies
def _add_policies(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _cmd_policies(args: argparse.Namespace) -> int:
    rows = []
    for name, entry in available_policies().items():
        cls = entry.cls if isinstance(entry, Preset) else entry
        doc = (entry.doc if isinstance(entry, Preset) and entry.doc else "") or _first_line(cls.__doc__)
        rows.append(
            {
                "name": name,
                "class": f"{cls.__module__}.{cls.__qualname__}",
                "doc": doc,
                "params": [
                    {"name": n, "default": d, "required": r} for n, d, r in _entry_params(entry)
                ],
                # the full cache plans (budget 1.0) without a size knob
                "budgets": not cls.evicts or cls.from_size.__func__ is not _base_from_size(),
            }
        )
    if args.json:
        print(json.dumps(rows, indent=2, default=repr))
        return 0
    width = max(len(r["name"]) for r in rows) + 2
    for r in rows:
        params = ", ".join(
            p["name"] if p["required"] else f"{p['name']}={p['default']!r}" for p in r["params"]
        )
        print(f"{r['name']:<{width}}{r['doc']}")
        print(f"{'':<{width}}parameters: {params or '(none)'}")
        if not r["budgets"]:
            print(f"{'':<{width}}(no budget planning: set its parameters explicitly)")
    return 0


def _base_from_size() -> Any:
    return EvictionPolicy.from_size.__func__


# ============================================================================ plan
def _add_plan(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help="registered policy name (see `kvpolicy policies`)")
    p.add_argument("--budget", type=float, default=0.4, help="average cache size over the full cache's (default 0.4)")
    p.add_argument("--context", type=int, required=True, help="tokens in the run (prompt included)")
    p.add_argument("--prompt", type=int, default=0, help="tokens prefilled at once (default 0)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="fix a parameter, e.g. --set stride=4")
    p.add_argument("--threshold-ratio", type=float, default=None, metavar="T/W",
                   help="BUZZ only: threshold / window ratio (> 0; default: the theorem's, 4.33 for stride 5; "
                   "the paper authors' code uses 2.5)")
    p.add_argument("--layers", type=int, default=None, metavar="L",
                   help="the model's layer count: per-layer budgets (pyramid_h2o, pyramidkv) are planned over every "
                   "layer (default: as their mean layer)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def _cmd_plan(args: argparse.Namespace) -> int:
    overrides = _parse_sets(args.set)
    entry = _check_overrides(args.name, overrides)
    plan = plan_policy(entry, args.budget, context_length=args.context, prompt_length=args.prompt,
                       threshold_ratio=args.threshold_ratio, layers=args.layers, **overrides)
    if args.json:
        print(json.dumps(plan.as_dict(), indent=2))
    else:
        print(plan)
        print(f"policy object     {plan.policy!r}")
    return 0


# ============================================================================ trace
def synthetic_logits(steps: int, heads: int = 1, seed: int = 0) -> "Any":
    """Attention logits ``[steps, heads, steps]`` that look a little like a language model's:
    a strong first token (the attention sink), a few heavy-hitter columns per head, a recency
    bias and occasional "sentence boundary" tokens, over Gaussian noise."""
    rng = np.random.default_rng(seed)
    q = np.arange(steps)[:, None]
    k = np.arange(steps)[None, :]
    out = np.empty((steps, heads, steps))
    for h in range(heads):
        logits = rng.normal(0.0, 1.0, size=(steps, steps))
        logits += 2.0 * np.exp(-np.maximum(q - k, 0) / rng.uniform(4.0, 16.0))  # recency
        logits[:, 0] += 4.0  # attention sink
        n_heavy = max(1, steps // 40)
        heavy = rng.choice(steps, size=min(steps, n_heavy), replace=False)
        logits[:, heavy] += rng.uniform(2.0, 4.0, size=heavy.shape[0])
        period = int(rng.integers(9, 17))
        logits[:, period - 1 :: period] += 1.0  # boundaries
        out[:, h, :] = logits
    return out


def synthetic_vectors(steps: int, heads: int = 1, head_dim: int = 16, seed: int = 0) -> tuple[Any, Any, Any]:
    """Keys, queries and values ``[steps, heads, head_dim]`` for the policies that score tokens from
    their keys (:data:`kvpolicy.KEY_STATISTICS`; Expected Attention reads the queries and values
    too): Gaussian, each key scaled by a log-normal length so key norms differ as a model's do
    (from a random stream of their own: the logits of the same ``seed`` stay as they are).

    Example:
        >>> k, q, v = synthetic_vectors(50, heads=2, seed=3)
        >>> k.shape, q.shape, v.shape, bool((k == synthetic_vectors(50, heads=2, seed=3)[0]).all())
        ((50, 2, 16), (50, 2, 16), (50, 2, 16), True)
    """
    rng = np.random.default_rng([seed, 1])
    keys = rng.normal(size=(steps, heads, head_dim)) * rng.lognormal(0.0, 0.5, size=(steps, heads, 1))
    queries = rng.normal(size=(steps, heads, head_dim))
    values = rng.normal(size=(steps, heads, head_dim))
    return keys, queries, values


def draw_trace(trace: Any, policy: Any, out: str | Path, *, title: str | None = None) -> Path:
    """Draw ``trace`` like the BUZZ paper's Figure 1: x the decode step, y the position, a dark
    pixel where the position is kept after that step (light: evicted; white: not yet seen)."""
    import matplotlib  # optional: the plot extra

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt  # optional: the plot extra
    from matplotlib.colors import ListedColormap  # optional: the plot extra
    from matplotlib.patches import Patch  # optional: the plot extra

    steps = len(trace.kept)
    heads = next(k for k in trace.kept if k is not None).shape[0]
    grid = np.zeros((heads, steps, steps), dtype=np.int8)  # [head, position, step]
    for t, kept in enumerate(trace.kept):
        if kept is None:
            continue
        grid[:, : t + 1, t] = 1  # seen
        for h in range(heads):
            grid[h, kept[h][kept[h] >= 0], t] = 2  # (-1: a hole, a head keeping fewer under head-wise budgets)
    cmap = ListedColormap(["#ffffff", "#dfe4ea", "#1f4e79"])
    rows = heads
    fig, axes = plt.subplots(rows, 1, figsize=(8.0, 1.2 + 3.6 * rows), squeeze=False, dpi=110)
    first = trace.prompt_len - 1 if trace.prompt_len else 0
    for h in range(heads):
        ax = axes[h, 0]
        ax.imshow(
            grid[h], origin="lower", aspect="auto", interpolation="nearest", cmap=cmap, vmin=0, vmax=2,
            extent=(-0.5, steps - 0.5, -0.5, steps - 0.5),
        )
        if trace.prompt_len:
            ax.axvline(first, color="#c0392b", lw=1, ls="--")
            ax.text(first, steps * 0.98, " end of prefill", color="#c0392b", fontsize=8, va="top")
        ax.set_ylabel("position" + (f" (head {h})" if heads > 1 else ""))
        ax.set_xlim(-0.5, steps - 0.5)
        ax.set_ylim(-0.5, steps - 0.5)
    axes[-1, 0].set_xlabel("step (token processed)")
    axes[0, 0].legend(
        handles=[
            Patch(color="#1f4e79", label="kept"),
            Patch(color="#dfe4ea", label="evicted"),
            Patch(color="#ffffff", ec="#999999", label="not yet seen"),
        ],
        loc="upper left",
        fontsize=8,
        framealpha=0.9,
    )
    cap = "unbounded" if policy.capacity is None else policy.capacity
    fig.suptitle(title or repr(policy), fontsize=10)
    axes[0, 0].set_title(
        f"{steps} tokens, prompt {trace.prompt_len}, capacity {cap}, "
        f"realised budget {trace.realised_budget:.1%}" if len(trace.sizes) else f"{steps} tokens",
        fontsize=8,
    )
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # the format named: without a suffix matplotlib would write out + ".png", not the path returned
    fig.savefig(out, format=out.suffix[1:].lower() or "png")
    plt.close(fig)
    return out


def _add_trace(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help="registered policy name (see `kvpolicy policies`)")
    p.add_argument("--budget", type=float, default=None, help="plan the parameters from a budget (default 0.3 unless --set is given)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="set a parameter, e.g. --set window=16")
    p.add_argument("--steps", type=int, default=None, help="tokens to replay (default 200; with --logits, theirs)")
    p.add_argument("--heads", type=int, default=None, help="KV heads, one panel each (default 1; with --logits, theirs)")
    p.add_argument("--prompt", type=int, default=0, help="tokens prefilled at once (default 0)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic logits")
    p.add_argument("--logits", type=Path, default=None, help=".npy logits [steps, heads, steps] (or [steps, steps]) instead of synthetic ones")
    for name, shape, who in (("keys", "[steps, heads, head_dim]", "Knorm, KeyDiff, Expected Attention"),
                             ("queries", "[steps, heads, head_dim]", "Expected Attention"),
                             ("values", "[steps, heads, d]", "Expected Attention")):
        p.add_argument(f"--{name}", type=Path, default=None,
                       help=f".npy {name} {shape} for the policies that read them ({who}); default: synthetic ones "
                       "(required with --logits)")
    p.add_argument("--out", type=Path, default=Path("trace.png"),
                   help="image to write (default trace.png; a name without a suffix is written as PNG)")


def _load_array(path: Path, what: str) -> Any:
    """A ``.npy`` array the trace reads, or :class:`CLIError` naming the file."""
    try:
        return np.load(path)
    except (OSError, ValueError) as e:
        raise CLIError(f"cannot read {what} from {str(path)!r}: {e}") from None


def _check_image_suffix(out: Path) -> None:
    """``--out``'s suffix must be an image format matplotlib writes (checked before the replay)."""
    suffix = out.suffix[1:].lower()
    if not suffix:
        return
    from matplotlib.backend_bases import FigureCanvasBase  # optional: the plot extra

    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix not in formats:
        raise CLIError(f"--out {out}: matplotlib writes no .{suffix} images; use one of {', '.join(sorted(formats))}")


def _trace_vectors(args: argparse.Namespace, policy: EvictionPolicy, steps: int, heads: int) -> dict[str, Any]:
    """The keys (and Expected Attention's queries and values) ``policy`` scores from: the
    ``--keys``/``--queries``/``--values`` files when given, else synthetic ones
    (:func:`synthetic_vectors`) with synthetic logits; with ``--logits`` a missing one is an error
    naming its flag. Empty for the policies that score from the attention."""
    needed = []
    if policy.score_statistic in KEY_STATISTICS:
        needed.append("keys")
    if policy.observes_queries:  # (Expected Attention: the queries' moments, times the value norms)
        needed += ["queries", "values"]
    unused = [n for n in ("keys", "queries", "values") if getattr(args, n) is not None and n not in needed]
    if unused:  # (replay would ignore it without a word)
        raise CLIError(f"--{unused[0]}: {policy!r} does not read {unused[0]} (its scores come from "
                       f"{'the keys' if needed else 'the attention'}); leave --{unused[0]} out")
    out: dict[str, Any] = {}
    for name in needed:
        path = getattr(args, name)
        if path is not None:
            out[name] = _load_array(path, name)
        elif args.logits is not None:
            raise CLIError(
                f"--{name}: {policy!r} scores tokens from their {_listed(needed)}; with --logits give "
                + " ".join(f"--{n} FILE.npy" for n in needed) + " (the synthetic logits come with synthetic ones)"
            )
    if len(out) < len(needed):
        synthetic = dict(zip(("keys", "queries", "values"), synthetic_vectors(steps, heads, seed=args.seed)))
        out = {name: out.get(name, synthetic[name]) for name in needed}
    return out


def _listed(names: Sequence[str]) -> str:
    """``keys``, ``keys and values``, ``keys, queries and values``."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def _cmd_trace(args: argparse.Namespace) -> int:
    check_output_file(args.out, "--out")
    _check_image_suffix(args.out)
    if args.logits is not None:
        given = [f"--{k} {getattr(args, k)}" for k in ("steps", "heads") if getattr(args, k) is not None]
        if given:  # the logits' own shape decides both; a different number would be dropped without a word
            raise CLIError(f"{', '.join(given)}: --logits gives the steps and heads (its shape); leave them out")
        logits = _load_array(args.logits, "logits")
        loaded = tuple(np.shape(logits))
        if logits.ndim == 2:
            logits = logits[:, None, :]
        if logits.ndim != 3 or logits.shape[0] != logits.shape[2] or logits.shape[0] == 0:
            raise CLIError(
                f"{str(args.logits)!r}: logits must have shape [steps, heads, steps] (or [steps, steps]) with steps >= 1, "
                f"got {loaded}"
            )
    else:
        args.steps = 200 if args.steps is None else args.steps
        args.heads = 1 if args.heads is None else args.heads
        if args.steps < 1:
            raise CLIError(f"--steps must be >= 1, got {args.steps}")
        if args.heads < 1:
            raise CLIError(f"--heads must be >= 1, got {args.heads}")
        logits = synthetic_logits(args.steps, args.heads, args.seed)
    steps = int(logits.shape[0]) if logits.ndim >= 1 else 0

    overrides = _parse_sets(args.set)
    entry = _check_overrides(args.name, overrides)
    budget = args.budget if args.budget is not None or overrides else 0.3
    if budget is not None:
        if not 0 <= args.prompt < max(steps, 1):
            raise CLIError(f"prompt must be >= 0 and < steps ({steps}), got {args.prompt}")
        policy = make_policy(entry, budget, context_length=steps, prompt_length=args.prompt, **overrides)
    else:
        policy = create_policy(args.name, **overrides)
    vectors = _trace_vectors(args, policy, steps, int(logits.shape[1]))
    trace = replay(policy, logits, args.prompt, **vectors)
    try:
        out = draw_trace(trace, policy, args.out)
    except OSError as e:
        raise CLIError(f"--out {args.out}: cannot write the PNG: {describe_os_error(e)}") from None
    budget_text = f", realised budget {trace.realised_budget:.1%}" if len(trace.sizes) else ""
    print(f"{policy!r}: {len(trace.evictions)} evictions{budget_text}")
    synthetic = [n for n in vectors if getattr(args, n) is None]
    if synthetic:
        print(f"{_listed(synthetic)}: synthetic (seed {args.seed}; {'/'.join('--' + n for n in synthetic)} FILE.npy for your own)")
    print(f"wrote {out}")
    return 0


# ============================================================================ compare
def _add_compare(p: argparse.ArgumentParser) -> None:
    compare.add_arguments(p)


def _cmd_compare(args: argparse.Namespace) -> int:
    return compare.run(args)


def _add_bench(p: argparse.ArgumentParser) -> None:
    bench.add_arguments(p)


def _cmd_bench(args: argparse.Namespace) -> int:
    return bench.run(args)


# ============================================================================ the parser
@dataclass(frozen=True)
class Verb:
    """One verb of the ``kvpolicy`` command: its name, its one-line help, what adds its arguments
    to its sub-parser, and what runs it (returns the exit status)."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


#: Every verb, in the order `kvpolicy --help` lists them. A new verb is one entry here.
VERBS: list[Verb] = [
    Verb("policies", "list the registered policies with their parameters", _add_policies, _cmd_policies),
    Verb("plan", "resolve a policy's parameters from a cache budget", _add_plan, _cmd_plan),
    Verb("trace", "replay a policy and draw the kept positions over time (PNG)", _add_trace, _cmd_trace),
    Verb("compare", "compare the policies on real text with a real model and write a report", _add_compare, _cmd_compare),
    Verb("bench", "CPU benchmarks: eviction cost vs cache size, decode speed and memory, step breakdown", _add_bench, _cmd_bench),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvpolicy",
        description="KV-cache eviction policies (BUZZ, H2O, StreamingLLM, local window): list, plan, trace.",
    )
    parser.add_argument("--version", action="version", version=f"kvpolicy {__version__}")
    sub = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    for verb in VERBS:
        p = sub.add_parser(verb.name, help=verb.help, description=verb.help)
        verb.add_arguments(p)
        p.set_defaults(run_verb=verb.run)  # the verb's function, read by main()
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvpolicy`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    return run_command(parser.prog, args.run_verb, args)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
