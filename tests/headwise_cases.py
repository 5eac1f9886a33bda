"""Hypothesis cases of AdaKV's decode steps, for the tests of its declared rule on NumPy
(tests/core/policies/test_adakv.py) and of the torch backend's victim search (tests/torch/test_headwise.py)."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from kvpolicy import H2O, AdaKV, CacheView


@st.composite
def decode_steps(draw: st.DrawFn) -> tuple[AdaKV, CacheView]:
    """A layer of ``H`` heads right after a decode step of AdaKV over H2O: ``H x (limit + 1)``
    tokens spread over the heads at random (holes lead), every head holding the newest ``recent``
    positions (AdaKV never evicts them), scores from a few levels (ties within and across heads),
    NaN among them."""
    heads = draw(st.integers(1, 4))
    heavy, recent = draw(st.integers(1, 5)), draw(st.integers(1, 3))
    limit = heavy + recent
    alpha = draw(st.sampled_from([0.0, 0.2, 0.5, 1.0]))
    floor = AdaKV(H2O(heavy, recent), alpha).floor
    total = heads * (limit + 1)
    counts = [max(floor + 1, recent)] * heads  # (what a head holds at least: its floor and the newest token, its window)
    for _ in range(total - sum(counts)):
        counts[draw(st.integers(0, heads - 1))] += 1
    n_seen = max(counts) + draw(st.integers(0, 6))
    n = max(counts)
    positions = np.full((1, heads, n), -1, dtype=np.int64)
    for h, c in enumerate(counts):
        older = sorted(draw(st.lists(st.integers(0, n_seen - recent - 1), min_size=c - recent, max_size=c - recent, unique=True)))
        positions[0, h, n - c :] = older + list(range(n_seen - recent, n_seen))
    levels = st.sampled_from([0.0, 0.25, 0.5, 1.0, 2.0, np.nan, -np.inf])
    scores = np.array(draw(st.lists(levels, min_size=heads * n, max_size=heads * n))).reshape(1, heads, n)
    scores = np.where(positions >= 0, scores, 0.0)  # (holes score 0 in the reference)
    state = {"seen": n_seen - 1, "kept": limit}
    return AdaKV(H2O(heavy, recent), alpha), CacheView(positions, scores, n_seen, state)
