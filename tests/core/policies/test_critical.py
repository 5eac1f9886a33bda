"""CriticalKV (kvpolicy/policies/critical.py, ``kvpolicy.statistics.value_weights`` and
``critical_scores``).

* the NumPy reference against kvpress's ``CriticalKVPress.score`` written out literally over
  Knorm (stage one: the ``int(b x first_stage_ratio)`` highest scores; stage two: ``(score +
  epsilon) x`` the L1 norm of ``W_o``-projected values averaged over the group), with and without
  ``W_o``, re-scored at every eviction, and the torch replay against the reference;
* AdaKV over it (CriticalAdaKV here), Expected Attention under it, kvpress's protocol: the torch
  replay keeps what the reference keeps; the conformance kit;
* ``kvpolicy.hf.output_projections`` and the transformers cache on layer 0 of a tiny random-weight
  Llama, bound to each layer's ``W_o``.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvpolicy_numpy
from kvpolicy import H2O, AdaKV, CriticalKV, ExpectedAttention, KeyDiff, Knorm, LagKV, SnapKV, make_policy, prefill_only
from kvpolicy.statistics import value_weights
from oracle import keep_highest_oracle, same_kept

torch = pytest.importorskip("torch")
import kvpolicy_torch  # noqa: E402


def kvpress_critical(keys: np.ndarray, values: np.ndarray, w_o: np.ndarray | None, held: list[int], first: int,
                     epsilon: float) -> list[float]:
    """One KV head's scores of its ``held`` tokens: Knorm's ``-|k|``, the ``first`` highest (a tie:
    the later) ``+inf``, the others ``(s + epsilon) x mean_g |W_o[g]^T v|_1``; ``w_o``
    ``[group, d, hidden]`` or ``None`` (the identity)."""
    s = [-float(np.linalg.norm(keys[p])) for p in held]
    if w_o is None:
        w = [float(np.abs(values[p]).sum()) for p in held]
    else:
        w = [float(np.mean([np.abs(values[p] @ w_o[g]).sum() for g in range(w_o.shape[0])])) for p in held]
    out = [(s[i] + epsilon) * w[i] for i in range(len(held))]
    for i in sorted(range(len(held)), key=lambda i: (s[i], i))[len(held) - first:] if first else []:
        out[i] = np.finfo(np.float64).max  # (kvpress: its dtype's largest value)
    return out


@st.composite
def cases(draw):
    size = draw(st.integers(1, 10))
    steps = draw(st.integers(2, 26))
    heads = draw(st.integers(1, 3))
    group = draw(st.integers(1, 2))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    d = draw(st.integers(2, 4))
    w_o = rng.normal(size=(heads, group, d, 5)) if draw(st.booleans()) else None
    policy = CriticalKV(Knorm(size=size, recent=draw(st.integers(0, min(1, size - 1)))),
                        epsilon=draw(st.sampled_from([0.0, 1e-4, 0.5])), first_stage_ratio=draw(st.sampled_from([0.0, 0.5, 1.0])),
                        projections=None if w_o is None else [w_o])
    # normal draws: no exact ties, which the literal rule breaks unrounded
    return policy, rng.normal(size=(steps, heads, d)), rng.normal(size=(steps, heads, d)), draw(st.integers(0, steps - 1)), w_o


@settings(max_examples=60, deadline=None)
@given(cases())
def test_the_reference_keeps_what_kvpress_scores_and_torch_the_same(case) -> None:
    policy, keys, values, prompt_len, w_o = case
    steps, heads, _ = keys.shape
    logits = np.zeros((steps, heads, steps))
    first = int(policy.scorer.size * policy.first_stage_ratio)
    want = keep_highest_oracle(policy.scorer, steps, heads, prompt_len, lambda h, held, t: kvpress_critical(
        keys[:, h], values[:, h], None if w_o is None else w_o[h], held, first, policy.epsilon))
    ref = kvpolicy_numpy.replay(policy, logits, prompt_len, keys=keys, values=values)
    same_kept(ref.kept, want)
    got = kvpolicy_torch.replay(policy, logits, prompt_len, keys=keys, values=values)
    same_kept(got.kept, ref.kept)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(6, 24), st.sampled_from(["adakv", "expected_attention", "prefill_only"]))
def test_wrapped_and_wrapping_the_torch_replay_keeps_what_the_reference_keeps(seed, prompt_len, kind) -> None:
    """AdaKV over CriticalKV (head-wise, holes), CriticalKV over Expected Attention (queries'
    moments, sinks +inf), CriticalKV under kvpress's protocol: numpy and torch keep the same."""
    rng = np.random.default_rng(seed)
    steps, heads = prompt_len + 6, 2
    keys, values, queries = (rng.normal(size=(steps, heads, 4)) for _ in range(3))
    policy = {"adakv": AdaKV(CriticalKV(KeyDiff(size=5, refresh=1)), 0.2),
              "expected_attention": CriticalKV(ExpectedAttention(size=6, sink=2, value_norm=False, refresh=1)),
              "prefill_only": prefill_only(CriticalKV(Knorm(size=prompt_len // 2)), 0.5)}[kind]
    logits = np.zeros((steps, heads, steps))
    ref = kvpolicy_numpy.replay(policy, logits, prompt_len, keys=keys, values=values, queries=queries)
    got = kvpolicy_torch.replay(policy, logits, prompt_len, keys=keys, values=values, queries=queries)
    same_kept(got.kept, ref.kept)
    if kind == "expected_attention":  # the sinks' +inf stays
        assert all(set(range(2)) <= set(row.tolist()) for row in ref.kept[-1])


def test_a_head_whose_candidates_are_all_first_stage_still_evicts_the_earliest() -> None:
    """``first_stage_ratio = 1`` beside a recent window: the one second-stage token is the newest
    (protected), so the victim is a first-stage token, the earliest, on both backends (a ``+inf``
    first stage left the torch backend's victim search nothing to pick: it differed)."""
    steps = 8
    keys = np.arange(1.0, steps + 1)[:, None, None]  # norms grow: the newest is always the largest
    policy = CriticalKV(Knorm(size=3, recent=1), first_stage_ratio=1.0)
    logits = np.zeros((steps, 1, steps))
    ref = kvpolicy_numpy.replay(policy, logits, 2, keys=keys, values=np.ones((steps, 1, 1)))
    got = kvpolicy_torch.replay(policy, logits, 2, keys=keys, values=np.ones((steps, 1, 1)))
    assert [k.tolist() for k in ref.kept[3:]] == [[[t - 2, t - 1, t]] for t in range(3, steps)]
    assert all(np.array_equal(a, b) for a, b in zip(ref.kept[2:], got.kept[2:]))


def test_value_weights_group_mean_of_projected_l1_norms() -> None:
    rng = np.random.default_rng(0)
    v, w = rng.normal(size=(1, 2, 5, 3)), rng.normal(size=(2, 3, 3, 4))
    want = np.array([[[np.mean([np.abs(v[0, h, i] @ w[h, g]).sum() for g in range(3)]) for i in range(5)] for h in range(2)]])
    np.testing.assert_allclose(value_weights(v, w), want, rtol=1e-12)
    np.testing.assert_allclose(value_weights(torch.tensor(v), torch.tensor(w)).numpy(), want, rtol=1e-12)


def test_the_kit_passes_criticalkv() -> None:
    from kvpolicy.testing import check_policy

    scorers = st.one_of(st.builds(Knorm, size=st.integers(1, 6), recent=st.just(0)),
                        st.builds(KeyDiff, size=st.integers(2, 6), recent=st.integers(0, 1)),
                        st.builds(LagKV, size=st.integers(2, 6), sink=st.integers(0, 1), lag=st.integers(1, 2)))
    report = check_policy(st.builds(CriticalKV, scorers, st.sampled_from([0.0, 1e-4]), st.sampled_from([0.0, 0.5, 1.0])),
                          settings=settings(max_examples=15, deadline=None))
    assert report.passed == ["replay", "sizes", "full_cache", "backends", "stateful", "ranking"], report.results


def test_reads_like_its_scorer_plans_binds_and_refuses() -> None:
    p = CriticalKV(ExpectedAttention(size=64, value_norm=False, refresh=4))
    assert (p.score_statistic, p.observes_queries, p.sink, p.refresh, p.first_stage, p.capacity) == (
        "expected_attention", True, 4, 4, 32, 65)
    assert p.decode_eviction == p.scorer.decode_eviction and p.size_rule()(70, {}) == 64
    planned = make_policy("critical_expected_attention", 0.5, context_length=300, prompt_length=200)
    assert isinstance(planned.scorer, ExpectedAttention) and not planned.scorer.value_norm
    ada = make_policy("critical_adakv_expected_attention", 0.5, context_length=300, prompt_length=200)
    assert isinstance(ada, AdaKV) and isinstance(ada.scorer, CriticalKV)
    assert isinstance(make_policy("critical_kv", 0.5, context_length=300, scorer="knorm").scorer, Knorm)
    w = [np.zeros((1, 1, 2, 3)), np.ones((1, 1, 2, 3))]
    bound = CriticalKV(Knorm(size=4), projections=w)
    assert bound.for_layer(1, 2).projection() is w[1] and bound.for_layer(1, 2) != bound
    assert bound.params()["projections"] == 2 and "projections=<2 layers>" in repr(bound)
    with pytest.raises(ValueError, match="bound to none"):
        bound.projection()
    assert bound.for_layer(0, 3) is bound  # another layer count (the planners' probe): unbound ...
    with pytest.raises(ValueError, match="a model with 2 layers"):
        bound.for_layer(0, 3).projection()  # ... which a scoring refuses
    planned = make_policy("critical_kv", 0.5, context_length=300, prompt_length=200, scorer="knorm", projections=w * 15)
    assert planned.projections is not None and planned.for_layer(29, 30).layer == 29
    with pytest.raises(ValueError, match="score computed from the cache"):
        CriticalKV(SnapKV(size=8, window=2))  # attention scores: the values are not beside them
    with pytest.raises(ValueError, match="score computed from the cache"):
        CriticalKV(H2O(heavy=2, recent=1))
    with pytest.raises(ValueError, match="first_stage_ratio"):
        CriticalKV(Knorm(size=4), first_stage_ratio=1.5)
    with pytest.raises(ValueError, match=r"projections\[0\]"):
        CriticalKV(Knorm(size=4), projections=[np.zeros((2, 3))])


@pytest.mark.hf
def test_the_transformers_cache_binds_each_layer_to_its_output_projection() -> None:
    """A tiny random-weight Llama (float64, 4 heads): ``output_projections`` reads each layer's
    ``o_proj`` in the GQA layout; with them the cache keeps on layer 0 what the reference keeps
    with layer 0's W_o, which is not what the identity keeps; and so under AdaKV and prefill_only,
    which bind the policy they wrap to each layer (``for_layer``)."""
    pytest.importorskip("transformers")
    from kvpolicy.hf import EvictingCache, output_projections
    from kvpolicy_tools.models import tiny_llama

    from layer0 import greedy_tokens, layer0_cached_values

    model = tiny_llama(num_layers=2, heads=4, kv_heads=4, head_dim=8, vocab=96, seed=3).double()
    ids = torch.randint(3, 96, (1, 30), generator=torch.Generator().manual_seed(5))
    w_o = output_projections(model)
    assert [tuple(w.shape) for w in w_o] == [(4, 1, 8, model.config.hidden_size)] * 2
    torch.testing.assert_close(w_o[0][2, 0], model.model.layers[0].self_attn.o_proj.weight[:, 16:24].T)
    policy = CriticalKV(Knorm(size=12), projections=w_o)
    cache = EvictingCache(policy, model)
    tokens = greedy_tokens(model, cache, ids, 12)
    logits, keys, values = layer0_cached_values(model, tokens, ids.shape[1])
    one = CriticalKV(Knorm(size=12), projections=[w_o[0].numpy()])
    trace = kvpolicy_numpy.replay(one, logits, prompt_len=ids.shape[1], keys=keys, values=values)
    np.testing.assert_array_equal(cache.layers[0].store.positions[0].numpy(), trace.kept[-1])
    identity = kvpolicy_numpy.replay(CriticalKV(Knorm(size=12)), logits, prompt_len=ids.shape[1], keys=keys, values=values)
    assert not np.array_equal(identity.kept[-1], trace.kept[-1])  # W_o matters
    # wrapped (AdaKV over it, kvpress's protocol over it): the wrapper binds it to each layer too
    for wrap in (lambda p: AdaKV(p, 0.2), lambda p: prefill_only(p, 0.5)):
        cache = EvictingCache(wrap(CriticalKV(Knorm(size=12), projections=w_o)), model)
        tokens = greedy_tokens(model, cache, ids, 12)
        logits, keys, values = layer0_cached_values(model, tokens, ids.shape[1])
        trace = kvpolicy_numpy.replay(wrap(one), logits, prompt_len=ids.shape[1], keys=keys, values=values)
        np.testing.assert_array_equal(cache.layers[0].store.positions[0].numpy(), trace.kept[-1])
