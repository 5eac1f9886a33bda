"""The ``kvpolicy compare`` report: console tables, ``report.md``, PNG plots and ``results.json``.

Everything here is computed from the results of the run that writes the report; the only numbers
not measured in the run are the BUZZ paper's own (Llama-2-7B), which appear in a separate,
labelled section (each task's :attr:`~kvpolicy_tools.eval.tasks.Task.paper_table`) and are never mixed
into our tables or plots.

What is particular to a task (its captions, verdicts, budget-plot panels, extra tables and plots,
paper table) comes from its :class:`~kvpolicy_tools.eval.tasks.Task` hooks, so no task is named here;
the shared formatting is :mod:`kvpolicy_tools.eval.display`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .display import (
    COLORS,
    STYLES,
    Panel,
    better as _better,
    cells as _cells,
    fmt,
    full_cell,
    is_reference_cell,
    md_table as _md_table,
    metric_name,
    order as _order,
    paired_se,
    pct as _pct,
    plot_scale as _scale,
    policy_name as _name,
    pyplot as _plt,
    row as _row,
    shared_legend,
    shown_in_percent,
    value as _value,
)
from kvpolicy.policies import BUZZ

from .results import TaskResult
from .tasks import Task, log_n_variant_of, policy_class, task_registry

__all__ = ["document", "write_report", "console_summary", "verdicts", "fmt", "metric_name", "paired_se"]


def _task_class(name: str) -> type[Task]:
    """The registered task class behind a results.json task (the base :class:`Task`, whose hooks
    are the defaults, when it is not registered here)."""
    return task_registry().get(name, Task)


#: The method the verdicts are about (the BUZZ paper's): every row whose policy is a BUZZ, its
#: presets and T/w variants included, against every other policy of the cell.
SUBJECT = BUZZ


def _buzz_rows(task: dict[str, Any]) -> list[str]:
    rows = dict.fromkeys(_row(c) for c in task["cells"] if _is_subject(c["policy"]))
    return _order(list(rows))


def _is_subject(policy: str) -> bool:
    cls = policy_class(policy)
    return cls is not None and issubclass(cls, SUBJECT)


# =========================================================================== verdicts
def verdicts(task: dict[str, Any]) -> list[str]:
    """Plain-language BUZZ-vs-baselines statements (a baseline: every other policy of the cell), computed
    from the cells (never hardcoded)."""
    own = _task_class(task["name"]).report_verdicts(task)
    if own is not None:
        return own
    metric = task["metric"]
    lines: list[str] = []
    groups: dict[str, list[dict[str, Any]]] = {}
    for c in task["cells"]:
        if c["kind"] in ("budget", "size"):
            groups.setdefault(c["label"], []).append(c)
    full = full_cell(task)
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
    rows = set(_row(c) for c in task["cells"])
    for scaled in _order(list(rows)):
        plain = log_n_variant_of(scaled)
        if plain is None or plain not in rows:
            continue

        def outputs(policy: str) -> dict[str, Any]:
            return {c["label"]: [(e["id"], e["scores"], e.get("text")) for e in c.get("samples", [])]
                    for c in task["cells"] if _row(c) == policy}

        a, b = outputs(plain), outputs(scaled)
        if a and a == b:
            longest = task["prompt_tokens"]["max"] + task["decode_steps_per_sample"]
            floors = {p["params"].get("log_floor") for c in task["cells"] if _row(c) == scaled for p in c["plans"]}
            lines.append(
                f"{_name(scaled)} gives exactly {_name(plain)}'s outputs here"
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
                # (the task says which way its metric is better: a plug-in metric is unknown to METRICS)
                ratio = (v / fv if fv else float("nan")) if task["higher_is_better"] else (fv / v if v else float("inf"))
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
        full = full_cell(task)
        if full is not None:
            out.append(f"full cache: {fmt(metric, _value(full, metric))}")
        for kind, what in (("budget", "cell = value (realised budget); columns = requested budget"),
                           ("size", "cell = value (measured average cache size); columns = fixed cache size"),
                           ("ratio", "cell = value (measured average cache size); columns = T/w")):
            if _cells(task, kind):
                out.append(_task_class(task["name"]).table_caption(kind) or what)
                out.append(_text_table(*_pivot(task, kind)))
        for line in verdicts(task):
            out.append("* " + line)
    return "\n".join(out)


# =========================================================================== plots
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
        full = next((c for c in cells if is_reference_cell(c)), None)
        if full is not None and full["metrics"].get(metric) is not None:
            ax.axhline(_scale(metric, full["metrics"][metric]), color="black", linestyle="--", linewidth=1.2,
                       label="Full cache")
        ax.set_ylabel(metric_name(metric) + (" (%)" if shown_in_percent(metric) else ""))
        ax.set_title(f"{title}\n(requested budget {bud[0]['label']}; realised under each bar)", fontsize=9)
        if shown_in_percent(metric):
            ax.set_ylim(0, max(5.0, ax.get_ylim()[1]))
        ax.grid(True, axis="y", alpha=0.3)
        return
    for p in policies:
        pts = sorted((100 * c["realised_budget"], _scale(metric, m)) for c in cells
                     if _row(c) == p and c["kind"] == "budget" and (m := c["metrics"].get(metric)) is not None)
        if pts:
            ax.plot([x for x, _ in pts], [y for _, y in pts], label=_name(p), color=COLORS.get(p),
                    **STYLES.get(p, {"marker": "o", "linewidth": 1.4}))
    full = next((c for c in cells if is_reference_cell(c)), None)
    if full is not None and full["metrics"].get(metric) is not None:
        ax.axhline(_scale(metric, full["metrics"][metric]), color="black", linestyle="--", linewidth=1.2, label="Full cache")
    ax.set_xlabel("realised KV cache budget (%)")
    ax.set_ylabel(metric_name(metric) + (" (%)" if shown_in_percent(metric) else ""))
    if not shown_in_percent(metric):
        ax.set_yscale("log")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)


def plot_budget(task: dict[str, Any], path: Path, model: str) -> Path | None:
    """Quality against the realised budget, one panel per :meth:`Task.budget_panels`."""
    panels: list[Panel] = _task_class(task["name"]).budget_panels(task) if _cells(task, "budget") else []
    if not panels:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, len(panels), figsize=(max(7.5, 4.4 * len(panels)), 4.2), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        _budget_panel(ax, task, panel.metric, panel.cells, panel.title)
        if panel.linear:
            ax.set_yscale("linear")
    shared_legend(fig, axes[0], columns=6, fontsize=9)
    fig.suptitle(f"{task['title']}\n{model}, n = {task['n_samples']}", fontsize=10)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_sizes(task: dict[str, Any], path: Path, model: str) -> Path | None:
    """Quality at fixed average cache sizes, as bars (cells that say how they were equalised are
    left to their task's own plots: bars cannot show two equalisations)."""
    cells = [c for c in _cells(task, "size") if not c.get("equalise")]
    if not cells:
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
    full = full_cell(task)
    if full is not None:
        ax.axhline(_scale(metric, full["metrics"][metric]), color="black", linestyle="--", label="Full cache")
    ax.set_xticks(range(len(sizes)))
    ax.set_xticklabels([f"cache {s}" for s in sizes])
    ax.set_ylabel(metric_name(metric))
    if not shown_in_percent(metric):
        ax.set_yscale("log")
    ax.set_title(f"{task['title']}\nat fixed average cache sizes: {model}, n = {task['n_samples']}", fontsize=10)
    ax.legend(fontsize=8, ncol=2)
    ax.grid(True, axis="y", alpha=0.3)
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
    labels = [lab for lab in dict.fromkeys(c["label"] for c in cells if not is_reference_cell(c))]
    references = {_row(c) for c in cells if is_reference_cell(c)}
    nrows, ncols = len(policies), max(len(labels), 1)
    fig, axes = plt.subplots(nrows, ncols, figsize=(2.4 * ncols + 1.4, 1.55 * nrows + 1.0), squeeze=False,
                             layout="constrained")
    im = None
    for i, p in enumerate(policies):
        for j in range(ncols):
            ax = axes[i][j]
            if p in references:
                c = next(c for c in cells if _row(c) == p)
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
            title = _name(p) if p in references else f"{_name(p)} {c['label']} ({_pct(c['realised_budget'])})"
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
                 + ("; values in %" if shown_in_percent(metric) else ""))
    lines.append(f"- Task time: {task['seconds']:.0f} s")
    lines.append("")
    lines.append(f"Reproduce this table: `{task['command']}`")
    lines.append("")
    cls = _task_class(task["name"])
    full = full_cell(task)
    if full is not None:
        lines.append(f"Full cache: **{fmt(metric, _value(full, metric))}**")
        lines.append("")
    for kind, what in (("budget", "Each cell: value (realised budget). Columns: requested budget."),
                       ("size", "Each cell: value (measured average cache size in tokens). Columns: fixed average cache size (the same for every policy)."),
                       ("ratio", "Each cell: value (measured average cache size). Columns: T/w.")):
        if _cells(task, kind):
            lines.append(cls.table_caption(kind) or what)
            lines.append("")
            lines.append(_md_table(*_pivot(task, kind)))
            lines.append("")
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
        delta = "-" if fv is None or v is None or is_reference_cell(c) else (
            f"{100 * (v - fv):+.1f}" if shown_in_percent(metric) else f"{v / fv:.2f}x")
        req = _pct(c["requested_budget"]) if c["kind"] == "budget" or is_reference_cell(c) else (
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
    lines += cls.report_details(task)
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
    """The separate section of the paper's own numbers, for the tasks of this run that have them."""
    tables = sorted((t for t in (_task_class(n).paper_table for n in names) if t), key=lambda t: t["rank"])
    if not tables:
        return ""
    lines = ["## For reference only: the paper's Llama-2-7B numbers (not measured here)", "",
             "These are copied from the BUZZ paper (Llama-2-7B, its own data pipeline). They are not comparable "
             "cell by cell with the tables above (different model, sizes and prompts) and are shown only so the "
             "shapes can be compared.", ""]
    for t in tables:
        lines.append(f"*{t['caption']}*")
        lines.append("")
        lines.append(_md_table([""] + t["columns"], [[r] + [f"{v:.{t['decimals']}f}" for v in vals] for r, vals in t["rows"].items()]))
        lines.append("")
    return "\n".join(lines)


def document(meta: dict[str, Any], results: Mapping[str, TaskResult]) -> dict[str, Any]:
    """The report's document, as ``results.json`` holds it: the run's ``meta`` and each task's
    typed results (:class:`~kvpolicy_tools.eval.results.TaskResult`) in their serialised form."""
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
        for fn, suffix in ((plot_budget, "budget"), (plot_sizes, "sizes"), (plot_heatmap, "heatmap")):
            p = fn(task, out / f"{name}_{suffix}.png", model)
            if p is not None:
                plots.append(p)
        plots += _task_class(name).report_plots(task, out, model)
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
