"""Complexity timing for any policy: :func:`benchmark_policy`.

Two measures per cache size, as :mod:`kvpolicy_tools.perf.eviction` defines them for the built-ins
(and with its workloads: the torch one runs :class:`kvpolicy_torch.LayerCache`, keys and values
included; the NumPy one applies the same decisions to preallocated positions and scores):

* **one eviction**: the decision plus the gather that applies it, from the decode step that
  brings the cache to the size at which the policy evicts;
* **per decoded token**: ``append`` + ``evict`` amortised over one whole eviction cycle of the
  steady state (for a policy that evicts at every step: on torch one compaction cycle of the slot
  layout, on NumPy a fixed number of steps).

Any policy works: the steady state (cache size when it evicts, size after, period, state) is
found by running the policy's own ``evict`` on placeholder scores, so nothing about its rules
needs to be known. The log-log slope of cost against the cache size is fitted with
:func:`kvpolicy_tools.perf.report.fit_slope` (``~0`` constant, ``~1`` linear in the cache).

Example:
    >>> from kvpolicy import LocalWindow
    >>> result = benchmark_policy(lambda size: LocalWindow(window=size - 1), sizes=(64, 128, 256),
    ...                           backends=("numpy",), rounds=1, target_s=0.001)
    >>> [r["cache_size"] for r in result.rows]
    [64, 128, 256]
    >>> -1 < result.slope("one_eviction", "numpy") < 3
    True
"""

from __future__ import annotations

import importlib
import inspect
import math
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from kvpolicy.validation import check_bool
from kvpolicy.policy import EvictionPolicy
from kvpolicy.registry import Preset, get_policy
from kvpolicy.testing._util import torch_available
from kvpolicy_tools.perf.eviction import POLICIES, NumpyWorkload, Steady, TorchWorkload, policy_at_size, steady_state
from kvpolicy_tools.perf.report import fit_slope, format_cost_axes, markdown_table, save_figure

__all__ = ["ComplexityResult", "Steady", "benchmark_policy", "policy_workload", "size_factory", "steady_state"]

def size_factory(policy_factory: Any) -> Callable[[int], EvictionPolicy]:
    """``size -> policy`` from a factory: a built-in class gets its benchmark policy of capacity
    ``size`` (:func:`kvpolicy_tools.perf.eviction.policy_at_size`); any other class or registry preset
    its ``from_size(size)``; a function taking one argument is called with the size.

    Raises ``ValueError`` for anything else (e.g. a policy instance, or a class without
    ``from_size``)."""
    if isinstance(policy_factory, EvictionPolicy):
        raise ValueError(f"{policy_factory!r} is one policy; timing across sizes needs a factory: size -> policy")
    if isinstance(policy_factory, Preset) or inspect.isclass(policy_factory):
        cls = policy_factory.cls if isinstance(policy_factory, Preset) else policy_factory
        if not (inspect.isclass(cls) and issubclass(cls, EvictionPolicy)):
            raise ValueError(f"{policy_factory!r} is not an EvictionPolicy class")
        if cls.name in POLICIES and cls.__module__.startswith("kvpolicy.policies") and not isinstance(policy_factory, Preset):
            return lambda size, _n=cls.name: policy_at_size(_n, size)
        if cls.from_size.__func__ is EvictionPolicy.from_size.__func__:  # type: ignore[attr-defined]
            raise ValueError(f"{cls.__name__} has no from_size(size); pass a factory: lambda size: {cls.__name__}(...)")
        return policy_factory.from_size
    if callable(policy_factory):
        try:
            inspect.signature(policy_factory).bind(256)
        except TypeError:
            raise ValueError(f"{getattr(policy_factory, '__name__', repr(policy_factory))} is not a size factory (it must accept one argument, the cache size)") from None
        except ValueError:  # no signature (a builtin): just try it
            pass
        return policy_factory
    raise ValueError(f"cannot time {policy_factory!r}: expected a policy class, a preset or a function size -> policy")


def _label(policy_factory: Any) -> str:
    if isinstance(policy_factory, Preset):
        return policy_factory.name
    name = getattr(policy_factory, "__name__", None)
    return name if name and name != "<lambda>" else repr(policy_factory)


def policy_workload(
    policy_factory: Any,
    size: int,
    backend: str = "numpy",
    *,
    batch: int = 1,
    heads: int = 8,
    head_dim: int = 64,
    seed: int = 0,
    label: str | None = None,
) -> Any:
    """A benchmark workload for ``policy_factory(size)``: ``reset_before_eviction()`` then
    ``one_eviction()``; ``reset_after_eviction()`` then ``decode_round()`` (``period`` decoded
    tokens); the pair pytest-benchmark's ``benchmark.pedantic(fn, setup=...)`` takes.
    ``steady`` (a :class:`Steady`) and ``policy`` are attributes."""
    policy = size_factory(policy_factory)(size)
    steady = steady_state(policy, size)
    cls = {"torch": TorchWorkload, "numpy": NumpyWorkload}.get(backend)
    if cls is None:
        raise ValueError(f"backend must be 'torch' or 'numpy', got {backend!r}")
    return cls(policy, steady, label=label or _label(policy_factory), batch=batch, heads=heads, head_dim=head_dim, seed=seed)


@dataclass
class ComplexityResult:
    """Timings of one policy across cache sizes (:func:`benchmark_policy`).

    ``rows``: one dict per backend and size: ``size`` (asked), ``cache_size`` (size at eviction),
    ``period``, ``one_eviction_s`` / ``per_token_s`` (fastest round) and their ``*_median_s``.
    """

    policy: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    batch: int = 1
    heads: int = 8
    head_dim: int = 64
    rounds: int = 3

    def slope(self, measure: str = "per_token", backend: str = "numpy") -> float:
        """Fitted ``k`` of ``cost ~ cache_size^k`` (``nan`` with fewer than 2 sizes)."""
        key = measure if measure.endswith("_s") else f"{measure}_s"
        pts = sorted((r["cache_size"], r[key]) for r in self.rows if r["backend"] == backend)
        return fit_slope([p[0] for p in pts], [p[1] for p in pts])

    @property
    def slopes(self) -> dict[str, dict[str, float]]:
        """``{backend: {"one_eviction": k, "per_token": k}}``."""
        return {
            b: {m: self.slope(m, b) for m in ("one_eviction", "per_token")}
            for b in dict.fromkeys(r["backend"] for r in self.rows)
        }

    def table(self) -> str:
        """A Markdown table of the timings (microseconds) and one of the slopes."""
        def us(x: float) -> str:
            v = x * 1e6
            return f"{v:,.0f}" if v >= 100 else f"{v:.2f}"

        body = [
            [r["backend"], f"{r['size']:,}", f"{r['cache_size']:,}", r["period"], us(r["one_eviction_s"]), us(r["per_token_s"])]
            for r in self.rows
        ]
        lines = [
            markdown_table(["backend", "size", "cache at eviction", "period", "one eviction (µs)", "per token (µs)"], body, "lrrrrr"),
            "",
            markdown_table(
                ["backend", "one eviction k", "per token k"],
                [[b, _k(s["one_eviction"]), _k(s["per_token"])] for b, s in self.slopes.items()],
                "lrr",
            ),
        ]
        return "\n".join(lines)

    def plot(self, path: str | Path, *, title: str | None = None) -> Path:
        """Two log-log panels (one eviction; per decoded token), one line per backend."""
        import matplotlib  # optional: the plot extra

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # optional: the plot extra

        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for ax, (key, name) in zip(axes, (("one_eviction", "one eviction"), ("per_token", "amortised per decoded token"))):
            for backend, style in (("torch", "-o"), ("numpy", "--s")):
                pts = sorted((r["cache_size"], r[f"{key}_s"]) for r in self.rows if r["backend"] == backend)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] * 1e6 for p in pts], style, ms=4,
                            label=f"{backend} k={_k(self.slope(key, backend))}")
            format_cost_axes(ax, name)
            ax.legend(fontsize=8)
        fig.suptitle(title or f"{self.policy}: eviction cost, batch {self.batch}, {self.heads} KV heads (k: log-log slope)", fontsize=10)
        return save_figure(fig, path, dpi=120)

    def as_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy, "rows": self.rows, "slopes": self.slopes, "batch": self.batch,
            "heads": self.heads, "head_dim": self.head_dim, "rounds": self.rounds,
        }


def _k(x: float) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{x:.2f}"


def _best(setup: Callable[[], None], fn: Callable[[], None], reps: int) -> float:
    best = math.inf
    for _ in range(reps):
        setup()
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def benchmark_policy(
    policy_factory: Any,
    sizes: Sequence[int] = (256, 512, 1024, 2048, 4096),
    *,
    backends: Sequence[str] | None = None,
    batch: int = 1,
    heads: int = 8,
    head_dim: int = 64,
    rounds: int = 3,
    target_s: float = 0.02,
    on_progress: Callable[[str], None] | None = None,
    label: str | None = None,
) -> ComplexityResult:
    """Time one eviction and the amortised eviction cost per decoded token at each size.

    Args:
        policy_factory: ``size -> policy`` (see :func:`size_factory`: a class with ``from_size``,
            a preset, a built-in class, or a function of the size).
        sizes: sizes passed to the factory; the fit uses the cache size at which each policy
            actually evicts (``rows[i]["cache_size"]``).
        backends: ``("numpy", "torch")`` by default (torch when installed).
        batch, heads, head_dim: the cache's shape (keys and values on torch).
        rounds, target_s: each round repeats a measurement for about ``target_s`` (at most 25
            times) and keeps its fastest; rounds are interleaved over the sizes (so slow phases
            of a shared machine hit all sizes alike) and the fastest round is reported, as in
            :func:`kvpolicy_tools.perf.eviction.measure_complexity`.
        on_progress: called with a label after each workload is built and after each round.

    Returns:
        A :class:`ComplexityResult` (``.rows``, ``.slope(measure, backend)``, ``.table()``,
        ``.plot(path)``).
    """
    if backends is None:
        backends = ("numpy", "torch") if torch_available() else ("numpy",)
    label = label or _label(policy_factory)
    result = ComplexityResult(label, batch=batch, heads=heads, head_dim=head_dim, rounds=rounds)
    for backend in backends:
        loads = [policy_workload(policy_factory, s, backend, batch=batch, heads=heads, head_dim=head_dim, label=label) for s in sizes]
        one: list[list[float]] = [[] for _ in loads]
        per: list[list[float]] = [[] for _ in loads]
        reps_one, reps_per = [], []
        for w in loads:  # warm-up, and how often to repeat within a round
            t1 = _best(w.reset_before_eviction, w.one_eviction, 2)
            t2 = _best(w.reset_after_eviction, w.decode_round, 1)
            reps_one.append(max(1, min(25, int(target_s / max(t1, 1e-6)))))
            reps_per.append(max(1, min(25, int(target_s / max(t2, 1e-6)))))
            if on_progress is not None:
                on_progress(f"{label} {backend} {w.size}")
        for r in range(rounds):
            for i, w in enumerate(loads):
                one[i].append(_best(w.reset_before_eviction, w.one_eviction, reps_one[i]))
                per[i].append(_best(w.reset_after_eviction, w.decode_round, reps_per[i]) / w.period)
            if on_progress is not None:
                on_progress(f"{label} {backend} round {r + 1}")
        for i, (s, w) in enumerate(zip(sizes, loads)):
            result.rows.append(
                {
                    "backend": backend,
                    "policy": label,
                    "size": s,
                    "cache_size": w.steady.size,
                    "period": w.period,
                    "evicts": w.steady.evicts,
                    "one_eviction_s": min(one[i]),
                    "per_token_s": min(per[i]),
                    "one_eviction_median_s": statistics.median(one[i]),
                    "per_token_median_s": statistics.median(per[i]),
                }
            )
    return result


def progress_steps(sizes: Sequence[int], backends: Sequence[str], rounds: int) -> int:
    """How many times :func:`benchmark_policy` calls ``on_progress``."""
    return len(backends) * (len(sizes) + rounds)


# ---------------------------------------------------------------------------------- kvpolicy bench
def load_factory(spec: str) -> Any:
    """The object ``package.module:Attr`` names (``Attr`` may be dotted)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"expected package.module:Factory, got {spec!r}")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import {module_name!r} for --policy {spec!r}: {e}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{module_name!r} has no attribute {attr!r} (--policy {spec!r})")
        obj = getattr(obj, part)
    return obj


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "policy"


def bench_steps(specs: Sequence[str], sizes: Sequence[int], backends: Sequence[str], rounds: int) -> int:
    """Progress-bar steps :func:`bench_specs` takes."""
    return len(specs) * progress_steps(sizes, backends, rounds)


def bench_specs(
    specs: Sequence[str],
    *,
    sizes: Sequence[int],
    backends: Sequence[str],
    batch: int = 1,
    heads: int = 8,
    rounds: int = 3,
    on_progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """``kvpolicy bench --policy package.module:Factory`` (or a registered name):
    :func:`benchmark_policy` for each spec that is a size factory; the others get ``{"spec",
    "skipped": why}`` (they still take part in the decode benchmark, which plans them by budget)."""
    out: list[dict[str, Any]] = []
    for spec in specs:
        obj = load_factory(spec) if ":" in spec else get_policy(spec)
        try:
            size_factory(obj)
        except ValueError as e:
            out.append({"spec": spec, "skipped": str(e)})
            if on_progress is not None:
                for _ in range(progress_steps(sizes, backends, rounds)):
                    on_progress(f"{spec} (skipped)")
            continue
        label = _label(obj)
        result = benchmark_policy(obj, sizes, backends=backends, batch=batch, heads=heads, rounds=rounds, on_progress=on_progress, label=label)
        out.append({"spec": spec, **result.as_dict()})
    return out


def bench_report(entries: Sequence[dict[str, Any]], out: str | Path, plots: bool = True) -> list[str]:
    """Markdown lines (tables, slopes, PNG links) for :func:`bench_specs`' entries; writes one
    ``complexity_<policy>.png`` per timed policy when ``plots``."""
    plots = check_bool("plots", plots)
    lines: list[str] = []
    for e in entries:
        if "skipped" in e:
            lines += [f"### `{e['spec']}`", "", f"Not timed: {e['skipped']}.", ""]
            continue
        result = ComplexityResult(e["policy"], list(e["rows"]), e["batch"], e["heads"], e["head_dim"], e["rounds"])
        lines += [
            f"### `{e['spec']}` ({e['policy']}), batch {e['batch']}, {e['heads']} KV heads, head_dim {e['head_dim']}",
            "",
            "Microseconds at each size (fastest of the rounds); k is the log-log slope of the cost against the "
            "cache size at eviction.",
            "",
            result.table(),
            "",
        ]
        if plots:
            path = result.plot(Path(out) / f"complexity_{_slug(e['policy'])}.png")
            lines += [f"![eviction cost of {e['policy']}]({path.name})", ""]
    return lines
