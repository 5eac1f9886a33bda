"""kvpolicy_torch.layout: the views of the returned range a decode step reads, kept per range.

A decode step reads the slots ``[0, hi)`` through views the layout makes once per ``hi`` of its
storage and keeps (:meth:`SlotLayout.keep_views`): they must be the same as fresh slices at every
step (they are views, so writes and compactions in place show through), at most ``kept_ranges``
of them are kept, a new storage gets views of its own, and a copy of the layout (pickle, deepcopy:
what copying a cache does) reads its own tensors, never the original's. (The rest of the layout is
tested through LayerCache: tests/torch/test_layer.py.)
"""

from __future__ import annotations

import copy
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from kvpolicy_torch.layout import SlotLayout  # noqa: E402
from kvpolicy_torch.rows import Rows  # noqa: E402
from kvpolicy_torch.storage import RangeViews, Storage  # noqa: E402
from kvpolicy_torch.victims import CandidateSearch  # noqa: E402


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
    assert views.keys.data_ptr() == store.keys.data_ptr() and views.scores.data_ptr() == store.scores.data_ptr()


@settings(max_examples=50, deadline=None)
@given(batch=st.integers(1, 3), heads=st.integers(1, 3), slots=st.integers(1, 12),
       his=st.lists(st.integers(1, 12), min_size=1, max_size=30), kept=st.integers(0, 4))
def test_kept_views_read_what_fresh_slices_read_after_every_write(batch, heads, slots, his, kept) -> None:
    layout = SlotLayout(CandidateSearch(), None)
    layout.kept_ranges = kept
    store = _storage(batch, heads, slots)
    for step, hi in enumerate(his):
        hi = min(hi, slots)
        views = layout.keep_views(store, hi)
        assert views is not None
        _same(views, store, hi)
        # a step's writes in place (a score, a token, a compaction's moves): seen through kept views
        views.scores.add_(1.0)
        store.keys[:, :, hi - 1].fill_(float(step))
        store.positions.copy_(store.positions.roll(1, dims=2))
        _same(layout.keep_views(store, hi), store, hi)  # type: ignore[arg-type]
    # at most `kept` ranges are kept: the others get fresh views at every call
    asked = {min(hi, slots) for hi in his}
    assert sum(layout.keep_views(store, hi) is layout.keep_views(store, hi) for hi in asked) == min(kept, len(asked))


def test_another_storage_gets_views_of_its_own() -> None:
    layout = SlotLayout(CandidateSearch(), None)
    first, second = _storage(1, 2, 6), _storage(1, 2, 6)
    layout.keep_views(first, 4)
    views = layout.keep_views(second, 4)
    assert views is not None
    _same(views, second, 4)


def test_a_view_of_some_slots_gets_no_views() -> None:
    layout = SlotLayout(CandidateSearch(), None)
    assert layout.keep_views(_storage(2, 2, 6).narrow(1, 4), 2) is None


@pytest.mark.parametrize("copier", [copy.deepcopy, lambda s: pickle.loads(pickle.dumps(s))], ids=["deepcopy", "pickle"])
def test_a_copy_reads_its_own_tensors(copier) -> None:
    layout = SlotLayout(CandidateSearch(), None)
    layout.store = _storage(1, 2, 8)
    layout.rows = Rows([5], [5], [5], [{}], [None], [[]])
    layout.write_one(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 3))  # the returned range: slots [0, 6)
    assert layout.views is not None and layout.returned == 6
    twin = copier(layout)
    assert twin.views is not None
    _same(twin.views, twin.store, 6)
    twin.views.scores.fill_(7.0)  # the copy's writes stay in the copy
    assert not torch.equal(layout.store.scores[:, :, :6], twin.store.scores[:, :, :6])


def test_a_refresh_interval_caches_decode_tokens_unscored() -> None:
    """Under a refresh interval a decode token scores UNSCORED until the next scoring (the rule the
    reference and the kit hold the backend to): the layout writes it so when caching it (its fresh
    score), so the eviction has nothing to mark; every other policy's tokens start at 0."""
    from kvpolicy import H2O, ExpectedAttention
    from kvpolicy.statistics import UNSCORED
    from kvpolicy_torch import LayerCache

    gen = torch.Generator().manual_seed(0)
    layer = LayerCache(ExpectedAttention(size=6, sink=1, refresh=8))
    layer.append(torch.randn(1, 1, 12, 4, generator=gen), torch.randn(1, 1, 12, 4, generator=gen))
    layer.observe_queries(torch.randn(1, 2, 12, 4, generator=gen))
    layer.evict()
    unscored = []
    for step in range(12):
        layer.append(torch.randn(1, 1, 1, 4, generator=gen), torch.randn(1, 1, 1, 4, generator=gen))
        assert layer.scores[0, 0, -1].item() == UNSCORED  # (the newest, as cached)
        layer.observe_queries(torch.randn(1, 2, 1, 4, generator=gen))
        layer.evict()
        unscored.append(int((layer.scores == UNSCORED).sum()))
    # the tokens since the last scoring (at 12 + 8 seen) are unscored after each eviction, as many as are kept
    assert unscored[:7] == [1, 2, 3, 4, 5, 5, 5] and unscored[7] == 0 and unscored[8:] == [1, 2, 3, 4]

    h2o = LayerCache(H2O(heavy=2, recent=2))
    h2o.append(torch.randn(1, 1, 6, 4, generator=gen), torch.randn(1, 1, 6, 4, generator=gen))
    h2o.accumulate(torch.ones(1, 1, 6))
    h2o.evict()
    h2o.append(torch.randn(1, 1, 1, 4, generator=gen), torch.randn(1, 1, 1, 4, generator=gen))
    assert h2o.scores[0, 0, -1].item() == 0.0
