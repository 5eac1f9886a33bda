"""The ``kvpolicy compare`` report: console tables, ``report.md``, PNG plots and ``results.json``.

Everything here is computed from the results of the run that writes the report; the only numbers
not measured in the run are the BUZZ paper's own (Llama-2-7B), which appear in a separate,
labelled section (:data:`PAPER_TABLES`) and are never mixed into our tables or plots.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .results import TaskResult

__all__ = ["document", "write_report", "console_summary", "verdicts", "PAPER_TABLES"]

BUZZES = ("buzz", "buzz_logn")
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
}
COLORS = {
    "local": "#7f7f7f",
    "streaming_llm": "#1f77b4",
    "h2o": "#2ca02c",
    "buzz": "#d62728",
    "buzz_logn": "#ff7f0e",
    "tova": "#9467bd",
    "snapkv": "#8c564b",
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
METRIC_NAMES = {
    "ppl": "perplexity",
    "rouge1": "ROUGE-1",
    "rouge2": "ROUGE-2",
    "rougeL": "ROUGE-L",
    "mean": "mean ROUGE (geometric)",
    "em": "exact match",
    "recall": "needle-word recall",
    "string_match": "string match",
}

STREAM_CAPTION = {
    "size": "Each cell: perplexity (measured average cache, capacity). Columns: fixed cache size, and how it is "
            "equalised: equal mean (the average cache over the scored steps is the size), equal capacity (the peak is "
            "the size).",
    "budget": "Each cell: perplexity (measured average cache, capacity). Columns: requested budget (target = budget x "
              "the full cache's average), and how it is equalised (equal mean, equal capacity).",
}

#: The BUZZ paper's own numbers (Llama-2-7B unless said otherwise), for the separate table only.
PAPER_TABLES: dict[str, dict[str, Any]] = {
    "summ": {
        "caption": "Paper, Table 2 (Llama-2-7B, XSum): mean ROUGE (geometric mean of R-1/2/L), %",
        "decimals": 1,
        "columns": ["60%", "50%", "40%", "30%", "20%", "10%"],
        "rows": {
            "BUZZ": [11.9, 12.1, 12.3, 11.9, 11.3, 10.9],
            "BUZZ (log n)": [12.3, 12.0, 12.0, 11.6, 11.6, 10.4],
            "H2O": [11.5, 11.4, 11.6, 11.4, 11.8, 10.2],
            "StreamingLLM": [11.9, 11.1, 11.2, 10.8, 10.0, 3.8],
            "Local": [7.6, 4.4, 2.9, 1.8, 1.4, 0.1],
        },
    },
    "ppl": {
        "caption": "Paper, perplexity table (Llama-2-7B, wikitext) at fixed cache sizes",
        "decimals": 3,
        "columns": ["BUZZ", "BUZZ (log n)", "H2O", "StreamingLLM", "Local", "Full"],
        "rows": {
            "cache 50": [9.394, 12.322, 9.987, 11.722, 194.803, 7.382],
            "cache 100": [8.037, 10.318, 8.881, 9.330, 35.979, 7.382],
        },
    },
    "tw": {
        "caption": "Paper, Table A (Llama-2-7B, CNN/DailyMail, stride 5, cache size 200): ROUGE (%) against T/w",
        "decimals": 4,
        "columns": ["1.5", "2.5", "3.5", "4.5", "5.5", "6.5"],
        "rows": {
            "ROUGE-1": [25.3847, 25.8219, 26.8306, 26.9212, 26.0562, 25.6403],
            "ROUGE-2": [6.9315, 7.8697, 7.7600, 7.9514, 7.4780, 7.3231],
            "ROUGE-L": [23.0359, 23.6857, 24.3394, 24.5161, 23.8286, 23.4886],
        },
    },
}


# =========================================================================== formatting
def fmt(metric: str, value: float | None) -> str:
    """A metric's value as the tables show it: perplexity with 2 decimals, the built-in shares
    (ROUGE, exact match, recall) in percent, any other metric (a plug-in task's) as it is."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if metric == "ppl":
        return f"{value:.2f}"
    return f"{100 * value:.1f}" if metric in METRIC_NAMES else f"{value:.4g}"


def metric_name(metric: str) -> str:
    """The name a table or plot gives ``metric`` (a plug-in task's metric is named by its key)."""
    return METRIC_NAMES.get(metric, metric)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _name(p: str) -> str:
    if p in NAMES:
        return NAMES[p]
    base, sep, ratio = p.rpartition("_tw")
    if sep and base in NAMES:
        return f"{NAMES[base]} (T/w {ratio})"
    return p


def _row(cell: dict[str, Any]) -> str:
    """A cell's table row: its policy, or ``buzz_tw<r>`` for BUZZ at another T/w (stream)."""
    return cell.get("row") or cell["policy"]


def _buzz_rows(task: dict[str, Any]) -> list[str]:
    rows = dict.fromkeys(_row(c) for c in task["cells"])
    return [r for r in _order(list(rows)) if r in BUZZES or r.startswith("buzz_tw")]


def _order(policies: Sequence[str]) -> list[str]:
    known = [p for p in NAMES if p in policies]
    return known + [p for p in policies if p not in NAMES]


def _cells(task: dict[str, Any], kind: str | None = None) -> list[dict[str, Any]]:
    return [c for c in task["cells"] if kind is None or c["kind"] == kind]


def _value(cell: dict[str, Any], metric: str) -> float | None:
    return cell["metrics"].get(metric)


def _better(task: dict[str, Any], a: float, b: float) -> bool:
    return a > b if task["higher_is_better"] else a < b


# =========================================================================== verdicts
def verdicts(task: dict[str, Any]) -> list[str]:
    """Plain-language BUZZ-vs-baselines statements (a baseline: every other policy of the cell), computed
    from the cells (never hardcoded)."""
    metric = task["metric"]
    lines: list[str] = []
    if task["name"] == "tw":
        cells = sorted((c for c in _cells(task, "ratio") if _value(c, metric) is not None), key=lambda c: c["ratio"])
        if cells:
            ranked = sorted(cells, key=lambda c: -_value(c, metric))
            best = ranked[0]
            near = min(cells, key=lambda c: abs(c["ratio"] - 4.333))
            other = ranked[1] if near is best and len(ranked) > 1 else near
            se = paired_se(best, other, metric)
            gap = _value(best, metric) - _value(other, metric)
            gap_text = f"{fmt(metric, gap)} points" + (f", {gap / se:.1f} s.e." if se else "")
            if near is best:
                lines.append(
                    f"Best T/w in this run: {best['ratio']:g}, the theorem's choice ({metric_name(metric)} "
                    f"{fmt(metric, _value(best, metric))}); runner-up T/w = {other['ratio']:g} at "
                    f"{fmt(metric, _value(other, metric))} ({gap_text} behind)."
                )
            else:
                lines.append(
                    f"Best T/w in this run: {best['ratio']:g} ({metric_name(metric)} {fmt(metric, _value(best, metric))}); "
                    f"the theorem's {near['ratio']:g} scores {fmt(metric, _value(near, metric))} ({gap_text} below)."
                )
            sizes = [c["average_cache"] for c in cells]
            lines.append(
                f"Measured average cache over the decode steps: {min(sizes):.0f} to {max(sizes):.0f} tokens across the "
                "ratios (the windows are chosen for one target size, but a short run's average depends on where it "
                "stops in the eviction cycle), so the ratios are not compared at exactly equal cache."
            )
        return lines
    groups: dict[str, list[dict[str, Any]]] = {}
    for c in task["cells"]:
        if c["kind"] in ("budget", "size"):
            groups.setdefault(c["label"], []).append(c)
    full = next((c for c in task["cells"] if _row(c) == "full"), None)
    any_se = False
    buzz_rows = set(_buzz_rows(task))
    for buzz in _buzz_rows(task):
        wins, losses, ties = [], [], []
        for label, cells in groups.items():
            by = {_row(c): c for c in cells}
            if buzz not in by or _value(by[buzz], metric) is None:
                continue
            # every other policy of the cell is a baseline (the paper's three, and any policy run beside them)
            base = [(p, _value(c, metric)) for p, c in by.items()
                    if p not in buzz_rows and _value(c, metric) is not None]
            if not base:
                continue
            best_p, best_v = (max if task["higher_is_better"] else min)(base, key=lambda x: x[1])
            v = _value(by[buzz], metric)
            se = paired_se(by[buzz], by[best_p], metric)
            entry = (label, best_p, best_v, v, se)
            if abs(v - best_v) < 1e-12:
                ties.append(entry)
            elif _better(task, v, best_v):
                wins.append(entry)
            else:
                losses.append(entry)
        n = len(wins) + len(losses) + len(ties)
        if not n:
            continue

        def gap(v: float, bv: float, se: float | None) -> str:
            nonlocal any_se
            if not se:
                return ""
            any_se = True
            return f", {abs(v - bv) / se:.1f} s.e."

        head = f"{_name(buzz)} beats every baseline at {len(wins)} of {n} settings"
        if wins:
            head += " (" + ", ".join(f"{lab}: {fmt(metric, v)} vs {_name(p)} {fmt(metric, bv)}{gap(v, bv, se)}"
                                     for lab, p, bv, v, se in wins) + ")"
        if ties:
            head += f", ties the best at {len(ties)}"
        if losses:
            parts = [f"{lab} (to {_name(p)}: {fmt(metric, bv)} vs {_name(buzz)} {fmt(metric, v)}{gap(v, bv, se)})"
                     for lab, p, bv, v, se in losses]
            head += "; it LOSES at " + ", ".join(parts)
        else:
            head += "; it loses nowhere"
        sig_w = sum(1 for _, _, bv, v, se in wins if se and abs(v - bv) >= 2 * se)
        sig_l = sum(1 for _, _, bv, v, se in losses if se and abs(v - bv) >= 2 * se)
        if any(se for *_, se in wins + losses):
            head += (f". Beyond 2 s.e.: {sig_w} of the {len(wins)} wins and {sig_l} of the {len(losses)} losses")
        lines.append(head + ".")
    if "buzz" in {_row(c) for c in task["cells"]} and "buzz_logn" in {_row(c) for c in task["cells"]}:
        def outputs(policy: str) -> dict[str, Any]:
            return {c["label"]: [(e["id"], e["scores"], e.get("text")) for e in c.get("samples", [])]
                    for c in task["cells"] if _row(c) == policy}

        a, b = outputs("buzz"), outputs("buzz_logn")
        if a and a == b:
            longest = task["prompt_tokens"]["max"] + task["decode_steps_per_sample"]
            floors = {p["params"].get("log_floor") for c in task["cells"] if _row(c) == "buzz_logn" for p in c["plans"]}
            lines.append(
                "BUZZ (log n) gives exactly BUZZ's outputs here"
                + (f": its logit scale max(log_512 n, 1) is 1 for every query that attends to at most 512 keys, and "
                   f"no query of this task attends to more than {longest}." if longest <= 512 and floors == {1.0} else ".")
            )
    if full is not None and _value(full, metric) == 0.0 and task["higher_is_better"]:
        lines.append(
            f"The full cache itself scores 0 {metric_name(metric)} here: the model cannot do this task even without "
            "eviction, so these cells cannot tell the policies apart."
        )
    elif full is not None and _value(full, metric) is not None:
        fv = _value(full, metric)
        for buzz in _buzz_rows(task):
            pts = []
            for label, cells in groups.items():
                c = next((c for c in cells if _row(c) == buzz), None)
                if c is None or _value(c, metric) is None or c["kind"] != "budget":
                    continue
                v = _value(c, metric)
                ratio = (fv / v) if metric == "ppl" else (v / fv if fv else float("nan"))
                pts.append((c["realised_budget"], label, ratio >= 0.99))
            pts.sort()
            k = len(pts)
            while k > 0 and pts[k - 1][2]:
                k -= 1
            if pts and k < len(pts):
                b, lab, _ = pts[k]
                lines.append(f"{_name(buzz)} keeps at least 99% of the full cache's {metric_name(metric)} at every "
                             f"budget from a realised {_pct(b)} ({lab} requested) up.")
            elif pts:
                lines.append(f"{_name(buzz)} stays below 99% of the full cache's {metric_name(metric)} at its largest "
                             f"budget here ({_pct(pts[-1][0])} realised).")
    if any_se:
        lines.append(
            f"s.e. = paired standard error of the per-sample difference over the n = {task['n_samples']} samples; "
            "gaps under about 2 s.e. are within noise."
        )
    return lines


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


# =========================================================================== console
def _pivot(task: dict[str, Any], kind: str) -> tuple[list[str], list[list[str]]]:
    metric = task["metric"]
    cells = _cells(task, kind)
    labels = []
    for c in cells:
        if c["label"] not in labels:
            labels.append(c["label"])
    policies = _order(list(dict.fromkeys(_row(c) for c in cells)))
    header = ["policy"] + labels
    rows = []
    for p in policies:
        row = [_name(p)]
        for lab in labels:
            c = next((c for c in cells if _row(c) == p and c["label"] == lab), None)
            if c is None:
                row.append("")
            elif c.get("equalise"):  # stream: both equalisations side by side, each cell's mean and peak
                cap = "-" if c.get("capacity") is None else str(c["capacity"])
                row.append(f"{fmt(metric, _value(c, metric))} (avg {c['average_cache']:.0f}, cap {cap})")
            else:
                row.append(f"{fmt(metric, _value(c, metric))} ({_pct(c['realised_budget'])})" if kind == "budget"
                           else f"{fmt(metric, _value(c, metric))} (avg {c['average_cache']:.0f})")
        rows.append(row)
    return header, rows


def _text_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths))
    sep = "  ".join("-" * w for w in widths)
    body = ["  ".join(str(x).ljust(w) for x, w in zip(r, widths)) for r in rows]
    return "\n".join([line, sep, *body])


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
    return "\n".join(out)


def console_summary(doc: dict[str, Any]) -> str:
    out = []
    meta = doc["meta"]
    out.append(f"kvpolicy compare: model {meta['model']} on {meta['device']} ({meta['dtype']}), "
               f"{meta['wall_seconds'] / 60:.1f} min")
    for task in doc["tasks"].values():
        metric = task["metric"]
        arrow = "higher is better" if task["higher_is_better"] else "lower is better"
        out.append(f"\n== {task['title']} [{task['name']}], {task['n_samples']} samples; "
                   f"{metric_name(metric)}, {arrow}")
        full = next((c for c in task["cells"] if _row(c) == "full"), None)
        if full is not None:
            out.append(f"full cache: {fmt(metric, _value(full, metric))}")
        for kind, what in (("budget", "cell = value (realised budget); columns = requested budget"),
                           ("size", "cell = value (measured average cache size); columns = fixed cache size"),
                           ("ratio", "cell = value (measured average cache size); columns = T/w")):
            if _cells(task, kind):
                if task["name"] == "stream":
                    what = STREAM_CAPTION[kind]
                out.append(what)
                out.append(_text_table(*_pivot(task, kind)))
        for line in verdicts(task):
            out.append("* " + line)
    return "\n".join(out)


# =========================================================================== plots
def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _scale(metric: str, v: float | None) -> float | None:
    if v is None:
        return None
    return v if metric == "ppl" else 100 * v


def _budget_panel(ax: Any, task: dict[str, Any], metric: str, cells: list[dict[str, Any]], title: str) -> None:
    policies = _order(list(dict.fromkeys(_row(c) for c in cells if c["kind"] == "budget")))
    if len({c["label"] for c in cells if c["kind"] == "budget"}) == 1:  # one budget: bars, not lines
        bud = [c for c in cells if c["kind"] == "budget"]
        for i, p in enumerate(policies):
            c = next(c for c in bud if _row(c) == p)
            v = _scale(metric, c["metrics"].get(metric)) or 0.0
            ax.bar(i, v, color=COLORS.get(p), label=_name(p))
            ax.text(i, v, fmt(metric, c["metrics"].get(metric)), ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(policies)))
        ax.set_xticklabels([f"{_name(p)}\n{_pct(next(c for c in bud if _row(c) == p)['realised_budget'])}"
                            for p in policies], fontsize=7)
        full = next((c for c in cells if _row(c) == "full"), None)
        if full is not None and full["metrics"].get(metric) is not None:
            ax.axhline(_scale(metric, full["metrics"][metric]), color="black", linestyle="--", linewidth=1.2,
                       label="Full cache")
        ax.set_ylabel(metric_name(metric) + ("" if metric == "ppl" else " (%)"))
        ax.set_title(f"{title}\n(requested budget {bud[0]['label']}; realised under each bar)", fontsize=9)
        if metric != "ppl":
            ax.set_ylim(0, max(5.0, ax.get_ylim()[1]))
        ax.grid(True, axis="y", alpha=0.3)
        return
    for p in policies:
        pts = sorted((100 * c["realised_budget"], _scale(metric, m)) for c in cells
                     if _row(c) == p and c["kind"] == "budget" and (m := c["metrics"].get(metric)) is not None)
        if pts:
            ax.plot([x for x, _ in pts], [y for _, y in pts], label=_name(p), color=COLORS.get(p),
                    **STYLES.get(p, {"marker": "o", "linewidth": 1.4}))
    full = next((c for c in cells if _row(c) == "full"), None)
    if full is not None and full["metrics"].get(metric) is not None:
        ax.axhline(_scale(metric, full["metrics"][metric]), color="black", linestyle="--", linewidth=1.2, label="Full cache")
    ax.set_xlabel("realised KV cache budget (%)")
    ax.set_ylabel(metric_name(metric) + ("" if metric == "ppl" else " (%)"))
    if metric == "ppl":
        ax.set_yscale("log")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)


def plot_budget(task: dict[str, Any], path: Path, model: str) -> Path | None:
    if not _cells(task, "budget") or task["name"] == "stream":
        return None
    plt = _plt()
    metrics = list(task["metrics"]) if task["name"] in ("summ",) else [task["metric"]]
    panels: list[tuple[str, list[dict[str, Any]], str]] = [(m, task["cells"], metric_name(m)) for m in metrics]
    if task["metric"] == "ppl":
        panels = [("ppl", task["cells"], "all policies (log scale)"),
                  ("ppl_zoom", [c for c in task["cells"] if _row(c) != "local"], "zoom: local window left out")]
    if task["name"] == "qa" and task["cells"] and task["cells"][0]["groups"]:
        keys = list(task["cells"][0]["groups"])
        panels = [(task["metric"], task["cells"], "average over gold positions")]
        for k in keys:
            sub = [{**c, "metrics": c["groups"].get(k, {})} for c in task["cells"]]
            panels.append((task["metric"], sub, f"gold document at position {k}"))
    fig, axes = plt.subplots(1, len(panels), figsize=(max(7.5, 4.4 * len(panels)), 4.2), squeeze=False)
    for ax, (m, cells, title) in zip(axes[0], panels):
        if m == "ppl_zoom":
            _budget_panel(ax, task, "ppl", cells, title)
            ax.set_yscale("linear")
        else:
            _budget_panel(ax, task, m, cells, title)
    _shared_legend(fig, axes[0], columns=6, fontsize=9)
    fig.suptitle(f"{task['title']}\n{model}, n = {task['n_samples']}", fontsize=10)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _shared_legend(fig: Any, axes: Any, *, columns: int, fontsize: int) -> None:
    """One legend below the panels: every label once, in the order the panels first show it."""
    handles: dict[str, Any] = {}
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=min(len(handles), columns),
               frameon=False, fontsize=fontsize)


def plot_stream(task: dict[str, Any], path: Path, model: str) -> Path | None:
    """Stream task: perplexity against the measured average cache (equal-mean cells) and against
    the capacity (equal-capacity cells), one line per row, the full cache as a reference line."""
    cells = [c for c in task["cells"] if c.get("equalise") and c["metrics"].get(task["metric"]) is not None]
    if task["name"] != "stream" or not cells:
        return None
    plt = _plt()
    metric = task["metric"]
    panels = [(eq, x) for eq, x in (("mean", "average_cache"), ("capacity", "capacity"))
              if any(c["equalise"] == eq for c in cells)]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels) + 1.0, 4.2), squeeze=False)
    full = next((c for c in task["cells"] if _row(c) == "full"), None)
    rows = _order(list(dict.fromkeys(_row(c) for c in cells)))
    for ax, (eq, xkey) in zip(axes[0], panels):
        for r in rows:
            pts = sorted((c[xkey], c["metrics"][metric]) for c in cells
                         if _row(c) == r and c["equalise"] == eq and c[xkey] is not None)
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], label=_name(r), color=COLORS.get(r),
                        **STYLES.get(r, {"marker": "o", "linewidth": 1.4, "linestyle": ":"}))
        if full is not None:
            ax.axhline(full["metrics"][metric], color="black", linestyle="--", linewidth=1.2, label="Full cache")
        ax.set_yscale("log")
        ax.set_xlabel("measured average cache (tokens)" if eq == "mean" else "capacity: peak tokens per head and layer")
        ax.set_ylabel(metric_name(metric))
        ax.set_title(f"equal {eq}" + (" (the paper's definition)" if eq == "mean" else " (equal peak memory)"), fontsize=9)
        ax.grid(True, alpha=0.3)
    _shared_legend(fig, axes[0], columns=4, fontsize=8)
    fig.suptitle(f"{task['title']}\n{model}, n = {task['n_samples']} documents x {task['decode_steps_per_sample']} tokens",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_sizes(task: dict[str, Any], path: Path, model: str) -> Path | None:
    cells = _cells(task, "size")
    if not cells or task["name"] == "stream":
        return None
    plt = _plt()
    metric = task["metric"]
    sizes = sorted({c["size"] for c in cells})
    policies = _order(list(dict.fromkeys(_row(c) for c in cells)))
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    width = 0.8 / max(len(policies), 1)
    for j, p in enumerate(policies):
        ys = [_scale(metric, next((c["metrics"].get(metric) for c in cells if _row(c) == p and c["size"] == s), None)) for s in sizes]
        xs = [i + (j - (len(policies) - 1) / 2) * width for i in range(len(sizes))]
        ax.bar(xs, [y or 0 for y in ys], width=width, label=_name(p), color=COLORS.get(p))
    full = next((c for c in task["cells"] if _row(c) == "full"), None)
    if full is not None:
        ax.axhline(_scale(metric, full["metrics"][metric]), color="black", linestyle="--", label="Full cache")
    ax.set_xticks(range(len(sizes)))
    ax.set_xticklabels([f"cache {s}" for s in sizes])
    ax.set_ylabel(metric_name(metric))
    if metric == "ppl":
        ax.set_yscale("log")
    ax.set_title(f"{task['title']}\nat fixed average cache sizes: {model}, n = {task['n_samples']}", fontsize=10)
    ax.legend(fontsize=8, ncol=2)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_tw(task: dict[str, Any], path: Path, model: str) -> Path | None:
    cells = sorted(_cells(task, "ratio"), key=lambda c: c["ratio"])
    if not cells:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for m, style in (("rouge1", "o-"), ("rouge2", "s-"), ("rougeL", "^-"), ("mean", "D-")):
        ax.plot([c["ratio"] for c in cells], [100 * c["metrics"][m] for c in cells], style, label=metric_name(m),
                linewidth=2.2 if m == "mean" else 1.3)
    full = next((c for c in task["cells"] if _row(c) == "full"), None)
    if full is not None:
        ax.axhline(100 * full["metrics"]["mean"], color="black", linestyle="--", linewidth=1, label="Full cache (mean)")
    from ..policies.buzz import threshold_ratio

    stride = (cells[0]["plans"][0]["params"].get("stride", 5) if cells[0]["plans"] else 5)
    opt = threshold_ratio(stride)
    ax.axvline(opt, color="purple", linestyle=":", label=f"theorem: T/w = {opt:.2f}")
    lo, hi = min(c["average_cache"] for c in cells), max(c["average_cache"] for c in cells)
    ax.set_xlabel("T / w")
    ax.set_ylabel("ROUGE (%)")
    ax.set_title(f"BUZZ, stride {stride}, cache size {cells[0]['size']} (measured average {lo:.0f}-{hi:.0f}): "
                 f"{model}, n = {task['n_samples']}", fontsize=10)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.grid(True, alpha=0.3)
    fig.set_size_inches(8.6, 4.0)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_heatmap(task: dict[str, Any], path: Path, model: str) -> Path | None:
    if task.get("group_names") != ["length", "depth"]:
        return None
    plt = _plt()
    metric = task["metric"]
    cells = [c for c in task["cells"] if c["groups"]]
    if not cells:
        return None
    keys = [tuple(k.split(",")) for k in cells[0]["groups"]]
    lengths = sorted({int(k[0]) for k in keys})
    depths = sorted({float(k[1]) for k in keys})
    policies = _order(list(dict.fromkeys(_row(c) for c in cells)))
    labels = [lab for lab in dict.fromkeys(c["label"] for c in cells if _row(c) != "full")]
    nrows, ncols = len(policies), max(len(labels), 1)
    fig, axes = plt.subplots(nrows, ncols, figsize=(2.4 * ncols + 1.4, 1.55 * nrows + 1.0), squeeze=False,
                             layout="constrained")
    im = None
    for i, p in enumerate(policies):
        for j in range(ncols):
            ax = axes[i][j]
            if p == "full":
                c = next(c for c in cells if _row(c) == "full")
                if j > 0:
                    ax.axis("off")
                    continue
            else:
                c = next((c for c in cells if _row(c) == p and c["label"] == labels[j]), None)
                if c is None:
                    ax.axis("off")
                    continue
            grid = [[100 * (c["groups"].get(f"{n},{d:g}", c["groups"].get(f"{n},{d}", {})).get(metric, float("nan")))
                     for n in lengths] for d in depths]
            im = ax.imshow(grid, vmin=0, vmax=100, cmap="RdYlGn", aspect="auto")
            for yi, row in enumerate(grid):
                for xi, v in enumerate(row):
                    if not math.isnan(v):
                        ax.text(xi, yi, f"{v:.0f}", ha="center", va="center", fontsize=8)
            ax.set_xticks(range(len(lengths)))
            ax.set_xticklabels([str(n) for n in lengths], fontsize=7)
            ax.set_yticks(range(len(depths)))
            ax.set_yticklabels([f"{d:.0%}" for d in depths], fontsize=7)
            title = _name(p) if p == "full" else f"{_name(p)} {c['label']} ({_pct(c['realised_budget'])})"
            ax.set_title(title, fontsize=8)
            if j == 0:
                ax.set_ylabel("depth", fontsize=8)
            if i == nrows - 1:
                ax.set_xlabel("prompt tokens", fontsize=8)
    if im is not None:
        fig.colorbar(im, ax=axes, shrink=0.6, label=f"{metric_name(metric)} (%)")
    fig.suptitle(f"{task['title']}: {model}\npanels: policy, requested budget (realised)", fontsize=10)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# =========================================================================== markdown
def _task_class(name: str) -> Any:
    """The registered task class behind a results.json task (``None``: not registered here)."""
    from .tasks import task_registry

    return task_registry().get(name)


def _task_md(task: dict[str, Any], plots: list[Path], out_dir: Path) -> str:
    metric = task["metric"]
    lines = [f"## {task['title']} (`{task['name']}`)", ""]
    lines.append(f"- Data: {task['data']}")
    pt = task["prompt_tokens"]
    lines.append(f"- Samples: {task['n_samples']}; prompt tokens {pt['min']}-{pt['max']} (median {pt['median']:.0f}); "
                 f"up to {task['decode_steps_per_sample']} decode steps per sample")
    for n in task["notes"]:
        lines.append(f"- {n}")
    lines.append(f"- Metric: {metric_name(metric)}, {'higher' if task['higher_is_better'] else 'lower'} is better"
                 + ("" if metric == "ppl" else "; values in %"))
    lines.append(f"- Task time: {task['seconds']:.0f} s")
    lines.append("")
    lines.append(f"Reproduce this table: `{task['command']}`")
    lines.append("")
    full = next((c for c in task["cells"] if _row(c) == "full"), None)
    if full is not None:
        lines.append(f"Full cache: **{fmt(metric, _value(full, metric))}**")
        lines.append("")
    for kind, what in (("budget", "Each cell: value (realised budget). Columns: requested budget."),
                       ("size", "Each cell: value (measured average cache size in tokens). Columns: fixed average cache size (the same for every policy)."),
                       ("ratio", "Each cell: value (measured average cache size). Columns: T/w.")):
        if _cells(task, kind):
            if task["name"] == "stream":
                what = STREAM_CAPTION[kind]
            lines.append(what)
            lines.append("")
            lines.append(_md_table(*_pivot(task, kind)))
            lines.append("")
    cls = _task_class(task["name"])
    if cls is not None:
        lines += cls.report_markdown(task)
    v = verdicts(task)
    if v:
        lines.append("**Verdict (computed from the cells above):**")
        lines.append("")
        lines += [f"- {x}" for x in v]
        lines.append("")
    # every cell
    extra = [m for m in task["metrics"] if m != metric] + [metric]
    header = (["policy", "requested", "equalised", "realised", "avg cache", "capacity", "full avg"]
              + [metric_name(m) for m in extra] + ["vs full", "decode s"])
    rows = []
    fv = _value(full, metric) if full is not None else None
    for c in task["cells"]:
        v = _value(c, metric)
        delta = "-" if fv is None or v is None or _row(c) == "full" else (
            f"{v / fv:.2f}x" if metric == "ppl" else f"{100 * (v - fv):+.1f}")
        req = _pct(c["requested_budget"]) if c["kind"] in ("budget", "full") else (
            f"size {c['size']}" if c["kind"] == "size" else f"T/w {c['ratio']:g}")
        cap = c.get("capacity")
        rows.append([_name(_row(c)), req, c.get("equalise") or "mean", _pct(c["realised_budget"]),
                     f"{c['average_cache']:.1f}", "unbounded" if cap is None else str(cap),
                     f"{c['full_average_cache']:.1f}"] + [fmt(m, c["metrics"].get(m)) for m in extra]
                    + [delta, f"{c['seconds']:.1f}"])
    lines.append("<details><summary>Every cell: requested and realised budgets side by side, average cache sizes, all metrics</summary>")
    lines.append("")
    lines.append(_md_table(header, rows))
    lines.append("")
    lines.append("</details>")
    lines.append("")
    groups = [c for c in task["cells"] if c["groups"]]
    if groups and task["name"] == "qa":
        keys = list(groups[0]["groups"])
        header = ["policy", "requested", "realised"] + [f"gold at {k}" for k in keys] + ["average"]
        rows = [[_name(_row(c)), c["label"], _pct(c["realised_budget"])]
                + [fmt(metric, c["groups"][k].get(metric)) for k in keys] + [fmt(metric, _value(c, metric))]
                for c in groups]
        lines.append("By position of the gold document:")
        lines.append("")
        lines.append(_md_table(header, rows))
        lines.append("")
    # resolved parameters
    lines.append("<details><summary>Resolved parameters of every policy (PolicyPlan.as_dict per prompt length)</summary>")
    lines.append("")
    header = ["policy", "cell", "parameters", "capacity", "planned realised", "planned avg size", "prompt / run tokens"]
    rows = []
    for c in task["cells"]:
        plans = c["plans"]
        for i, p in enumerate(plans[:4]):
            params = ", ".join(f"{k}={v}" for k, v in p["params"].items()) or "-"
            rows.append([_name(_row(c)) if i == 0 else "", c["label"] if i == 0 else "", params,
                         str(p["capacity"]), _pct(p["realised_budget"]), f"{p['average_size']:.1f}",
                         f"{p['prompt_length']} / {p['context_length']}"])
        if len(plans) > 4:
            rows.append(["", "", f"... {len(plans) - 4} more prompt lengths in results.json", "", "", "", ""])
    lines.append(_md_table(header, rows))
    lines.append("")
    lines.append("</details>")
    lines.append("")
    for p in plots:
        lines.append(f"![{p.stem}]({p.relative_to(out_dir).as_posix()})")
        lines.append("")
    lines.append("<details><summary>The command behind each cell</summary>")
    lines.append("")
    for c in task["cells"]:
        lines.append(f"- {_name(_row(c))} {c['label']}: `{c['command']}`")
    lines.append("")
    lines.append("</details>")
    lines.append("")
    return "\n".join(lines)


def _paper_md(names: Sequence[str]) -> str:
    keys = [k for k in ("summ", "ppl", "tw") if k in names]
    if not keys:
        return ""
    lines = ["## For reference only: the paper's Llama-2-7B numbers (not measured here)", "",
             "These are copied from the BUZZ paper (Llama-2-7B, its own data pipeline). They are not comparable "
             "cell by cell with the tables above (different model, sizes and prompts) and are shown only so the "
             "shapes can be compared.", ""]
    for k in keys:
        t = PAPER_TABLES[k]
        lines.append(f"*{t['caption']}*")
        lines.append("")
        lines.append(_md_table([""] + t["columns"], [[r] + [f"{v:.{t['decimals']}f}" for v in vals] for r, vals in t["rows"].items()]))
        lines.append("")
    return "\n".join(lines)


def document(meta: dict[str, Any], results: Mapping[str, TaskResult]) -> dict[str, Any]:
    """The report's document, as ``results.json`` holds it: the run's ``meta`` and each task's
    typed results (:class:`~kvpolicy.eval.results.TaskResult`) in their serialised form."""
    return {"meta": meta, "tasks": {name: r.as_dict() for name, r in results.items()}}


def write_report(doc: dict[str, Any], out_dir: str | Path) -> dict[str, Any]:
    """Write ``report.md``, ``results.json`` and the PNGs into ``out_dir``; return their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = doc["meta"]
    model = meta["model"]
    all_plots: list[Path] = []
    sections = []
    for name, task in doc["tasks"].items():
        plots = []
        for fn, suffix in ((plot_budget, "budget"), (plot_sizes, "sizes"), (plot_stream, "stream"), (plot_tw, "tw"),
                           (plot_heatmap, "heatmap")):
            p = fn(task, out / f"{name}_{suffix}.png", model)
            if p is not None:
                plots.append(p)
        cls = _task_class(name)
        if cls is not None:
            plots += cls.report_plots(task, out, model)
        task["plots"] = [p.name for p in plots]
        all_plots += plots
        sections.append(_task_md(task, plots, out))
    info = meta.get("model_info") or {}
    geo = (f" ({info.get('parameters', 0) / 1e6:.0f}M parameters, {info.get('layers')} layers, {info.get('heads')} heads, "
           f"{info.get('kv_heads')} KV heads)") if info else ""
    head = [
        "# kvpolicy compare report",
        "",
        f"Generated {meta['date']} by `{meta['command']}` in {meta['wall_seconds'] / 60:.1f} min.",
        "",
        f"- Model: **{model}**{geo}; {meta['device']}, {meta['dtype']}, {meta['threads']} thread(s); chat template: {meta['chat_template']}",
        f"- Software: kvpolicy {meta['kvpolicy']}, torch {meta['torch']}, transformers {meta['transformers']}, Python {meta['python']}; {meta['machine']}",
        f"- Policies: {', '.join(_name(p) for p in meta['policies'])}; requested budgets: {', '.join(_pct(b) for b in meta['budgets']) or 'none'}",
        f"- Data: {'embedded text from installed packages' if not meta['data_dir'] else meta['data_dir']} (each task says which)",
        "",
        "How to read: a *budget* is the average number of cached keys each decode step attended to, over what the "
        "full cache holds at the same steps (the BUZZ paper's definition). Every budget shown is **realised** "
        "(measured from the cache sizes during this run); the requested budget the parameters were planned for is "
        "shown beside it. Every number below was measured in this run; the paper's numbers appear only in the last, "
        "separate section. Decoding is greedy; each configuration starts from the same prefill of each prompt, "
        "on which its policy evicts as after its own prefill. This is a small model and a handful of samples: "
        "read differences against the standard errors given under each task.",
        "",
        "## Summary",
        "",
    ]
    for name, task in doc["tasks"].items():
        for v in verdicts(task)[:3]:
            head.append(f"- **{name}**: {v}")
    head.append("")
    text = "\n".join(head) + "\n" + "\n".join(sections) + "\n" + _paper_md(list(doc["tasks"]))
    (out / "report.md").write_text(text, encoding="utf-8")
    (out / "results.json").write_text(json.dumps(_clean(doc), indent=1), encoding="utf-8")
    return {"report": out / "report.md", "results": out / "results.json", "plots": all_plots}


def _clean(x: Any) -> Any:
    if isinstance(x, float):
        return None if math.isnan(x) or math.isinf(x) else x
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, Path):
        return str(x)
    return x
