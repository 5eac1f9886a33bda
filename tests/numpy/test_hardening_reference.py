"""Issue 28, the NumPy reference (``kvpolicy_numpy.replay``) and the shared eviction loop
(``kvpolicy.driver``): what a policy returns is checked and a bad answer names the policy; the views
it sees are read-only; NaN that arises inside a replay follows the NaN rule and is reported."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvpolicy_numpy
from kvpolicy import BUZZ, H2O, KeyDiff, Knorm, PolicyError, StreamingLLM
from kvpolicy import simulate_sizes
from kvpolicy.driver import NonFiniteWarning, check_keep, evict_until_done
from misbehaving import CORRUPTIONS, Corrupting, WritesPositions, WritesScores


# ---------------------------------------------------------------------------- what select() returns
@pytest.mark.parametrize("how", sorted(CORRUPTIONS))
def test_the_reference_refuses_a_bad_keep_naming_the_policy(how: str) -> None:
    policy = Corrupting(how)
    with pytest.raises(PolicyError) as exc:
        kvpolicy_numpy.replay(policy, np.zeros((12, 2, 12)), prompt_len=0)
    msg = str(exc.value)
    assert repr(policy) in msg and CORRUPTIONS[how] in msg, msg


def test_slot_minus_one_no_longer_wraps_to_the_newest_token() -> None:
    with pytest.raises(PolicyError, match=r"slot -1 is outside \[0, 5\)"):
        kvpolicy_numpy.replay(Corrupting("negative"), np.zeros((8, 1, 8)))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    n=st.integers(2, 40),
    batch=st.integers(1, 2),
    heads=st.integers(1, 3),
    data=st.data(),
)
def test_check_keep_accepts_exactly_the_strictly_ascending_in_range_answers(n, batch, heads, data) -> None:
    """Property: check_keep passes an answer iff every row is strictly ascending, within
    ``[0, n)`` and shorter than ``n``; what it refuses names the row and head at fault."""
    k = data.draw(st.integers(0, n), label="k")
    keep = np.asarray(
        data.draw(st.lists(st.lists(st.lists(st.integers(-2, n + 1), min_size=k, max_size=k), min_size=heads,
                                    max_size=heads), min_size=batch, max_size=batch), label="keep"),
        dtype=np.int64,
    ).reshape(batch, heads, k)
    positions = np.broadcast_to(np.arange(n), (batch, heads, n))
    valid = k < n and (k == 0 or (keep.min() >= 0 and keep.max() < n and bool(np.all(np.diff(keep, axis=-1) > 0))))
    if valid:
        assert np.array_equal(check_keep(H2O(heavy=1, recent=1), keep, positions), keep)
    else:
        with pytest.raises(PolicyError, match=r"H2O\(heavy=1, recent=1\)"):
            check_keep(H2O(heavy=1, recent=1), keep, positions)


def test_the_planner_refuses_a_policy_that_stops_above_its_capacity() -> None:
    """simulate_sizes runs the same loop: no silent sizes for a policy that breaks its capacity."""
    with pytest.raises(PolicyError, match="more than its capacity 5"):
        simulate_sizes(Corrupting("over_capacity"), 20)


# ---------------------------------------------------------------------------- read-only views
@pytest.mark.parametrize("policy", [WritesScores(), WritesPositions(heavy=2, recent=2)], ids=["scores", "positions"])
def test_a_policy_that_writes_into_its_view_is_refused(policy) -> None:
    with pytest.raises(PolicyError, match=r"wrote into the view it was shown: view\.positions and view\.scores are read-only"):
        kvpolicy_numpy.replay(policy, np.random.default_rng(0).normal(size=(10, 2, 10)), prompt_len=3)
    # only the policy's view is read-only; the loop's own arrays are not frozen
    positions = np.arange(6)[None, None].copy()
    out, _, _ = evict_until_done(StreamingLLM(sink=1, window=2), positions, None, 6, {})
    assert positions.flags.writeable and out.flags.writeable
    positions[0, 0, 0] = 7  # still ours to change


# ---------------------------------------------------------------------------- NaN inside a replay
def _overflowing(steps: int = 14) -> np.ndarray:
    """Finite logits whose product with a log-n scale above 1 overflows float64."""
    logits = np.zeros((steps, 1, steps))
    logits[:, :, 5] = 1e308
    return logits


LOGN = BUZZ(sink=1, window=2, stride=3, threshold=3, log_n=True, log_base=2.0)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_overflow_under_log_n_is_reported_with_step_and_head(backend: str) -> None:
    if backend == "torch":
        replay = pytest.importorskip("kvpolicy_torch").replay
    else:
        replay = kvpolicy_numpy.replay
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trace = replay(LOGN, _overflowing(), prompt_len=0)
    ours = [w for w in caught if issubclass(w.category, NonFiniteWarning)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    assert "at step 5 (head 0)" in str(ours[0].message) and "log-n" in str(ours[0].message)
    assert trace.nonfinite and trace.nonfinite[0] == (5, 0)
    assert all(step >= 5 for step, _ in trace.nonfinite)


def test_overflow_follows_the_nan_rule_on_both_backends() -> None:
    """The NaN scores rank lowest (CacheView.ranking_scores) on both backends alike."""
    kvpolicy_torch = pytest.importorskip("kvpolicy_torch")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = kvpolicy_numpy.replay(LOGN, _overflowing(), prompt_len=0)
        b = kvpolicy_torch.replay(LOGN, _overflowing(), prompt_len=0)
    assert a.nonfinite == b.nonfinite
    for x, y in zip(a.kept, b.kept):
        assert (x is None and y is None) or np.array_equal(x, y)


def test_ordinary_input_reports_nothing() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", NonFiniteWarning)
        trace = kvpolicy_numpy.replay(LOGN, np.random.default_rng(1).normal(size=(14, 2, 14)), prompt_len=4)
    assert trace.nonfinite == []


@pytest.mark.parametrize("policy", [Knorm(size=4), KeyDiff(size=4)], ids=repr)
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_keys_of_a_key_scored_policy_are_refused(policy, bad) -> None:
    """Knorm and KeyDiff score tokens from their keys: a NaN or infinite key would decide by the NaN
    rule without a word, so both replays refuse it naming the step and head (other policies ignore
    keys)."""
    import kvpolicy_torch

    keys = np.random.default_rng(0).normal(size=(12, 2, 4))
    keys[7, 1, 2] = bad
    logits = np.zeros((12, 2, 12))
    for replay in (kvpolicy_numpy.replay, kvpolicy_torch.replay):
        with pytest.raises(ValueError, match=r"keys must be finite for .*keys\[7, 1, 2\] is .* \(step 7, head 1\)"):
            replay(policy, logits, keys=keys)
    kvpolicy_numpy.replay(H2O(2, 2), logits, keys=keys)  # ignored by a policy that does not read them
