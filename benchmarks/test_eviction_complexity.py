"""Eviction cost against the cache size, every policy, torch and NumPy backends.

Two benchmarks per point (see :mod:`kvpolicy_tools.perf.eviction`): one eviction from a cache of
``size`` tokens, and the amortised cost per decoded token of ``append`` + ``evict`` over one
eviction cycle. The session summary fits the log-log slope of each series (conftest.py).
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

import _settings  # noqa: E402

from kvpolicy_tools.perf.eviction import POLICIES, fits, workload  # noqa: E402

POINTS = [
    pytest.param(backend, policy, batch, heads, size, id=f"{backend}-{policy}-b{batch}-h{heads}-{size}")
    for backend in ("torch", "numpy")
    for batch, heads in _settings.CONFIGS
    for policy in POLICIES
    for size in _settings.SIZES
    if fits(backend, size, batch, heads, _settings.MAX_TOKEN_HEADS)
]


def _length(w) -> int:
    return w.layer.length if w.backend == "torch" else w.length


@pytest.mark.parametrize("backend, policy, batch, heads, size", POINTS)
def test_one_eviction(benchmark, record, backend, policy, batch, heads, size):
    w = workload(backend, policy, size, batch=batch, heads=heads, head_dim=_settings.HEAD_DIM)
    benchmark.group = f"one eviction: {backend}, {policy}, batch {batch}, {heads} heads"
    benchmark.extra_info.update(backend=backend, policy=policy, batch=batch, heads=heads, size=size)
    benchmark.pedantic(w.one_eviction, setup=w.reset_before_eviction, rounds=_settings.ROUNDS, warmup_rounds=1)
    # the benchmark measured what it claims: an eviction from `size` tokens (none for the full cache)
    if policy == "full":
        assert _length(w) == size
    else:
        assert _length(w) < size
    record(benchmark, measure="one_eviction", backend=backend, policy=policy, batch=batch, heads=heads, size=size)


@pytest.mark.parametrize("backend, policy, batch, heads, size", POINTS)
def test_per_token(benchmark, record, backend, policy, batch, heads, size):
    w = workload(backend, policy, size, batch=batch, heads=heads, head_dim=_settings.HEAD_DIM)
    benchmark.group = f"per decoded token: {backend}, {policy}, batch {batch}, {heads} heads"
    benchmark.extra_info.update(backend=backend, policy=policy, batch=batch, heads=heads, size=size, steps_per_round=w.period)
    benchmark.pedantic(w.decode_round, setup=w.reset_after_eviction, rounds=_settings.ROUNDS, warmup_rounds=1)
    # one whole cycle: back to the post-eviction size (the full cache just grows)
    w2 = workload(backend, policy, size, batch=1, heads=1, head_dim=4)
    w2.reset_after_eviction()
    start = _length(w2)
    w2.decode_round()
    assert _length(w2) == (start + w2.period if policy == "full" else start)
    record(benchmark, per=w.period, measure="per_token", backend=backend, policy=policy, batch=batch, heads=heads, size=size)
