"""Reports: the machine a run used, log-log slope fits, Markdown tables and PNG plots."""

from __future__ import annotations

import importlib.metadata as md
import math
import os
import platform
import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvpolicy.validation import check_bool

__all__ = [
    "fit_slope",
    "median_interval",
    "machine",
    "machine_line",
    "markdown_table",
    "plot_breakdown",
    "plot_complexity",
    "plot_decode",
    "save_figure",
    "slopes",
]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:  # pragma: no cover - not Linux
        pass
    return platform.processor() or platform.machine()


def machine(*, shared: bool | None = None) -> dict[str, Any]:
    """What the run ran on. ``shared=None`` infers it from the load average before the run
    (above half the cores: other work was running)."""

    shared = check_bool("shared", shared, allow_none=True)
    cores = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except OSError:  # pragma: no cover
        load = float("nan")
    info: dict[str, Any] = {
        "cpu": _cpu_model(),
        "cores": cores,
        "load_average_1min": round(load, 2),
        "shared": bool(load > cores / 2) if shared is None else shared,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
    }
    for dist in ("torch", "transformers", "numpy"):
        try:
            info[dist] = md.version(dist)
        except md.PackageNotFoundError:
            info[dist] = None
    try:
        import torch  # optional: names torch's threads in the machine description

        info["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:  # pragma: no cover
        pass
    return info


def machine_line(info: Mapping[str, Any]) -> str:
    """One Markdown line describing ``info`` (from :func:`machine`)."""
    shared = (
        f"**shared** with other jobs (1-min load average {info['load_average_1min']} at the start)"
        if info.get("shared")
        else f"not shared (1-min load average {info['load_average_1min']} at the start)"
    )
    parts = [
        f"{info['cpu']}, {info['cores']} cores",
        f"torch {info.get('torch')} ({info.get('torch_threads')} threads)",
        f"transformers {info.get('transformers')}",
        f"Python {info['python']}",
    ]
    if info.get("gpu"):
        parts.insert(1, f"GPU {info['gpu']}")
    return "; ".join(parts) + f"; {shared}; {info['date']}"


def fit_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ``log y`` against ``log x`` (the exponent ``k`` of ``y ~ x^k``)."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x > 0 and y > 0]
    if len(pts) < 2:
        return float("nan")
    mx = statistics.fmean(p[0] for p in pts)
    my = statistics.fmean(p[1] for p in pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx if sxx else float("nan")


def median_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float] | None:
    """A distribution-free confidence interval of the median of ``values`` (independent rounds):
    the order statistics ``x_(j)`` and ``x_(n+1-j)`` with the largest ``j`` such that a
    Binomial(n, 1/2) falls below ``j`` with probability at most ``(1 - level) / 2``. ``None`` when
    ``n`` rounds are too few for that level (fewer than 6 at 95%).

    A speed figure's median over interleaved rounds comes with it, so a claim such as "at least
    95% of the limit" can be read against the noise of the run.

    Example:
        >>> median_interval([0.91, 0.95, 0.93, 0.97, 0.94, 0.96, 0.92, 0.95, 0.94, 0.96])
        (0.92, 0.96)
        >>> median_interval([1.0, 1.1, 0.9]) is None
        True
    """
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be > 0 and < 1, got {level!r}")
    x = sorted(float(v) for v in values)
    n = len(x)
    tail = (1.0 - level) / 2.0
    below, j = 0.0, 0  # below: P(B <= j - 1) for B ~ Binomial(n, 1/2)
    while j < n:
        p_next = below + math.comb(n, j) / 2.0**n  # P(B <= j)
        if p_next > tail:
            break
        below, j = p_next, j + 1
    if j == 0:
        return None
    return x[j - 1], x[n - j]


def slopes(
    rows: Iterable[Mapping[str, Any]], value: str, *, keys: Sequence[str] = ("backend", "policy", "batch", "heads")
) -> dict[tuple[Any, ...], tuple[float, int]]:
    """Fit :func:`fit_slope` of ``row[value]`` against ``row["size"]`` per group of ``keys``.

    Returns ``{group: (slope, points)}``; groups with fewer than 3 sizes get ``nan``.
    """
    groups: dict[tuple[Any, ...], list[tuple[float, float]]] = {}
    for row in rows:
        if row.get(value) is None:
            continue
        groups.setdefault(tuple(row[k] for k in keys), []).append((row["size"], row[value]))
    out = {}
    for key, pts in sorted(groups.items(), key=lambda kv: tuple(map(str, kv[0]))):
        pts.sort()
        slope = fit_slope([p[0] for p in pts], [p[1] for p in pts]) if len(pts) >= 3 else float("nan")
        out[key] = (slope, len(pts))
    return out


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], align: str | None = None) -> str:
    """A GitHub Markdown table; ``align`` is one of ``l``/``r`` per column (default: first left)."""
    headers = list(headers)
    align = align or ("l" + "r" * (len(headers) - 1))
    sep = ["---" if a == "l" else "---:" for a in align]
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(sep) + " |"]
    for row in rows:
        lines.append("| " + " | ".join(str(c) for c in row) + " |")
    return "\n".join(lines)


def _pyplot() -> Any:
    import matplotlib  # optional: the plot extra

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional: the plot extra

    return plt


def save_figure(fig: Any, path: str | os.PathLike[str], *, dpi: int = 130, rect: tuple[float, ...] | None = None) -> Path:
    """Lay ``fig`` out (``tight_layout``, within ``rect`` if given), write it to ``path`` (its
    folder created), close it and return the path: the last step of every performance plot."""
    fig.tight_layout() if rect is None else fig.tight_layout(rect=rect)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    _pyplot().close(fig)
    return path


POLICY_COLORS = {
    "buzz": "tab:orange",
    "h2o": "tab:blue",
    "streaming_llm": "tab:green",
    "local": "tab:purple",
    "full": "tab:gray",
    "tova": "tab:red",
    "scissorhands": "tab:brown",
}


def format_cost_axes(ax: Any, title: str) -> None:
    """Log-log axes of eviction cost (microseconds) against the cache size at an eviction."""
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("cache size at eviction (tokens per head)")
    ax.set_ylabel("microseconds")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.25)


def plot_complexity(rows: Sequence[Mapping[str, Any]], path: str | os.PathLike[str], *, batch: int, heads: int, title: str = "") -> Path:
    """Two log-log panels (one eviction; per decoded token) for one ``batch x heads`` configuration."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 5.4))
    measures = (("one_eviction_s", "one eviction"), ("per_token_s", "amortised per decoded token"))
    for ax, (value, label) in zip(axes, measures):
        for backend, style in (("torch", "-o"), ("numpy", "--s")):
            for policy in dict.fromkeys(r["policy"] for r in rows):  # every measured policy, in measured order
                color = POLICY_COLORS.get(policy)  # None: matplotlib's next colour
                pts = sorted(
                    (r["size"], r[value])
                    for r in rows
                    if r["backend"] == backend and r["policy"] == policy and r["batch"] == batch and r["heads"] == heads
                    and r.get(value)
                )
                if not pts:
                    continue
                xs, ys = [p[0] for p in pts], [p[1] * 1e6 for p in pts]
                slope = fit_slope(xs, ys) if len(xs) >= 3 else float("nan")
                ax.plot(xs, ys, style, color=color, ms=3.5, lw=1.3, alpha=0.9 if backend == "torch" else 0.6,
                        label=f"{policy} ({backend}) k={slope:.2f}")
        format_cost_axes(ax, label)
        ax.legend(fontsize=6.5, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.14), frameon=False)
    fig.suptitle(title or f"Eviction cost, batch {batch}, {heads} KV heads (k: log-log slope)", fontsize=10)
    return save_figure(fig, path)


def _decode_style(label: str) -> dict[str, Any]:
    """Colour by family (darker for larger budgets), dashed for the full caches, dotted unfused."""
    import matplotlib.colors as mcolors  # optional: the plot extra

    families = {"DynamicCache": "black", "FullCache": "tab:gray", "capture": "tab:purple", "BUZZ": "tab:orange",
                "H2O": "tab:blue", "StreamingLLM": "tab:green"}
    base = next((c for k, c in families.items() if label.startswith(k)), "tab:brown")
    shade = 1.0
    for pct, f in (("10%", 0.55), ("25%", 0.8), ("50%", 1.0)):
        if f" {pct}" in label:
            shade = f
    rgb = mcolors.to_rgb(base)
    color = tuple(1 - shade * (1 - c) for c in rgb)
    ls = ":" if "unfused" in label else ("--" if label in ("DynamicCache", "FullCache") or label.startswith("capture") else "-")
    return {"color": color, "ls": ls, "marker": "o", "ms": 3.5, "lw": 1.4}


def plot_decode(rows: Sequence[Mapping[str, Any]], path: str | os.PathLike[str], *, title: str = "") -> Path:
    """Speed-up over DynamicCache and KV bytes against the context length, one line per candidate."""
    plt = _pyplot()
    from matplotlib.ticker import FuncFormatter  # optional: the plot extra

    fig, axes = plt.subplots(1, 2, figsize=(11, 5.6))
    labels = list(dict.fromkeys(r["label"] for r in rows))
    for label in labels:
        pts = sorted((r["context"], r["ratio_vs_dynamic"], r["kv_bytes"]) for r in rows if r["label"] == label)
        xs = [p[0] for p in pts]
        style = _decode_style(label)
        axes[0].plot(xs, [p[1] for p in pts], label=label, **style)
        axes[1].plot(xs, [p[2] / 2**20 for p in pts], label=label, **style)
    axes[0].axhline(1.0, color="black", lw=0.8)
    axes[0].set_ylabel("tokens/s relative to DynamicCache (same run)")
    axes[1].set_ylabel("KV bytes held (MiB)")
    axes[1].set_yscale("log")
    axes[1].yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axes[1].yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
        ax.set_xlabel("context (prompt tokens)")
        ax.grid(True, which="both", alpha=0.25)
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, fontsize=7, ncol=5, loc="lower center", frameon=False)
    fig.suptitle(title or "Decode speed and cache memory", fontsize=10)
    return save_figure(fig, path, rect=(0, 0.14, 1, 1))


def plot_breakdown(table: Mapping[str, Mapping[str, float]], path: str | os.PathLike[str], *, order: Sequence[str], title: str = "") -> Path:
    """Stacked horizontal bars: milliseconds per decode step by category, one bar per candidate."""
    plt = _pyplot()
    labels = list(table)
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(labels) + 2.2))
    left = [0.0] * len(labels)
    cmap = plt.get_cmap("tab10")
    for i, cat in enumerate(order):
        widths = [table[lab].get(cat, 0.0) for lab in labels]
        if not any(widths):
            continue
        ax.barh(labels, widths, left=left, color=cmap(i % 10), label=cat)
        left = [a + b for a, b in zip(left, widths)]
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds per decode step")
    ax.legend(fontsize=7, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.16), frameon=False)
    ax.set_title(title or "Where a decode step's time goes", fontsize=10)
    ax.grid(True, axis="x", alpha=0.25)
    return save_figure(fig, path)
