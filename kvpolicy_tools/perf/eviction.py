"""Eviction cost against cache size, for every built-in policy, on the torch and NumPy backends.

Two measures, both at a cache of ``size`` tokens per head:

* **one eviction**: the policy's decision plus the gather that applies it, from a decode step
  that brings the cache to ``size`` tokens (for BUZZ: the middle reaches its threshold, with as
  many old tokens as the steady state has).
* **per decoded token**: the amortised cost of a decode loop, ``append`` one token then
  ``evict`` (the policy's check, and its evictions when they come), over one whole eviction cycle
  (BUZZ: from just after an eviction to just after the next; on torch, policies that evict one
  token per step: one whole compaction cycle of the slot layout, so the amortised compaction is
  included; otherwise a fixed number of steps). Attention and the score accumulation are left out: they cost
  ``O(size)`` per token with or without eviction (the decode benchmark measures them).

``policy_at_size(name, size)`` builds each policy so that its cache holds ``size`` tokens when
it evicts: the largest of its kind (``from_size``) whose ``capacity`` is at most ``size``, the
policy :func:`kvpolicy.plan_capacity` plans. That is exactly ``size`` for the one-token policies
and Scissorhands (at sizes that are multiples of 8); for BUZZ (sink 4, stride 5, the window and
threshold from the parameter-estimation theorem, as ``from_size`` builds it) up to a few tokens
less, since its capacity grows in steps of about ``1 + T / w`` tokens (the middle size at
eviction is about 0.81 ``size``).

The torch workload runs on :class:`kvpolicy_torch.LayerCache` (keys and values included); the
NumPy workload applies the same decisions to NumPy positions and scores (the reference backend
holds no keys or values), in preallocated arrays, so both show the policy's own complexity.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpolicy.budget import fit_capacity
from kvpolicy.driver import evict_until_done
from kvpolicy.registry import Preset, get_policy

__all__ = [
    "POLICIES",
    "NumpyWorkload",
    "Steady",
    "TorchWorkload",
    "eviction_period",
    "fits",
    "measure_complexity",
    "policy_at_size",
    "steady_state",
    "workload",
]

#: Policies measured (``buzz_logn`` evicts exactly like ``buzz``: log n changes attention only).
POLICIES = ("buzz", "h2o", "streaming_llm", "local", "full", "tova", "scissorhands")

#: Decode steps per round for the policies that evict at every step (and the full cache).
EVERY_STEP_ROUND = 8


def policy_at_size(name: str, size: int) -> Any:
    """The policy ``name`` whose cache holds about ``size`` tokens when it evicts: the largest of
    its kind whose ``capacity`` is at most ``size`` (:func:`kvpolicy.budget.fit_capacity`, from
    the registry and ``from_size``, no policy named here); a policy that never evicts
    (``evicts = False``) with its defaults. See the module docstring.

    Example:
        >>> policy_at_size("h2o", 64), policy_at_size("streaming_llm", 64).capacity
        (H2O(heavy=31, recent=32), 64)
    """
    if size < 16:
        raise ValueError(f"size must be >= 16, got {size}")
    entry = get_policy(name)
    cls = entry.cls if isinstance(entry, Preset) else entry
    return fit_capacity(entry, size) if cls.evicts else entry()


@dataclass(frozen=True)
class Steady:
    """A policy's periodic eviction cycle (from placeholder scores; sizes are host decisions).

    ``size``: cache size when it evicts (the new token included); ``after``: size right after;
    ``period``: decode steps from one eviction to the next; ``state``: the policy state between
    them; ``seen_before`` / ``seen_after``: tokens seen just before the evicting step / right
    after the previous eviction. ``evicts`` is ``False`` for a policy that never evicts."""

    size: int
    after: int
    period: int
    state: dict[str, int]
    seen_before: int
    seen_after: int
    evicts: bool = True


def steady_state(policy: Any, size_hint: int = 1024, *, cycles: int = 6) -> Steady:
    """Run ``policy`` one decode token at a time on placeholder scores until its evictions repeat
    (``cycles`` evictions; BUZZ's old-token count settles within a few); an unbounded policy
    (``capacity is None``) gets a cache of ``size_hint`` tokens and is not expected to evict.

    Example:
        >>> from kvpolicy import H2O
        >>> s = steady_state(H2O(heavy=4, recent=4))
        >>> (s.size, s.after, s.period)
        (9, 8, 1)
    """

    cap = policy.capacity
    if cap is None:
        return Steady(size_hint, size_hint - 1, EVERY_STEP_ROUND, {}, size_hint - 1, size_hint - 1, evicts=False)
    pos = np.zeros((1, 1, cap + 1), dtype=np.int64)
    state = policy.init_state()
    n = seen = 0
    events: list[tuple[int, int, int, dict[str, int]]] = []
    limit = 100 * cap + 1000
    while len(events) < cycles:
        if n >= cap + 1:
            raise ValueError(f"{policy!r} holds {n} tokens, more than its capacity {cap}: run check_policy on it")
        pos[..., n] = seen
        n += 1
        seen += 1
        before, state_before = n, dict(state)
        kept = evict_until_done(policy, pos[..., :n], None, seen, state)[0]
        pos[..., : kept.shape[-1]] = kept
        n = int(kept.shape[-1])
        if n < before:
            events.append((seen, before, n, state_before))
        if seen > limit:
            raise ValueError(f"{policy!r} did not evict {cycles} times within {limit} tokens")
    (s1, _, a1, _), (s2, b2, _, st2) = events[-2], events[-1]
    return Steady(b2, a1, s2 - s1, st2, s2 - 1, s1)


def eviction_period(name: str, size: int) -> int:
    """Decode steps between two evictions in the steady state (1 for per-step policies)."""
    return steady_state(policy_at_size(name, size), size).period


class TorchWorkload:
    """A :class:`~kvpolicy_torch.LayerCache` of ``batch x heads`` rows at a chosen state.

    ``one_eviction()`` runs one eviction from a cache of ``steady.size`` tokens;
    ``decode_round()`` ``period`` decode steps of ``append`` + ``evict``: one eviction cycle, or,
    for a policy that evicts one token per step, one whole compaction cycle of the slot layout
    (so the amortised compaction is in the per-token figure). Call ``reset_before_eviction()`` /
    ``reset_after_eviction()`` before each (pytest-benchmark's ``setup``): they restore the
    layer's bookkeeping with :meth:`~kvpolicy_torch.LayerCache.restore`.
    """

    backend = "torch"

    def __init__(
        self,
        policy: Any,
        steady: Steady,
        *,
        label: str | None = None,
        batch: int = 1,
        heads: int = 8,
        head_dim: int = 64,
        dtype: Any = None,
        device: str = "cpu",
        seed: int = 0,
    ) -> None:
        import torch  # optional: the NumPy workload runs without torch

        from kvpolicy_torch import LayerCache  # optional: as torch

        size = steady.size
        self.name, self.size, self.batch, self.heads = label or policy.name, size, batch, heads
        self.policy, self.steady = policy, steady
        dtype = dtype or torch.float32
        g = torch.Generator().manual_seed(seed)
        extra = EVERY_STEP_ROUND + 1 if policy.capacity is None else 0
        self.layer = LayerCache(policy, reserve=size + extra if policy.capacity is None else None)
        kv = torch.randn(batch, heads, size - 1, head_dim, generator=g, dtype=dtype).to(device)
        self.layer.append(kv, kv)
        received = torch.rand(batch, heads, size - 1, generator=g).to(device=device, dtype=self.layer.scores.dtype)
        self.layer.accumulate(received)
        self.layer.evict()  # nothing to evict: the cache is one token short of its size
        self.token = kv[:, :, :1].clone()
        compaction = self.layer.compaction_period
        if steady.period > 1:
            self.period = steady.period
        else:
            self.period = compaction if compaction is not None else EVERY_STEP_ROUND
        snap = self.layer.snapshot()
        # before: size - 1 tokens (the next decode step appends the size-th); after: post-eviction
        self._before = dataclasses.replace(
            snap, seen=[steady.seen_before] * batch, states=[dict(steady.state) for _ in range(batch)]
        )
        # after: post-eviction; for one-token evictions the storage is full of holes, so the
        # round's first step compacts (and the round is one whole compaction cycle)
        front = self.layer.slots if compaction is not None and steady.period == 1 else steady.after
        self._after = dataclasses.replace(
            snap, seen=[steady.seen_after] * batch, count=[steady.after] * batch, front=[front] * batch,
            states=[dict(steady.state) for _ in range(batch)],
        )

    def reset_before_eviction(self) -> None:
        """``size - 1`` tokens, then one decode append: the next ``evict`` evicts."""
        self.layer.restore(self._before)
        self.layer.append(self.token, self.token)

    def reset_after_eviction(self) -> None:
        self.layer.restore(self._after)

    def one_eviction(self) -> None:
        self.layer.evict()

    def decode_round(self) -> None:
        layer, token = self.layer, self.token
        for _ in range(self.period):
            layer.append(token, token)
            layer.evict()


class NumpyWorkload:
    """The same decisions on NumPy positions and scores (preallocated ``[batch, heads, slots]``):
    the reference backend's own complexity (it holds no keys or values)."""

    backend = "numpy"

    def __init__(
        self, policy: Any, steady: Steady, *, label: str | None = None, batch: int = 1, heads: int = 8, seed: int = 0, **_: Any
    ) -> None:
        size = steady.size
        self.name, self.size, self.batch, self.heads = label or policy.name, size, batch, heads
        self.policy, self.steady = policy, steady
        rng = np.random.default_rng(seed)
        self.period = steady.period if steady.period > 1 else EVERY_STEP_ROUND
        slots = size + 1 if policy.capacity is not None else size + self.period + 1
        self.pos = np.zeros((batch, heads, slots), dtype=np.int64)
        self.pos[...] = np.arange(slots)
        self.scores = np.zeros((batch, heads, slots))
        self.scores[..., : size - 1] = rng.random((batch, heads, size - 1))
        self._pos0, self._scores0 = self.pos.copy(), self.scores.copy()
        self._before = (size - 1, steady.seen_before, dict(steady.state))
        self._after = (steady.after, steady.seen_after, dict(steady.state))
        self.length, self.n_seen, self.state = 0, 0, {}
        self.phase = "decode"

    def _restore(self, snap: tuple[int, int, dict[str, int]]) -> None:
        self.length, self.n_seen, state = snap
        self.state = dict(state)
        self.pos[...] = self._pos0
        self.scores[...] = self._scores0

    def append(self) -> None:
        n = self.length
        self.pos[..., n] = self.n_seen
        self.scores[..., n] = 0.0
        self.length = n + 1
        self.n_seen += 1

    def evict(self) -> None:
        n = self.length
        pos, scores, rounds = evict_until_done(self.policy, self.pos[..., :n], self.scores[..., :n], self.n_seen, self.state)
        if rounds:
            kept = pos.shape[-1]
            self.pos[..., :kept] = pos
            self.scores[..., :kept] = scores
            self.length = kept

    def reset_before_eviction(self) -> None:
        self._restore(self._before)
        self.append()

    def reset_after_eviction(self) -> None:
        self._restore(self._after)

    def one_eviction(self) -> None:
        self.evict()

    def decode_round(self) -> None:
        for _ in range(self.period):
            self.append()
            self.evict()


def workload(backend: str, name: str, size: int, **kwargs: Any) -> TorchWorkload | NumpyWorkload:
    """A :class:`TorchWorkload` or :class:`NumpyWorkload` of the built-in ``name`` at ``size``."""
    if backend not in ("torch", "numpy"):
        raise ValueError(f"backend must be 'torch' or 'numpy', got {backend!r}")
    policy = policy_at_size(name, size)
    cls = TorchWorkload if backend == "torch" else NumpyWorkload
    return cls(policy, steady_state(policy, size), label=name, **kwargs)


def fits(backend: str, size: int, batch: int, heads: int, max_token_heads: int) -> bool:
    """Whether a workload stays under ``max_token_heads`` (``batch * heads * size``; NumPy holds
    no keys or values, so it is allowed four times as many)."""
    limit = max_token_heads * (4 if backend == "numpy" else 1)
    return batch * heads * size <= limit


def measure_complexity(
    sizes: Sequence[int],
    configs: Sequence[tuple[int, int]],
    *,
    policies: Sequence[str] = POLICIES,
    backends: Sequence[str] = ("torch", "numpy"),
    rounds: int = 3,
    head_dim: int = 64,
    max_token_heads: int = 2**21,
    target_s: float = 0.02,
    on_progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Seconds of one eviction and per decoded token, for every backend x ``(batch, heads)`` x
    policy x size (sizes above ``max_token_heads`` skipped).

    Each of ``rounds`` rounds repeats a measurement until about ``target_s`` has passed (at most
    25 times) and keeps its fastest; the rounds are interleaved over the sizes of a series (one
    backend, configuration and policy), so slow phases of a shared machine hit every size alike.
    Rows hold the minimum over rounds (``*_s``: on a shared machine noise only adds time) and the
    median (``*_median_s``).
    """
    rows: list[dict[str, Any]] = []
    perf = time.perf_counter

    def timed(setup: Callable[[], None], fn: Callable[[], None], reps: int) -> float:
        best = math.inf
        for _ in range(reps):
            setup()
            t = perf()
            fn()
            best = min(best, perf() - t)
        return best

    for backend in backends:
        for batch, heads in configs:
            for name in policies:
                series = [s for s in sizes if fits(backend, s, batch, heads, max_token_heads)]
                loads = [workload(backend, name, s, batch=batch, heads=heads, head_dim=head_dim) for s in series]
                one: list[list[float]] = [[] for _ in loads]
                per: list[list[float]] = [[] for _ in loads]
                reps_one, reps_per = [], []
                for w in loads:  # warm-up (allocator, first calls), and how often to repeat
                    t1 = timed(w.reset_before_eviction, w.one_eviction, 2)
                    t2 = timed(w.reset_after_eviction, w.decode_round, 1)
                    reps_one.append(max(1, min(25, int(target_s / max(t1, 1e-6)))))
                    reps_per.append(max(1, min(25, int(target_s / max(t2, 1e-6)))))
                for _ in range(rounds):
                    for i, w in enumerate(loads):
                        one[i].append(timed(w.reset_before_eviction, w.one_eviction, reps_one[i]))
                        per[i].append(timed(w.reset_after_eviction, w.decode_round, reps_per[i]) / w.period)
                for i, (s, w) in enumerate(zip(series, loads)):
                    rows.append(
                        {
                            "backend": backend,
                            "policy": name,
                            "batch": batch,
                            "heads": heads,
                            "size": s,
                            "period": w.period,
                            "one_eviction_s": min(one[i]),
                            "per_token_s": min(per[i]),
                            "one_eviction_median_s": statistics.median(one[i]),
                            "per_token_median_s": statistics.median(per[i]),
                        }
                    )
                del loads
                if on_progress is not None:
                    on_progress(f"{backend} b{batch} h{heads} {name}")
    return rows
