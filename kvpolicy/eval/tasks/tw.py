"""``tw``: the paper's T/w sweep of BUZZ (Table A), at a fixed stride and cache size."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from .summ import SummarizationOptions, SummarizationTask
from .base import CacheConfig, Sample, TaskOptions, TokenizerAdapter, is_reference, parse_floats, register_task


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
        out += [CacheConfig("buzz", size=self.options.tw_cache_size, ratio=float(r), stride=self.options.tw_stride, chunk=chunk)
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
        from ...policies.buzz import threshold_ratio

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
