"""ChunkKV (kvpolicy/policies/chunkkv.py): a scorer's selection in whole chunks.

* the NumPy reference against a literal Python rule (chunks of slots, the partial chunk kept, the
  best ``(b - r) // L`` complete chunks by the sum of Knorm's scores, a protected token making its
  chunk +inf), decode-time and under kvpress's protocol (``prefill_only``), and the torch replay
  against the reference, on random keys;
* kvpress's chunk count (``int(ceil(n / L) (1 - r))``) where the context is a multiple of ``L``;
* the conformance kit over several scorers;
* the transformers cache on layer 0 of a tiny random-weight Llama (wiring, not language).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvpolicy_numpy
from kvpolicy import H2O, TOVA, AdaKV, ChunkKV, ExpectedAttention, KeyDiff, Knorm, SnapKV, StreamingLLM, make_policy, prefill_only
from kvpolicy.policies.chunkkv import chunk_scores
from oracle import literal_replay, same_kept

torch = pytest.importorskip("torch")
import kvpolicy_torch  # noqa: E402


def literal(size: int, recent: int, length: int, shared: bool, keys: np.ndarray, prompt_len: int,
            ratio: float | None = None) -> list[list[list[int]] | None]:
    """Kept positions per step and head of ``ChunkKV(Knorm(size, recent), length)``, literally
    (``ratio``: under ``prefill_only`` instead, once after the prompt with ``b = int(n (1 - r))``)."""
    steps, heads, _ = keys.shape
    done = False

    def evict(cached: list[list[int]], t: int, prompt: bool) -> None:
        nonlocal done
        n = len(cached[0])
        if ratio is None:
            if n <= size:
                return
            b, protect = size, recent
        else:
            if done or t != prompt_len - 1 or prompt_len < 2:
                return
            done = True
            b, protect = max(1, int(n * (1 - ratio))), recent
            if b >= n:
                return
        scores = [[-float(np.linalg.norm(keys[p, h])) for p in cached[h]] for h in range(heads)]
        if shared:
            summed = [sum(scores[h][i] for h in range(heads)) for i in range(n)]
            scores = [summed] * heads
        for h in range(heads):
            if b < length or n < length:  # the scorer's own choice (its protected tokens last of all)
                drop = sorted(range(n), key=lambda i: (i >= n - protect, scores[h][i], i))[: n - b]
                cached[h] = [p for i, p in enumerate(cached[h]) if i not in drop]
                continue
            rest, chunks = n % length, n // length
            sums = []
            for c in range(chunks):
                total = 0.0
                for j in range(length):
                    total += scores[h][c * length + j]
                sums.append(math.inf if any(i >= n - protect for i in range(c * length, (c + 1) * length)) else total)
            best = sorted(range(chunks), key=lambda c: (sums[c], c))[chunks - (b - rest) // length :]
            slots = sorted(i for c in best for i in range(c * length, (c + 1) * length)) + list(range(chunks * length, n))
            cached[h] = [cached[h][i] for i in slots]

    return literal_replay(steps, heads, prompt_len, evict)


@st.composite
def cases(draw):
    length = draw(st.integers(1, 5))
    size = draw(st.integers(1, 14))
    recent = draw(st.integers(0, min(2, size - 1)))
    steps = draw(st.integers(2, 28))
    heads = draw(st.integers(1, 3))
    prompt_len = draw(st.integers(0, steps - 1))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    keys = rng.normal(size=(steps, heads, 4))  # normal draws: no exact ties, which the literal rule breaks unrounded
    return size, recent, length, draw(st.booleans()), keys, prompt_len


@settings(max_examples=60, deadline=None)
@given(cases())
def test_the_reference_keeps_the_literal_chunks_and_torch_the_same(case) -> None:
    size, recent, length, shared, keys, prompt_len = case
    policy = ChunkKV(Knorm(size=size, recent=recent), length, selection="shared" if shared else "per_head")
    logits = np.zeros((keys.shape[0], keys.shape[1], keys.shape[0]))
    ref = kvpolicy_numpy.replay(policy, logits, prompt_len, keys=keys)
    same_kept(ref.kept, literal(size, recent, length, shared, keys, prompt_len))
    got = kvpolicy_torch.replay(policy, logits, prompt_len, keys=keys)
    same_kept(got.kept, ref.kept)


@settings(max_examples=40, deadline=None)
@given(cases(), st.sampled_from([0.0, 0.25, 0.5, 0.75, 0.875]))
def test_under_kvpress_protocol_the_context_keeps_whole_chunks_once(case, ratio) -> None:
    size, recent, length, shared, keys, prompt_len = case
    policy = prefill_only(ChunkKV(Knorm(size=max(size, recent + 1), recent=recent), length,
                                  selection="shared" if shared else "per_head"), ratio)
    logits = np.zeros((keys.shape[0], keys.shape[1], keys.shape[0]))
    ref = kvpolicy_numpy.replay(policy, logits, prompt_len, keys=keys)
    same_kept(ref.kept, literal(size, recent, length, shared, keys, prompt_len, ratio=ratio))
    got = kvpolicy_torch.replay(policy, logits, prompt_len, keys=keys)
    same_kept(got.kept, ref.kept)


@given(st.integers(1, 12), st.integers(1, 8), st.sampled_from([0.25, 0.5, 0.75, 0.875]))
def test_kvpress_chunk_count_where_the_context_is_whole_chunks(chunks, length, ratio) -> None:
    """kvpress's ChunkKVPress keeps ``max(1, int(ceil(n / L) (1 - r)))`` chunks; for ``n = c L`` and
    a budget of at least one chunk ChunkKV keeps as many (docs: they differ only through the
    partial chunk and budgets below one chunk)."""
    n = chunks * length
    k = max(1, int(n * (1 - ratio)))
    if k < length or k >= n:
        return
    assert ChunkKV(Knorm(size=1), length).kept_tokens(n, k) == max(1, int(math.ceil(n / length) * (1 - ratio))) * length


def test_chunk_scores_protect_and_count_nan_as_lowest() -> None:
    """A chunk holding a protected token (H2O's recent window) scores +inf; a NaN sum (+inf beside
    -inf) counts as -inf."""
    from kvpolicy import CacheView

    scores = np.array([[[1.0, 2.0, np.inf, -np.inf, 0.5, 0.5, 3.0, 1.0]]])
    view = CacheView(np.arange(8)[None, None], scores, 8)
    assert chunk_scores(view, H2O(heavy=2, recent=2), 2).tolist() == [[[3.0, -np.inf, 1.0, np.inf]]]


def test_the_kit_passes_chunkkv_over_scorers() -> None:
    from kvpolicy.testing import check_policy

    scorers = st.one_of(st.builds(Knorm, size=st.integers(2, 8), recent=st.integers(0, 1)),
                        st.builds(KeyDiff, size=st.integers(2, 8), recent=st.integers(0, 1)),
                        st.builds(H2O, heavy=st.integers(1, 5), recent=st.integers(1, 2)),
                        st.builds(TOVA, size=st.integers(1, 6), selection=st.just("per_head")),
                        st.builds(SnapKV, size=st.integers(3, 8), window=st.integers(1, 2)))
    report = check_policy(st.builds(ChunkKV, scorers, st.integers(1, 4), selection=st.sampled_from(["shared", "per_head"])),
                          settings=settings(max_examples=20, deadline=None))
    assert report.passed == ["replay", "sizes", "full_cache", "backends", "stateful"], report.results


def test_reads_like_its_scorer_plans_and_refuses() -> None:
    p = ChunkKV(SnapKV(size=64, window=16), chunk_length=8)
    assert (p.score_statistic, p.prompt_rows, p.capacity, p.selection, p.decode_eviction) == ("accumulate", 16, None, "shared", None)
    assert p == ChunkKV(SnapKV(size=64, window=16), 8) != ChunkKV(SnapKV(size=64, window=16), 8, selection="per_head")
    assert p.params() == {"scorer": {"policy": "snapkv", "size": 64, "window": 16, "kernel": 5, "pooling": "avg",
                                     "selection": "per_head"}, "chunk_length": 8}
    assert repr(ChunkKV(Knorm(size=4), 2, selection="per_head")) == (
        "ChunkKV(scorer=Knorm(size=4, recent=0), chunk_length=2, selection='per_head')")
    planned = make_policy("chunkkv", 0.5, context_length=300, prompt_length=200)
    assert isinstance(planned.scorer, SnapKV) and planned.chunk_length == 20
    assert isinstance(make_policy("chunkkv", 0.5, context_length=300, scorer="knorm").scorer, Knorm)
    with pytest.raises(ValueError, match="rank tokens by a score"):
        ChunkKV(StreamingLLM(sink=1, window=4))
    with pytest.raises(ValueError, match="rank tokens by a score"):
        ChunkKV(AdaKV(Knorm(size=4)))
    with pytest.raises(ValueError, match="select per head"):
        ChunkKV(TOVA(size=4))
    with pytest.raises(ValueError, match="chunk_length"):
        ChunkKV(Knorm(size=4), 0)
    with pytest.raises(ValueError, match="EvictionPolicy instance"):
        ChunkKV("knorm")
    assert ChunkKV(ExpectedAttention(size=8)).observes_queries


@pytest.mark.hf
def test_the_transformers_cache_keeps_what_the_reference_keeps() -> None:
    """Layer 0 of a tiny random-weight Llama (float64): the EvictingCache's kept positions after a
    prompt and 16 greedy steps equal the reference replay's on the layer's own keys."""
    pytest.importorskip("transformers")
    from kvpolicy.hf import EvictingCache
    from kvpolicy_tools.models import tiny_llama

    from layer0 import greedy_tokens, layer0_logits_and_keys

    model = tiny_llama(num_layers=2, heads=4, kv_heads=4, head_dim=8, vocab=96, seed=3).double()
    ids = torch.randint(3, 96, (1, 30), generator=torch.Generator().manual_seed(5))
    for policy in (ChunkKV(Knorm(size=14), 4), prefill_only(ChunkKV(Knorm(size=1), 4, selection="per_head"), 0.5)):
        cache = EvictingCache(policy, model)
        tokens = greedy_tokens(model, cache, ids, 16)
        logits, keys = layer0_logits_and_keys(model, tokens)
        trace = kvpolicy_numpy.replay(policy, logits, prompt_len=ids.shape[1], keys=keys)
        np.testing.assert_array_equal(cache.layers[0].store.positions[0].numpy(), trace.kept[-1])
        assert trace.kept[-1].shape[-1] < tokens.shape[1]  # it did evict


@pytest.mark.hf
def test_static_shapes_rescore_the_cache_before_a_host_eviction() -> None:
    """With static shapes a policy without a one-token decode rule evicts on the host between
    steps (``LayerCache.settle``); for a score from the cache (ChunkKV over Knorm) the scores are
    recomputed first, as an eager step does: the same tokens and kept positions as eager (before the
    fix, settle ranked stale scores and kept the newest tokens). Tiny random-weight Llama, GQA."""
    pytest.importorskip("transformers")
    from kvpolicy.hf import EvictingCache, greedy_decode
    from kvpolicy_tools.models import tiny_llama

    model = tiny_llama(num_layers=2, heads=4, kv_heads=2, head_dim=8, vocab=96, seed=3)
    ids = torch.randint(3, 96, (1, 30), generator=torch.Generator().manual_seed(5))
    for policy in (ChunkKV(Knorm(size=14), 4), ChunkKV(Knorm(size=14), 1, selection="per_head")):
        eager = EvictingCache(policy, model)
        want = greedy_decode(model, ids, eager, 24)
        static = EvictingCache(policy, model, static_shapes=True, max_tokens=ids.shape[1] + 25)
        assert torch.equal(greedy_decode(model, ids, static, 24), want), policy
        for a, b in zip(eager.layers, static.layers):
            assert a.store.positions.tolist() == b.store.positions.tolist(), policy
