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


@pytest.mark.parametrize("policy", [Knorm(size=4), KeyDiff(size=4, refresh=1)], ids=repr)
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


# ---------------------------------------------------------------------------- issue 44: the edges
@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("group", [1, 2])
def test_non_finite_queries_of_expected_attention_are_refused(bad, group) -> None:
    """Class 3: a NaN query made every Expected Attention score NaN, so the policy silently dropped
    the oldest; both replays now refuse it by name, as they refuse a NaN key."""
    import kvpolicy_torch
    from kvpolicy import ExpectedAttention

    rng = np.random.default_rng(0)
    steps, heads, d = 12, 2, 4
    keys, values = rng.normal(size=(steps, heads, d)), rng.normal(size=(steps, heads, d))
    queries = rng.normal(size=(steps, heads, group, d))
    queries[7, 1, group - 1, 2] = bad
    where = r"queries\[7, 1, 2\]" if group == 1 else r"queries\[7, 1, 1, 2\]"
    policy = ExpectedAttention(size=4, sink=1)
    for replay in (kvpolicy_numpy.replay, kvpolicy_torch.replay):
        with pytest.raises(ValueError, match=rf"queries must be finite for ExpectedAttention\(.*{where} is .* \(step 7, head 1\)"):
            replay(policy, np.zeros((steps, heads, steps)), 3, values=values, keys=keys,
                   queries=queries[:, :, 0] if group == 1 else queries)
    kvpolicy_numpy.replay(H2O(2, 2), np.zeros((steps, heads, steps)), queries=queries)  # ignored by a policy that reads none


@pytest.mark.parametrize("prompt_len", [0, 6])
@pytest.mark.parametrize("value", [1e308, -1e308])
def test_the_reference_reports_overflow_as_torch_does(prompt_len, value) -> None:
    """Class 14: huge finite logits under log n: the reference said it with NumPy's anonymous
    "overflow encountered in multiply" warnings next to (or, for an overflow to -inf, without) its
    NonFiniteWarning; now it warns exactly what the torch backend warns."""
    kvpolicy_torch = pytest.importorskip("kvpolicy_torch")
    logits = np.zeros((10, 1, 10))
    logits[:, :, 3] = value
    said = {}
    for name, replay in (("numpy", kvpolicy_numpy.replay), ("torch", kvpolicy_torch.replay)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trace = replay(LOGN, logits, prompt_len=prompt_len, values=np.ones((10, 1, 2)))
        said[name] = ([(w.category, str(w.message)) for w in caught], trace.nonfinite)
        if trace.nonfinite:  # NaN outputs are always said by name
            assert np.isnan(np.asarray(trace.outputs)).any()
    assert said["numpy"] == said["torch"]
    assert all(category is NonFiniteWarning for category, _ in said["numpy"][0])


class _NoRoom(StreamingLLM):
    """StreamingLLM whose select keeps one token too many: ``capacity`` tokens, no room for the next."""

    name = "no_room_test"
    decode_eviction = None

    def size_rule(self):  # noqa: F811 - no rule: the planner replays select
        return None

    def select(self, view):
        n = view.n_cached
        if n <= self.capacity:
            return None
        return view.keep(view.arange(self.sink), view.arange(n - self.capacity + self.sink, n))


@pytest.mark.parametrize("prompt_len", [0, 9])
def test_a_select_that_leaves_no_room_for_the_next_token_is_refused_on_both_backends(prompt_len) -> None:
    """Class 15: the reference accepted a select that keeps ``capacity`` tokens (the next decode
    step then attends ``capacity + 1``) while torch raised; both now raise the same PolicyError."""
    kvpolicy_torch = pytest.importorskip("kvpolicy_torch")
    policy = _NoRoom(sink=1, window=2)
    messages = []
    for replay in (kvpolicy_numpy.replay, kvpolicy_torch.replay):
        with pytest.raises(PolicyError, match=r"_NoRoom\(sink=1, window=2\) stopped evicting with 4 tokens cached, "
                                              r"more than its capacity 4 allows between steps \(3: the next token must fit\)") as e:
            replay(policy, np.zeros((12, 2, 12)), prompt_len=prompt_len)
        messages.append(str(e.value))
    assert messages[0] == messages[1]
    with pytest.raises(PolicyError, match="more than its capacity 4 allows"):
        simulate_sizes(policy, 12)


@pytest.mark.parametrize(("rope", "error", "message"), [
    ("rope", TypeError, r"rope must be a kvpolicy.statistics.Rotary"),
    (dict(inv_freq=np.ones(5)), ValueError, r"rope rotates 10 dimensions .* more than the head_dim 8 .* rotary_dim <= 8"),
    (dict(inv_freq=np.ones((2, 2))), ValueError, r"rope.inv_freq must have shape \[rotary_dim / 2\] .* got \(2, 2\)"),
    (dict(inv_freq=np.ones(0)), ValueError, r"rope.inv_freq must have shape \[rotary_dim / 2\] .* got \(0,\)"),
    (dict(inv_freq=np.ones(3), rotary_dim=4), ValueError, r"rope.rotary_dim must be 2 \* len\(inv_freq\) = 6 .* got 4"),
    (dict(inv_freq=np.array([1.0, np.nan])), ValueError, r"rope.inv_freq must be finite: rope.inv_freq\[1\] is nan"),
    (dict(inv_freq=np.ones(2), style="x"), ValueError, r"rope.style must be one of 'half', 'interleaved'"),
], ids=["type", "too_wide", "2d", "empty", "rotary_dim", "nan", "style"])
def test_a_rope_that_cannot_rotate_the_keys_is_refused_by_name(rope, error, message) -> None:
    """Class 11: a RoPE of the wrong shape or rotary dimension gave raw NumPy (or torch)
    broadcasting errors from inside Expected Attention's scores; both replays now name the field."""
    import kvpolicy_torch
    from kvpolicy import ExpectedAttention
    from kvpolicy.statistics import Rotary

    rng = np.random.default_rng(0)
    keys, values, queries = (rng.normal(size=(10, 2, 8)) for _ in range(3))
    rope = Rotary(**rope) if isinstance(rope, dict) else rope
    for replay in (kvpolicy_numpy.replay, kvpolicy_torch.replay):
        with pytest.raises(error, match=message):
            replay(ExpectedAttention(size=4, sink=1), np.zeros((10, 2, 10)), 3, values=values, keys=keys, queries=queries, rope=rope)
    trace = kvpolicy_numpy.replay(ExpectedAttention(size=4, sink=1), np.zeros((10, 2, 10)), 3, values=values, keys=keys,
                                  queries=queries, rope=Rotary(np.ones(3)))  # partial rotary: 6 of 8 dimensions
    assert trace.kept[-1].shape == (2, 4)


def test_non_finite_values_of_a_cache_score_are_refused() -> None:
    """Issue 44's re-probe: a NaN value given to Expected Attention (whose score multiplies by the
    value norm) was accepted, and its token silently scored as a zero value; both replays refuse it."""
    import kvpolicy_numpy
    from kvpolicy import ExpectedAttention

    r = np.random.default_rng(0)
    logits, keys, values, queries = (r.normal(size=s) for s in ((12, 2, 12), (12, 2, 4), (12, 2, 4), (12, 2, 4)))
    values[10, 1, :] = np.nan
    with pytest.raises(ValueError, match=r"values must be finite for ExpectedAttention.*values\[10, 1, 0\] is nan"):
        kvpolicy_numpy.replay(ExpectedAttention(size=5, sink=1, future=8), logits, 0, values=values, keys=keys, queries=queries)
