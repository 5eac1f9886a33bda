"""Budgets: turn "keep 30% of the cache" into policy parameters, and measure what a run realises.

Budget means what the BUZZ paper means: the policy's *average* cache size over a run divided by
the full cache's average size over the same run. Here a run is ``context_length`` tokens of
which the first ``prompt_length`` are one prefill; the average is taken over the decode steps
(every token when ``prompt_length`` is 0), and the size of a step is the number of keys its query
attends to (the new token included). Cache sizes of the built-in policies depend on counts only,
never on scores, so the plan replays the real policy code on placeholder scores and is exact.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from .validation import check_float, check_int
from .driver import evict_until_done
from .policies.buzz import BUZZ, check_ratio
from .policy import EvictionPolicy
from .registry import Preset, get_policy

__all__ = ["PLAN_TOLERANCE", "PolicyPlan", "fit_capacity", "make_policy", "plan_policy", "plan_capacity", "replay_sizes",
           "simulate_sizes", "realised_budget", "smallest_size", "warn_mean_layer"]

#: How far (a fraction of the request) a plan's realised budget may be from the requested one
#: before :func:`plan_policy` warns: a short run allows only a few sizes, so the nearest may be
#: far from the request (``plan_policy("local", 0.01, context_length=100)`` realises 0.039).
PLAN_TOLERANCE = 0.25


def simulate_sizes(policy: EvictionPolicy, context_length: int, prompt_length: int = 0, *,
                   layers: int | None = None) -> np.ndarray:
    """Cache size at every decode step of a run (keys attended, the new one included).

    A policy that declares a size rule (:meth:`~kvpolicy.EvictionPolicy.size_rule`: every
    built-in) is simulated on host integers; any other policy is replayed through its own
    ``evict`` on placeholder arrays. Both give the same sizes (checked by the tests).

    ``layers``: the sizes averaged over a model of that many layers, layer ``l`` running
    ``policy.for_layer(l, layers)`` (per-layer budgets, :class:`~kvpolicy.PyramidKV`: a layer
    whose budget exceeds the tokens seen keeps only those, so the layers' mean is not the mean
    layer's); float. ``None``: the policy itself.

    Example:
        >>> from kvpolicy import StreamingLLM, PyramidKV
        >>> simulate_sizes(StreamingLLM(sink=1, window=2), 6).tolist()
        [1, 2, 3, 4, 4, 4]
        >>> simulate_sizes(PyramidKV("h2o", size=4, beta=4, floor=2), 6, layers=2).tolist()
        [1.0, 2.0, 3.0, 3.5, 4.0, 4.5]
    """
    context_length = check_int("context_length", context_length, minimum=1)
    prompt_length = check_int("prompt_length", prompt_length, minimum=0, maximum=context_length)
    if layers is not None:
        layers = check_int("layers", layers, minimum=1)
        per_layer: dict[EvictionPolicy, int] = {}  # (layers often share a policy: simulate each once)
        for layer in range(layers):
            one = policy.for_layer(layer, layers)
            per_layer[one] = per_layer.get(one, 0) + 1
        total = sum(n * simulate_sizes(one, context_length, prompt_length).astype(np.float64) for one, n in per_layer.items())
        return total / layers
    rule = policy.size_rule()
    if rule is None:
        return replay_sizes(policy, context_length, prompt_length)
    state = policy.init_state()
    n = rule(prompt_length, state) if prompt_length else 0
    sizes = np.empty(context_length - prompt_length, dtype=np.int64)
    for i in range(context_length - prompt_length):
        n += 1
        sizes[i] = n
        n = rule(n, state)
    return sizes


def replay_sizes(policy: EvictionPolicy, context_length: int, prompt_length: int = 0) -> np.ndarray:
    """:func:`simulate_sizes` by replaying the policy's own ``evict`` on placeholder arrays: what
    a policy without a declared size rule is planned with, and the reference a declared rule is
    held to (the same sizes, on any scores, since sizes depend on counts only).

    Example:
        >>> from kvpolicy import StreamingLLM
        >>> replay_sizes(StreamingLLM(sink=1, window=2), 6, prompt_length=4).tolist()  # (the prompt evicted first)
        [4, 4]
    """
    context_length = check_int("context_length", context_length, minimum=1)
    prompt_length = check_int("prompt_length", prompt_length, minimum=0, maximum=context_length)
    state = policy.init_state()
    positions = np.zeros((1, 1, 0), dtype=np.int64)
    sizes = []

    def evict_until_stable(phase: str) -> None:
        nonlocal positions
        positions = evict_until_done(policy, positions, None, n_seen, state, phase)[0]

    n_seen = 0
    if prompt_length:
        n_seen = prompt_length
        positions = np.arange(prompt_length, dtype=np.int64)[None, None, :]
        evict_until_stable("prefill")
    for t in range(prompt_length, context_length):
        n_seen = t + 1
        positions = np.concatenate([positions, np.full((1, 1, 1), t, dtype=np.int64)], axis=-1)
        sizes.append(positions.shape[-1])
        evict_until_stable("decode")
    return np.asarray(sizes, dtype=np.int64)


def realised_budget(sizes: np.ndarray, context_length: int, prompt_length: int = 0) -> float:
    """Average of ``sizes`` over the full cache's average on the same decode steps.

    Defined over decode steps only, so a run needs at least one: ``prompt_length <
    context_length``, and ``sizes`` holds one size per decode step.

    Example:
        >>> realised_budget(np.asarray([1, 2, 2, 2]), 4)
        0.7
    """
    context_length = check_int("context_length", context_length, minimum=1)
    prompt_length = check_int("prompt_length", prompt_length, minimum=0, maximum=context_length - 1)
    sizes = np.asarray(sizes)
    if sizes.shape != (context_length - prompt_length,):
        raise ValueError(
            f"sizes must hold one size per decode step, shape ({context_length - prompt_length},), "
            f"got {sizes.shape}"
        )
    full = np.arange(prompt_length + 1, context_length + 1, dtype=np.float64)
    return float(np.mean(sizes) / np.mean(full))


@dataclass(frozen=True)
class PolicyPlan:
    """A policy resolved from a budget, with what it realises on the planned run."""

    policy: EvictionPolicy
    requested_budget: float
    realised_budget: float
    context_length: int
    prompt_length: int
    average_size: float
    full_average_size: float
    #: The ``T / w`` BUZZ was planned with (``None``: the theorem's, or not BUZZ).
    threshold_ratio: float | None = None
    #: Set by :func:`plan_capacity`: the capacity the plan had to stay within.
    requested_capacity: int | None = None
    #: The model's layer count the budget was realised over (per-layer budgets), or ``None``.
    layers: int | None = None

    @property
    def capacity(self) -> int | None:
        return self.policy.capacity

    def as_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy.name,
            "params": self.policy.params(),
            "requested_budget": self.requested_budget,
            "realised_budget": self.realised_budget,
            "context_length": self.context_length,
            "prompt_length": self.prompt_length,
            "capacity": self.capacity,
            "average_size": self.average_size,
            "full_average_size": self.full_average_size,
            **({"threshold_ratio": self.threshold_ratio} if self.threshold_ratio is not None else {}),
            **({"requested_capacity": self.requested_capacity} if self.requested_capacity is not None else {}),
            **({"layers": self.layers} if self.layers is not None else {}),
        }

    def __str__(self) -> str:
        params = ", ".join(f"{k}={v}" for k, v in self.policy.params().items()) or "-"
        cap = "unbounded" if self.capacity is None else str(self.capacity)
        return (
            f"policy            {self.policy.name}\n"
            f"parameters        {params}\n"
            f"capacity          {cap} tokens per head and layer\n"
            f"run               {self.context_length} tokens"
            + (f" ({self.prompt_length} prefilled)" if self.prompt_length else "")
            + "\n"
            f"average size      {self.average_size:.1f} (full cache: {self.full_average_size:.1f})\n"
            + (f"capacity limit    {self.requested_capacity} (equal capacity)\n" if self.requested_capacity is not None else "")
            + (f"layers            {self.layers} (each layer's budget planned)\n" if self.layers is not None else "")
            + f"budget            requested {self.requested_budget:.1%}, realised {self.realised_budget:.1%}"
        )


def smallest_size(name: str | type[EvictionPolicy] | Preset, limit: int, **overrides: Any) -> int:
    """The smallest size, from the policy's ``min_size`` up to ``limit``, that ``from_size``
    accepts with ``overrides`` (the size the planners start from): an override such as
    ``recent=4`` needs a size that leaves room for it. ``ValueError`` naming the overrides when
    no size up to ``limit`` accepts them, and for ``size=`` itself (the planners set it).

    Example:
        >>> smallest_size("knorm", 100), smallest_size("knorm", 100, recent=3)
        (1, 4)
    """
    entry = _entry(name)
    limit = check_int("limit", limit, minimum=1)
    cls = entry.cls if isinstance(entry, Preset) else entry
    if "size" in overrides:
        raise ValueError(
            f"size={overrides['size']!r} cannot be an override: size is what the planner sets from the budget (or "
            f"capacity); pass the budget you want, or build the policy itself (e.g. {cls.__name__}.from_size(...))"
        )

    def refusal(size: int) -> ValueError | None:
        try:
            entry.from_size(size, **dict(overrides))
        except ValueError as e:
            return e
        return None

    lo = entry.min_size
    first = refusal(lo)
    if first is None or not overrides:
        if first is not None:
            raise first
        return lo
    # the sizes an override fits grow upwards (recent <= size - sink, ...): the first that fits
    hi, last = lo, first
    while last is not None:
        if hi >= limit:
            if str(last) == str(first):
                raise first  # refused alike at every size: the constructor's own message names the parameter
            named = ", ".join(f"{k}={v!r}" for k, v in overrides.items())
            raise ValueError(
                f"{named} cannot be planned for {entry.name}: no size from {entry.min_size} to {limit} accepts it "
                f"(at size {hi}: {last})"
            )
        lo, hi = hi, min(max(hi * 2, hi + 1), limit)
        last = refusal(hi)
    while hi - lo > 1:  # refused at lo, accepted at hi
        mid = (lo + hi) // 2
        if refusal(mid) is None:
            hi = mid
        else:
            lo = mid
    return hi


def _ratio_overrides(entry: Any, threshold_ratio: float | None, overrides: dict[str, Any]) -> dict[str, Any]:
    """``overrides`` plus a validated ``threshold_ratio`` (BUZZ only)."""
    if threshold_ratio is None:
        return dict(overrides)

    cls = entry.cls if isinstance(entry, Preset) else entry
    if not (isinstance(cls, type) and issubclass(cls, BUZZ)):
        raise ValueError(f"threshold_ratio applies to BUZZ (and its presets) only, not {cls.name!r}")
    if "threshold" in overrides:
        raise ValueError("give threshold or threshold_ratio, not both")
    return {**overrides, "threshold_ratio": check_ratio(threshold_ratio)}


def plan_policy(
    name: str | type[EvictionPolicy] | Preset,
    budget: float = 0.4,
    *,
    context_length: int,
    prompt_length: int = 0,
    threshold_ratio: float | None = None,
    layers: int | None = None,
    **overrides: Any,
) -> PolicyPlan:
    """Resolve a policy's parameters so its realised budget is as close as possible to ``budget``.

    ``overrides`` fix parameters (e.g. ``stride=4``, ``sink=1``); the remaining size knob is
    searched (bisection over the policy's ``from_size``) against an exact size simulation.
    ``threshold_ratio`` (BUZZ only, > 0): plan with ``T = round(threshold_ratio * w)`` instead of
    the theorem's ratio (the smallest legal threshold, 3, still applies). ``layers``: the model's
    layer count, for a policy with per-layer budgets (:class:`~kvpolicy.PyramidKV`): the budget
    is then realised over every layer (:func:`simulate_sizes`); without it such a policy is
    planned as its mean layer, which overstates what it keeps once a layer's budget exceeds the
    tokens the run has seen (a warning says so).

    Example:
        >>> plan = plan_policy("buzz", 0.3, context_length=2048)
        >>> abs(plan.realised_budget - 0.3) < 0.05
        True
        >>> p = plan_policy("buzz", 0.3, context_length=2048, threshold_ratio=2.5).policy
        >>> p.threshold == round(2.5 * p.window)
        True
    """
    budget = check_float("budget", budget, low=0.0, high=1.0, low_open=True)
    context_length = check_int("context_length", context_length, minimum=1)
    prompt_length = check_int("prompt_length", prompt_length, minimum=0, maximum=context_length - 1)
    layers = None if layers is None else check_int("layers", layers, minimum=1)
    entry = _entry(name)
    overrides = _ratio_overrides(entry, threshold_ratio, overrides)
    full_avg = float(np.mean(np.arange(prompt_length + 1, context_length + 1)))

    def build(size: int) -> EvictionPolicy:
        return entry.from_size(size, **dict(overrides))

    memo: dict[int, tuple[EvictionPolicy, float, float]] = {}

    def evaluate(size: int) -> tuple[EvictionPolicy, float, float]:
        if size not in memo:
            policy = build(size)
            sizes = simulate_sizes(policy, context_length, prompt_length, layers=layers)
            memo[size] = (policy, float(np.mean(sizes)) / full_avg, float(np.mean(sizes)))
        return memo[size]

    cls = entry.cls if isinstance(entry, Preset) else entry
    title = entry.name  # (a preset by its own name: "snapkv_buzz", not its class's "compose")
    if not cls.evicts:
        if budget != 1.0:
            raise ValueError(f"budget for the {cls.name!r} policy must be 1.0 (it keeps every token), got {budget}")
        policy = entry(**overrides)
        return PolicyPlan(policy, 1.0, 1.0, context_length, prompt_length, full_avg, full_avg)

    lo = smallest = smallest_size(entry, max(entry.min_size, context_length), **overrides)
    hi = max(lo, context_length)
    if evaluate(lo)[1] > budget + 0.05:
        fixed = _blocking_overrides(entry, budget, context_length, prompt_length, full_avg, overrides)
        if fixed:
            named = ", ".join(f"{k}={overrides[k]!r}" for k in fixed)
            raise ValueError(
                f"{named} keeps {cls.name} at a realised budget of at least {evaluate(lo)[1]:.3f} on a "
                f"{context_length}-token run, above the requested budget {budget}: lower {' and '.join(fixed)} or "
                "leave it out so the budget sets it"
            )
        floor = evaluate(lo)[1]
        # a policy that compresses only a prompt (SnapKV) keeps every token of a run without one
        hint = (" (it keeps every token of a run without a prompt: give prompt_length, `kvpolicy plan --prompt N`)"
                if prompt_length == 0 and floor >= 1.0 else "")
        raise ValueError(
            f"budget {budget} is below the smallest {title} reaches on a {context_length}-token run "
            f"({floor:.3f}); allowed range: [{floor:.3f}, 1]{hint}"
        )
    # Find the smallest size whose realised budget reaches the request. The realised budget is
    # close to linear in size, so probe by interpolation inside the bracket (a few simulations
    # instead of a full bisection), falling back to the midpoint when interpolation stalls.
    if evaluate(hi)[1] < budget:
        lo = hi
    bisect = False
    while lo < hi:
        if bisect:
            mid = (lo + hi) // 2
        else:
            r_lo, r_hi = evaluate(lo)[1], evaluate(hi)[1]
            guess = lo + round((budget - r_lo) / max(r_hi - r_lo, 1e-12) * (hi - lo))
            mid = min(max(guess, lo), hi - 1)
        width = hi - lo
        if evaluate(mid)[1] >= budget:
            hi = mid
        else:
            lo = mid + 1
        bisect = (hi - lo) * 2 > width  # interpolation stalled: halve next time
    candidates = [evaluate(lo)] + ([evaluate(lo - 1)] if lo > smallest else [])
    policy, realised, avg = min(candidates, key=lambda c: abs(c[1] - budget))
    if realised < budget - 0.05:
        warnings.warn(
            f"budget {budget} is out of reach for {title} on this {context_length}-token run: the most it realises "
            f"is {realised:.3f} ({policy!r}; per-layer budgets leave the smallest layers' budgets below the run)",
            UserWarning, stacklevel=2,
        )
    elif abs(realised - budget) > PLAN_TOLERANCE * budget:
        warnings.warn(
            f"budget {budget} is far from what {title} can realise on this {context_length}-token run: the nearest "
            f"plan, {policy!r}, realises {realised:.3f} ({realised / budget:.1f}x the request; more than "
            f"{PLAN_TOLERANCE:.0%} off). A longer run (context_length) gives finer sizes",
            UserWarning, stacklevel=2,
        )
    if layers is None:
        warn_mean_layer(policy, context_length, prompt_length, average=avg)
    return PolicyPlan(policy, budget, realised, context_length, prompt_length, avg, full_avg, threshold_ratio,
                      layers=layers)


def warn_mean_layer(policy: EvictionPolicy, context_length: int, prompt_length: int, *,
                    average: float | None = None) -> None:
    """Warn when ``policy`` gives layers their own budgets (:meth:`~kvpolicy.EvictionPolicy.for_layer`)
    and a plan of its mean layer misstates the run: a layer whose budget exceeds the tokens seen
    at some step keeps fewer than its budget there, so the layers' mean falls below the mean
    layer's. (The bottom of a :class:`~kvpolicy.PyramidKV` is the same for every layer count, and
    the largest.) Within 0.5% counts as exact. ``average``: the mean layer's average size on this
    run, when the caller has it (:func:`plan_policy` does).

    Example:
        >>> from kvpolicy import H2O
        >>> warn_mean_layer(H2O(heavy=8, recent=8), 100, 50)  # (one budget for every layer: silent)
    """
    if policy.for_layer(0, 2) == policy == policy.for_layer(1, 2):
        return
    # two layers are the widest split (the bottom layer's budget is the same for every layer
    # count): if their mean keeps what the mean layer keeps, no layer count falls short of it
    mean = float(np.mean(simulate_sizes(policy, context_length, prompt_length))) if average is None else average
    if float(np.mean(simulate_sizes(policy, context_length, prompt_length, layers=2))) >= 0.995 * mean:
        return
    warnings.warn(
        f"{policy!r} gives layers their own budgets, and its largest ones exceed the tokens this "
        f"{context_length}-token run has seen at some step: planned as its mean layer, the realised budget "
        f"is overstated. Pass layers= (the model's layer count) to plan every layer",
        UserWarning, stacklevel=3,
    )


def _blocking_overrides(
    entry: Any, budget: float, context_length: int, prompt_length: int, full_avg: float, overrides: dict[str, Any]
) -> list[str]:
    """The fixed parameters of ``overrides`` without which ``budget`` becomes reachable (each left
    out alone, then all together): what an unreachable budget is to be blamed on."""
    def reachable(kept: dict[str, Any]) -> bool:
        try:
            smallest = entry.from_size(smallest_size(entry, max(entry.min_size, context_length), **kept), **kept)
        except ValueError:
            return False
        return float(np.mean(simulate_sizes(smallest, context_length, prompt_length))) / full_avg <= budget + 0.05

    names = [k for k in overrides if not (k == "threshold_ratio" and issubclass(getattr(entry, "cls", entry), BUZZ))]
    alone = [k for k in names if reachable({j: v for j, v in overrides.items() if j != k})]
    if alone:
        return alone
    return names if names and reachable({j: v for j, v in overrides.items() if j not in names}) else []


def plan_capacity(
    name: str | type[EvictionPolicy] | Preset,
    capacity: int,
    *,
    context_length: int,
    prompt_length: int = 0,
    threshold_ratio: float | None = None,
    layers: int | None = None,
    **overrides: Any,
) -> PolicyPlan:
    """The largest policy whose :attr:`~kvpolicy.EvictionPolicy.capacity` (peak tokens per head
    and layer, i.e. peak memory) is at most ``capacity``: the *equal-capacity* counterpart of
    :func:`plan_policy`'s equal mean size. The plan reports the average size and realised budget
    this policy reaches on the described run (BUZZ's average is well below its capacity; over
    ``layers`` layers for per-layer budgets, as :func:`plan_policy`).

    Example:
        >>> plan = plan_capacity("buzz", 50, context_length=1056, prompt_length=32)
        >>> plan.capacity <= 50, round(plan.average_size) < 50
        (True, True)
        >>> plan_capacity("streaming_llm", 50, context_length=1056, prompt_length=32).capacity
        50
    """
    capacity = check_int("capacity", capacity, minimum=1)
    context_length = check_int("context_length", context_length, minimum=1)
    prompt_length = check_int("prompt_length", prompt_length, minimum=0, maximum=context_length - 1)
    entry = _entry(name)
    layers = None if layers is None else check_int("layers", layers, minimum=1)
    policy = fit_capacity(entry, capacity, **_ratio_overrides(entry, threshold_ratio, overrides))
    full_avg = float(np.mean(np.arange(prompt_length + 1, context_length + 1)))
    sizes = simulate_sizes(policy, context_length, prompt_length, layers=layers)
    avg = float(np.mean(sizes))
    if layers is None:
        warn_mean_layer(policy, context_length, prompt_length, average=avg)
    return PolicyPlan(policy, capacity / full_avg, avg / full_avg, context_length, prompt_length, avg, full_avg,
                      threshold_ratio, capacity, layers=layers)


def fit_capacity(name: str | type[EvictionPolicy] | Preset, capacity: int, **overrides: Any) -> EvictionPolicy:
    """The largest policy of a kind whose :attr:`~kvpolicy.EvictionPolicy.capacity` is at most
    ``capacity``: ``from_size(size, **overrides)`` of the largest such ``size`` (a registry name,
    a policy class or a preset; any policy with a size knob, none named). What
    :func:`plan_capacity` plans and the eviction benchmarks measure (:mod:`kvpolicy_tools.perf.eviction`).

    Example:
        >>> fit_capacity("h2o", 65), fit_capacity("streaming_llm", 50).capacity
        (H2O(heavy=32, recent=32), 50)
    """
    capacity = check_int("capacity", capacity, minimum=1)
    entry = _entry(name)
    cls = entry.cls if isinstance(entry, Preset) else entry
    if not cls.evicts:
        raise ValueError(f"the {cls.name!r} policy has no capacity limit (it keeps every token): plan it without one")

    def cap(size: int) -> float:
        c = entry.from_size(size, **dict(overrides)).capacity
        return math.inf if c is None else c

    lo = smallest_size(entry, max(entry.min_size, capacity), **overrides)
    if cap(lo) > capacity:
        named = "".join(f", {k}={v!r}" for k, v in overrides.items())
        raise ValueError(
            f"capacity {capacity} is below the smallest {cls.name}{named and ' with' + named[1:]} can have "
            f"({cap(lo):g}); allowed range: >= {cap(lo):g}"
        )
    hi = max(lo, capacity)
    while cap(hi) <= capacity:  # capacities grow at least one token per size step for the built-ins
        hi *= 2
    # the largest size whose capacity fits: cap(lo) <= capacity < cap(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if cap(mid) <= capacity:
            lo = mid
        else:
            hi = mid
    return entry.from_size(lo, **dict(overrides))


def _entry(name: object) -> type[EvictionPolicy] | Preset:
    """The registry entry ``name`` stands for: a registered name, a policy class or a preset."""
    if isinstance(name, str):
        return get_policy(name)
    if isinstance(name, Preset) or (isinstance(name, type) and issubclass(name, EvictionPolicy)):
        return name
    hint = " (an instance: pass its class, or use it as is)" if isinstance(name, EvictionPolicy) else ""
    raise ValueError(
        "name must be a registered policy name (see kvpolicy.available_policies()), an EvictionPolicy "
        f"subclass or a Preset; got {name!r}{hint}"
    )


def make_policy(
    name: str | type[EvictionPolicy] | Preset,
    budget: float = 0.4,
    *,
    context_length: int,
    prompt_length: int = 0,
    threshold_ratio: float | None = None,
    layers: int | None = None,
    **overrides: Any,
) -> EvictionPolicy:
    """A policy whose realised budget on the described run is closest to ``budget`` (``layers``:
    the model's layer count, for per-layer budgets: see :func:`plan_policy`).

    For BUZZ the threshold comes from the parameter-estimation theorem
    (:func:`kvpolicy.estimate_threshold`) unless overridden, or from ``threshold_ratio`` (``T / w``,
    BUZZ only). Use :func:`plan_policy` to also get the realised budget and average size.

    Example:
        >>> from kvpolicy import make_policy
        >>> make_policy("h2o", 0.25, context_length=1024)
        H2O(heavy=68, recent=68)
    """
    return plan_policy(
        name, budget, context_length=context_length, prompt_length=prompt_length, threshold_ratio=threshold_ratio,
        layers=layers, **overrides,
    ).policy
