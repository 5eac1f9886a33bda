"""kvpolicy_torch.storage: the views a decode step reads (``Storage.range_views``; the layout keeps
them per range: tests/torch/test_layout.py) and the spare slots' memory bound."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from kvpolicy_torch.storage import MEMORY_BOUND, RangeViews, SlotPlan, Storage  # noqa: E402


def _storage(batch: int, heads: int, slots: int) -> Storage:
    store = Storage.allocate(torch.zeros(batch, heads, 1, 4), torch.zeros(batch, heads, 1, 3), slots, torch.float32)
    store.keys.copy_(torch.randn(store.keys.shape))
    store.values.copy_(torch.randn(store.values.shape))
    store.positions.copy_(torch.randint(-1, 50, store.positions.shape))
    store.scores.copy_(torch.rand(store.scores.shape))
    store.bias.copy_(torch.where(store.positions < 0, float("-inf"), 0.0))
    return store


def _same(views: RangeViews, store: Storage, hi: int) -> None:
    b, h = store.keys.shape[:2]
    assert torch.equal(views.keys, store.keys[:, :, :hi]) and torch.equal(views.values, store.values[:, :, :hi])
    assert torch.equal(views.keys3t, store.keys[:, :, :hi].reshape(b * h, hi, -1).transpose(1, 2))
    assert torch.equal(views.values3, store.values[:, :, :hi].reshape(b * h, hi, -1))
    assert torch.equal(views.bias3, store.bias[:, :, :hi].reshape(b * h, 1, hi))
    assert torch.equal(views.scores, store.scores[:, :, :hi]) and torch.equal(views.positions, store.positions[:, :, :hi])
    # views, not copies: the decode step's writes land in the storage
    assert views.keys.data_ptr() == store.keys.data_ptr() and views.scores.data_ptr() == store.scores.data_ptr()


@settings(max_examples=50, deadline=None)
@given(batch=st.integers(1, 3), heads=st.integers(1, 3), slots=st.integers(1, 12), hi=st.integers(1, 12))
def test_range_views_are_views_of_the_slots_below_hi(batch, heads, slots, hi) -> None:
    store = _storage(batch, heads, slots)
    hi = min(hi, slots)
    views = store.range_views(hi)
    _same(views, store, hi)
    views.scores.add_(1.0)  # a step's writes in place land in the storage
    store.keys[:, :, hi - 1].fill_(3.0)
    _same(views, store, hi)


def test_a_view_of_some_slots_has_no_range_views() -> None:
    store = _storage(2, 2, 6).narrow(1, 4)
    assert not store.whole
    with pytest.raises(ValueError, match="whole tensors"):
        store.range_views(2)


@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(2, 20_000), heads=st.integers(1, 8), head_dim=st.sampled_from([32, 64, 80, 128, 256]),
       kv_itemsize=st.sampled_from([2, 4, 8]), score_itemsize=st.sampled_from([4, 8]), min_slack=st.integers(0, 128))
def test_spare_slots_keep_the_storage_within_the_memory_bound(capacity, heads, head_dim, kv_itemsize, score_itemsize,
                                                              min_slack) -> None:
    """Issue 43: a one-token eviction's storage (keys, values, positions, scores, bias and the spare
    slots) allocates at most MEMORY_BOUND x the key and value bytes it holds between steps
    (capacity - 1 tokens), wherever the bookkeeping leaves room for one spare slot at all."""
    per_slot = heads * 2 * head_dim * kv_itemsize
    bookkeeping = heads * (8 + 2 * score_itemsize)
    plan = SlotPlan(capacity, None, slack=True)
    slots = plan.first(1, per_slot, min_slack, 1 << 30, bookkeeping=bookkeeping)
    allocated, held = slots * (per_slot + bookkeeping), (capacity - 1) * per_slot
    if (capacity + 1) * (per_slot + bookkeeping) <= MEMORY_BOUND * held:
        assert allocated <= MEMORY_BOUND * held
    else:  # (a tiny capacity or a tiny head: one spare slot, the least a one-token eviction appends into)
        assert slots == capacity + 1
    # never more than the speed rule alone would take (capacity / 8, or min_slack up to half the capacity)
    assert slots - capacity <= max(1, max(capacity // 8, min(capacity // 2, min_slack)))


@settings(max_examples=200, deadline=None)
@given(capacities=st.lists(st.integers(2, 4_000), min_size=2, max_size=40), heads=st.integers(1, 8),
       head_dim=st.sampled_from([64, 80, 128, 256]), kv_itemsize=st.sampled_from([2, 4]),
       score_itemsize=st.sampled_from([4, 8]), min_slack=st.integers(0, 128))
def test_pooled_spare_slots_keep_the_cache_within_the_memory_bound(capacities, heads, head_dim, kv_itemsize,
                                                                   score_itemsize, min_slack) -> None:
    """Layers of different capacities (PyramidKV) take the spare slots of their mean capacity:
    the cache as a whole (every layer's keys, values, bookkeeping and spare slots) stays within
    MEMORY_BOUND x what it holds between steps, wherever the mean layer has room for a spare slot."""
    from kvpolicy_torch.storage import pooled_capacity

    per_slot = heads * 2 * head_dim * kv_itemsize
    bookkeeping = heads * (8 + 2 * score_itemsize)
    pooled = pooled_capacity(capacities)
    if len(set(capacities)) == 1:
        assert pooled is None
        return
    assert pooled == sum(capacities) // len(capacities)
    slots = [SlotPlan(c, None, slack=True, pooled=pooled).first(1, per_slot, min_slack, 1 << 30, bookkeeping=bookkeeping)
             for c in capacities]
    spare = {s - c for s, c in zip(slots, capacities)}
    assert len(spare) == 1  # every layer the same spare slots: the mean layer's
    allocated = sum(slots) * (per_slot + bookkeeping)
    held = sum(c - 1 for c in capacities) * per_slot
    if (pooled + 1) * (per_slot + bookkeeping) <= MEMORY_BOUND * (pooled - 1) * per_slot:
        assert allocated <= MEMORY_BOUND * held
