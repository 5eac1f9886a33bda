"""How ``kvpolicy compare``'s results are shown: metric values and names, policy names, colours
and line styles, and the lookups over a task's cells (as ``results.json`` holds them) that the
report and the tasks' own report hooks share.

A *task* here is the dict ``results.json`` holds under ``tasks``: ``name``, ``metric``,
``metrics``, ``higher_is_better``, ``cells`` (each with ``policy``, ``row``, ``kind``, ``label``,
``metrics``, ``groups``, ``samples``, ...).

Example:
    >>> fmt("ppl", 12.3456), fmt("em", 0.5), fmt("my_score", 0.123456)
    ('12.35', '50.0', '0.1235')
    >>> policy_name("buzz_tw2.5"), pct(0.304)
    ('BUZZ (T/w 2.5)', '30.4%')
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

from .metrics import metric_info

__all__ = [
    "COLORS", "NAMES", "Panel", "REFERENCE_KIND", "STYLES", "better", "cells", "fmt", "full_cell", "is_reference_cell", "lower_is_better",
    "md_table", "metric_name", "order", "paired_se", "pct",
    "plot_scale", "policy_name", "pyplot", "row", "shared_legend", "shown_in_percent", "value",
]

#: The ``kind`` of a reference cell: a policy that keeps every token (``evicts = False``, the full
#: cache), run once per sample instead of per budget or size (``results.json`` writes ``"full"``).
REFERENCE_KIND = "full"
NAMES = {
    "full": "Full cache",
    "local": "Local window",
    "streaming_llm": "StreamingLLM",
    "h2o": "H2O",
    "buzz": "BUZZ",
    "buzz_logn": "BUZZ (log n)",
    "tova": "TOVA",
    "snapkv": "SnapKV",
    "snapkv_buzz": "SnapKV + BUZZ",
    "snapkv_h2o": "SnapKV + H2O",
    "snapkv_tova": "SnapKV + TOVA",
    "pyramidkv": "PyramidKV",
    "pyramid_h2o": "H2O, PyramidKV budgets",
    "knorm": "Knorm",
    "keydiff": "KeyDiff",
    "expected_attention": "Expected Attention",
    "scissorhands": "Scissorhands",
    "adakv": "AdaKV",
    "adakv_snapkv": "AdaKV + SnapKV",
    "adakv_h2o": "AdaKV + H2O",
    "adakv_keydiff": "AdaKV + KeyDiff",
    "adakv_tova": "AdaKV + TOVA",
    "adakv_expected_attention": "AdaKV + Expected Attention",
    "kvzip": "KVzip",
    "kvzip_headwise": "KVzip (head-wise)",
    "pyramid": "PyramidKV budgets",
    "compose": "Composition",
    "chunkkv": "ChunkKV",
    "critical_kv": "CriticalKV",
    "critical_expected_attention": "CriticalKV + Expected Attention",
    "critical_adakv_expected_attention": "CriticalAdaKV + Expected Attention",
    "lagkv": "LagKV",
}
#: A colour of its own for every built-in policy (tests/tools/eval/test_compare.py holds them
#: distinct), so no two lines of a plot share one; the full cache's reference line is black.
COLORS = {
    "full": "#000000",
    "local": "#7f7f7f",
    "streaming_llm": "#1f77b4",
    "h2o": "#2ca02c",
    "buzz": "#d62728",
    "buzz_logn": "#ff7f0e",
    "tova": "#9467bd",
    "snapkv": "#8c564b",
    "snapkv_buzz": "#ff9896",
    "snapkv_h2o": "#98df8a",
    "snapkv_tova": "#c5b0d5",
    "pyramidkv": "#c49c94",
    "pyramid_h2o": "#393b79",
    "knorm": "#17becf",
    "keydiff": "#bcbd22",
    "expected_attention": "#e377c2",
    "scissorhands": "#8c6d31",
    "adakv": "#843c39",
    "adakv_snapkv": "#9edae5",
    "adakv_h2o": "#1b9e77",
    "adakv_keydiff": "#dbdb8d",
    "adakv_tova": "#aec7e8",
    "adakv_expected_attention": "#f7b6d2",
    "kvzip": "#e7ba52",
    "kvzip_headwise": "#ad494a",
    "pyramid": "#637939",
    "compose": "#7b4173",
    "chunkkv": "#5254a3",
    "critical_kv": "#8ca252",
    "critical_expected_attention": "#6b6ecf",
    "critical_adakv_expected_attention": "#d6616b",
    "lagkv": "#a55194",
}
STYLES = {  # BUZZ (log n) dashed on top of a thicker BUZZ line, so both show when they coincide
    "local": {"marker": "v", "linewidth": 1.4},
    "streaming_llm": {"marker": "s", "linewidth": 1.4},
    "h2o": {"marker": "^", "linewidth": 1.4},
    "buzz": {"marker": "o", "linewidth": 3.2},
    "buzz_logn": {"marker": "D", "linewidth": 1.6, "linestyle": "--", "markersize": 4.5},
    "tova": {"marker": "P", "linewidth": 1.4},
    "snapkv": {"marker": "X", "linewidth": 1.4},
}


class Panel(NamedTuple):
    """One panel of a task's budget plot: ``metric`` of ``cells`` against the realised budget,
    titled ``title``; ``linear`` keeps a linear axis for a value metric (a zoom)."""

    metric: str
    cells: list[dict[str, Any]]
    title: str
    linear: bool = False


def fmt(metric: str, value: float | None) -> str:
    """A metric's value as the tables show it: a value metric (perplexity) with 2 decimals, a
    built-in share (ROUGE, exact match, recall) in percent, any other metric (a plug-in task's) as
    it is."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    info = metric_info(metric)
    if info is None:
        return f"{value:.4g}"
    return f"{100 * value:.1f}" if info.percent else f"{value:.2f}"


def shown_in_percent(metric: str) -> bool:
    """Whether plots and tables show ``metric`` in percent (a plug-in task's metric: plotted as a
    share, as the built-in shares are)."""
    info = metric_info(metric)
    return info is None or info.percent


def plot_scale(metric: str, v: float | None) -> float | None:
    """``v`` as a plot's axis shows it: shares in percent, value metrics (perplexity) as they are."""
    if v is None:
        return None
    return 100 * v if shown_in_percent(metric) else v


def lower_is_better(metric: str) -> bool:
    """Whether lower values of ``metric`` are better (perplexity): ratios to the full cache are
    taken the other way round and plots use a log axis."""
    info = metric_info(metric)
    return info is not None and info.lower_is_better


def metric_name(metric: str) -> str:
    """The name a table or plot gives ``metric`` (a plug-in task's metric is named by its key)."""
    info = metric_info(metric)
    return metric if info is None else info.title


def pct(x: float | None) -> str:
    """A share as a percentage with one decimal (``-`` for none)."""
    return "-" if x is None else f"{100 * x:.1f}%"


def policy_name(p: str) -> str:
    """The display name of a policy row (``buzz_tw2.5``: BUZZ at another T/w)."""
    if p in NAMES:
        return NAMES[p]
    base, sep, ratio = p.rpartition("_tw")
    if sep and base in NAMES:
        return f"{NAMES[base]} (T/w {ratio})"
    return p


def row(cell: dict[str, Any]) -> str:
    """A cell's table row: its policy, or ``buzz_tw<r>`` for BUZZ at another T/w (stream)."""
    return cell.get("row") or cell["policy"]


def order(policies: Sequence[str]) -> list[str]:
    """Policies in the report's order: the named ones first, in :data:`NAMES`' order."""
    known = [p for p in NAMES if p in policies]
    return known + [p for p in policies if p not in NAMES]


def cells(task: dict[str, Any], kind: str | None = None) -> list[dict[str, Any]]:
    """A task's cells, or those of one kind (``budget``, ``size``, ``ratio``, ``full``)."""
    return [c for c in task["cells"] if kind is None or c["kind"] == kind]


def value(cell: dict[str, Any], metric: str) -> float | None:
    """A cell's aggregate value of ``metric`` (``None`` when it has none)."""
    return cell["metrics"].get(metric)


def better(task: dict[str, Any], a: float, b: float) -> bool:
    """Whether ``a`` is better than ``b`` for this task's headline metric."""
    return a > b if task["higher_is_better"] else a < b


def is_reference_cell(cell: dict[str, Any]) -> bool:
    """Whether ``cell`` is a reference line (its policy keeps every token), by its kind."""
    return cell["kind"] == REFERENCE_KIND


def full_cell(task: dict[str, Any]) -> dict[str, Any] | None:
    """The task's full-cache cell (the reference line), if it ran one."""
    return next((c for c in task["cells"] if is_reference_cell(c)), None)


def paired_se(a: dict[str, Any], b: dict[str, Any], metric: str) -> float | None:
    """Standard error of the mean per-sample difference between two cells (same samples)."""
    va = {e["id"]: e["scores"].get(metric) for e in a.get("samples", [])}
    vb = {e["id"]: e["scores"].get(metric) for e in b.get("samples", [])}
    d = [va[k] - vb[k] for k in va if k in vb and va[k] is not None and vb[k] is not None]
    if len(d) < 2:
        return None
    mean = sum(d) / len(d)
    var = sum((x - mean) ** 2 for x in d) / (len(d) - 1)
    return math.sqrt(var / len(d)) or None


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (files only, no display)."""
    import matplotlib  # optional: the plot extra

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional: the plot extra

    return plt


def shared_legend(fig: Any, axes: Any, *, columns: int, fontsize: int) -> None:
    """One legend below the panels: every label once, in the order the panels first show it."""
    handles: dict[str, Any] = {}
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=min(len(handles), columns),
               frameon=False, fontsize=fontsize)


def md_table(header: list[str], rows: list[list[str]]) -> str:
    """A GitHub Markdown table."""
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
    return "\n".join(out)
