"""Decode throughput, cache memory and the per-step breakdown of a transformers model.

The measurement, for one model and one context length:

1. **One prefill, shared.** The prompt (random token ids) is prefilled once with transformers'
   ``DynamicCache``; its keys and values are then loaded into every candidate cache. For an
   evicting cache the loaded prompt gets placeholder scores and is evicted once, exactly as a real
   prefill would leave it *in size and state*: the built-in policies decide how many tokens to keep
   from counts only, and the speed of a decode step depends on how many tokens are kept, not on
   which. A policy that scores from the queries' moments (Expected Attention, AdaKV over it) is
   given placeholder prompt queries the same way. (Prefilling an 8k prompt takes minutes on a small CPU; doing it once per context
   instead of once per candidate is what makes the benchmark affordable.)
2. **Interleaved decode.** Every candidate keeps its own cache and decodes the same fixed random
   token sequence (so every candidate does the same work). The candidates take turns token by
   token, in an order rotated at every step; a round is ``steps`` such sweeps. A candidate's ratio
   to ``DynamicCache`` is taken within the round, then the median over rounds is reported: machine
   noise that lasts longer than one sweep over the candidates cancels out of the ratios.
3. **Memory.** Bytes of keys and values held after the run, and bytes allocated by the store
   (kvpolicy preallocates to capacity and also keeps positions and scores).

The per-step breakdown (:func:`breakdown`) wraps the pieces of a decode step with wall-clock
timers (CPU only: on CUDA the timers would measure launches, use ``torch.profiler`` there).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.modeling_utils import AttentionInterface

import kvpolicy_integrations.hf as hf
from kvpolicy import H2O, FullCache, plan_policy
from kvpolicy.validation import check_bool
from kvpolicy.registry import get_policy
from kvpolicy_integrations.capabilities import cache_kwargs, text_config
from kvpolicy_integrations.hf import ATTENTION_NAME, EvictingCache
from kvpolicy_torch import LayerCache

from ..eval.display import policy_name
from .report import median_interval

__all__ = [
    "Candidate",
    "DecodeResult",
    "PolicySpec",
    "Prefill",
    "breakdown",
    "build_cache",
    "cache_bytes",
    "hold_last",
    "measure_decode",
    "prefill",
    "standard_candidates",
    "step_timers",
]


@dataclass(eq=False)
class Candidate:
    """One cache configuration to measure.

    Attributes:
        label: row name in the tables (``"BUZZ 25%"``).
        policy: an :class:`~kvpolicy.EvictionPolicy`, or ``None`` for transformers' ``DynamicCache``.
        budget: the budget the policy was planned for (``None``: not planned).
        cache_options: extra keyword arguments of :class:`~kvpolicy_integrations.hf.EvictingCache`.
        keep_last: for a ``DynamicCache``: hold only the last ``keep_last`` prompt tokens (the
            *limit* of a budget: a plain cache attending to as many keys as the policy keeps,
            paying no scoring and no eviction; :func:`measure_decode` holds it at its budget's
            policies' count before every round, :func:`hold_last`).
    """

    label: str
    policy: Any = None
    budget: float | None = None
    cache_options: dict[str, Any] = field(default_factory=dict)
    keep_last: int | None = None

    @property
    def is_dynamic(self) -> bool:
        return self.policy is None


@dataclass(frozen=True)
class PolicySpec:
    """How to build a policy for a run: ``planner(budget, context_length, prompt_length)``.

    ``budgeted=False``: the planner ignores the budget (a fixed policy), measured once.
    """

    label: str
    planner: Callable[[float | None, int, int], Any]
    budgeted: bool = True

    def __post_init__(self) -> None:
        check_bool("budgeted", self.budgeted)

    @classmethod
    def named(cls, name: str) -> "PolicySpec":
        """A registered policy, planned with :func:`kvpolicy.plan_policy`."""
        entry = get_policy(name)

        def planner(budget: float | None, context_length: int, prompt_length: int) -> Any:
            return plan_policy(entry, budget, context_length=context_length, prompt_length=prompt_length).policy

        return cls(policy_name(name), planner)  # (the display name kvpolicy compare shows)


def standard_candidates(
    context: int,
    decode_tokens: int,
    *,
    policies: Sequence[str | PolicySpec] = ("streaming_llm", "h2o", "buzz"),
    budgets: Sequence[float] = (0.1, 0.25, 0.5),
    capture_only: bool = True,
    full: bool = True,
    limits: bool = True,
) -> list[Candidate]:
    """``DynamicCache``, our ``FullCache``, a capture-only cache, the limit of each budget, and
    ``policies`` x ``budgets``.

    Policies (registry names or :class:`PolicySpec`) are planned for a run of ``context`` prompt
    tokens and ``decode_tokens`` decoded ones.

    The capture-only candidate is H2O with a capacity above the whole run: it never evicts, so
    its cost over ``FullCache`` is the cost of capturing scores (the score product, the
    accumulation, the eviction check): the "score-capture overhead".

    The limit of budget ``b`` (``"limit 25%"``) is a ``DynamicCache`` holding only the last
    ``b x context`` prompt tokens; :func:`measure_decode` then holds it at as many tokens as the
    budget's policies keep, before every round. It attends to as many keys as they do and does no
    scoring and no eviction, so a policy's speed as a share of it is what the policy's
    bookkeeping costs.
    """
    capture_only, full = check_bool("capture_only", capture_only), check_bool("full", full)
    total = context + decode_tokens
    out = [Candidate("DynamicCache")]
    if full:
        out.append(Candidate("FullCache", FullCache()))
    if capture_only:
        out.append(Candidate("capture only", H2O(heavy=total, recent=total)))
    if limits:
        out += [Candidate(f"limit {b:.0%}", budget=b, keep_last=max(1, round(b * context))) for b in budgets]
    for entry in policies:
        spec = PolicySpec.named(entry) if isinstance(entry, str) else entry
        if not spec.budgeted:
            out.append(Candidate(spec.label, spec.planner(None, total, context)))
            continue
        for b in budgets:
            out.append(Candidate(f"{spec.label} {b:.0%}", spec.planner(b, total, context), budget=b))
    return out


@dataclass
class Prefill:
    """A prompt prefilled once: per-layer keys and values ``[batch, kv_heads, context, head_dim]``."""

    keys: list[Any]
    values: list[Any]
    context: int
    batch: int
    seconds: float


def _sync(device: Any) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _device_of(model: Any) -> Any:
    return next(model.parameters()).device


def prefill(model: Any, context: int, *, batch: int = 1, seed: int = 0, chunk: int | None = None) -> Prefill:
    """Prefill ``context`` random tokens with ``DynamicCache``; ``chunk`` bounds each forward."""

    device = _device_of(model)
    vocab = int(text_config(model).vocab_size)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(min(3, vocab - 1), vocab, (batch, context), generator=g).to(device)
    cache = DynamicCache(config=model.config)
    chunk = chunk or context
    start = time.perf_counter()
    with torch.no_grad():
        for lo in range(0, context, chunk):
            hi = min(context, lo + chunk)
            pos = torch.arange(lo, hi, device=device)[None].expand(batch, -1)
            model(input_ids=ids[:, lo:hi], **cache_kwargs(model, cache), position_ids=pos, use_cache=True, logits_to_keep=1)
    _sync(device)
    seconds = time.perf_counter() - start
    keys = [layer.keys for layer in cache.layers]
    values = [layer.values for layer in cache.layers]
    return Prefill(keys, values, context, batch, seconds)


def build_cache(model: Any, candidate: Candidate, pre: Prefill, *, score_seed: int = 0) -> Any:
    """A fresh cache of ``candidate`` holding the prefilled prompt (see the module docstring)."""
    if candidate.is_dynamic:
        cache = DynamicCache(config=model.config)
        last = candidate.keep_last or pre.context
        with torch.no_grad():
            for i, (k, v) in enumerate(zip(pre.keys, pre.values)):
                cache.update(k[:, :, -last:].contiguous(), v[:, :, -last:].contiguous(), i)  # a copy, as update concatenates
        return cache

    cache = EvictingCache(candidate.policy, model, **candidate.cache_options)
    g = torch.Generator().manual_seed(score_seed)
    with torch.no_grad():
        for layer, k, v in zip(cache.layers, pre.keys, pre.values):
            layer.lazy_initialization(k, v)
            store = layer.store
            store.append(k, v)
            if candidate.policy.uses_scores:
                # Placeholder for what the prompt's queries gave each key: sizes (and so speed)
                # do not depend on it; about the mass a causal prefill spreads per key.
                shape = tuple(store.scores.shape)
                received = torch.rand(shape, generator=g) * (2.0 * model.config.num_attention_heads / shape[1])
                store.accumulate(received.to(store.scores.device))
            if candidate.policy.observes_queries:
                # Expected Attention (or a wrapper scoring with it) scores from the moments of the
                # queries seen, and the prefill kept none: placeholder queries (before RoPE), one
                # per prompt token and query head, as for the scores above (a step's work does
                # not depend on their values; the decode steps' own queries are added to them).
                b, _, n, d = k.shape
                queries = torch.randn(b, text_config(model).num_attention_heads, n, d, generator=g)
                store.observe_queries(queries.to(device=k.device, dtype=k.dtype))
            store.evict()
    return cache


def cache_bytes(cache: Any) -> tuple[int, int]:
    """``(kv_bytes_held, bytes_allocated)`` of a ``DynamicCache`` or an ``EvictingCache``."""
    if hasattr(cache, "kv_bytes"):
        return int(cache.kv_bytes), int(cache.allocated_bytes)
    held = 0
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            if t is not None:
                held += t.numel() * t.element_size()
    return held, held


def _kept_length(cache: Any) -> float:
    """Tokens a cache holds per layer (mean over layers; under head-wise budgets, AdaKV, over
    heads too: ``lengths()`` is the widest head's)."""
    if hasattr(cache, "lengths"):
        lengths = [layer.store.mean_length if layer.store.policy.ragged_heads else length
                   for layer, length in zip(cache.layers, cache.lengths())]
        return sum(lengths) / len(lengths)
    return float(cache.layers[0].keys.shape[2])


def hold_last(cache: Any, tokens: int) -> None:
    """Cut every layer of a ``DynamicCache`` back to its newest ``tokens`` tokens (contiguous
    copies, as a fresh cache of that many would hold them); a layer holding fewer is left as it is.

    Example:
        >>> cache = DynamicCache()
        >>> _ = cache.update(torch.arange(6.0).view(1, 1, 6, 1), torch.zeros(1, 1, 6, 1), 0)
        >>> hold_last(cache, 4)
        >>> cache.layers[0].keys.flatten().tolist(), cache.layers[0].keys.is_contiguous()
        ([2.0, 3.0, 4.0, 5.0], True)
    """
    for layer in cache.layers:
        if layer.keys.shape[2] > tokens:
            layer.keys = layer.keys[:, :, -tokens:].contiguous()
            layer.values = layer.values[:, :, -tokens:].contiguous()


def _evictions(cache: Any) -> int:
    if hasattr(cache, "layers") and cache.layers and hasattr(cache.layers[0], "store"):
        return sum(layer.store.evictions for layer in cache.layers)
    return 0


def use_attention_for(model: Any, cache: Any) -> None:
    """Plain ``"sdpa"`` for the model (the baseline users have): an ``EvictingCache`` switches a
    model to kvpolicy's attention for its own forwards only (``scope_attention``), and a model
    left on ``"kvpolicy_sdpa"`` for good would make the baseline pay for kvpolicy's dispatch."""
    if getattr(model.config, "_attn_implementation", None) == ATTENTION_NAME:
        model.set_attn_implementation("sdpa")


def decode(model: Any, cache: Any, ids: Any, position: int) -> int:
    """Feed ``ids`` ``[batch, steps]`` one token at a time; return the next position."""

    b, steps = ids.shape
    use_attention_for(model, cache)
    with torch.no_grad():
        for t in range(steps):
            pos = torch.full((b, 1), position + t, dtype=torch.long, device=ids.device)
            model(input_ids=ids[:, t : t + 1], **cache_kwargs(model, cache), position_ids=pos, use_cache=True, logits_to_keep=1)
    return position + steps


@dataclass
class DecodeResult:
    """Decode speed and memory of one candidate at one context length."""

    label: str
    policy: str
    budget: float | None
    context: int
    batch: int
    seconds_per_step: list[float]
    ratio_vs_dynamic: list[float]
    kv_bytes: int
    allocated_bytes: int
    dynamic_kv_bytes: int
    kept: float
    capacity: int | None
    evictions: int
    steps: int
    share_of_limit: list[float] | None = None
    #: Tokens per layer the limit of ``share_of_limit`` held at the end (this policy's own limit).
    limit_kept: float | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.batch / statistics.median(self.seconds_per_step)

    @property
    def ratio(self) -> float:
        """Median over rounds of (DynamicCache s/step) / (this s/step): > 1 is faster."""
        return statistics.median(self.ratio_vs_dynamic)

    @property
    def memory_ratio(self) -> float:
        return self.kv_bytes / max(self.dynamic_kv_bytes, 1)

    def as_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "policy": self.policy,
            "budget": self.budget,
            "context": self.context,
            "batch": self.batch,
            "tokens_per_s": self.tokens_per_s,
            "ratio_vs_dynamic": self.ratio,
            "ratio_min": min(self.ratio_vs_dynamic),
            "ratio_max": max(self.ratio_vs_dynamic),
            "seconds_per_step": self.seconds_per_step,
            "kv_bytes": self.kv_bytes,
            "allocated_bytes": self.allocated_bytes,
            "memory_ratio": self.memory_ratio,
            "kept": self.kept,
            "capacity": self.capacity,
            "evictions": self.evictions,
            "steps": self.steps,
            "share_of_limit": None if self.share_of_limit is None else statistics.median(self.share_of_limit),
            # 95% confidence interval of that median over the rounds (None: too few rounds)
            "share_of_limit_interval": None if self.share_of_limit is None else median_interval(self.share_of_limit),
            "share_of_limit_rounds": self.share_of_limit,
        }


def measure_decode(
    model: Any,
    pre: Prefill,
    candidates: Sequence[Candidate],
    *,
    rounds: int = 3,
    steps: int = 8,
    warmup: int = 2,
    seed: int = 1,
    on_step: Callable[[str], None] | None = None,
) -> list[DecodeResult]:
    """Interleaved decode of every candidate from the same prefilled prompt (module docstring).

    ``candidates[0]`` is the reference of the ratios (``DynamicCache`` in
    :func:`standard_candidates`). ``on_step(label)`` is called after every timed block (a progress
    bar hook).

    The limit of a budget (a ``DynamicCache`` candidate with ``keep_last``) is held at as many
    tokens as that budget's policies keep: before every round, untimed, it is cut back
    (:func:`hold_last`) to the most any of them keeps then, so over a round it holds that count
    plus the round's steps. (Left to grow, it would attend to ever more keys than the policies as
    the rounds go on, and the shares would rise with the length of the run.) It is built from the
    whole prompt, so it can be held at any count up to the context. Each policy's
    ``share_of_limit`` is taken against a limit of its own, a copy held at *its* count and timed
    in the same rounds: one limit held at the most of several policies would hold more than a
    policy that keeps fewer (BUZZ's count rises to its threshold between evictions), which
    flatters that policy's share.
    """
    device = _device_of(model)
    vocab = int(text_config(model).vocab_size)
    g = torch.Generator().manual_seed(seed)
    total = warmup + rounds * steps
    ids = torch.randint(min(3, vocab - 1), vocab, (pre.batch, total), generator=g).to(device)
    limit_of = {c.budget: j for j, c in enumerate(candidates) if c.is_dynamic and c.keep_last is not None}
    policies_of = {j: [i for i, c in enumerate(candidates) if not c.is_dynamic and c.budget == b]
                   for b, j in limit_of.items()}
    held_limits = {j for j, members in policies_of.items() if members}  # limits with policies to follow
    caches = [build_cache(model, replace(c, keep_last=None) if i in held_limits else c, pre) for i, c in enumerate(candidates)]
    # each policy's own limit (appended after the candidates, timed with them, not reported)
    own_limit: dict[int, int] = {}
    for j in held_limits:
        for i in policies_of[j]:
            own_limit[i] = len(caches)
            caches.append(build_cache(model, replace(candidates[j], keep_last=None), pre))
    position = [pre.context] * len(caches)
    for i, cache in enumerate(caches):  # warm-up: allocator, first-call paths
        position[i] = decode(model, cache, ids[:, :warmup], position[i])
    evictions0 = [_evictions(c) for c in caches]
    times: list[list[float]] = [[] for _ in caches]
    n = len(caches)
    for r in range(rounds):
        kept = {i: round(_kept_length(caches[i])) for i in own_limit}  # (every policy of a held limit)
        for j in held_limits:
            hold_last(caches[j], max(kept[i] for i in policies_of[j]))
        for i, k in own_limit.items():
            hold_last(caches[k], kept[i])
        sums = [0.0] * n
        for t in range(steps):
            # one token per candidate, in an order rotated at every step: noise lasting longer than
            # a sweep over the candidates hits all of them alike
            tok = ids[:, warmup + r * steps + t : warmup + r * steps + t + 1]
            shift = (r * steps + t) % n
            for i in list(range(shift, n)) + list(range(shift)):
                use_attention_for(model, caches[i])
                _sync(device)
                start = time.perf_counter()
                position[i] = decode(model, caches[i], tok, position[i])
                _sync(device)
                sums[i] += time.perf_counter() - start
        for i in range(n):
            times[i].append(sums[i] / steps)
            if on_step is not None and i < len(candidates):
                on_step(candidates[i].label)
    dyn_bytes = cache_bytes(caches[0])[0]
    results = []
    for i, (cand, cache) in enumerate(zip(candidates, caches)):
        held, alloc = cache_bytes(cache)
        ratios = [times[0][r] / times[i][r] for r in range(rounds)]
        j = own_limit.get(i, limit_of.get(cand.budget) if not cand.is_dynamic else None)
        share = None if j is None else [times[j][r] / times[i][r] for r in range(rounds)]
        results.append(
            DecodeResult(
                label=cand.label,
                policy="transformers.DynamicCache" if cand.is_dynamic else repr(cand.policy),
                budget=cand.budget,
                context=pre.context,
                batch=pre.batch,
                seconds_per_step=times[i],
                ratio_vs_dynamic=ratios,
                kv_bytes=held,
                allocated_bytes=alloc,
                dynamic_kv_bytes=dyn_bytes,
                kept=_kept_length(cache),
                capacity=None if cand.is_dynamic else cand.policy.capacity,
                evictions=_evictions(cache) - evictions0[i],
                steps=rounds * steps,
                share_of_limit=share,
                limit_kept=None if j is None else _kept_length(caches[j]),
            )
        )
    del caches
    return results


# ----------------------------------------------------------------------------------- breakdown
class _Timers:
    """Exclusive wall-clock time per category: a nested timed call is subtracted from its parent."""

    def __init__(self) -> None:
        self.total: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._stack: list[float] = []  # time spent in children of each open frame

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        perf = time.perf_counter

        def timed(*args: Any, **kwargs: Any) -> Any:
            self._stack.append(0.0)
            start = perf()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = perf() - start
                children = self._stack.pop()
                self.total[name] = self.total.get(name, 0.0) + elapsed - children
                self.calls[name] = self.calls.get(name, 0) + 1
                if self._stack:
                    self._stack[-1] += elapsed

        timed.__wrapped__ = fn  # type: ignore[attr-defined]
        return timed


@contextmanager
def step_timers() -> Iterator[_Timers]:
    """Patch the pieces of a decode step with exclusive timers while the context is open.

    Categories: ``attention`` (SDPA), ``attention+scores (fused)`` (the fused decode path,
    :meth:`LayerCache.attend`, the scores' accumulation included),
    ``score product`` (``received_attention``), ``accumulate``, ``evict``, ``cache update``
    (append / ``torch.cat``), ``pos-shift`` (``rope_rotate``: StreamingLLM's query rotated back
    for its sinks, or keys re-rotated for other policies with ``positions="cache"``) and
    ``attention glue`` (the rest of kvpolicy's attention function: checks, bookkeeping).
    """

    timers = _Timers()
    patches: list[tuple[Any, str, Any]] = []

    def patch(obj: Any, attr: str, name: str) -> None:
        if not hasattr(obj, attr):
            return
        original = getattr(obj, attr)
        patches.append((obj, attr, original))
        setattr(obj, attr, timers.wrap(name, original))

    # a fresh instance reads transformers' global mapping (its local one is empty); the wrapped
    # entries go in and the originals come back through the public AttentionInterface.register
    interface = AttentionInterface()
    saved = {key: interface[key] for key in ("sdpa", hf.ATTENTION_NAME, hf.SCOPED_ATTENTION_NAME) if key in interface}
    try:
        patch(hf, "sdpa_attention_forward", "attention")
        patch(hf, "received_attention", "score product")
        patch(LayerCache, "attend", "attention+scores (fused)")
        patch(LayerCache, "accumulate", "accumulate")
        patch(LayerCache, "evict", "evict")
        patch(hf.EvictingLayer, "update", "cache update")
        patch(hf, "rope_rotate", "pos-shift")
        patch(DynamicLayer, "update", "cache update")
        for key, label in (("sdpa", "attention"), (hf.ATTENTION_NAME, "attention glue"),
                           (hf.SCOPED_ATTENTION_NAME, "attention glue")):
            if key in saved:
                AttentionInterface.register(key, timers.wrap(label, saved[key]))
        yield timers
    finally:
        for obj, attr, original in reversed(patches):
            setattr(obj, attr, original)
        for key, fn in saved.items():
            AttentionInterface.register(key, fn)


BREAKDOWN_ORDER = (
    "attention",
    "attention+scores (fused)",
    "score product",
    "accumulate",
    "evict",
    "cache update",
    "pos-shift",
    "attention glue",
    "rest of the model",
)


def breakdown(
    model: Any,
    pre: Prefill,
    candidates: Sequence[Candidate],
    *,
    steps: int = 8,
    rounds: int = 2,
    warmup: int = 2,
    seed: int = 2,
    on_step: Callable[[str], None] | None = None,
) -> dict[str, dict[str, float]]:
    """Milliseconds per decode step spent in each category, per candidate label.

    ``"step"`` is the whole step; ``"rest of the model"`` is the step minus the timed categories
    (projections, MLP, norms, RoPE, the LM head, the mask, Python around them). The timers' own
    overhead (about a microsecond per call) lands in the categories. The candidates take turns
    token by token like :func:`measure_decode`; the table averages all ``rounds * steps`` steps.
    """
    device = _device_of(model)
    vocab = int(text_config(model).vocab_size)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(min(3, vocab - 1), vocab, (pre.batch, warmup + rounds * steps), generator=g).to(device)
    caches = [build_cache(model, c, pre) for c in candidates]
    position = [decode(model, cache, ids[:, :warmup], pre.context) for cache in caches]
    totals: list[dict[str, float]] = [{} for _ in candidates]
    step_time = [0.0] * len(candidates)
    n = len(candidates)
    for r in range(rounds):
        for t in range(steps):
            tok = ids[:, warmup + r * steps + t : warmup + r * steps + t + 1]
            shift = (r * steps + t) % n
            for i in list(range(shift, n)) + list(range(shift)):
                use_attention_for(model, caches[i])
                with step_timers() as timers:
                    start = time.perf_counter()
                    position[i] = decode(model, caches[i], tok, position[i])
                    step_time[i] += time.perf_counter() - start
                for k, v in timers.total.items():
                    totals[i][k] = totals[i].get(k, 0.0) + v
        if on_step is not None:
            for i in range(n):
                on_step(candidates[i].label)
    out: dict[str, dict[str, float]] = {}
    n = rounds * steps
    for i, cand in enumerate(candidates):
        row = {k: v / n * 1e3 for k, v in totals[i].items()}
        row["rest of the model"] = step_time[i] / n * 1e3 - sum(row.values())
        row["step"] = step_time[i] / n * 1e3
        out[cand.label] = row
    del caches
    return out
