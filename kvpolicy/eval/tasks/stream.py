"""``stream``: the paper's perplexity protocol (a short prefill, then token by token)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from .ppl import PerplexityTask
from .base import CacheConfig, Sample, TokenizerAdapter, is_reference, parse_floats, parse_ints, register_task


#: The short stream task of the default ``kvpolicy compare`` run (the full protocol is
#: ``--tasks stream``): documents, scored tokens, fixed cache sizes; no budgets, no T/w variant.
STREAM_SHORT = {"samples": 4, "tokens": 128, "sizes": (50,)}


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
        short = bool(getattr(args, "short_stream", False))
        sizes, ratios = getattr(args, "cache_sizes", None), getattr(args, "tw_ratios", None)
        return StreamOptions(
            stream_tokens=getattr(args, "stream_tokens", None),
            stream_prefill=getattr(args, "stream_prefill", 32),
            stream_sizes=None if sizes is None else tuple(parse_ints(sizes, "--cache-sizes")),
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
            if p == "buzz":
                rows += [("buzz", float(r)) for r in self.ratios]
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
