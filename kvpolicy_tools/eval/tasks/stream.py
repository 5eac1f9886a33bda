"""``stream``: the paper's perplexity protocol (a short prefill, then token by token)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ..display import COLORS, STYLES, full_cell, metric_name, order, policy_name, pyplot, row, shared_legend
from .ppl import PerplexityTask
from .base import CacheConfig, Sample, TokenizerAdapter, is_reference, parse_floats, parse_ints, register_task, replace_flag, takes_threshold_ratio


#: The short stream task of the default ``kvpolicy compare`` run (the full protocol is
#: ``--tasks stream``): documents, scored tokens, fixed cache sizes; no budgets, no T/w variant.
STREAM_SHORT = {"samples": 4, "tokens": 128, "sizes": (50,)}

#: The captions of the stream's tables (each cell shows its measured average and capacity).
STREAM_CAPTION = {
    "size": "Each cell: perplexity (measured average cache, capacity). Columns: fixed cache size, and how it is "
            "equalised: equal mean (the average cache over the scored steps is the size), equal capacity (the peak is "
            "the size).",
    "budget": "Each cell: perplexity (measured average cache, capacity). Columns: requested budget (target = budget x "
              "the full cache's average), and how it is equalised (equal mean, equal capacity).",
}


@dataclass
class StreamOptions:
    """``stream``'s settings (``None``: the full protocol's default, or the short run's)."""

    stream_tokens: int | None = None  # tokens fed one at a time and scored (default 1024)
    stream_prefill: int = 32  # tokens prefilled at once first
    stream_sizes: tuple[int, ...] | None = None  # fixed cache sizes (default 50, 100)
    stream_ratios: tuple[float, ...] = (2.5,)  # BUZZ also run at these T/w
    equalise: str = "both"  # "mean", "capacity" or "both"
    short: bool = False  # the short version of the default run


@register_task
class StreamTask(PerplexityTask):
    """The paper's perplexity protocol: a short prefill (``--stream-prefill``, 32 tokens), then
    ``--stream-tokens`` (1,024) tokens per document fed one at a time through the evicting cache,
    each next-token prediction scored, at fixed cache sizes (the paper's 50 and 100) and budgets,
    with two equalisations side by side (``--equalise``): equal *mean* cache size and equal
    *capacity* (peak tokens per head and layer). BUZZ also runs at the T/w of ``--tw-ratios``."""

    name = "stream"
    title = "Streaming perplexity (short prefill, then token by token)"
    kind = "stream"
    default_samples = 16
    help = ("the paper's perplexity protocol: --stream-prefill tokens (32) prefilled, then --stream-tokens (1024) "
            "per document fed one at a time and scored, at --cache-sizes (50,100) and --budgets, --equalise mean|capacity|both "
            "(default both), BUZZ also at --tw-ratios (2.5); 16 documents (embedded: Wikipedia articles; --data-dir: "
            "wikitext-2). The default run carries a short version (4 documents, 128 tokens, size 50)")
    Options = StreamOptions
    paper_table = None  # the paper's perplexity table is ppl's (fixed sizes after a long prefill)

    @classmethod
    def add_arguments(cls, group: Any) -> None:
        group.add_argument("--equalise", choices=("mean", "capacity", "both"), default=None,
                           help="stream: what a size or budget fixes: the average cache size over the scored steps (mean, "
                           "the paper's definition), the capacity (the most tokens a head holds at any step: peak memory), "
                           "or both side by side (default both; the default run's short stream: mean)")
        group.add_argument("--stream-tokens", type=int, default=None,
                           help="stream: tokens per document fed one at a time and scored (default 1024; 128 in the default run)")
        group.add_argument("--stream-prefill", type=int, default=32,
                           help="stream: tokens prefilled at once before streaming (default %(default)s)")

    @classmethod
    def options_from_args(cls, args: Any) -> StreamOptions:
        # --cache-sizes (declared by ppl) and --tw-ratios (declared by tw) set the stream's too
        short = bool(getattr(args, "default_run", False))
        sizes, ratios = getattr(args, "cache_sizes", None), getattr(args, "tw_ratios", None)
        return StreamOptions(
            stream_tokens=getattr(args, "stream_tokens", None),
            stream_prefill=getattr(args, "stream_prefill", 32),
            stream_sizes=None if sizes is None else positive_sizes(parse_ints(sizes, "--cache-sizes")),
            stream_ratios=(2.5,) if ratios is None else tuple(parse_floats(ratios, "--tw-ratios")),
            # the default run's short stream: the paper's equal mean only (both doubles its time)
            equalise=getattr(args, "equalise", None) or ("mean" if short else "both"),
            short=short,
        )

    @property
    def n_samples(self) -> int:
        if self.opt.samples is not None:
            return self.opt.samples
        return STREAM_SHORT["samples"] if self.options.short else self.default_samples

    @property
    def tokens(self) -> int:
        if self.options.stream_tokens is not None:
            return self.options.stream_tokens
        return STREAM_SHORT["tokens"] if self.options.short else 1024

    @property
    def sizes(self) -> tuple[int, ...]:
        if self.options.stream_sizes is not None:
            return tuple(self.options.stream_sizes)
        return tuple(STREAM_SHORT["sizes"]) if self.options.short else (50, 100)

    @property
    def ratios(self) -> tuple[float, ...]:
        return () if self.options.short else tuple(self.options.stream_ratios)

    @property
    def equalisations(self) -> tuple[str, ...]:
        eq = self.options.equalise
        if eq not in ("mean", "capacity", "both"):
            raise ValueError(f"--equalise must be one of 'mean', 'capacity', 'both'; got {eq!r}")
        return ("mean", "capacity") if eq == "both" else (eq,)

    def check(self, policies: Sequence[str], budgets: Sequence[float]) -> None:
        """Nothing to check (ppl's check reads ppl's --cache-sizes; the stream's sizes default to 50, 100)."""

    def configs(self, policies: Sequence[str], budgets: Sequence[float]) -> list[CacheConfig]:
        budgets = () if self.options.short else tuple(budgets)
        targets = [{"size": int(z)} for z in self.sizes] + [{"budget": float(b)} for b in budgets]
        rows: list[tuple[str, float | None]] = []
        for p in policies:
            if is_reference(p):
                continue
            rows.append((p, None))
            if takes_threshold_ratio(p):
                rows += [(p, float(r)) for r in self.ratios]
        out = [CacheConfig(p) for p in policies if is_reference(p)]
        for target in targets:
            for eq in self.equalisations:
                out += [CacheConfig(p, equalise=eq, variant_ratio=r, show_equalise=True, **target) for p, r in rows]
        return out

    def samples(self, tok: TokenizerAdapter) -> list[Sample]:
        prompt = self.options.stream_prefill
        if prompt < 1:
            raise ValueError(f"--stream-prefill must be >= 1, got {prompt}")
        m = self.tokens
        if m < 1:
            raise ValueError(f"--stream-tokens must be >= 1, got {m}")
        out = self._prefilled_then_scored(
            tok, prompt, m,
            f", then {m} tokens fed one at a time through the evicting cache, each next-token prediction scored "
            "(per-token negative log-likelihood; every policy scores the same tokens, so the per-document "
            "differences are paired)",
        )
        meaning = ("*equal mean* plans every policy so its average cache over the scored steps is the target (the "
                   "paper's definition); *equal capacity* gives every policy the target as its capacity (the most "
                   "tokens a head holds at any step, i.e. peak memory)")
        shown = "two equalisations side by side" if len(self.equalisations) == 2 else f"equal {self.equalisations[0]} only"
        self.notes.append(
            f"{shown}: {meaning}. A size is a number of tokens; a budget's target is budget x the full cache's "
            "average. Each cell shows its measured average and capacity"
        )
        if self.ratios and any(True for _ in self.ratios):
            self.notes.append(
                "BUZZ runs at the theorem's T/w (4.33 for stride 5) and, as separate rows, at T/w = "
                + ", ".join(f"{r:g}" for r in self.ratios) + " (the paper authors' code defaults to 2.5)"
            )
        return out

    def cli_flags(self) -> list[str]:
        return [f"--stream-tokens {self.tokens}", f"--stream-prefill {self.options.stream_prefill}",
                f"--equalise {self.options.equalise}",
                "--tw-ratios " + (",".join(f"{r:g}" for r in self.ratios) or "none")]

    # ----------------------------------------------------------------------- rerun commands
    def run_flags(self, cache_sizes: Sequence[int] | None) -> list[str]:
        """The stream's own sizes when the command states none, and ``--context`` when given."""
        out = []
        if not cache_sizes:
            sizes = self.sizes if cache_sizes is None else ()
            out += ["--cache-sizes", ",".join(str(z) for z in sizes) or "none"]
        return out + (["--context", str(self.opt.context)] if self.opt.context else [])

    def command_budgets(self, budgets: Sequence[float]) -> Sequence[float] | None:
        """The default run's short stream runs no budgets."""
        return [] if self.options.short else budgets

    def command_cache_sizes(self) -> Sequence[int] | None:
        """None stated: :meth:`run_flags` gives the stream's own."""
        return None

    def cell_command(self, cell: Any, command: Any) -> str:
        """One cell at its own equalisation; a BUZZ T/w row also runs plain BUZZ."""
        ratios = "none" if cell.variant_ratio is None else f"{cell.variant_ratio:g}"
        if is_reference(cell.policy):
            return command([cell.policy], [], cache_sizes=[], flags=replace_flag(self.cli_flags(), "--tw-ratios", "none"))
        cmd = command([cell.policy], [cell.requested_budget] if cell.kind == "budget" else [],
                      cache_sizes=[cell.size] if cell.kind == "size" else [],
                      flags=replace_flag(self.cli_flags(), "--tw-ratios", ratios))
        return cmd.replace("--equalise both", f"--equalise {cell.equalise}")

    # ----------------------------------------------------------------------- report hooks
    @classmethod
    def table_caption(cls, kind: str) -> str | None:
        return STREAM_CAPTION.get(kind)

    @classmethod
    def budget_panels(cls, task: dict[str, Any]) -> list[Any]:
        """None: :meth:`report_plots` draws budgets and sizes with their equalisations."""
        return []

    @classmethod
    def report_plots(cls, task: dict[str, Any], out_dir: Path, model: str) -> list[Path]:
        """Perplexity against the measured average cache (equal-mean cells) and against the
        capacity (equal-capacity cells), one line per row, the full cache as a reference line."""
        cells = [c for c in task["cells"] if c.get("equalise") and c["metrics"].get(task["metric"]) is not None]
        if not cells:
            return []
        path = out_dir / f"{task['name']}_stream.png"
        plt = pyplot()
        metric = task["metric"]
        panels = [(eq, x) for eq, x in (("mean", "average_cache"), ("capacity", "capacity"))
                  if any(c["equalise"] == eq for c in cells)]
        fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels) + 1.0, 4.2), squeeze=False)
        full = full_cell(task)
        rows = order(list(dict.fromkeys(row(c) for c in cells)))
        for ax, (eq, xkey) in zip(axes[0], panels):
            for r in rows:
                pts = sorted((c[xkey], c["metrics"][metric]) for c in cells
                             if row(c) == r and c["equalise"] == eq and c[xkey] is not None)
                if pts:
                    ax.plot([x for x, _ in pts], [y for _, y in pts], label=policy_name(r), color=COLORS.get(r),
                            **STYLES.get(r, {"marker": "o", "linewidth": 1.4, "linestyle": ":"}))
            if full is not None:
                ax.axhline(full["metrics"][metric], color="black", linestyle="--", linewidth=1.2, label="Full cache")
            ax.set_yscale("log")
            ax.set_xlabel("measured average cache (tokens)" if eq == "mean" else "capacity: peak tokens per head and layer")
            ax.set_ylabel(metric_name(metric))
            ax.set_title(f"equal {eq}" + (" (the paper's definition)" if eq == "mean" else " (equal peak memory)"), fontsize=9)
            ax.grid(True, alpha=0.3)
        shared_legend(fig, axes[0], columns=4, fontsize=8)
        fig.suptitle(f"{task['title']}\n{model}, n = {task['n_samples']} documents x {task['decode_steps_per_sample']} tokens",
                     fontsize=10)
        fig.tight_layout(rect=(0, 0.12, 1, 1))
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return [path]


def positive_sizes(sizes: list[int]) -> tuple[int, ...]:
    """``--cache-sizes`` for the stream: each at least one token, or ``ValueError`` naming the flag.

    Example:
        >>> positive_sizes([50, 100])
        (50, 100)
    """
    if any(z < 1 for z in sizes):
        raise ValueError(f"--cache-sizes must be >= 1 token, got {', '.join(str(z) for z in sizes if z < 1)}")
    return tuple(sizes)
