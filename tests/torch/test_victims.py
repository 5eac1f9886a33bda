"""kvpolicy_torch/victims.py: H2O's victim search among candidates (kvpolicy_torch.LayerCache,
``victim="lowest"`` on CPU).

Above ``candidate_min_scores`` scores per step the store finds the lowest eligible score among a
candidate set and the slots that became eligible since its last full search, trusting that
accumulated scores only grow. Held here to the full scan on the same inputs: every decode step
evicts the same slot, under ties (small integer scores), zeros, and received values that break
monotonicity (negative, NaN), for one row and for batches.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from kvpolicy import H2O  # noqa: E402
from kvpolicy_torch import LayerCache  # noqa: E402

HEADS, DIM = 2, 2

received_values = st.one_of(
    st.integers(0, 3).map(float),  # small integers: exact ties everywhere
    st.floats(0, 1, allow_nan=False, width=32),
    st.sampled_from([-1.0, math.nan, math.inf]),  # not monotone (or infinite): the candidates are dropped
)


def _layers(policy: H2O, candidates: int) -> tuple[LayerCache, LayerCache]:
    fast, full = LayerCache(policy), LayerCache(policy)
    fast.candidate_min_scores, fast.candidates = 1, candidates
    full.candidate_min_scores = 1 << 60
    return fast, full


@given(
    heavy=st.integers(10, 30), recent=st.integers(1, 6), candidates=st.integers(1, 3), batch=st.integers(1, 2),
    prompt=st.integers(1, 40), steps=st.integers(1, 60), data=st.data(),
)
@settings(max_examples=200, deadline=None)
def test_candidate_search_evicts_what_the_full_scan_evicts(heavy, recent, candidates, batch, prompt, steps, data) -> None:
    policy = H2O(heavy=heavy, recent=recent)
    fast, full = _layers(policy, candidates)
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    kv = torch.randn(batch, HEADS, prompt, DIM, generator=g)
    for layer in (fast, full):
        layer.append(kv, kv)
    monotone_only = data.draw(st.booleans())
    values = st.integers(0, 3).map(float) if monotone_only else received_values
    for t in range(steps + 1):
        n = fast.slot_positions.shape[-1]
        received = torch.tensor(data.draw(st.lists(values, min_size=batch * HEADS * n, max_size=batch * HEADS * n)))
        received = received.view(batch, HEADS, n)
        for layer in (fast, full):
            layer.accumulate(received.clone())
            layer.evict()
        assert torch.equal(fast.positions, full.positions), t
        if t == steps:
            break
        token = torch.randn(batch, HEADS, 1, DIM, generator=g)
        for layer in (fast, full):
            layer.append(token, token)


def test_candidate_search_is_taken_and_searches_rarely() -> None:
    """A long decode with growing scores: the candidate path answers (its full searches are a few
    per hundred steps), and what it keeps equals the full scan's."""
    policy = H2O(heavy=300, recent=20)
    fast, full = _layers(policy, 8)
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(1, HEADS, 400, DIM, generator=g)
    for layer in (fast, full):
        layer.append(kv, kv)
    for _ in range(300):
        received = torch.rand(fast.slot_positions.shape, generator=g) ** 4  # a few tokens get most
        for layer in (fast, full):
            layer.accumulate(received)
            layer.evict()
        token = torch.randn(1, HEADS, 1, DIM, generator=g)
        for layer in (fast, full):
            layer.append(token, token)
    assert torch.equal(fast.positions, full.positions)
    assert full.candidate_searches == 0
    assert 1 <= fast.candidate_searches <= 150


def test_tova_never_takes_the_candidate_path() -> None:
    """TOVA's scores are the latest query's attention (they go down as well as up): the bound
    would not hold, so its victim is always found by the full scan."""
    from kvpolicy import TOVA

    layer = LayerCache(TOVA(size=40))
    layer.candidate_min_scores, layer.candidates = 1, 2
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(1, HEADS, 40, DIM, generator=g)
    layer.append(kv, kv)
    for _ in range(30):
        layer.accumulate(torch.rand(layer.slot_positions.shape, generator=g))
        layer.evict()
        token = torch.randn(1, HEADS, 1, DIM, generator=g)
        layer.append(token, token)
    assert layer.candidate_searches == 0
