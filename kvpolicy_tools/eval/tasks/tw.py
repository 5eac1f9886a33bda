"""``tw``: the paper's T/w sweep of BUZZ (Table A), at a fixed stride and cache size."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from kvpolicy.policies.buzz import BUZZ, threshold_ratio

from ..display import cells as cells_of, fmt, full_cell, metric_name, paired_se, pyplot, value
from .base import CacheConfig, Sample, TaskOptions, TokenizerAdapter, is_reference, parse_floats, register_task, replace_flag
from .summ import SummarizationOptions, SummarizationTask


@dataclass
class TwOptions(SummarizationOptions):
    """``tw``'s settings: the ratios swept, the fixed cache size and stride, the prefill chunk."""

    tw_ratios: tuple[float, ...] = (1.5, 2.5, 3.5, 4.33, 4.5, 5.5, 6.5)
    tw_cache_size: int = 200
    tw_stride: int = 5
    tw_chunk: int | None = 32


@register_task
class TwSweepTask(SummarizationTask):
    """The parameter-estimation check (the paper's Table A): BUZZ at a fixed stride and a fixed
    average cache size, sweeping T/w; the theorem predicts the best at (s^2+1)/(s+1) (4.33 for s=5)."""

    name = "tw"
    title = "BUZZ T/w sweep at fixed stride and cache size (ROUGE)"
    group_names = ()
    help = "BUZZ T/w sweep at fixed stride and average cache size, ROUGE (the paper's Table A)"
    Options = TwOptions

    #: The BUZZ paper's own numbers (the report's separate section; never mixed into the tables).
    paper_table = {
        "rank": 2,
    "caption": "Paper, Table A (Llama-2-7B, CNN/DailyMail, stride 5, cache size 200): ROUGE (%) against T/w",
    "decimals": 4,
    "columns": ["1.5", "2.5", "3.5", "4.5", "5.5", "6.5"],
    "rows": {
        "ROUGE-1": [25.3847, 25.8219, 26.8306, 26.9212, 26.0562, 25.6403],
        "ROUGE-2": [6.9315, 7.8697, 7.7600, 7.9514, 7.4780, 7.3231],
        "ROUGE-L": [23.0359, 23.6857, 24.3394, 24.5161, 23.8286, 23.4886],
    },
    }

    @classmethod
    def report_verdicts(cls, task: dict[str, Any]) -> list[str]:
        """The best T/w of the run against the theorem's, and how far apart the ratios' caches are."""
        metric = task["metric"]
        lines: list[str] = []
        cells = sorted((c for c in cells_of(task, "ratio") if value(c, metric) is not None), key=lambda c: c["ratio"])
        if cells:
            ranked = sorted(cells, key=lambda c: -value(c, metric))
            best = ranked[0]
            near = min(cells, key=lambda c: abs(c["ratio"] - 4.333))
            other = ranked[1] if near is best and len(ranked) > 1 else near
            se = paired_se(best, other, metric)
            gap = value(best, metric) - value(other, metric)
            gap_text = f"{fmt(metric, gap)} points" + (f", {gap / se:.1f} s.e." if se else "")
            if near is best:
                lines.append(
                    f"Best T/w in this run: {best['ratio']:g}, the theorem's choice ({metric_name(metric)} "
                    f"{fmt(metric, value(best, metric))}); runner-up T/w = {other['ratio']:g} at "
                    f"{fmt(metric, value(other, metric))} ({gap_text} behind)."
                )
            else:
                lines.append(
                    f"Best T/w in this run: {best['ratio']:g} ({metric_name(metric)} {fmt(metric, value(best, metric))}); "
                    f"the theorem's {near['ratio']:g} scores {fmt(metric, value(near, metric))} ({gap_text} below)."
                )
            sizes = [c["average_cache"] for c in cells]
            lines.append(
                f"Measured average cache over the decode steps: {min(sizes):.0f} to {max(sizes):.0f} tokens across the "
                "ratios (the windows are chosen for one target size, but a short run's average depends on where it "
                "stops in the eviction cycle), so the ratios are not compared at exactly equal cache."
            )
        return lines

    @classmethod
    def report_plots(cls, task: dict[str, Any], out_dir: Path, model: str) -> list[Path]:
        """ROUGE against T/w, the theorem's ratio marked."""
        cells = sorted(cells_of(task, "ratio"), key=lambda c: c["ratio"])
        if not cells:
            return []
        path = out_dir / f"{task['name']}_tw.png"
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        for m, style in (("rouge1", "o-"), ("rouge2", "s-"), ("rougeL", "^-"), ("mean", "D-")):
            ax.plot([c["ratio"] for c in cells], [100 * c["metrics"][m] for c in cells], style, label=metric_name(m),
                    linewidth=2.2 if m == "mean" else 1.3)
        full = full_cell(task)
        if full is not None:
            ax.axhline(100 * full["metrics"]["mean"], color="black", linestyle="--", linewidth=1, label="Full cache (mean)")

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
        return [path]

    def command_budgets(self, budgets: Sequence[float]) -> Sequence[float] | None:
        """No ``--budgets``: the sweep runs at a fixed cache size."""
        return None

    def cell_command(self, cell: Any, command: Any) -> str:
        """A ratio cell reruns BUZZ at its T/w alone; the full cache without budgets."""
        if is_reference(cell.policy):
            return command([cell.policy], None)
        flags = replace_flag(self.cli_flags(), "--tw-ratios", f"{cell.ratio:g}")
        return command([cell.policy], None, flags=flags)

    @classmethod
    def add_arguments(cls, group: Any) -> None:
        group.add_argument("--tw-ratios", default=None,
                           help="tw: T/w ratios to sweep (default 1.5,2.5,3.5,4.33,4.5,5.5,6.5; the theorem's optimum for "
                           "stride 5 is 4.33); stream: BUZZ also runs at these T/w, as rows of their own (default 2.5, the "
                           "paper authors' code; 'none' for none)")
        group.add_argument("--tw-cache-size", type=int, default=200,
                           help="tw: cache size held fixed, in tokens: each ratio's window gives this long-run average "
                           "cache (default %(default)s, as in the paper; the measured average is reported)")
        group.add_argument("--tw-stride", type=int, default=5, help="tw: BUZZ stride (default %(default)s)")
        group.add_argument("--tw-prefill-chunk", type=int, default=32,
                           help="tw: prefill prompts in chunks of this many tokens, each followed by an eviction, so BUZZ's "
                           "threshold acts during the prompt (default %(default)s; 0 = one prefill, where T/w hardly matters)")

    @classmethod
    def options_from_args(cls, args: Any) -> TwOptions:
        ratios = getattr(args, "tw_ratios", None)
        return TwOptions(
            equal_prompts=getattr(args, "equal_prompts", False),
            tw_ratios=TwOptions.tw_ratios if ratios is None else tuple(parse_floats(ratios, "--tw-ratios")),
            tw_cache_size=getattr(args, "tw_cache_size", 200),
            tw_stride=getattr(args, "tw_stride", 5),
            tw_chunk=getattr(args, "tw_prefill_chunk", 32) or None,
        )

    def _summaries(self, options: TaskOptions) -> SummarizationTask:
        """The summarisation task this sweep draws its prompts from."""
        return SummarizationTask(options, self.src, SummarizationOptions(equal_prompts=self.options.equal_prompts))

    def configs(self, policies: Sequence[str], budgets: Sequence[float]) -> list[CacheConfig]:
        chunk = self.options.tw_chunk or None
        out = [CacheConfig(p, chunk=chunk) for p in policies if is_reference(p)]
        out += [CacheConfig(BUZZ.name, size=self.options.tw_cache_size, ratio=float(r), stride=self.options.tw_stride, chunk=chunk)
                for r in self.options.tw_ratios]
        return out

    def samples(self, tok: TokenizerAdapter) -> list[Sample]:
        want = self.n_samples
        min_len = int(2.5 * self.options.tw_cache_size)
        if self.src.paper or self.src.summaries is not None:
            # natural-length prompts: keep those long enough for the cache size to evict
            pool_opt = TaskOptions(**{**self.opt.__dict__, "samples": 10 ** 9})
            base = self._summaries(pool_opt)
            pool = base.samples(tok)
            self.data_note = base.data_note
            out = [s for s in pool if s.prompt_length >= min_len][:want]
            self.notes.append(f"prompts of at least {min_len} tokens (2.5x the cache size), as in the file")
        else:
            opt = TaskOptions(**{**self.opt.__dict__, "context": self.opt.context or max(self.default_context, min_len)})
            base = self._summaries(opt)
            out = base.samples(tok)
            self.data_note = base.data_note
            self.notes.extend(base.notes)

        self.notes.append(
            f"BUZZ stride {self.options.tw_stride}, sink 4, window solved per ratio so the long-run average cache is "
            f"{self.options.tw_cache_size} tokens (w = (C - sink) / (1 + (T/w)(1 + 1/r*)/2), the steady state of the "
            f"eviction cycle); the theorem's optimum T/w = r* = {threshold_ratio(self.options.tw_stride):.2f}"
        )
        if self.options.tw_chunk:
            self.notes.append(
                f"prompts are prefilled in chunks of {self.options.tw_chunk} tokens, each followed by an eviction, so BUZZ "
                "runs its old/new-token rounds throughout the prompt (after a one-shot prefill the threshold hardly "
                "matters: one eviction leaves the middle below T and few decode steps follow)"
            )
        return out

    def cli_flags(self) -> list[str]:
        return super().cli_flags() + ["--tw-ratios " + ",".join(f"{r:g}" for r in self.options.tw_ratios),
                                      f"--tw-cache-size {self.options.tw_cache_size}", f"--tw-stride {self.options.tw_stride}",
                                      f"--tw-prefill-chunk {self.options.tw_chunk or 0}"]
