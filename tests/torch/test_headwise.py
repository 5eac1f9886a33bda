"""kvpolicy_torch/headwise.py: AdaKV head-wise budgets on the torch backend and in the transformers cache.

Differential: ``kvpolicy_torch.replay`` (LayerCache) keeps what ``kvpolicy_numpy.replay`` keeps,
holes included; a LayerCache's kept bytes are the layer's budget while its storage is the widest
head's slots; attention never reads a hole; layer 0 of an evicting greedy generation on a tiny
random-weight Llama (float64) keeps what the reference keeps on that layer's logits and keys. Fast
(tiny shapes and models); left-padded batches are in tests/integrations/test_ragged.py, the kit in
tests/core/policies/test_adakv.py, the embedded model in the slow test at the end.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvpolicy_numpy
from kvpolicy import H2O, TOVA, AdaKV, KeyDiff, Knorm, SnapKV

from headwise_cases import decode_steps
from oracle import same_kept

torch = pytest.importorskip("torch")
import kvpolicy_torch  # noqa: E402
from kvpolicy_torch import LayerCache  # noqa: E402

SCORERS = st.one_of(
    st.builds(H2O, heavy=st.integers(1, 6), recent=st.integers(1, 4)),
    st.builds(TOVA, size=st.integers(1, 8), selection=st.just("per_head")),
    st.builds(Knorm, size=st.integers(1, 8)),
    st.builds(KeyDiff, size=st.integers(2, 8), recent=st.integers(0, 1)),
    st.builds(SnapKV, size=st.integers(3, 10), window=st.integers(1, 2), kernel=st.sampled_from([1, 3, 5])),
)


@given(SCORERS, st.sampled_from([0.0, 0.2, 0.6, 1.0]), st.integers(1, 4), st.integers(2, 26), st.data())
@settings(max_examples=80, deadline=None)
def test_torch_keeps_what_the_reference_keeps(scorer, alpha, heads, steps, data) -> None:
    prompt = data.draw(st.integers(0, steps - 1))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    # continuous logits: two heads' softmax rows round differently in NumPy and torch, so a tie
    # across heads (equal in exact arithmetic) may go either way; the kit (tests/core/policies/test_adakv.py)
    # holds exact ties with bit-equal scores on both sides
    logits = rng.normal(size=(steps, heads, steps))
    keys = rng.integers(-2, 3, size=(steps, heads, 4)).astype(np.float64)  # (keys: computed alike, ties kept)
    policy = AdaKV(scorer, alpha)
    want = kvpolicy_numpy.replay(policy, logits, prompt, keys=keys)
    got = kvpolicy_torch.replay(policy, logits, prompt, keys=keys)
    same_kept(want.kept, got.kept)
    assert want.sizes.tolist() == got.sizes.tolist()


def _layer(policy, heads=3, prompt=40, decode=25, seed=0):
    """A LayerCache after a ``prompt``-token prefill and ``decode`` steps of random attention."""
    g = torch.Generator().manual_seed(seed)
    layer = LayerCache(policy)
    k = torch.randn(1, heads, prompt, 8, generator=g, dtype=torch.float64)
    layer.append(k, k.clone())
    head_weight = torch.tensor([0.2, 1.0, 5.0][:heads], dtype=torch.float64)[None, :, None]  # sharp to flat
    layer.accumulate(torch.softmax(torch.randn(1, heads, prompt, generator=g, dtype=torch.float64) * head_weight, -1))
    layer.evict()
    for _ in range(decode):
        k = torch.randn(1, heads, 1, 8, generator=g, dtype=torch.float64)
        layer.append(k, k.clone())
        n = layer.slot_positions.shape[-1]
        received = torch.softmax(torch.randn(1, heads, n, generator=g, dtype=torch.float64) * head_weight, -1)
        layer.accumulate(received * (layer.slot_positions >= 0))
        layer.evict()
    return layer


@pytest.mark.parametrize("policy", [AdaKV(H2O(8, 4), 0.2), AdaKV(H2O(8, 4), 0.0), AdaKV(KeyDiff(12, refresh=1), 0.2)], ids=repr)
def test_kept_bytes_are_the_budget_and_storage_the_widest_head(policy) -> None:
    heads = 3
    layer = _layer(policy, heads)
    per_token = 2 * 8 * 8  # a key and a value of 8 float64
    b = policy.share
    assert layer.kv_bytes == heads * b * per_token  # the layer's budget, exactly
    pos = layer.positions[0]
    held = (pos >= 0).sum(-1)
    assert int(held.sum()) == heads * b and int(held.min()) >= policy.floor
    # the storage: slots for the widest head (allocated for the mean, grown when a head needs
    # more, never past the most one head can hold)
    widest = int(held.max())
    assert layer.length == widest and widest <= policy.head_capacity(heads) - 1
    assert max(policy.capacity, widest + 1) <= layer.slots <= policy.head_capacity(heads)
    assert layer.nbytes >= layer.kv_bytes
    assert layer.mean_length == b  # what eval's realised budgets count (length: the widest head's)


def test_attention_never_reads_a_hole() -> None:
    """A decode step's output equals attention over each head's held tokens alone."""
    policy = AdaKV(H2O(6, 3), 0.0)
    layer = _layer(policy, heads=3, decode=10, seed=1)
    k = torch.randn(1, 3, 1, 8, dtype=torch.float64)
    K, V = layer.append(k, k.clone())
    q = torch.randn(1, 3, 1, 8, dtype=torch.float64)
    out = layer.attend(q, 0.35)
    pos = layer.slot_positions[0]
    assert bool((pos < 0).any())  # some head holds holes
    for h in range(3):
        held = pos[h] >= 0
        w = torch.softmax((K[0, h][held] @ q[0, h, 0]) * 0.35, 0)
        torch.testing.assert_close(out[0, 0, h] if out.ndim == 4 and out.shape[1] == 1 else out[0, h, 0], w @ V[0, h][held])


HEADWISE_SCORERS = st.one_of(
    st.builds(H2O, heavy=st.integers(1, 6), recent=st.integers(1, 4)),
    st.builds(TOVA, size=st.integers(2, 8), selection=st.just("per_head")),
    st.builds(Knorm, size=st.integers(2, 8)),
    st.builds(KeyDiff, size=st.integers(2, 8), recent=st.integers(0, 1), refresh=st.integers(1, 3)),
)


@given(HEADWISE_SCORERS, st.sampled_from([0.0, 0.2, 0.6, 1.0]), st.integers(1, 4), st.integers(1, 14),
       st.integers(1, 30), st.data())
@settings(max_examples=40, deadline=None)
def test_static_steps_keep_what_the_eager_layout_keeps(scorer, alpha, heads, prompt, steps, data) -> None:
    """Head-wise budgets with static shapes (the decode eviction a masked write on the device,
    :func:`~kvpolicy_torch.headwise.headwise_victims`; each head's token written into its first
    hole) keep, head by head, the positions the eager layout keeps, and attend alike; the host
    reads the device's steps once in the middle (its layout: each head's tokens ending at the
    widest head's, holes first) and hands them back."""
    policy = AdaKV(scorer, alpha)
    assert policy.headwise_eviction is not None
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    middle = data.draw(st.integers(0, steps))
    layers = LayerCache(policy), LayerCache(policy, static_shapes=True)
    k = torch.randn(1, heads, prompt, 8, generator=g, dtype=torch.float64)
    received = torch.softmax(torch.randn(1, heads, prompt, generator=g, dtype=torch.float64) * 3, -1)
    for layer in layers:
        K, _ = layer.append(k, -k)  # (static shapes: every slot of the storage, the prompt's first)
        layer.accumulate(torch.nn.functional.pad(received, (0, K.shape[2] - prompt)))
        layer.evict()

    def held(layer) -> list:
        return [sorted(p for p in head if p >= 0) for head in layer.positions[0].tolist()]

    for t in range(steps):
        k = torch.randn(1, heads, 1, 8, generator=g, dtype=torch.float64)
        q = torch.randn(1, 2 * heads, 1, 8, generator=g, dtype=torch.float64)  # (GQA: two query heads a KV head)
        outs = []
        for layer in layers:
            layer.append(k, -k)
            outs.append(layer.attend(q, 0.7))
            layer.evict()
        torch.testing.assert_close(outs[1], outs[0])
        if t == middle:
            assert held(layers[1]) == held(layers[0])  # (a read: the device's steps handed to the host)
    assert held(layers[1]) == held(layers[0])
    assert layers[1].slots <= policy.head_capacity(heads)  # (static: the widest a head may grow, at most)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_static_storage_follows_the_widest_head_and_grows_between_steps(compiled) -> None:
    """A static-shaped head-wise layer starts with slots for its widest head (not the most any
    head may hold, :meth:`~kvpolicy.AdaKV.head_capacity`); where one head keeps gaining (AdaKV over
    TOVA: head 1's queries attend to its first token alone, so its others score 0 and are the
    layer's victims, while head 0 gains a token a step) the storage grows between steps, when the
    host's bound on the widest head reaches its end (``settle``), and keeps what the eager layout
    keeps; compiled (``fullgraph``), each growth is one more graph and no step overflows."""
    from torch._dynamo.utils import counters

    policy = AdaKV(TOVA(size=48, selection="per_head"), alpha_safeguard=0.0)
    heads, prompt = 2, 96
    g = torch.Generator().manual_seed(0)
    eager, static = LayerCache(policy), LayerCache(policy, static_shapes=True)
    quiet = torch.tensor([0.0, 1e-2], dtype=torch.float64).view(1, heads, 1, 1)  # head 0's keys 0 (uniform), head 1's small...
    k = torch.randn(1, heads, prompt, 8, generator=g, dtype=torch.float64) * quiet
    k[0, 1, 0] = 3.0  # ...but its first: head 1's queries attend to it alone
    received = torch.rand(1, heads, prompt, generator=g, dtype=torch.float64)
    for layer in (eager, static):
        K, _ = layer.append(k, -k)
        layer.accumulate(torch.nn.functional.pad(received, (0, K.shape[2] - prompt)))
        layer.evict()
    first = static.slots
    assert first < policy.head_capacity(heads)

    def step(layer, k, q):
        layer.append(k, -k)
        out = layer.attend(q, 0.7)
        layer.evict()
        return out

    torch._dynamo.reset()
    counters.clear()
    run = torch.compile(step, fullgraph=True, dynamic=False, backend="eager") if compiled else step
    sizes = {first}
    for _ in range(50):
        k = torch.randn(1, heads, 1, 8, generator=g, dtype=torch.float64) * quiet
        q = torch.ones(1, heads, 1, 8, dtype=torch.float64)
        torch.testing.assert_close(run(static, k, q), step(eager, k, q))
        static.settle()  # (an eager static step settles in evict(); a compiled one leaves it here)
        sizes.add(static.slots)
    held = [[sorted(p for p in head if p >= 0) for head in layer.positions[0].tolist()] for layer in (eager, static)]
    assert held[1] == held[0]
    widest = max(len(h) for h in held[0])
    assert widest > first and len(sizes) > 1 and max(sizes) <= policy.head_capacity(heads)  # it grew, to at most head_capacity
    if compiled:
        # a graph for each storage size (and, as in tests/torch/test_static.py, at most one more:
        # the first step's trace guards on the layer's first-step state)
        assert len(sizes) <= counters["stats"]["unique_graphs"] <= len(sizes) + 1


def test_static_shapes_are_refused_without_a_declared_headwise_eviction_and_a_chunk_after_one_is_masked_per_head() -> None:
    """Head-wise budgets without a declared decode eviction need the eager layout (static_shapes
    refused by name: AdaKV over SnapKV). A prompt chunk after
    a head-wise eviction (heads holding different tokens) gets a mask per KV head: each head's
    queries see that head's kept tokens and the chunk, causally (it raised NotImplementedError
    before 2026-11-28; the transformers differentials in tests/integrations/hf hold the attention)."""
    with pytest.raises(ValueError, match="static_shapes"):
        LayerCache(AdaKV(SnapKV(size=40)), static_shapes=True)
    layer = _layer(AdaKV(H2O(6, 3), 0.0), heads=3, decode=5)
    k = torch.randn(1, 3, 4, 8, dtype=torch.float64)
    layer.append(k, k.clone())
    mask, pos = layer.chunk_mask(), layer.slot_positions
    assert mask.shape == (1, 3, 4, pos.shape[-1])
    held_before = (pos[:, :, :-4] >= 0)  # [1, 3, n - 4]: what each head kept before the chunk
    assert bool((held_before.sum(-1) != held_before[:, :1].sum(-1)).any())  # the heads differ
    assert torch.equal(mask[..., :-4], held_before[:, :, None, :].expand(-1, -1, 4, -1))
    assert torch.equal(mask[0, :, :, -4:], torch.ones(4, 4, dtype=torch.bool).tril().expand(3, -1, -1))


# ============================================================================ transformers
transformers = pytest.importorskip("transformers")
from kvpolicy_tools.models import tiny_llama  # noqa: E402
from kvpolicy_integrations.hf import EvictingCache, cache_kwargs  # noqa: E402


def _layer0(model, tokens):
    from layer0 import layer0_logits_and_keys

    return layer0_logits_and_keys(model, tokens)


@pytest.mark.parametrize(
    "policy", [AdaKV(H2O(6, 4), 0.2), AdaKV(KeyDiff(10, recent=2, refresh=1), 0.0), AdaKV(SnapKV(12, window=4), 0.5)], ids=repr
)
def test_evicting_cache_keeps_what_the_reference_keeps_on_layer0(policy) -> None:
    """Layer 0 of an evicting greedy generation (prefill of 30, 20 decode steps; 4 heads, no GQA)
    keeps what kvpolicy_numpy.replay keeps on layer 0's logits and keys, holes included; every
    layer holds the layer budget."""
    model = tiny_llama(num_layers=2, heads=4, kv_heads=4, head_dim=8, vocab=96, seed=3).double()
    ids = torch.randint(3, 96, (1, 30), generator=torch.Generator().manual_seed(5))
    cache = EvictingCache(policy, model)
    from layer0 import greedy_tokens

    logits, keys = _layer0(model, greedy_tokens(model, cache, ids, 20))
    trace = kvpolicy_numpy.replay(policy, logits, prompt_len=ids.shape[1], keys=keys)
    np.testing.assert_array_equal(cache.layers[0].store.positions[0].numpy(), trace.kept[-1])
    for layer in cache.layers:
        held = int((layer.store.positions >= 0).sum())
        assert held == 4 * (policy.share if policy.capacity is not None else trace.sizes[-1])


def test_tensor_parallel_ranks_run_adakv_share_and_refuse_what_they_cannot_pair() -> None:
    """Under tensor parallelism a layer's heads are split over ranks: each rank's layers run AdaKV's
    share (ShardedAdaKV, which gathers the others' scores; the 2-rank run is in
    tests/integrations/test_deepspeed_multi.py); AdaKV inside a composition and a batch of several sequences
    are refused with the reason, before any exchange."""
    from kvpolicy import compose
    from kvpolicy.deepspeed import ShardedEvictingCache, TensorParallelHeads, shard_layout
    from kvpolicy.policies import ShardedAdaKV

    model = tiny_llama(num_layers=1, heads=4, kv_heads=2, head_dim=8)
    cache = ShardedEvictingCache(AdaKV(H2O(4, 2)), model, layout=shard_layout(model, 2), rank=1)
    policy = cache.layers[0].store.policy
    assert isinstance(policy, ShardedAdaKV) and policy.wrapped == AdaKV(H2O(4, 2)) == cache.requested_policy
    assert isinstance(policy.exchange, TensorParallelHeads) and (policy.exchange.heads, policy.exchange.start) == (2, 1)
    with pytest.raises(ValueError, match="one sequence at a time"):
        cache.update(torch.zeros(2, 1, 3, 8), torch.zeros(2, 1, 3, 8), 0)
    with pytest.raises(ValueError, match="AdaKV itself only"):
        ShardedEvictingCache(compose(prefill=SnapKV(size=40), decode=AdaKV(H2O(4, 2))), model, layout=shard_layout(model, 2), rank=0)
    one = ShardedEvictingCache(AdaKV(H2O(4, 2)), model, layout=shard_layout(model, 1), rank=0)  # one rank: AdaKV itself
    assert one.layers[0].store.policy == AdaKV(H2O(4, 2)) and not one.headwise_split


@pytest.mark.slow
def test_real_model_keeps_the_budget_and_alpha_one_is_the_scorer() -> None:
    """SmolLM2-135M (real weights, 30 layers, 3 KV heads x 64 dims, float32), a 200-token prompt
    and 8 greedy tokens at budget 0.25: AdaKV over H2O keeps exactly the layer budget's bytes in
    every layer, each head at least its floor, heads' shares differ somewhere; with
    ``alpha_safeguard = 1`` it generates H2O's tokens and keeps H2O's positions in every layer."""
    from kvpolicy import make_policy, models

    model, tok = models.load("smollm2-135m")
    text = " ".join(f"Note {i}: the crate in bay {i} holds {i * 7 % 13} blue boxes." for i in range(30))
    ids = tok(text, return_tensors="pt")["input_ids"][:, :200]
    h2o = make_policy("h2o", 0.25, context_length=208, prompt_length=200)

    def run(policy):
        cache = EvictingCache(policy, model)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8,
                                 do_sample=False, **cache_kwargs(model, cache))  # fmt: skip
        return out, [layer.store for layer in cache.layers]

    out, stores = run(AdaKV(h2o, 0.2))
    b = h2o.heavy + h2o.recent
    per_token = 2 * 64 * 4  # a key and a value, head_dim 64, float32
    spread = False
    for store in stores:
        assert store.kv_bytes == 3 * b * per_token
        held = (store.positions[0] >= 0).sum(-1)
        assert int(held.min()) >= int(0.2 * b) and int(held.sum()) == 3 * b
        spread |= bool(held.max() > held.min())
    assert spread
    same, same_stores = run(AdaKV(h2o, 1.0))
    alone, alone_stores = run(h2o)
    assert torch.equal(same, alone)
    for a, b_ in zip(same_stores, alone_stores):
        assert torch.equal(a.positions, b_.positions)


def test_over_expected_attention() -> None:
    """AdaKV over Expected Attention (its statistic's parameters read through the wrapper): torch
    keeps what the reference keeps, and alpha_safeguard=1 is Expected Attention per head."""
    from kvpolicy import ExpectedAttention
    from kvpolicy.testing import example_inputs

    logits = np.random.default_rng(0).normal(size=(30, 3, 30))
    ea = ExpectedAttention(8, sink=2, future=16, refresh=1)
    for alpha in (0.2, 1.0):
        policy = AdaKV(ea, alpha)
        inputs = example_inputs(policy, logits)
        want = kvpolicy_numpy.replay(policy, logits, 12, **inputs)
        got = kvpolicy_torch.replay(policy, logits, 12, **inputs)
        assert all(np.array_equal(a, b) for a, b in zip(want.kept[11:], got.kept[11:]))
        assert all(int((k >= 0).sum()) == 3 * 8 for k in want.kept[11:])
    alone = kvpolicy_numpy.replay(ea, logits, 12, **example_inputs(ea, logits))
    assert all(np.array_equal(a, b) for a, b in zip(want.kept[11:], alone.kept[11:]))


# ---------------------------------------------------------------------------- the decode step's victims
@given(decode_steps(), st.booleans(), st.sampled_from([0, 8]), st.booleans())
@settings(max_examples=400, deadline=None)
def test_the_victim_search_frees_what_the_declared_rule_drops(case, slot_window, host_merge_heads, settle_ties) -> None:
    """headwise_victims (exact, a constant number of kernels), step_victims (a static step's: one
    topk where it is sure, slots in any order) and likely_victims (fewer, where it is
    sure) free the tokens AdaKV's HeadwiseEviction drops, which the kit holds to select(): ties
    across heads and within, NaN, floors that bind, 1 to 4 heads; the candidates cut either at the
    recent window's slots (rows alike) or by position (rows on other frontiers); the heads' lowest
    merged on the host (few heads) or on the device (many); ties on a cut settled by the candidates'
    positions (``settle_ties``) or left to the exact search."""
    from unittest import mock

    from kvpolicy_torch.headwise import headwise_victims, likely_victims, step_victims

    policy, view = case
    rule = policy.headwise_eviction
    want = rule.keep(view)
    positions = torch.as_tensor(view.positions)
    scores = torch.as_tensor(view.scores).masked_fill(positions < 0, float("inf"))  # (torch's holes: +inf)
    n = view.n_cached

    def kept(victims) -> np.ndarray:
        held = view.held.copy()
        for h, j in victims:
            held[0, h, j] = False
        return view.keep_where(held)

    head, slot = headwise_victims(positions, scores, view.n_seen, rule)
    np.testing.assert_array_equal(kept(zip(head[0].tolist(), slot[0].tolist())), want)
    # a static step's search (one topk where sure), on the slots as laid out and reversed (a static
    # step leaves slot order anything: only positions order the tokens)
    due = torch.tensor([True])
    head, slot = step_victims(positions, scores, view.n_seen, rule, due)
    np.testing.assert_array_equal(kept(zip(head[0].tolist(), slot[0].tolist())), want)
    head, slot = step_victims(positions.flip(-1), scores.flip(-1), view.n_seen, rule, due)
    np.testing.assert_array_equal(kept(zip(head[0].tolist(), (n - 1 - slot[0]).tolist())), want)
    head, slot = headwise_victims(positions.flip(-1), scores.flip(-1), view.n_seen, rule)
    np.testing.assert_array_equal(kept(zip(head[0].tolist(), (n - 1 - slot[0]).tolist())), want)
    if slot_window:
        candidates = scores[:, :, : n - rule.recent]
    else:
        candidates = torch.where(positions < view.n_seen - rule.recent, scores, float("inf"))
    counts = (positions >= 0).sum(-1).tolist()
    with mock.patch.object(kvpolicy_torch.headwise, "HOST_MERGE_HEADS", host_merge_heads):  # (0: merged on the device)
        found = likely_victims(candidates, counts, rule,
                               positions=positions if settle_ties else None)  # (the slots past the candidates' too, as the layer passes them)
    if found is not None:
        (victims, after), = found
        np.testing.assert_array_equal(kept(victims), want)
        assert after == (np.asarray(want) >= 0).sum(-1)[0].tolist()


@pytest.mark.parametrize("host_merge_heads", [8, 0])
def test_ties_on_a_cut_are_settled_by_position_not_left_to_the_exact_search(host_merge_heads) -> None:
    """Under a refresh interval a narrow head's scored tokens run out between two scorings and it
    loses its earliest UNSCORED ones, all of one score: likely_victims, given the candidates'
    positions, settles those ties as the declared rule does (by position, then head) instead of
    answering None (the exact search, ~20 kernels a layer); a NaN still goes to the exact search.
    The heads' lowest merged on the host (few KV heads) and on the device (``HOST_MERGE_HEADS``
    patched to 0: what a model with more than 8 KV heads takes)."""
    from unittest import mock

    from kvpolicy import HeadwiseEviction
    from kvpolicy.statistics import UNSCORED
    from kvpolicy_torch.headwise import headwise_victims, likely_victims

    with mock.patch.object(kvpolicy_torch.headwise, "HOST_MERGE_HEADS", host_merge_heads):
        rule = HeadwiseEviction(limit=5, recent=0, floor=2)
        # head 0: one scored token then the UNSCORED newest; head 1: scored low; head 2: scored high
        positions = torch.tensor([[[3, 6, 7, 8, 9, 10], [0, 1, 2, 8, 9, 10], [4, 5, 7, 8, 9, 10]]])
        u = float(UNSCORED)
        scores = torch.tensor([[[1.0, u, u, u, u, u], [0.5, 2.0, u, u, u, u], [9.0, 9.5, u, u, u, u]]], dtype=torch.float64)
        counts = [[6, 6, 6]]
        # (a tie on head 0's cut, not on the layer's: the search over the layer's flat slots needs no tie order)
        assert likely_victims(scores, counts, rule) == [([(1, 0), (0, 0), (1, 1)], [5, 4, 6])]
        (victims, after), = likely_victims(scores, counts, rule, positions=positions)
        head, slot = headwise_victims(positions, scores, 11, rule)
        assert sorted(victims) == sorted(zip(head[0].tolist(), slot[0].tolist())) == [(0, 0), (1, 0), (1, 1)]
        assert after == [5, 4, 6]
        # a tie at the layer's cut, across heads: the earlier position goes, then the lower head
        scores = torch.tensor([[[u] * 6, [u] * 6, [u] * 6]], dtype=torch.float64)
        assert likely_victims(scores, counts, rule) is None  # (without positions the tie order is unknown)
        (victims, _), = likely_victims(scores, counts, rule, positions=positions)
        head, slot = headwise_victims(positions, scores, 11, rule)
        assert sorted(victims) == sorted(zip(head[0].tolist(), slot[0].tolist())) == [(1, 0), (1, 1), (1, 2)]
        assert likely_victims(scores.index_fill(-1, torch.tensor([1]), float("nan")), counts, rule, positions=positions) is None


def test_a_decode_step_frees_its_victims_in_place() -> None:
    """adakv_h2o's decode steps take the declared rule: select is not asked, no slot moves until a
    row reaches the end of its storage (then one compaction, every few steps), and the layer keeps
    what the reference keeps."""
    from unittest import mock

    policy = AdaKV(H2O(24, 8), 0.2)
    heads, prompt, decode = 3, 64, 60
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(prompt + decode, heads, prompt + decode))
    want = kvpolicy_numpy.replay(policy, logits, prompt)
    with mock.patch.object(AdaKV, "select", autospec=True, side_effect=AdaKV.select) as select, \
            mock.patch.object(kvpolicy_torch.layout.SlotLayout, "keep", autospec=True,
                              side_effect=kvpolicy_torch.layout.SlotLayout.keep) as moves:
        got = kvpolicy_torch.replay(policy, logits, prompt)
    same_kept(want.kept, got.kept)
    assert select.call_count == 2  # the prompt's eviction (and the call that declines after it) only
    assert 1 <= moves.call_count - 1 <= decode // 8  # compactions: one per several steps, not one a step


@pytest.mark.parametrize("chunk_bytes", [64, 1 << 20])
def test_compaction_of_ragged_heads_in_chunks_keeps_every_token(chunk_bytes) -> None:
    """A compaction after head-wise decode evictions moves a narrow head's tokens to later slots
    (its holes lead): in chunks too small for the layer it must still read each token before a
    chunk overwrites it."""
    policy = AdaKV(H2O(10, 4), 0.0)
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(70, 4, 70)) * np.array([0.1, 1.0, 4.0, 9.0])[None, :, None]
    want = kvpolicy_numpy.replay(policy, logits, 20)
    with mock_chunk(chunk_bytes):
        got = kvpolicy_torch.replay(policy, logits, 20)
    same_kept(want.kept, got.kept)


def mock_chunk(chunk_bytes):
    from unittest import mock

    return mock.patch.object(LayerCache, "compaction_chunk_bytes", chunk_bytes)
