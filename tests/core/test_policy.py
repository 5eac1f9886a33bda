"""kvpolicy/policy.py: the invariants every policy keeps on replays, ``CacheView`` (its broadcast keep
arrays and the NaN rule of ``ranking_scores``), log n scaling and shared selection. The BUZZ and H2O
rules are in tests/core/policies/test_buzz.py and test_h2o.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from kvpolicy import BUZZ, H2O, TOVA, CacheView, FullCache, LocalWindow, LogNScaling, StreamingLLM, simulate_sizes
from kvpolicy.testing import example_inputs
from kvpolicy_numpy import replay
from strategies import any_policy, logits_arrays, replay_cases, selections


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
# ============================================================================ BUZZ, on replays
# ============================================================================ H2O
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
