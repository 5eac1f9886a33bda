"""LagKV (kvpolicy/policies/lagkv.py, ``kvpolicy.statistics.lag_scores``).

* the NumPy reference against kvpress's ``LagKVPress.score`` procedure written out literally in
  NumPy (the held tokens in position order, partitions of ``lag`` after the sinks, each scaled
  by the next one's min and max, the channels' standard deviation softmaxed, keys and values
  averaged, ranks within a partition; sinks and the tail 1; the ramp below ``sink + 2 lag``),
  re-scored at every eviction, and the torch replay (slots not in position order after its O(1)
  decode evictions) against the reference;
* a refresh interval: the reference keeps what the rule says literally (kvpress's scores after
  the prompt and at every ``refresh``-th decode step, held in between, the tokens appended since
  ``UNSCORED``), and the torch replay what the reference keeps;
* the conformance kit; the transformers cache on layer 0 of a tiny random-weight Llama.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvpolicy_numpy
from kvpolicy import LagKV, compose, make_policy, prefill_only
from kvpolicy.statistics import UNSCORED, lag_scores, refresh_interval
from oracle import keep_highest_oracle, refresh_oracle as literal_refresh, same_kept

torch = pytest.importorskip("torch")
import kvpolicy_torch  # noqa: E402


def kvpress_lag(keys: np.ndarray, values: np.ndarray, sink: int, lag: int, cross: bool) -> list[float]:
    """kvpress's ``LagKVPress.score`` of one head's ``[n, d]`` keys and values, literally (a
    channel whose lag holds one value scales to 0, where kvpress divides by zero)."""
    n, d = keys.shape
    if n < sink + 2 * lag:
        score = np.ones(n)
        if n > sink:
            score[sink:] = np.arange(n - sink) / (n - sink)
        return score.tolist()
    end = sink + ((n - sink) // lag) * lag
    tail = lag + n - end

    def states(x: np.ndarray) -> np.ndarray:
        t = x[sink:end].reshape(-1, lag, x.shape[-1])
        ref, v = t[1:], t[:-1]
        low, high = ref.min(axis=1, keepdims=True), ref.max(axis=1, keepdims=True)
        span = high - low
        scaled = np.where(span > 0, (v - low) / np.where(span > 0, span, 1.0), 0.0)
        std = scaled.std(axis=-1, ddof=1)
        e = np.exp(std - std.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)

    score = (states(keys) + states(values)) / 2
    if not cross:
        score = np.argsort(np.argsort(score, axis=-1, kind="stable"), axis=-1, kind="stable") / lag
    return np.concatenate([np.ones(sink), score.reshape(-1), np.ones(tail)]).tolist()


@st.composite
def cases(draw):
    lag = draw(st.integers(1, 4))
    sink = draw(st.integers(0, 3))
    size = draw(st.integers(1, 12))
    # (refresh=1: the every-step rule kvpress's scores are compared with; the default scores every 64th step)
    policy = LagKV(size=size, recent=draw(st.integers(0, min(2, size - 1))), sink=sink, lag=lag,
                   cross_scoring=draw(st.booleans()), selection=draw(st.sampled_from(["per_head", "shared"])), refresh=1)
    steps = draw(st.integers(2, 30))
    heads = draw(st.integers(1, 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    d = draw(st.integers(2, 4))
    # normal draws: no exact ties but the ranks', which both sides break by position
    return policy, rng.normal(size=(steps, heads, d)), rng.normal(size=(steps, heads, d)), draw(st.integers(0, steps - 1))


@settings(max_examples=50, deadline=None)
@given(cases())
def test_the_reference_keeps_what_kvpress_scores_and_torch_the_same(case) -> None:
    policy, keys, values, prompt_len = case
    steps, heads, _ = keys.shape
    logits = np.zeros((steps, heads, steps))
    want = keep_highest_oracle(policy, steps, heads, prompt_len, lambda h, held, t: kvpress_lag(
        keys[held, h], values[held, h], policy.sink, policy.lag, policy.cross_scoring))
    ref = kvpolicy_numpy.replay(policy, logits, prompt_len, keys=keys, values=values)
    same_kept(ref.kept, want)
    got = kvpolicy_torch.replay(policy, logits, prompt_len, keys=keys, values=values)
    same_kept(got.kept, ref.kept)


def refresh_oracle(policy: LagKV, keys: np.ndarray, values: np.ndarray, prompt_len: int) -> list[list[list[int]] | None]:
    """Kept positions per step and head under a refresh interval, literally: kvpress's scores of
    the held tokens after the prompt and at every ``refresh``-th decode step since the last
    scoring, kept per position in between; a token appended since scores ``UNSCORED``; then,
    while more than ``size`` are held, the lowest outside the newest ``recent`` goes (the
    earliest of a tie; ``"shared"``: scores summed over heads)."""
    steps, heads, _ = keys.shape
    return literal_refresh(
        policy, steps, heads, prompt_len,
        lambda h, held, t: kvpress_lag(keys[held, h], values[held, h], policy.sink, policy.lag, policy.cross_scoring),
        lambda p: UNSCORED,
    )


@settings(max_examples=50, deadline=None)
@given(cases(), st.integers(2, 5))
def test_a_refresh_interval_keeps_what_the_literal_rule_keeps(case, refresh) -> None:
    policy, keys, values, prompt_len = case
    policy = LagKV(**{**policy.params(), "refresh": refresh})
    steps, heads, _ = keys.shape
    logits = np.zeros((steps, heads, steps))
    ref = kvpolicy_numpy.replay(policy, logits, prompt_len, keys=keys, values=values)
    same_kept(ref.kept, refresh_oracle(policy, keys, values, prompt_len))
    got = kvpolicy_torch.replay(policy, logits, prompt_len, keys=keys, values=values)
    same_kept(got.kept, ref.kept)


def test_a_refresh_interval_changes_what_is_kept() -> None:
    # (the oracle test above could pass with refresh ignored on both sides)
    rng = np.random.default_rng(1)
    keys, values = rng.normal(size=(60, 1, 4)), rng.normal(size=(60, 1, 4))
    logits = np.zeros((60, 1, 60))
    every = kvpolicy_numpy.replay(LagKV(size=16, sink=2, lag=3, refresh=1), logits, 20, keys=keys, values=values)
    sparse = kvpolicy_numpy.replay(LagKV(size=16, sink=2, lag=3, refresh=5), logits, 20, keys=keys, values=values)
    assert any(a.tolist() != b.tolist() for a, b in zip(every.kept[20:], sparse.kept[20:]))


@pytest.mark.parametrize("prefill_refresh, decode_refresh", [(1, 4), (4, 1)])
def test_a_composition_follows_its_decode_policys_refresh(prefill_refresh, decode_refresh) -> None:
    # LagKV as the prompt's policy and as the decode policy: the interval is the decode policy's,
    # and torch keeps what the reference keeps
    rng = np.random.default_rng(0)
    keys, values, logits = rng.normal(size=(60, 2, 4)), rng.normal(size=(60, 2, 4)), rng.normal(size=(60, 2, 60))
    policy = compose(prefill=LagKV(size=10, sink=2, lag=2, refresh=prefill_refresh),
                     decode=LagKV(size=12, sink=2, lag=3, refresh=decode_refresh))
    assert refresh_interval(policy) == decode_refresh
    ref = kvpolicy_numpy.replay(policy, logits, 30, keys=keys, values=values)
    same_kept(kvpolicy_torch.replay(policy, logits, 30, keys=keys, values=values).kept, ref.kept)


def test_scores_ignore_slot_order_and_holes() -> None:
    """The same tokens in another slot order, with holes among them, score the same."""
    rng = np.random.default_rng(3)
    keys, values = rng.normal(size=(1, 1, 11, 3)), rng.normal(size=(1, 1, 11, 3))
    positions = np.arange(11)[None, None]
    want = lag_scores(keys, values, positions, sink=1, lag=3)
    perm = np.array([4, 0, 9, 10, 2, 1, 3, 8, 5, 7, 6])
    holes = np.concatenate([np.zeros((1, 1, 2, 3)), keys[..., perm, :]], axis=-2), np.concatenate([np.zeros((1, 1, 2, 3)), values[..., perm, :]], axis=-2)
    shuffled = lag_scores(*holes, np.concatenate([[[[-1, -1]]], positions[..., perm]], axis=-1), sink=1, lag=3)
    assert shuffled[..., 2:].tolist() == want[..., perm].tolist() and shuffled[..., :2].tolist() == [[[0.0, 0.0]]]


def test_the_kit_passes_lagkv() -> None:
    from kvpolicy.testing import check_policy

    report = check_policy(LagKV, {"size": st.integers(2, 8), "recent": st.just(0), "sink": st.integers(0, 2),
                                  "lag": st.integers(1, 3), "cross_scoring": st.booleans(), "refresh": st.integers(1, 3)},
                          settings=settings(max_examples=12, deadline=None))
    assert report.passed == ["replay", "sizes", "full_cache", "backends", "stateful", "ranking"], report.results


def test_parameters_and_plans() -> None:
    p = make_policy("lagkv", 0.5, context_length=300, prompt_length=200)
    assert isinstance(p, LagKV) and (p.sink, p.lag, p.cross_scoring) == (4, 128, False)
    assert repr(LagKV(size=8, lag=4, cross_scoring=True)) == "LagKV(size=8, recent=0, sink=4, lag=4, cross_scoring=True)"
    with pytest.raises(ValueError, match="lag"):
        LagKV(size=8, lag=0)
    assert prefill_only(LagKV(size=1, lag=2), 0.5).kept_tokens(40) == 20


@pytest.mark.hf
@pytest.mark.parametrize("refresh", [1, 5])
def test_the_transformers_cache_keeps_what_the_reference_keeps(refresh) -> None:
    """Layer 0 of a tiny random-weight Llama (float64): kept positions after a prompt and 16 greedy
    steps equal the reference replay's on the layer's keys and values (the O(1) decode eviction
    reuses slots, so the cache scores tokens out of position order), scored at every step and at
    every 5th."""
    pytest.importorskip("transformers")
    from kvpolicy.hf import EvictingCache
    from kvpolicy_tools.models import tiny_llama

    from layer0 import greedy_tokens, layer0_cached_values

    model = tiny_llama(num_layers=2, heads=4, kv_heads=4, head_dim=8, vocab=96, seed=3).double()
    ids = torch.randint(3, 96, (1, 30), generator=torch.Generator().manual_seed(5))
    policy = LagKV(size=16, sink=2, lag=4, refresh=refresh)
    cache = EvictingCache(policy, model)
    tokens = greedy_tokens(model, cache, ids, 16)
    logits, keys, values = layer0_cached_values(model, tokens, ids.shape[1])
    trace = kvpolicy_numpy.replay(policy, logits, prompt_len=ids.shape[1], keys=keys, values=values)
    np.testing.assert_array_equal(cache.layers[0].store.positions[0].numpy(), trace.kept[-1])
