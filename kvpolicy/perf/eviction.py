"""Eviction cost against cache size, for every built-in policy, on the torch and NumPy backends.

Two measures, both at a cache of ``size`` tokens per head:

* **one eviction**: the policy's decision plus the gather that applies it, from a decode step
  that brings the cache to ``size`` tokens (for BUZZ: the middle reaches its threshold, with as
  many old tokens as the steady state has).
* **per decoded token**: the amortised cost of a decode loop, ``append`` one token then
  ``evict`` (the policy's check, and its evictions when they come), over one whole eviction cycle
  (BUZZ: from just after an eviction to just after the next; policies that evict at every step:
  a fixed number of steps). Attention and the score accumulation are left out: they cost
  ``O(size)`` per token with or without eviction (the decode benchmark measures them).

``policy_at_size(name, size)`` builds each policy so that its cache holds ``size`` tokens when
it evicts (its ``capacity`` is ``size``): for BUZZ, sink 4, stride 5, the window from the
parameter-estimation theorem, and the threshold that makes the capacity ``size`` (the middle size
at eviction is about 0.81 ``size``).

The torch workload runs on :class:`kvpolicy_torch.LayerCache` (keys and values included); the
NumPy workload applies the same decisions to NumPy positions and scores (the reference backend
holds no keys or values), in preallocated arrays, so both show the policy's own complexity.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "POLICIES",
    "NumpyWorkload",
    "TorchWorkload",
    "eviction_period",
    "fits",
    "measure_complexity",
    "policy_at_size",
    "workload",
]

#: Policies measured (``buzz_logn`` evicts exactly like ``buzz``: log n changes attention only).
POLICIES = ("buzz", "h2o", "streaming_llm", "local", "full")

#: Decode steps per round for the policies that evict at every step (and the full cache).
EVERY_STEP_ROUND = 8


def policy_at_size(name: str, size: int) -> Any:
    """The policy ``name`` with ``capacity == size`` (see the module docstring)."""
    from kvpolicy import BUZZ, H2O, FullCache, LocalWindow, StreamingLLM, threshold_ratio

    if size < 16:
        raise ValueError(f"size must be >= 16, got {size}")
    if name == "buzz":
        sink, stride = 4, 5
        window = max(1, round((size - sink) / (1 + threshold_ratio(stride))))
        return BUZZ(sink=sink, window=window, stride=stride, threshold=size - sink - window)
    if name == "h2o":
        heavy = (size - 1) // 2
        return H2O(heavy=heavy, recent=size - 1 - heavy)
    if name == "streaming_llm":
        return StreamingLLM(sink=4, window=size - 5)
    if name == "local":
        return LocalWindow(window=size - 1)
    if name == "full":
        return FullCache()
    raise ValueError(f"unknown policy {name!r}; expected one of {', '.join(POLICIES)}")


def _steady(policy: Any, size: int) -> tuple[int, dict[str, int], int, int]:
    """Run the size rule of ``policy`` until its evictions are periodic.

    Returns ``(after, state, period, seen)``: the cache size right after an eviction, the policy
    state then, the decode steps until the next eviction (its last step evicts), and the tokens
    seen so far. The full cache returns ``(size - 1, {}, EVERY_STEP_ROUND, size - 1)``.
    """
    from kvpolicy.budget import _size_rule

    rule = _size_rule(policy)
    if rule is None or policy.capacity is None:
        return size - 1, {}, EVERY_STEP_ROUND, size - 1
    state = policy.init_state()
    n, seen, evictions = 0, 0, []
    while len(evictions) < 6:  # BUZZ's old-token count settles within a few evictions
        n += 1
        seen += 1
        after = rule(n, state)
        if after < n:
            evictions.append((seen, after, dict(state)))
        n = after
        if seen > 100 * size + 1000:  # pragma: no cover - a policy that never evicts
            raise RuntimeError(f"{policy!r} does not evict within {seen} tokens")
    (s1, after1, state1), (s2, _, _) = evictions[-2], evictions[-1]
    return after1, state1, s2 - s1, s1


def eviction_period(name: str, size: int) -> int:
    """Decode steps between two evictions in the steady state (1 for per-step policies)."""
    return _steady(policy_at_size(name, size), size)[2]


@dataclass
class _Snapshot:
    length: int
    n_seen: int
    state: dict[str, int]


class TorchWorkload:
    """A :class:`~kvpolicy_torch.LayerCache` of ``batch x heads`` rows at a chosen state.

    ``one_eviction()`` runs one eviction from a cache of ``size`` tokens; ``decode_round()`` one
    eviction cycle of ``append`` + ``evict``. Call ``reset_before_eviction()`` /
    ``reset_after_eviction()`` before each (pytest-benchmark's ``setup``).
    """

    backend = "torch"

    def __init__(
        self,
        name: str,
        size: int,
        *,
        batch: int = 1,
        heads: int = 8,
        head_dim: int = 64,
        dtype: Any = None,
        device: str = "cpu",
        seed: int = 0,
    ) -> None:
        import torch

        from kvpolicy_torch import LayerCache

        self.name, self.size, self.batch, self.heads = name, size, batch, heads
        self.policy = policy_at_size(name, size)
        dtype = dtype or torch.float32
        g = torch.Generator().manual_seed(seed)
        after, state, period, seen = _steady(self.policy, size)
        self.period = period if self.policy.capacity is not None and name == "buzz" else EVERY_STEP_ROUND
        self.layer = LayerCache(self.policy)
        kv = torch.randn(batch, heads, size, head_dim, generator=g, dtype=dtype).to(device)
        if self.policy.capacity is None:  # grow the full cache once, outside the timed region
            self.layer.append(torch.cat([kv, kv], dim=2), torch.cat([kv, kv], dim=2))
            self.layer.length = 0
            self.layer.n_seen = 0
        self.layer.append(kv[:, :, : size - 1], kv[:, :, : size - 1])
        self.layer.accumulate(torch.rand(batch, heads, size - 1, generator=g).to(device))
        self.layer.evict()  # nothing to evict: the cache is one token short of its capacity
        self.layer.n_seen = seen
        self.layer.state = dict(state)
        self.token = kv[:, :, :1].clone()
        # before: size - 1 tokens (the last decode step appends the size-th); after: post-eviction
        self._before = _Snapshot(size - 1, seen, dict(state))
        self._after = _Snapshot(after, seen, dict(state))
        self._pos0 = self.layer._pos.clone()  # type: ignore[union-attr]
        self._scores0 = self.layer._scores.clone()  # type: ignore[union-attr]

    def _restore(self, snap: _Snapshot) -> None:
        layer = self.layer
        layer._overflow = None
        layer.length = snap.length
        layer.n_seen = snap.n_seen
        layer.state = dict(snap.state)
        layer._pos.copy_(self._pos0)  # type: ignore[union-attr]
        layer._scores.copy_(self._scores0)  # type: ignore[union-attr]

    def reset_before_eviction(self) -> None:
        """``size - 1`` tokens, then one decode append: the next ``evict`` evicts."""
        self._restore(self._before)
        self.layer.append(self.token, self.token)

    def reset_after_eviction(self) -> None:
        self._restore(self._after)

    def one_eviction(self) -> None:
        self.layer.evict()

    def decode_round(self) -> None:
        layer, token = self.layer, self.token
        for _ in range(self.period):
            layer.append(token, token)
            layer.evict()


class NumpyWorkload:
    """The same decisions on NumPy positions and scores (preallocated ``[batch, heads, slots]``)."""

    backend = "numpy"

    def __init__(self, name: str, size: int, *, batch: int = 1, heads: int = 8, seed: int = 0, **_: Any) -> None:
        import numpy as np

        self.name, self.size, self.batch, self.heads = name, size, batch, heads
        self.policy = policy_at_size(name, size)
        rng = np.random.default_rng(seed)
        after, state, period, seen = _steady(self.policy, size)
        self.period = period if name == "buzz" else EVERY_STEP_ROUND
        slots = size if self.policy.capacity is not None else size + EVERY_STEP_ROUND + 1
        self.pos = np.zeros((batch, heads, slots), dtype=np.int64)
        self.pos[...] = np.arange(slots)
        self.scores = np.zeros((batch, heads, slots))
        self.scores[..., : size - 1] = rng.random((batch, heads, size - 1))
        self._pos0, self._scores0 = self.pos.copy(), self.scores.copy()
        self._before = _Snapshot(size - 1, seen, dict(state))
        self._after = _Snapshot(after, seen, dict(state))
        self.length, self.n_seen, self.state = 0, 0, {}
        self.phase = "decode"

    def _restore(self, snap: _Snapshot) -> None:
        self.length, self.n_seen, self.state = snap.length, snap.n_seen, dict(snap.state)
        self.pos[...] = self._pos0
        self.scores[...] = self._scores0

    def append(self) -> None:
        n = self.length
        self.pos[..., n] = self.n_seen
        self.scores[..., n] = 0.0
        self.length = n + 1
        self.n_seen += 1

    def evict(self) -> None:
        import numpy as np

        from kvpolicy.policy import CacheView

        while True:
            n = self.length
            view = CacheView(self.pos[..., :n], self.scores[..., :n], self.n_seen, self.state, "decode")
            keep = self.policy.evict(view)
            if keep is None:
                return
            keep = np.asarray(keep)
            kept = keep.shape[-1]
            new_pos = np.take_along_axis(self.pos[..., :n], keep, axis=-1)
            new_scores = np.take_along_axis(self.scores[..., :n], keep, axis=-1)
            self.pos[..., :kept] = new_pos
            self.scores[..., :kept] = new_scores
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
    """A :class:`TorchWorkload` or :class:`NumpyWorkload`."""
    if backend == "torch":
        return TorchWorkload(name, size, **kwargs)
    if backend == "numpy":
        return NumpyWorkload(name, size, **kwargs)
    raise ValueError(f"backend must be 'torch' or 'numpy', got {backend!r}")


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
    import statistics
    import time

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
