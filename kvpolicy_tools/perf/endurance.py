"""Endurance: a long stream, one token at a time, through a real model's cache shape.

An evicting cache must hold its memory and its per-token cost flat however long the stream: its
storage is allocated once to the policy's capacity, and nothing may grow with the tokens seen
(no list of evictions kept per token, no position tensor that widens, no allocator creep). This
module streams ``tokens`` tokens through one :class:`kvpolicy_torch.LayerCache` per layer of a
model's cache shape (SmolLM2-135M's by default: 30 layers, 3 KV heads, head_dim 64, float32),
each step exactly as a decode step uses it: ``append`` one token's keys and values, ``accumulate``
the attention the cached tokens received, ``evict``. Keys, values and received attention are
random (from small pools prepared before the run); no model forward runs, so the measurement
is the cache's own cost.

Sampled along the way (``samples`` times, evenly):

* **allocated bytes**: the sum of the layers' ``LayerCache.nbytes`` (and, on CUDA,
  ``torch.cuda.memory_allocated``);
* **RSS**: the process's resident set size (psutil);
* **per-token time**: over the tokens since the previous sample, the fastest token's step
  through all layers (other work on a shared machine only ever adds time, so this is the
  cache's own cost), the median, and the mean (which includes the amortised cost of BUZZ's
  periodic evictions and the slot layout's compactions).

:meth:`EnduranceResult.flatness` compares the first and the last decile of the samples taken
after a warm-up (the cache filling to its capacity, the allocator settling): the ratio
last / first of each metric's median, which should be within 5% of 1 (:meth:`EnduranceResult.is_flat`
judges the bytes and the fastest-token time).

Time is noise-bound on a shared machine, so a short run cannot tell a small growth from load.
``run_endurance(..., count_work=True)`` also counts each token's **work**, deterministically: the
torch calls its step makes and the bytes of the tensors those calls return (views included), under
a :class:`torch.overrides.TorchFunctionMode` (which slows the step: its times are not the cache's).
:meth:`EnduranceResult.work_growth` compares the costliest token of the second half of the
measured tokens with the first half's: a cost that grows with the tokens seen (a longer list, a
wider position tensor) shows there, while periodic work (BUZZ's evictions every ``stride`` tokens,
the slot layout's compactions) peaks alike in both halves. CI asserts this on 2,000 tokens.

Example:
    >>> from kvpolicy_tools.perf.endurance import endurance_policy, run_endurance
    >>> result = run_endurance(endurance_policy("h2o", 32), tokens=400, layers=2, samples=20, warmup=100)
    >>> result.flatness()["allocated_bytes"]
    1.0
    >>> counted = run_endurance(endurance_policy("h2o", 32), tokens=400, layers=2, samples=20, warmup=100, count_work=True)
    >>> counted.work_growth()
    {'torch_calls': 1.0, 'tensor_bytes': 1.0}
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from kvpolicy.validation import check_int
from kvpolicy.policy import check_eviction_policy
from kvpolicy_tools.perf.eviction import policy_at_size
from kvpolicy_tools.perf.report import markdown_table
from kvpolicy_torch import LayerCache

__all__ = [
    "SMOLLM2_135M",
    "CacheShape",
    "EnduranceResult",
    "EnduranceSample",
    "endurance_policy",
    "markdown",
    "run_endurance",
    "summary_line",
    "work_line",
]

#: The metrics :meth:`EnduranceResult.flatness` compares.
METRICS = ("allocated_bytes", "rss_bytes", "seconds_per_token")
#: What :meth:`EnduranceResult.is_flat` judges by default: the bytes, and the time of the fastest
#: token of each sample (other work on a shared machine only adds time, so the fastest tokens
#: show the cache's own cost; the median is reported next to it).
FLAT_METRICS = ("allocated_bytes", "rss_bytes", "min_seconds_per_token")
#: What :meth:`EnduranceResult.work_growth` compares (with ``count_work=True``).
WORK_METRICS = ("torch_calls", "tensor_bytes")


class _WorkCounter(TorchFunctionMode):
    """Counts the torch calls made under it and the bytes of the tensors they return."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.nbytes = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.calls += 1
        # the mode is off inside its own handler, so these calls are not counted
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.nbytes += t.numel() * t.element_size()
        return out


@dataclass(frozen=True)
class CacheShape:
    """The KV-cache shape of a model: layers, KV heads per layer, head dimension, dtype name."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("layers", "kv_heads", "head_dim"):
            check_int(name, getattr(self, name), minimum=1)


#: SmolLM2-135M (the embedded model, ``kvpolicy_tools.models.load("smollm2-135m")``): 30 layers,
#: 9 query heads sharing 3 KV heads, head_dim 64; float32 on CPU.
SMOLLM2_135M = CacheShape(layers=30, kv_heads=3, head_dim=64, dtype="float32")


def endurance_policy(name: str, kept: int) -> Any:
    """The policy ``name`` (``"buzz"``, ``"h2o"``, ``"streaming_llm"``, ``"local"``) whose cache
    holds at most ``kept`` tokens per head (its capacity), as the eviction benchmarks build it
    (:func:`kvpolicy_tools.perf.eviction.policy_at_size`)."""
    return policy_at_size(name, check_int("kept", kept, minimum=16))


@dataclass(frozen=True)
class EnduranceSample:
    """One sample: after ``token`` tokens, the bytes held and the recent per-token time."""

    token: int
    allocated_bytes: int
    rss_bytes: int
    seconds_per_token: float
    device_allocated_bytes: int | None = None
    cached_tokens: int = 0
    mean_seconds_per_token: float = math.nan
    #: the fastest token since the previous sample: other work on a shared machine only ever
    #: adds time, so this is the most noise-proof view of the cache's own cost
    min_seconds_per_token: float = math.nan


@dataclass
class EnduranceResult:
    """Samples of one endurance run, with its flatness (first vs last decile after the warm-up)."""

    label: str
    policy: str
    params: dict[str, Any]
    shape: CacheShape
    tokens: int
    warmup: int
    device: str
    samples: list[EnduranceSample] = field(default_factory=list)
    total_seconds: float = 0.0
    #: per token (``count_work=True`` only): torch calls of its step, and the bytes of the
    #: tensors they returned
    torch_calls: list[int] = field(default_factory=list)
    tensor_bytes: list[int] = field(default_factory=list)

    def measured(self) -> list[EnduranceSample]:
        """The samples taken after the warm-up."""
        return [s for s in self.samples if s.token > self.warmup]

    def deciles(self, metric: str) -> tuple[float, float]:
        """Median of ``metric`` over the first and over the last decile of :meth:`measured`."""
        rows = self.measured()
        if len(rows) < 2:
            raise ValueError(f"need at least 2 samples after the warm-up, got {len(rows)} (more tokens or samples)")
        k = max(1, len(rows) // 10)
        first = statistics.median(float(getattr(s, metric)) for s in rows[:k])
        last = statistics.median(float(getattr(s, metric)) for s in rows[-k:])
        return first, last

    def flatness(self) -> dict[str, float]:
        """``last / first`` decile medians for each metric (1.0: perfectly flat), and the same
        ratio of the fastest tokens (``min_seconds_per_token``, robust to a busy machine)."""
        out = {}
        for metric in (*METRICS, "min_seconds_per_token"):
            first, last = self.deciles(metric)
            out[metric] = last / first if first else (1.0 if last == first else math.inf)
        return out

    def is_flat(self, tolerance: float = 0.05, metrics: Sequence[str] = FLAT_METRICS) -> bool:
        """Whether every metric's ratio is within ``tolerance`` of 1."""
        ratios = self.flatness()
        return all(abs(ratios[m] - 1.0) <= tolerance for m in metrics)

    def work_peaks(self) -> dict[str, tuple[int, int]]:
        """For each of :data:`WORK_METRICS`: the costliest token of the first and of the second
        half of the tokens after the warm-up.

        Raises:
            ValueError: the run did not count its work (``count_work=False``), or fewer than 2
                tokens follow the warm-up.
        """
        if not self.torch_calls:
            raise ValueError("work was not counted: run_endurance(..., count_work=True)")
        if self.tokens - self.warmup < 2:
            raise ValueError(f"need at least 2 tokens after the warm-up, got {self.tokens - self.warmup}")
        mid = self.warmup + (self.tokens - self.warmup) // 2
        return {m: (max(getattr(self, m)[self.warmup : mid]), max(getattr(self, m)[mid:])) for m in WORK_METRICS}

    def work_growth(self) -> dict[str, float]:
        """For each of :data:`WORK_METRICS`: the second half's costliest token over the first
        half's (:meth:`work_peaks`; 1.0: no growth). Deterministic, unlike time. Each half must
        span the policy's periodic work (BUZZ's eviction every few hundred tokens at SmolLM2's
        shape): with too few tokens a periodic peak reads as growth."""
        return {
            m: last / first if first else (1.0 if last == first else math.inf)
            for m, (first, last) in self.work_peaks().items()
        }

    def as_dict(self) -> dict[str, Any]:
        first_last = {m: self.deciles(m) for m in (*METRICS, "mean_seconds_per_token", "min_seconds_per_token")}
        return {
            "label": self.label,
            "policy": self.policy,
            "params": self.params,
            "shape": self.shape.__dict__,
            "tokens": self.tokens,
            "warmup": self.warmup,
            "device": self.device,
            "total_seconds": self.total_seconds,
            "first_decile": {m: v[0] for m, v in first_last.items()},
            "last_decile": {m: v[1] for m, v in first_last.items()},
            "flatness": self.flatness(),
            "work_growth": self.work_growth() if self.torch_calls else None,
            "samples": [s.__dict__ for s in self.samples],
        }


def run_endurance(
    policy: Any,
    tokens: int = 100_000,
    *,
    shape: CacheShape = SMOLLM2_135M,
    layers: int | None = None,
    samples: int | None = None,
    warmup: int | None = None,
    device: str = "cpu",
    pool: int = 64,
    seed: int = 0,
    label: str | None = None,
    on_sample: Callable[[EnduranceSample], None] | None = None,
    count_work: bool = False,
) -> EnduranceResult:
    """Stream ``tokens`` tokens one at a time through ``shape.layers`` evicting layer caches.

    Args:
        policy: an :class:`~kvpolicy.EvictionPolicy` (each layer gets its own cache).
        tokens: tokens streamed.
        shape: the cache shape (default SmolLM2-135M's); ``layers`` overrides its layer count.
        samples: how many samples to take, evenly spread over the run (default: 200, at most
            ``tokens``).
        warmup: tokens left out of :meth:`EnduranceResult.flatness` (default: the larger of
            twice the capacity and 5% of the run).
        device: torch device of the caches.
        pool: random key/value and received-attention tensors prepared before the run and used
            in turn (generating them per token would be measured too).
        on_sample: called with each sample as it is taken (progress).
        count_work: also count each token's torch calls and the bytes of the tensors they
            return (:meth:`EnduranceResult.work_growth`); the counting slows every step, so the
            run's times then include it.
    """
    import psutil  # optional: resident memory where installed

    policy = check_eviction_policy("policy", policy)
    tokens = check_int("tokens", tokens, minimum=2)
    samples = min(200, tokens) if samples is None else check_int("samples", samples, minimum=2, maximum=tokens)
    pool = check_int("pool", pool, minimum=1)
    n_layers = shape.layers if layers is None else check_int("layers", layers, minimum=1)
    capacity = policy.capacity
    if capacity is None:
        raise ValueError(f"policy must bound the cache (capacity is None for {policy!r}): a full cache grows by design")
    if warmup is None:
        warmup = max(2 * capacity, tokens // 20)
    warmup = check_int("warmup", warmup, minimum=0, maximum=tokens - 1)
    dtype = getattr(torch, shape.dtype)
    dev = torch.device(device)
    g = torch.Generator().manual_seed(seed)
    h, d = shape.kv_heads, shape.head_dim
    kv_pool = torch.randn(pool, 1, h, 1, d, generator=g, dtype=dtype).to(dev)

    def received_of(width: int) -> torch.Tensor:
        # received attention of a decode query over the slots it attends: random, scaled like a
        # softmax output (the values only steer which tokens the score-based policies keep)
        r = torch.rand(pool, 1, h, width, generator=g, dtype=torch.float32).to(dev)
        return r / r.sum(dim=-1, keepdim=True)

    # append() may return more slots than the capacity (a layout with spare slots): the pool is
    # widened the first time that happens, a host-int check per layer
    received_pool = received_of(capacity)
    caches = [LayerCache(policy) for _ in range(n_layers)]
    process = psutil.Process()
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    result = EnduranceResult(
        label=label or repr(policy),
        policy=policy.name,
        params=policy.params(),
        shape=CacheShape(n_layers, h, d, shape.dtype),
        tokens=tokens,
        warmup=warmup,
        device=str(dev),
    )
    every = tokens / samples
    next_sample = every
    per_token = np.empty(tokens, dtype=np.float64)
    last_sample = 0
    clock = time.perf_counter
    start = clock()
    for t in range(tokens):
        kv = kv_pool[t % pool]
        received = received_pool[(t * 7) % pool]
        counter = _WorkCounter() if count_work else None
        t0 = clock()
        with counter if counter is not None else contextlib.nullcontext():
            for cache in caches:
                keys, _ = cache.append(kv, kv)
                n = keys.shape[-2]
                if n > received.shape[-1]:
                    received_pool = received_of(2 * n)
                    received = received_pool[(t * 7) % pool]
                cache.accumulate(received[..., :n])
                cache.evict()
        if counter is not None:
            result.torch_calls.append(counter.calls)
            result.tensor_bytes.append(counter.nbytes)
        sync()
        per_token[t] = clock() - t0
        if t + 1 >= next_sample or t + 1 == tokens:
            sample = EnduranceSample(
                token=t + 1,
                allocated_bytes=sum(c.nbytes for c in caches),
                rss_bytes=int(process.memory_info().rss),
                seconds_per_token=float(np.median(per_token[last_sample : t + 1])),
                mean_seconds_per_token=float(np.mean(per_token[last_sample : t + 1])),
                min_seconds_per_token=float(np.min(per_token[last_sample : t + 1])),
                device_allocated_bytes=int(torch.cuda.memory_allocated(dev)) if cuda else None,
                cached_tokens=caches[0].length,
            )
            result.samples.append(sample)
            if on_sample is not None:
                on_sample(sample)
            last_sample = t + 1
            next_sample += every
    result.total_seconds = clock() - start
    return result


def markdown(results: Sequence[EnduranceResult], *, tolerance: float = 0.05) -> str:
    """A Markdown table: per run, first and last decile of each metric and their ratio."""
    def mib(x: float) -> str:
        return f"{x / 2**20:.2f}"

    rows = []
    for r in results:
        ratios = r.flatness()
        (b0, b1), (r0, r1), (s0, s1) = (r.deciles(m) for m in METRICS)
        m0, m1 = r.deciles("mean_seconds_per_token")
        f0, f1 = r.deciles("min_seconds_per_token")
        flat = "yes" if r.is_flat(tolerance) else "**no**"
        rows.append(
            [
                r.label,
                f"{r.tokens:,}",
                f"{mib(b0)} → {mib(b1)} (x{ratios['allocated_bytes']:.3f})",
                f"{mib(r0)} → {mib(r1)} (x{ratios['rss_bytes']:.3f})",
                f"{f0 * 1e3:.3f} → {f1 * 1e3:.3f} (x{ratios['min_seconds_per_token']:.3f})",
                f"{s0 * 1e3:.3f} → {s1 * 1e3:.3f} (x{ratios['seconds_per_token']:.3f})",
                f"{m0 * 1e3:.3f} → {m1 * 1e3:.3f} (x{m1 / m0:.3f})",
                f"{r.total_seconds:.0f}",
                flat,
            ]
        )
    headers = [
        "policy",
        "tokens",
        "allocated MiB, first → last decile",
        "RSS MiB",
        "ms per token, fastest (all layers)",
        "ms per token, median",
        "ms per token, mean",
        "run s",
        f"flat within {tolerance:.0%}",
    ]
    return markdown_table(headers, rows)


def work_line(result: EnduranceResult) -> str:
    """One line per counted run (``count_work=True``): the costliest token of each half after the
    warm-up, in torch calls and bytes of returned tensors."""
    growth = result.work_growth()
    parts = [f"{m} {first:,} -> {last:,} x{growth[m]:.3f}" for m, (first, last) in result.work_peaks().items()]
    return f"{result.label:40s} {result.tokens:7d} tok  " + "  ".join(parts)


def summary_line(result: EnduranceResult) -> str:
    """One line per run for a terminal summary."""
    f = result.flatness()
    s0, s1 = result.deciles("seconds_per_token")
    r0, r1 = result.deciles("rss_bytes")
    return (
        f"{result.label:40s} {result.tokens:7d} tok  bytes x{f['allocated_bytes']:.3f}  "
        f"rss {r0 / 2**20:7.1f}->{r1 / 2**20:7.1f} MiB x{f['rss_bytes']:.3f}  "
        f"{s0 * 1e3:.3f}->{s1 * 1e3:.3f} ms/tok x{f['seconds_per_token']:.3f}"
    )
