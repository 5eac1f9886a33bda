"""kvpolicy_torch.storage: the views a decode step reads (``Storage.range_views``; the layout keeps
them per range: tests/torch/test_torch_layout.py) and the spare slots' memory bound."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from kvpolicy_torch.storage import MEMORY_BOUND, SlotPlan, Storage  # noqa: E402


def test_a_view_of_some_slots_has_no_range_views() -> None:
    """(The views of a whole storage are held to fresh slices in tests/torch/test_torch_layout.py,
    where the layout keeps them.)"""
    store = Storage.allocate(torch.zeros(2, 2, 1, 4), torch.zeros(2, 2, 1, 3), 6, torch.float32).narrow(1, 4)
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


@pytest.mark.parametrize("keys_dtype, want", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                              (torch.float64, torch.float64)])
def test_the_bias_is_in_the_dtype_attention_adds_it_in(keys_dtype, want) -> None:
    """The bias is added to the logits, which attention computes in float32 (float64 for float64
    keys): kept in that dtype whatever the scores' (float64 for a score from the cache), a decode
    step adds it without a cast, and its bytes count as such under the memory bound. A layer of
    Knorm (float64 scores) attends, with holes, exactly as attention over its kept tokens."""
    from kvpolicy import Knorm
    from kvpolicy_torch import LayerCache
    from kvpolicy_torch.layout import chunk_tokens
    from kvpolicy_torch.storage import bookkeeping_bytes, logits_dtype

    assert logits_dtype(keys_dtype) == want
    store = Storage.allocate(torch.zeros(1, 2, 1, 4, dtype=keys_dtype), torch.zeros(1, 2, 1, 4, dtype=keys_dtype), 5,
                             torch.float64)
    assert (store.scores.dtype, store.bias.dtype) == (torch.float64, want)
    assert bookkeeping_bytes(2, torch.float64, want) == 2 * (8 + 8 + want.itemsize)
    chunk = chunk_tokens(torch.ones(1, 2, 3, 4, dtype=keys_dtype), torch.ones(1, 2, 3, 4, dtype=keys_dtype),
                         torch.tensor([[False, True, True]]), [0], torch.float64)
    assert chunk.bias.dtype == want and chunk.bias[0, 0].tolist() == [float("-inf"), 0.0, 0.0]

    gen = torch.Generator().manual_seed(0)
    layer = LayerCache(Knorm(size=6))
    layer.append(torch.randn(1, 2, 10, 8, generator=gen), torch.randn(1, 2, 10, 8, generator=gen))
    layer.evict()
    holes = 0
    for _ in range(4):
        k, v = torch.randn(1, 2, 1, 8, generator=gen), torch.randn(1, 2, 1, 8, generator=gen)
        K, V = layer.append(k, v)
        bias = layer.bias  # (None while the returned slots hold no hole: the first step after the prompt)
        if bias is None:
            bias = torch.zeros(K.shape[:3])
        else:
            assert bias.dtype == torch.float32
            holes += int(torch.isinf(bias).sum())
        q = torch.randn(1, 2, 1, 8, generator=gen)
        out = torch.softmax(q @ K.transpose(-1, -2) / 8**0.5 + bias[:, :, None, :], -1) @ V
        kept_k, kept_v = layer.keys, layer.values  # (the kept tokens alone, in position order)
        want_out = torch.softmax(q @ kept_k.transpose(-1, -2) / 8**0.5, -1) @ kept_v
        torch.testing.assert_close(out, want_out)
        layer.evict()
    assert holes > 0
