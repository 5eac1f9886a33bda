"""``selection="shared"``: accepted by every built-in policy, and its score reduction (the
all-reduce across tensor-parallel ranks) runs only in rounds that evict."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpolicy import BUZZ, H2O, CacheView, DeferredScoresView, FullCache, LocalWindow, StreamingLLM, make_policy
from kvpolicy.registry import available_policies

torch = pytest.importorskip("torch")

from kvpolicy_torch import LayerCache  # noqa: E402

BUILT_IN = {
    "full": lambda sel: FullCache(selection=sel),
    "local": lambda sel: LocalWindow(window=6, selection=sel),
    "streaming_llm": lambda sel: StreamingLLM(sink=2, window=5, selection=sel),
    "h2o": lambda sel: H2O(heavy=3, recent=4, selection=sel),
    "buzz": lambda sel: BUZZ(sink=2, window=4, stride=3, threshold=6, selection=sel),
}


def test_every_registered_built_in_is_covered():
    assert set(BUILT_IN) <= set(available_policies())
    assert {"full", "local", "streaming_llm", "h2o", "buzz"} == set(BUILT_IN)


@pytest.mark.parametrize("name", sorted(BUILT_IN))
def test_every_built_in_accepts_shared_selection(name):
    policy = BUILT_IN[name]("shared")
    assert policy.selection == "shared"
    assert "selection='shared'" in repr(policy)
    assert policy != BUILT_IN[name]("per_head")
    with pytest.raises(ValueError, match="selection"):
        BUILT_IN[name]("everywhere")


@pytest.mark.parametrize("name", ["local", "streaming_llm", "h2o", "buzz"])
def test_budget_planning_passes_shared_selection(name):
    assert make_policy(name, 0.3, context_length=256, selection="shared").selection == "shared"


def _run(policy, steps: int, *, prompt: int = 9, heads: int = 3, seed: int = 0, reduce=None):
    """Drive a LayerCache: a prompt, then ``steps`` decode steps with random received attention."""
    g = torch.Generator().manual_seed(seed)
    layer = LayerCache(policy, reduce_scores=reduce)
    decode_rounds = 0
    for t in range(steps + 1):
        q = prompt if t == 0 else 1
        k = torch.randn(2, heads, q, 4, generator=g)
        keys, _ = layer.append(k, k)
        layer.accumulate(torch.rand(2, heads, keys.shape[2], generator=g))
        rounds = layer.evict()
        if t:
            decode_rounds += len(rounds)
    return layer, decode_rounds


@pytest.mark.parametrize("name", ["full", "local", "streaming_llm"])
def test_score_free_policies_share_trivially(name):
    """A policy that reads no scores keeps the same slots on every head: shared == per_head."""
    calls = []
    shared, _ = _run(BUILT_IN[name]("shared"), 30, reduce=lambda s: calls.append(1) or s)
    per_head, _ = _run(BUILT_IN[name]("per_head"), 30)
    assert torch.equal(shared.positions, per_head.positions)
    assert calls == []  # nothing to reduce


@pytest.mark.parametrize("name", ["h2o", "buzz"])
@given(steps=st.integers(1, 60), seed=st.integers(0, 2**16))
@settings(max_examples=25, deadline=None)
def test_one_reduction_per_decode_eviction_round(name, steps, seed):
    """The all-reduce stand-in runs exactly once per decode eviction round, never in a step that
    keeps everything (scores are read only once the policy has decided to evict)."""
    calls: list[tuple[int, ...]] = []

    def reduce(summed):
        calls.append(tuple(summed.shape))
        return summed

    layer, _ = _run(BUILT_IN[name]("shared"), 0, seed=seed, reduce=reduce)
    after_prefill = len(calls)
    assert after_prefill <= layer.evictions  # BUZZ's later prefill rounds sample old tokens only
    g = torch.Generator().manual_seed(seed + 1)
    rounds = 0
    for _ in range(steps):
        k = torch.randn(2, 3, 1, 4, generator=g)
        keys, _ = layer.append(k, k)
        layer.accumulate(torch.rand(2, 3, keys.shape[2], generator=g))
        before = len(calls)
        done = layer.evict()
        rounds += len(done)
        assert len(calls) - before == len(done)  # per step: reductions == rounds
        # [batch, 1, n]: the cached tokens, or for a one-token eviction only its candidates
        assert all(shape[:2] == (2, 1) and shape[2] <= done[0][0] for shape in calls[before:])
    assert len(calls) - after_prefill == rounds
    assert (layer.positions == layer.positions[:, :1]).all()  # one selection for every head


@pytest.mark.parametrize("name", ["h2o", "buzz"])
def test_shared_selection_equals_the_selection_on_summed_scores(name):
    """The deferred view changes when the scores are computed, not what is kept."""
    g = torch.Generator().manual_seed(3)
    positions = torch.arange(20).expand(2, 3, 20)
    scores = torch.rand(2, 3, 20, generator=g)
    shared = BUILT_IN[name]("shared")
    per_head = BUILT_IN[name]("per_head")
    state_a, state_b = shared.init_state(), per_head.init_state()
    keep = shared.evict(CacheView(positions, scores, 20, state_a))
    summed = CacheView(positions[:, :1], scores.sum(1, keepdim=True), 20, state_b)
    expected = per_head.evict(summed)
    assert torch.equal(keep, expected.expand(2, 3, -1))
    assert state_a == state_b


def test_deferred_view_computes_once_and_not_for_shape_questions():
    calls = []
    view = DeferredScoresView(np.arange(6)[None, None], lambda: calls.append(1) or np.ones((1, 1, 6)), 6, phase="prefill")
    assert (view.n_cached, view.batch, view.heads, view.phase) == (6, 1, 1, "prefill")
    assert view.arange(3).tolist() == [0, 1, 2] and view.xp is not None
    assert "scores_computed=False" in repr(view) and calls == []
    assert view.scores.sum() == 6 and view.scores_computed and view.scores.sum() == 6
    assert calls == [1]


def test_shared_reduction_count_through_evicting_cache():
    """The same through transformers' generate: reductions == eviction rounds over decode."""
    pytest.importorskip("transformers")
    from kvpolicy.hf import EvictingCache, cache_kwargs
    from kvpolicy_tools.models import tiny_llama

    model = tiny_llama(num_layers=2, heads=4, kv_heads=2, head_dim=8, vocab=64, seed=0)
    calls = []
    cache = EvictingCache(H2O(heavy=4, recent=4, selection="shared"), model, reduce_scores=lambda s: calls.append(1) or s)
    ids = torch.randint(3, 64, (1, 6), generator=torch.Generator().manual_seed(0))  # no prefill eviction
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False, **cache_kwargs(model, cache))
    rounds = sum(layer.store.evictions for layer in cache.layers)
    # 6 prompt tokens, then 19 decode forwards each adding one: a layer exceeds heavy + recent = 8
    # from the third decode step on and evicts one token per step from then: 17 rounds per layer,
    # out of 20 evict() calls per layer.
    assert rounds == 2 * 17 == len(calls)
