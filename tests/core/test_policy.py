"""Policy invariants and the BUZZ / H2O rules, checked on replays and on single decisions."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from kvpolicy import (
    BUZZ,
    H2O,
    CacheView,
    FullCache,
    LocalWindow,
    LogNScaling,
    TOVA,
    StreamingLLM,
    fixed_point_middle,
    simulate_sizes,
    threshold_ratio,
)
from kvpolicy.testing import example_inputs
from kvpolicy_numpy import replay, softmax
from strategies import (
    LOGIT_LEVELS,
    any_policy,
    buzz_policies,
    h2o_policies,
    logits_arrays,
    replay_cases,
    selections,
)


# ============================================================================ helpers
def protected(policy) -> tuple[int, int]:
    """``(sink, window)`` a policy must always keep (0 when it has none)."""
    if isinstance(policy, (BUZZ, StreamingLLM)):
        return policy.sink, policy.window
    if isinstance(policy, (H2O, TOVA)):
        return 0, policy.recent
    if isinstance(policy, LocalWindow):
        return 0, policy.window
    return 0, 0


def first_index(prompt_len: int) -> int:
    """First step with a kept array."""
    return max(prompt_len - 1, 0)


def reconstruct_scores(trace, logits: np.ndarray, policy, t: int) -> list[dict[int, float]]:
    """Accumulated score of every token in the pre-eviction cache of decode step ``t``, per head,
    recomputed from the trace alone: at each decode step ``u`` query ``u`` attended to
    ``kept[u-1] + [u]``. With shared selection, one entry: the sum over heads, as the policy
    sees it. (Prompt-free traces only; the same float operations as the replay, so ties are
    exact ties.)"""
    assert trace.prompt_len == 0
    heads = logits.shape[1]
    scores: list[dict[int, float]] = [dict() for _ in range(heads)]
    for u in range(t + 1):
        n_keys = 1 if u == 0 else trace.kept[u - 1].shape[-1] + 1  # log n: n = keys attended
        scale = np.float64(1.0) if policy.log_n is None else policy.log_n.scales(np.asarray([n_keys]))[0]
        for h in range(heads):
            attended = ([] if u == 0 else trace.kept[u - 1][h].tolist()) + [u]
            probs = softmax(logits[u, h, attended] * scale)
            scores[h] = {j: scores[h].get(j, 0.0) + float(pr) for j, pr in zip(attended, probs)}
    if policy.selection == "shared":
        summed = dict(scores[0])
        for h in range(1, heads):
            summed = {j: summed[j] + scores[h][j] for j in summed}
        return [summed] * heads
    return scores


# ============================================================================ every policy
@given(replay_cases())
@example((BUZZ(sink=1, window=1, stride=3, threshold=3), np.zeros((30, 1, 30)), 30))
@example((H2O(heavy=1, recent=1), np.zeros((5, 2, 5)), 0))
def test_invariants_every_policy(case) -> None:
    policy, logits, prompt_len = case
    steps, heads, _ = logits.shape
    trace = replay(policy, logits, prompt_len, **example_inputs(policy, logits))  # keys (values, queries): Knorm, KeyDiff, Expected Attention
    cap = policy.capacity
    sink, window = protected(policy)

    assert len(trace.kept) == steps
    assert all(k is None for k in trace.kept[: first_index(prompt_len)])
    assert len(trace.sizes) == steps - prompt_len
    if cap is not None:
        assert np.all(trace.sizes <= cap), f"attended more than capacity {cap}: {trace.sizes.max()}"
    previous: np.ndarray | None = None
    for t in range(first_index(prompt_len), steps):
        kept = trace.kept[t]
        assert kept.dtype.kind == "i" and kept.ndim == 2 and kept.shape[0] == heads
        if cap is not None:
            # after an eviction there is room for the next token: strictly below capacity
            assert kept.shape[1] < cap
        for h in range(heads):
            row = kept[h].tolist()
            assert row == sorted(set(row)), f"step {t} head {h}: not sorted and unique: {row}"
            # (the newest token is kept when the policy protects a window; TOVA with recent=0 may
            # evict it, as its paper does)
            assert 0 <= row[0] and row[-1] <= t, f"step {t}: positions out of [0, {t}]"
            assert set(range(min(sink, t + 1))) <= set(row), f"step {t}: sink lost: {row}"
            assert set(range(max(0, t - window + 1), t + 1)) <= set(row), f"step {t}: window lost: {row}"
            if previous is not None:
                assert set(row) <= set(previous[h].tolist()) | {t}, "an evicted token came back"
        if policy.selection == "shared":
            assert (kept == kept[0:1]).all(), "shared selection kept different tokens per head"
        previous = kept
    # the sizes the budget planner simulates are the replay's sizes, whatever the scores
    assert trace.sizes.tolist() == simulate_sizes(policy, steps, prompt_len).tolist()


@given(logits_arrays(), st.data())
def test_full_cache_keeps_everything(logits, data) -> None:
    steps = logits.shape[0]
    prompt_len = data.draw(st.integers(0, steps))
    trace = replay(FullCache(), logits, prompt_len)
    for t in range(first_index(prompt_len), steps):
        assert trace.kept[t].tolist() == [list(range(t + 1))] * logits.shape[1]
    assert trace.evictions == []
    assert trace.sizes.tolist() == list(range(prompt_len + 1, steps + 1))


@given(any_policy(), st.data())
def test_policy_whose_capacity_covers_the_sequence_equals_full_cache(policy, data) -> None:
    """Up to ``capacity`` tokens nothing is ever evicted before attention: the sizes and
    attention outputs equal the full cache's; below ``capacity`` the kept tokens do too."""
    cap = policy.capacity
    steps = data.draw(st.integers(1, cap if cap is not None else 40))
    logits = data.draw(logits_arrays(steps=steps))
    heads = logits.shape[1]
    prompt_len = data.draw(st.integers(0, steps))
    values = np.random.default_rng(0).normal(size=(steps, heads, 4))
    trace = replay(policy, logits, prompt_len, **{**example_inputs(policy, logits), "values": values})
    full = replay(FullCache(), logits, prompt_len, values=values)
    assert trace.sizes.tolist() == full.sizes.tolist()
    if policy.log_n is None:
        np.testing.assert_array_equal(trace.outputs, full.outputs)
        np.testing.assert_allclose(trace.outputs, trace.full_outputs, rtol=1e-12, atol=1e-12)
    last = steps - 1 if cap is None or steps < cap else steps - 2  # the step reaching cap may evict
    for t in range(first_index(prompt_len), last + 1):
        assert trace.kept[t].tolist() == full.kept[t].tolist()
    if cap is None or steps < cap:
        assert trace.evictions == []


def test_capacity_is_reached_then_evicted() -> None:
    """The converse: one token more than ``capacity - 1`` triggers the first eviction."""
    for policy in [
        BUZZ(sink=2, window=3, stride=3, threshold=5),
        H2O(heavy=3, recent=2),
        StreamingLLM(sink=2, window=3),
        LocalWindow(window=4),
    ]:
        cap = policy.capacity
        trace = replay(policy, np.zeros((cap, 1, cap)))
        assert trace.evictions and trace.evictions[0][0] == cap - 1, policy
        assert trace.evictions[0][1] == cap, policy


@pytest.mark.parametrize(
    "policy, kept",
    [
        (StreamingLLM(sink=2, window=3), [0, 1, 7, 8, 9]),
        (LocalWindow(window=3), [7, 8, 9]),
        (FullCache(), list(range(10))),
    ],
)
def test_score_free_policies_keep_fixed_positions(policy, kept) -> None:
    logits = np.random.default_rng(1).normal(size=(10, 2, 10))
    trace = replay(policy, logits)
    assert trace.kept[9].tolist() == [kept, kept]


# ============================================================================ BUZZ, one decision
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


# ============================================================================ BUZZ, on replays
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


# ============================================================================ H2O
@st.composite
def h2o_views(draw):
    policy = draw(h2o_policies())
    n = draw(st.integers(policy.heavy + policy.recent + 1, policy.heavy + policy.recent + 12))
    heads = draw(st.integers(1, 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    levels = np.asarray(draw(st.sampled_from([(0.0, 1.0), LOGIT_LEVELS])))
    scores = rng.choice(levels, size=(1, heads, n))
    return policy, CacheView(np.arange(n)[None, None, :].repeat(heads, 1), scores, n)


@given(h2o_views())
def test_h2o_evicts_the_lowest_scores_outside_recent(case) -> None:
    policy, view = case
    n = view.n_cached
    keep = policy.select(view)
    for h in range(view.heads):
        row = keep[0, h].tolist()
        assert len(row) == policy.heavy + policy.recent
        evicted = sorted(set(range(n)) - set(row))
        candidates = list(range(n - policy.recent))
        # one at a time: lowest score, earliest position among equals
        order = sorted(candidates, key=lambda i: (view.scores[0, h, i], i))
        assert evicted == sorted(order[: len(evicted)])


@given(h2o_policies(), logits_arrays(min_steps=5, max_steps=40))
def test_h2o_replay_evicts_lowest_score_each_step(policy, logits) -> None:
    trace = replay(policy, logits, 0)
    steps, heads, _ = logits.shape
    for t, before, after in trace.evictions:
        assert before == after + 1 == policy.heavy + policy.recent + 1
        scores = reconstruct_scores(trace, logits, policy, t)
        for h in range(heads):
            cache = (trace.kept[t - 1][h].tolist() if t else []) + [t]
            (victim,) = set(cache) - set(trace.kept[t][h].tolist())
            outside = cache[: len(cache) - policy.recent]
            low = min(scores[h][j] for j in outside)
            assert victim == next(j for j in outside if scores[h][j] == low)


# ============================================================================ log n
@pytest.mark.parametrize("base", [2.0, 8.0, 512.0])
@pytest.mark.parametrize("floor", [0.0, 0.5, 1.0])
def test_log_n_scale(base, floor) -> None:
    s = LogNScaling(base, floor)
    for n in [1, 2, 3, 7, 8, 100, 511, 512, 513, 4096]:
        assert math.isclose(s.scale(n), max(math.log(n) / math.log(base), floor), rel_tol=1e-12)
        assert math.isclose(float(s.scales(np.asarray([n]))[0]), s.scale(n), rel_tol=1e-12)
    assert math.isclose(s.scale(int(base)), 1.0)  # n = base: ordinary attention
    if floor == 0.0 and base > 2:
        assert s.scale(2) < 1.0  # the literal formula softens attention below the base


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


@given(selections)
def test_shared_selection_sums_scores_over_heads(selection) -> None:
    """Two heads that disagree: shared follows the summed scores, per-head each its own."""
    view = CacheView(
        np.arange(6)[None, None, :].repeat(2, 1),
        np.asarray([[[0, 5, 1, 0, 0, 0], [0, 0, 6, 0, 0, 0]]], dtype=np.float64),
        6,
        {"n_old": 0},
    )
    p = BUZZ(sink=1, window=1, stride=4, threshold=3, selection=selection)
    keep = p.evict(view)
    if selection == "shared":
        assert keep[0].tolist() == [[0, 2, 5], [0, 2, 5]]  # slot 2: 1 + 6 > slot 1: 5 + 0
    else:
        assert keep[0].tolist() == [[0, 1, 5], [0, 2, 5]]
    assert view.state["n_old"] == 1


# ---------------------------------------------------------------------------- the NaN rule of the policies
# What reaches a policy's ``select`` anyway (a hand-built view, an overflow upstream): a NaN
# score counts as -inf (CacheView.ranking_scores). Tested on NumPy and torch views, which must agree.
SPECIAL = [np.nan, -np.inf, np.inf, 0.0, 0.25, 0.5, 1.0]


def _decide(policy, scores: np.ndarray, state: dict, backend: str) -> np.ndarray | None:
    b, h, n = scores.shape
    positions = np.broadcast_to(np.arange(n, dtype=np.int64), (b, h, n)).copy()
    if backend == "torch":
        torch = pytest.importorskip("torch")
        view = CacheView(torch.as_tensor(positions), torch.as_tensor(scores, dtype=torch.float32), n, dict(state))
    else:
        view = CacheView(positions, scores.copy(), n, dict(state))
    keep = policy.evict(view)
    return None if keep is None else np.asarray(keep.cpu() if backend == "torch" else keep)


@st.composite
def _views(draw, cases):
    policy, n, state = draw(cases)
    batch, heads = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    values = draw(st.lists(st.sampled_from(SPECIAL), min_size=batch * heads * n, max_size=batch * heads * n))
    return policy, np.asarray(values, dtype=np.float64).reshape(batch, heads, n), state


@st.composite
def _h2o_cases(draw):
    heavy, recent = draw(st.integers(1, 5)), draw(st.integers(1, 3))
    n = heavy + recent + draw(st.integers(1, 4))  # one surplus token: the argmin path; more: the sort
    selection = draw(st.sampled_from(["per_head", "shared"]))
    return H2O(heavy=heavy, recent=recent, selection=selection), n, {}


@st.composite
def _buzz_cases(draw):
    stride, sink, window = draw(st.integers(3, 5)), draw(st.integers(1, 2)), draw(st.integers(1, 2))
    threshold = draw(st.integers(3, 12))
    n_old = draw(st.integers(0, threshold - 1))
    selection = draw(st.sampled_from(["per_head", "shared"]))
    policy = BUZZ(sink=sink, window=window, stride=stride, threshold=threshold, selection=selection)
    return policy, sink + window + threshold, {"n_old": n_old}


# shared selection sums +inf and -inf of two heads to NaN (numpy says so); the rule then applies
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("cases", [_h2o_cases(), _buzz_cases()], ids=["h2o", "buzz"])
@given(data=st.data())
def test_nan_counts_as_minus_inf_on_both_backends(cases, data) -> None:
    pytest.importorskip("torch")
    policy, scores, state = data.draw(_views(cases))
    as_minus_inf = np.where(np.isnan(scores), -np.inf, scores)
    numpy_keep = _decide(policy, scores, state, "numpy")
    assert numpy_keep is not None
    np.testing.assert_array_equal(numpy_keep, _decide(policy, scores, state, "torch"))
    np.testing.assert_array_equal(numpy_keep, _decide(policy, as_minus_inf, state, "numpy"))


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_h2o_evicts_a_nan_score_first(backend) -> None:
    h2o = H2O(heavy=3, recent=1)
    # one surplus token (argmin path) and two (sort path): NaN goes before the lowest finite score
    for scores, kept in [
        ([0.1, np.nan, 0.0, 0.3, 9.0], [0, 2, 3, 4]),
        ([0.1, np.nan, 0.0, np.nan, 0.3, 9.0], [0, 2, 4, 5]),
        # NaN and -inf are equal: the earliest goes first
        ([0.5, -np.inf, 0.2, np.nan, 9.0], [0, 2, 3, 4]),
        ([0.5, np.nan, 0.2, -np.inf, 9.0], [0, 2, 3, 4]),
        # +inf is the highest score
        ([np.inf, 0.0, 0.2, 0.1, 9.0], [0, 2, 3, 4]),
    ]:
        keep = _decide(h2o, np.asarray([[scores]]), {}, backend)
        assert keep[0, 0].tolist() == kept, scores


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_buzz_nan_never_wins_a_segment_unless_all_are_nan(backend) -> None:
    buzz = BUZZ(sink=1, window=1, stride=3, threshold=6)  # the middle is slots 1..6: two new segments
    scores = [0.0, np.nan, 0.1, 0.0, np.nan, np.nan, np.nan, 0.0]
    keep = _decide(buzz, np.asarray([[scores]]), {"n_old": 0}, backend)
    # segment [1, 2, 3]: 0.1 at slot 2 beats NaN; segment [4, 5, 6] is all NaN: the earliest wins
    assert keep[0, 0].tolist() == [0, 2, 4, 7]


def test_ranking_scores_leave_finite_and_infinite_scores_alone() -> None:
    scores = np.asarray([[[np.nan, -np.inf, np.inf, 0.5]]])
    view = CacheView(np.arange(4)[None, None], scores, 4)
    assert view.ranking_scores.tolist() == [[[-np.inf, -np.inf, np.inf, 0.5]]]
    assert np.isnan(view.scores[0, 0, 0])  # the view itself is not modified
    assert FullCache().evict(view) is None


# ---------------------------------------------------------------------------- CacheView.keep's broadcast keep arrays

def test_keep_of_shared_slots_is_a_broadcast_view() -> None:
    view = CacheView(np.zeros((2, 3, 10), dtype=np.int64), np.zeros((2, 3, 10)), 10)
    keep = view.keep(view.arange(2), view.arange(6, 10))
    assert keep.shape == (2, 3, 6) and keep.strides[:2] == (0, 0)
    assert keep.tolist() == [[[0, 1, 6, 7, 8, 9]] * 3] * 2
