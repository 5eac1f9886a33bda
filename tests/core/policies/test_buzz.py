"""BUZZ (kvpolicy/policies/buzz.py): its parameters, its rule (one decision, replays, the long-run fixed
point) and, first, BUZZ with log n as the paper writes it (section 3.5): logits times ``log_512(n)``, ``n`` the
number of keys the query attends to (the entries of its softmax), no floor by default.

Checked on the NumPy reference (against the formula written out by hand), the torch replay and
the transformers path (a tiny random-weight float64 Llama: wiring and numerics, not language),
below and above 512 keys, and against each other.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

import kvpolicy_numpy
from kvpolicy import (
    BUZZ,
    CacheView,
    LogNScaling,
    create_policy,
    estimate_threshold,
    fixed_point_middle,
    make_policy,
    simulate_sizes,
    threshold_ratio,
)
from kvpolicy_numpy import replay
from kvpolicy_numpy.replay import softmax
from replay_scores import reconstruct_scores
from strategies import LOGIT_LEVELS, buzz_policies, logits_arrays


@given(st.integers(1, 5000), st.sampled_from([8.0, 64.0, 512.0]))
def test_scale_is_log_base_n_without_floor(n, base):
    s = LogNScaling(base=base)
    assert s.scale(n) == pytest.approx(math.log(n) / math.log(base), rel=1e-12, abs=1e-15)
    assert float(s.scales(np.asarray([n]))[0]) == pytest.approx(s.scale(n), rel=1e-12, abs=1e-15)
    floored = LogNScaling(base=base, floor=1.0)
    assert floored.scale(n) == max(s.scale(n), 1.0)


def test_buzz_logn_is_the_formula_as_written():
    p = create_policy("buzz_logn", sink=4, window=8, stride=5, threshold=35)
    assert p.log_n == LogNScaling(512.0, 0.0)
    assert p.log_n.scale(512) == 1.0
    assert p.log_n.scale(64) == pytest.approx(2 / 3)  # softer below 512 keys
    assert p.log_n.scale(4096) == pytest.approx(4 / 3)  # sharper above
    assert BUZZ(log_n=True, log_floor=1.0).log_n.scale(64) == 1.0  # the earlier variant, still available


def _rows(steps, heads=2, d=3, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(steps, heads, steps)) * 2.0, rng.normal(size=(steps, heads, d))


@pytest.mark.parametrize("prompt_len", [0, 7])
def test_buzz_logn_differs_from_buzz_exactly_by_the_scale_below_512(prompt_len):
    """No eviction in this run (capacity above its length), so both policies attend to the same
    keys: BUZZ's outputs are softmax(l) V and BUZZ-log-n's softmax(log_512(n) l) V, n = t + 1 keys."""
    steps = 40
    logits, values = _rows(steps)
    plain = BUZZ(sink=4, window=30, stride=5, threshold=20)
    logn = BUZZ(sink=4, window=30, stride=5, threshold=20, log_n=True)
    a = kvpolicy_numpy.replay(plain, logits, prompt_len, values)
    b = kvpolicy_numpy.replay(logn, logits, prompt_len, values)
    assert not a.evictions and not b.evictions
    for t in range(steps):
        n = t + 1  # keys attended: all of 0..t
        expect_plain = np.einsum("hk,khd->hd", softmax(logits[t, :, :n]), values[:n])
        expect_logn = np.einsum("hk,khd->hd", softmax(logits[t, :, :n] * (math.log(n) / math.log(512))), values[:n])
        np.testing.assert_allclose(a.outputs[t], expect_plain, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(b.outputs[t], expect_logn, rtol=1e-12, atol=1e-12)
        if n > 1:
            assert not np.allclose(a.outputs[t], b.outputs[t])
    # with the earlier floor the two coincide below 512 keys
    floored = kvpolicy_numpy.replay(BUZZ(sink=4, window=30, stride=5, threshold=20, log_n=True, log_floor=1.0),
                                    logits, prompt_len, values)
    np.testing.assert_array_equal(floored.outputs, a.outputs)


def _crossing_policy():
    # capacity 564: decode queries attend to 401..564 keys, below and above 512; evictions keep
    # the count of kept keys (not tokens seen) as n
    return BUZZ(sink=4, window=500, stride=5, threshold=60, log_n=True)


def test_reference_scale_counts_kept_keys_after_eviction():
    steps, prompt = 620, 400
    logits, values = _rows(steps, heads=1, d=2, seed=1)
    policy = _crossing_policy()
    trace = kvpolicy_numpy.replay(policy, logits, prompt, values)
    assert trace.evictions  # n (kept keys) and t + 1 (tokens seen) part ways
    assert min(trace.sizes) < 512 < max(trace.sizes)
    for i, t in enumerate(range(prompt, steps)):
        kept = np.concatenate([trace.kept[t - 1][0], [t]])  # what query t attends to
        n = trace.sizes[i]
        assert len(kept) == n
        probs = softmax(logits[t, 0, kept] * (math.log(n) / math.log(512)))
        np.testing.assert_allclose(trace.outputs[t, 0], probs @ values[kept, 0], rtol=1e-11, atol=1e-12)


def test_torch_replay_agrees_with_reference_above_and_below_512():
    torch = pytest.importorskip("torch")
    import kvpolicy_torch

    steps, prompt = 620, 400
    logits, values = _rows(steps, seed=2)
    policy = _crossing_policy()
    a = kvpolicy_numpy.replay(policy, logits, prompt, values)
    b = kvpolicy_torch.replay(policy, torch.as_tensor(logits), prompt, torch.as_tensor(values))
    assert min(a.sizes) < 512 < max(a.sizes)
    np.testing.assert_array_equal(a.sizes, b.sizes)
    for t in range(prompt - 1, steps):
        np.testing.assert_array_equal(a.kept[t], b.kept[t])
    np.testing.assert_allclose(a.outputs, b.outputs, rtol=1e-9, atol=1e-11)


@pytest.mark.slow
def test_transformers_path_agrees_with_reference_above_and_below_512():
    """Layer 0 of a float64 tiny Llama (no GQA) through EvictingCache: its attention outputs,
    prefill rows (n = i + 1) and decode steps (n = kept keys, 401 to 564), equal the NumPy
    reference's on the same logits and values."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from kvpolicy_tools.models import tiny_llama
    from kvpolicy_integrations.hf import EvictingCache, cache_kwargs

    model = tiny_llama(num_layers=1, heads=2, kv_heads=2, head_dim=8, vocab=64, seed=4,
                       max_position_embeddings=1024).double()
    steps, prompt = 600, 400
    ids = torch.randint(3, 64, (1, steps), generator=torch.Generator().manual_seed(0))
    attn = model.model.layers[0].self_attn
    outs = []

    def grab_out(module, args):
        outs.append(args[0].detach())

    policy = _crossing_policy()
    cache = EvictingCache(policy, model)
    h = attn.o_proj.register_forward_pre_hook(grab_out)
    try:
        with torch.no_grad():
            model(ids[:, :prompt], **cache_kwargs(model, cache), use_cache=True)
            for t in range(prompt, steps):
                model(ids[:, t : t + 1], **cache_kwargs(model, cache), use_cache=True)
    finally:
        h.remove()
    got = torch.cat(outs, dim=1)[0].view(steps, 2, 8).numpy()  # [steps, heads, d]

    from layer0 import layer0_inputs

    x, pos = layer0_inputs(model, ids)
    q = attn.q_proj(x).view(1, steps, 2, 8).transpose(1, 2)
    k = attn.k_proj(x).view(1, steps, 2, 8).transpose(1, 2)
    v = attn.v_proj(x).view(1, steps, 2, 8)[0]  # [steps, heads, d]
    q, k = apply_rotary_pos_emb(q, k, *pos)
    logits = (torch.einsum("bhqd,bhkd->bqhk", q, k) * attn.scaling)[0].detach().numpy()
    trace = kvpolicy_numpy.replay(policy, logits, prompt, v.detach().numpy())
    assert trace.evictions and min(trace.sizes) < 512 < max(trace.sizes)
    np.testing.assert_array_equal(cache.layers[0].store.positions[0].numpy(), trace.kept[-1])
    np.testing.assert_allclose(got, trace.outputs, rtol=1e-8, atol=1e-10)


# ---------------------------------------------------------------------------- validation: bad input raises a ValueError naming the parameter


@pytest.mark.parametrize("stride", [1, 2])
def test_buzz_stride_below_3(stride) -> None:
    with pytest.raises(ValueError, match=rf"stride must be >= 3, got {stride}"):
        BUZZ(sink=1, window=4, stride=stride, threshold=6)
    with pytest.raises(ValueError, match="stride must be >= 3"):
        threshold_ratio(stride)
    with pytest.raises(ValueError, match="stride must be >= 3"):
        estimate_threshold(stride, 10)


@pytest.mark.parametrize("stride", [3, 4, 5, 8, 17])
@pytest.mark.parametrize("threshold", [1, 2])
def test_buzz_threshold_too_small(stride, threshold) -> None:
    with pytest.raises(ValueError, match=rf"threshold must be >= 3, got {threshold}"):
        BUZZ(sink=1, window=4, stride=stride, threshold=threshold)
    assert BUZZ(sink=1, window=4, stride=stride, threshold=3).threshold == 3


@pytest.mark.parametrize("stride", range(3, 30))
def test_smallest_allowed_threshold_shrinks_the_middle(stride) -> None:
    """With T = 3 every eviction leaves fewer than T middle tokens (so the capacity holds),
    and T = 2 would not: 2 old tokens thinned by s_hat >= 2 keep 1, plus 1 new one."""
    s_hat = (stride + 1) // 2
    for a in range(3):
        assert math.ceil(a / s_hat) + math.ceil((3 - a) / stride) < 3
    assert math.ceil(1 / s_hat) + math.ceil(1 / stride) == 2  # T = 2, a = 1: no shrink


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(log_n=True, log_base=1.0), "log_base"),
        (dict(log_n=True, log_base=0.5), "log_base"),
        (dict(log_n=True, log_floor=-0.1), "log_floor"),
        (dict(interval_keep="middle"), "interval_keep"),
        (dict(selection="per_layer"), "selection"),
    ],
)
def test_buzz_choice_parameters(kwargs, param) -> None:
    with pytest.raises(ValueError, match=rf"^{param} must be"):
        BUZZ(sink=1, window=2, stride=3, threshold=3, **kwargs)


NOT_BOOLS = ["yes", "no", "False", 1, 0, 1.0, None, np.int64(1), [True]]


@pytest.mark.parametrize("bad", NOT_BOOLS, ids=repr)
def test_buzz_log_n_accepts_only_bools(bad) -> None:
    with pytest.raises(ValueError, match=rf"^log_n must be True or False, got {re.escape(repr(bad))}$"):
        BUZZ(sink=1, window=2, stride=3, threshold=3, log_n=bad)
    with pytest.raises(ValueError, match="^log_n must be True or False"):
        make_policy("buzz", 0.3, context_length=100, log_n=bad)


@pytest.mark.parametrize("good, expected", [(True, True), (False, False), (np.True_, True), (np.False_, False)])
def test_buzz_log_n_bools(good, expected) -> None:
    p = BUZZ(sink=1, window=2, stride=3, threshold=3, log_n=good)
    assert (p.log_n is not None) is expected
    assert p.params().get("log_n", False) is expected


def test_buzz_log_parameters_checked_even_without_log_n() -> None:
    with pytest.raises(ValueError, match="^log_base must be"):
        BUZZ(log_base="512")
    with pytest.raises(ValueError, match="^log_floor must be"):
        BUZZ(log_floor=-1.0)


# ---------------------------------------------------------------------------- BUZZ's rule: one decision, replays, the fixed point


@st.composite
def buzz_views(draw):
    """A BUZZ policy and a cache view at an eviction: ``n_old`` old, the rest new."""
    policy = draw(buzz_policies())
    t = policy.threshold
    n_old = draw(st.integers(0, t - 1))
    middle = draw(st.integers(t, t + 3 * policy.stride))  # > T happens after a prefill
    n = policy.sink + middle + policy.window
    heads = draw(st.integers(1, 3))
    levels = draw(st.sampled_from([(0.0, 1.0), LOGIT_LEVELS, tuple(np.linspace(0, 1, 97))]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    scores = rng.choice(np.asarray(levels, dtype=np.float64), size=(1, heads, n))
    positions = np.broadcast_to(np.sort(rng.choice(10 * n, size=n, replace=False)), (1, heads, n)).copy()
    return policy, n_old, CacheView(positions, scores, int(positions.max()) + 1, {"n_old": n_old})


@given(buzz_views())
def test_buzz_single_eviction_rules(case) -> None:
    """Old tokens: first (or last) of each group of s_hat. New tokens: exactly one survivor per
    stride segment (the partial last one included), its highest score, the earliest on ties."""
    policy, n_old, view = case
    n = view.n_cached
    sink, window, s = policy.sink, policy.window, policy.stride
    s_hat = (s + 1) // 2
    scores = view.scores.copy()
    keep = policy.select(view)  # per-head decision (the shared path is tested by the oracle)
    assert keep is not None
    new_start, new_stop = sink + n_old, n - window
    n_new = new_stop - new_start
    for h in range(view.heads):
        slots = keep[0, h].tolist()
        assert slots[:sink] == list(range(sink)), "sink changed"
        assert slots[len(slots) - window :] == list(range(n - window, n)), "window changed"
        middle = slots[sink : len(slots) - window]
        old_kept = [i for i in middle if i < new_start]
        new_kept = [i for i in middle if i >= new_start]
        groups = [list(range(sink + g, min(sink + g + s_hat, new_start))) for g in range(0, n_old, s_hat)]
        pick = 0 if policy.interval_keep == "first" else -1
        assert old_kept == [g[pick] for g in groups], f"old tokens {old_kept} break the interval rule"
        segments = [list(range(a, min(a + s, new_stop))) for a in range(new_start, new_stop, s)]
        assert len(new_kept) == len(segments) == math.ceil(n_new / s)
        for seg, won in zip(segments, new_kept):
            assert won in seg, f"survivor {won} outside its segment {seg}"
            best = max(scores[0, h, i] for i in seg)
            assert scores[0, h, won] == best, "survivor is not the segment's argmax"
            assert won == next(i for i in seg if scores[0, h, i] == best), "tie not broken to earliest"
    assert view.state["n_old"] == len(old_kept) + len(new_kept)


def test_buzz_segment_rule_worked_by_hand() -> None:
    """sink 1, window 1, stride 3, 2 old + 7 new: old -> keep slot 1 (s_hat=2); new segments
    [3,4,5] [6,7,8] [9] -> argmax 4, first of tie 6, 9."""
    p = BUZZ(sink=1, window=1, stride=3, threshold=9)
    scores = np.asarray([[[9, 5, 5, 0, 2, 1, 3, 3, 1, 0, 7]]], dtype=np.float64)
    view = CacheView(np.arange(11)[None, None, :], scores, 11, {"n_old": 2})
    assert p.select(view)[0, 0].tolist() == [0, 1, 4, 6, 9, 10]
    assert view.state == {"n_old": 4}
    p_last = BUZZ(sink=1, window=1, stride=3, threshold=9, interval_keep="last")
    view = CacheView(np.arange(11)[None, None, :], scores, 11, {"n_old": 2})
    assert p_last.select(view)[0, 0].tolist() == [0, 2, 4, 6, 9, 10]


def test_buzz_does_not_evict_below_threshold() -> None:
    p = BUZZ(sink=2, window=3, stride=4, threshold=6)
    for middle in range(-5, 6):
        n = max(0, 5 + middle)
        view = CacheView(np.arange(n)[None, None, :], np.ones((1, 1, n)), n, {"n_old": 0})
        assert p.select(view) is None
    view = CacheView(np.arange(11)[None, None, :], np.ones((1, 1, 11)), 11, {"n_old": 0})
    assert p.select(view) is not None


@given(buzz_policies(), logits_arrays(min_steps=10, max_steps=60))
def test_buzz_replay_follows_the_rule_at_every_eviction(policy, logits) -> None:
    """From the trace alone: at every eviction, the old tokens (the middle after the previous
    eviction) are interval-sampled and each stride segment of the new ones keeps its argmax."""
    steps, heads, _ = logits.shape
    trace = replay(policy, logits, 0)
    sink, window, s = policy.sink, policy.window, policy.stride
    s_hat = (s + 1) // 2
    pick = 0 if policy.interval_keep == "first" else -1
    old: list[list[int]] = [[] for _ in range(heads)]  # per head: the old middle tokens
    for t, _, _ in trace.evictions:
        scores = reconstruct_scores(trace, logits, policy, t)
        for h in range(heads):
            cache = (trace.kept[t - 1][h].tolist() if t else []) + [t]
            middle = cache[sink : len(cache) - window]
            assert len(middle) == policy.threshold, "an eviction ran before the middle reached T"
            n_old = len(old[h])
            assert middle[:n_old] == old[h], "old tokens are not the previous survivors"
            new = middle[n_old:]
            want = [old[h][i : i + s_hat][pick] for i in range(0, n_old, s_hat)]
            for a in range(0, len(new), s):
                seg = new[a : a + s]
                best = max(scores[h][j] for j in seg)
                want.append(next(j for j in seg if scores[h][j] == best))
            assert trace.kept[t][h].tolist() == cache[:sink] + want + cache[len(cache) - window :]
            old[h] = want


def independent_buzz_evictions(sink, window, stride, threshold, steps, prompt_len):
    """``(t, before, after)`` of every BUZZ eviction, from token counts only."""
    s_hat = (stride + 1) // 2
    out = []
    n_old = 0
    size = 0

    def rounds(t):
        nonlocal size, n_old
        while size - sink - window >= threshold:
            middle = size - sink - window
            kept = -(-n_old // s_hat) + -(-(middle - n_old) // stride)
            out.append((t, size, sink + kept + window))
            size, n_old = sink + kept + window, kept

    if prompt_len:
        size = prompt_len
        rounds(prompt_len - 1)
    for t in range(prompt_len, steps):
        size += 1
        rounds(t)
    return out


@given(buzz_policies(), st.integers(1, 200), st.data())
@example(BUZZ(sink=1, window=2, stride=3, threshold=4), 40, None)
def test_buzz_evicts_exactly_when_the_middle_reaches_the_threshold(policy, steps, data) -> None:
    prompt_len = 0 if data is None else data.draw(st.integers(0, steps))
    logits = np.zeros((steps, 1, steps))
    trace = replay(policy, logits, prompt_len)
    want = independent_buzz_evictions(
        policy.sink, policy.window, policy.stride, policy.threshold, steps, prompt_len
    )
    assert trace.evictions == want
    for t, before, after in trace.evictions:
        if t >= prompt_len:  # decode: the middle grows by one, so it is exactly T, and one
            # eviction brings it below T
            assert before - policy.sink - policy.window == policy.threshold
            assert after - policy.sink - policy.window < policy.threshold
    # prefill: the rule repeated until it holds
    if prompt_len:
        assert len(trace.kept[prompt_len - 1][0]) - policy.sink - policy.window < policy.threshold


@given(
    st.integers(3, 12),
    st.integers(1, 4),
    st.integers(3, 40),
    st.sampled_from(["first", "last"]),
)
def test_buzz_long_run_middle_matches_the_fixed_point(stride, sink, window, keep) -> None:
    """Post-eviction middle sizes a_n satisfy a_n = ceil(a/s_hat) + ceil((T-a)/s) with
    f(a) <= a_n < f(a) + 2 for f(a) = a/s_hat + (T-a)/s of slope lam; so, once the transient has
    died, a* <= a_n < a* + 2/(1-lam) where a* = T/ratio is f's fixed point."""
    threshold = max(3, round(threshold_ratio(stride) * window))
    policy = BUZZ(sink=sink, window=window, stride=stride, threshold=threshold, interval_keep=keep)
    s_hat = (stride + 1) // 2
    lam = 1 / s_hat - 1 / stride
    a_star = fixed_point_middle(stride, threshold)
    steps = sink + window + threshold + 42 * math.ceil(threshold - a_star)  # ~42 evictions
    sizes = simulate_sizes(policy, steps)
    # a decode step whose size dropped vs the previous one followed an eviction
    post = [int(sizes[i] - 1 - sink - window) for i in range(1, len(sizes)) if sizes[i] <= sizes[i - 1]]
    assert len(post) >= 40
    assert math.isclose(a_star, threshold / threshold_ratio(stride))
    for a in post[20:]:
        assert a_star - 1e-9 <= a < a_star + 2 / (1 - lam), (a, a_star)
    # and with the theorem's threshold the long-run middle is about the window
    assert abs(np.mean(post[20:]) - window) <= 2 / (1 - lam) + 0.5


def test_buzz_fixed_point_bound_can_fail() -> None:
    """The bound above rejects a policy that thins old tokens with s instead of s_hat."""

    class NoHalfStride(BUZZ):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.s_hat = self.stride

    stride, sink, window = 5, 1, 30
    threshold = round(threshold_ratio(stride) * window)
    sizes = simulate_sizes(NoHalfStride(sink, window, stride, threshold), 40 * threshold)
    post = [int(sizes[i] - 1 - sink - window) for i in range(1, len(sizes)) if sizes[i] <= sizes[i - 1]]
    a_star = fixed_point_middle(stride, threshold)
    lam = 1 / 3 - 1 / 5
    assert not all(a_star - 1e-9 <= a < a_star + 2 / (1 - lam) for a in post[20:])


def test_buzz_prefill_repeats_until_the_middle_fits() -> None:
    p = BUZZ(sink=1, window=2, stride=3, threshold=4)
    trace = replay(p, np.zeros((100, 1, 100)), prompt_len=100)
    # 97 middle -> 33 (new, stride 3) -> 17 -> 9 -> 5 -> 3 (old, s_hat 2)
    assert [after - 3 for _, _, after in trace.evictions] == [33, 17, 9, 5, 3]
    assert all(t == 99 for t, _, _ in trace.evictions)
    # zero logits: earlier prompt tokens have larger summed scores, so each segment keeps its
    # first token; then every other one: 1,4,..,97 -> 1,7,.. -> 1,13,.. -> 1,25,.. -> 1,49,97
    assert trace.kept[99].tolist() == [[0, 1, 49, 97, 98, 99]]


def test_log_n_changes_attention_in_replay() -> None:
    """Query t's softmax uses logits times max(log_base(t+1), floor)."""
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(12, 1, 12))
    values = rng.normal(size=(12, 1, 3))
    p = BUZZ(sink=1, window=20, stride=3, threshold=3, log_n=True, log_base=2.0, log_floor=0.0)
    trace = replay(p, logits, values=values)
    t = 9
    probs = softmax(logits[t, 0, : t + 1] * (math.log(t + 1) / math.log(2.0)))
    np.testing.assert_allclose(trace.outputs[t, 0], probs @ values[: t + 1, 0], rtol=1e-12)
    plain = replay(BUZZ(sink=1, window=20, stride=3, threshold=3), logits, values=values)
    assert not np.allclose(trace.outputs[t], plain.outputs[t])
    np.testing.assert_allclose(plain.outputs, plain.full_outputs, rtol=1e-12, atol=1e-12)
