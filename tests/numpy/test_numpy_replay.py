"""kvpolicy_numpy/replay.py, the reference: the vectorised policies (through kvpolicy_numpy.replay) equal
the literal oracle, every step, every head, with a random prompt length, per-head and shared selection;
and the inputs a replay refuses (held on both replays, NumPy and torch)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from kvpolicy import BUZZ, H2O, TOVA, FullCache, LocalWindow, SnapKV
from kvpolicy.testing.strategies import make_logits
from kvpolicy_numpy import replay
from oracle import oracle
from strategies import (
    buzz_policies,
    h2o_policies,
    local_policies,
    replay_cases,
    snapkv_policies,
    streaming_policies,
    tova_policies,
)


def assert_same_as_oracle(policy, logits, prompt_len) -> None:
    values = np.random.default_rng(logits.shape[0]).normal(size=(logits.shape[0], logits.shape[1], 2))
    trace = replay(policy, logits, prompt_len, values=values)
    ref = oracle(policy, logits, prompt_len, values=values)
    steps = logits.shape[0]
    for t in range(steps):
        got, want = trace.kept[t], ref.kept[t]
        if want is None:
            assert got is None, f"step {t}: replay kept {got} before the prompt ended"
            continue
        assert got is not None, f"step {t}: replay kept nothing"
        assert got.tolist() == want, f"{policy!r}, prompt_len={prompt_len}, step {t}"
    assert trace.sizes.tolist() == ref.sizes
    assert trace.evictions == ref.evictions
    # attention outputs: the softmax over the kept keys, with the log-n scale
    np.testing.assert_allclose(trace.outputs, np.asarray(ref.outputs), rtol=1e-9, atol=1e-12)


def _sink_logits(steps: int, heads: int) -> np.ndarray:
    """Position 0 takes all the attention: every other score is exactly 0 (ties everywhere)."""
    logits = np.zeros((steps, heads, steps))
    logits[:, :, 0] = 1.0e4
    return logits


@given(replay_cases(buzz_policies()))
@example((BUZZ(sink=1, window=2, stride=3, threshold=4), np.zeros((20, 2, 20)), 0))
@example((BUZZ(sink=1, window=2, stride=3, threshold=4, selection="shared"), np.zeros((20, 2, 20)), 13))
@example((BUZZ(sink=2, window=1, stride=4, threshold=7), _sink_logits(40, 2), 0))
@example((BUZZ(sink=1, window=1, stride=3, threshold=5, log_n=True, log_base=2.0, log_floor=0.0), np.random.default_rng(0).normal(size=(30, 1, 30)), 4))
def test_buzz_matches_oracle(case) -> None:
    assert_same_as_oracle(*case)


@given(replay_cases(h2o_policies()))
@example((H2O(heavy=2, recent=2), np.zeros((12, 1, 12)), 9))
# the reference gathered these logits Fortran-ordered and NumPy's sum rounded 1/3 one ulp lower
# there than in C order: a tie the oracle breaks to the earliest token became a different victim
@example((H2O(heavy=5, recent=2, selection="shared"), make_logits(22, 2, kind="extremes", seed=176804035), 0))
@example((H2O(heavy=3, recent=2), _sink_logits(20, 2), 0))
@example((H2O(heavy=3, recent=2), _sink_logits(20, 2), 12))
def test_h2o_matches_oracle(case) -> None:
    assert_same_as_oracle(*case)


@given(replay_cases(tova_policies()))
@example((TOVA(size=2), np.zeros((12, 1, 12)), 9))
@example((TOVA(size=3, recent=1), _sink_logits(20, 2), 0))
@example((TOVA(size=3, selection="shared"), _sink_logits(20, 2), 12))
def test_tova_matches_oracle(case) -> None:
    assert_same_as_oracle(*case)


@given(replay_cases(snapkv_policies()))
@example((SnapKV(size=3, window=1, kernel=3), np.zeros((12, 1, 12)), 9))
@example((SnapKV(size=4, window=2, kernel=5), _sink_logits(20, 2), 15))
@example((SnapKV(size=4, window=2, kernel=1, selection="shared"), np.random.default_rng(2).normal(size=(16, 2, 16)), 12))
def test_snapkv_matches_oracle(case) -> None:
    assert_same_as_oracle(*case)


@given(replay_cases(st.one_of(streaming_policies(), local_policies(), st.just(FullCache()))))
def test_score_free_policies_match_oracle(case) -> None:
    assert_same_as_oracle(*case)


@given(replay_cases(buzz_policies(max_window=3, max_threshold=8), min_steps=40, max_steps=90, max_heads=2))
def test_buzz_matches_oracle_long_runs(case) -> None:
    """Longer runs: many evictions, so old tokens go through several interval samplings."""
    assert_same_as_oracle(*case)


# ---------------------------------------------------------------------- the oracle is not vacuous
class _Argmin(BUZZ):
    """BUZZ keeping each segment's *lowest* score (a plausible sign bug)."""

    size_rule = None  # its own select: no inherited rule

    def select(self, view):
        return super().select(type(view)(view.positions, -view.scores, view.n_seen, view.state, view.phase))


class _LastOfTies(BUZZ):
    """BUZZ breaking argmax ties toward the latest position of a segment."""

    size_rule = None  # its own select: no inherited rule

    def select(self, view):
        eps = 1e-9 * view.arange(view.n_cached)  # later slots win ties, no other ordering changes
        return super().select(type(view)(view.positions, view.scores + eps, view.n_seen, view.state, view.phase))


class _NoIntervalSampling(BUZZ):
    """BUZZ that thins old tokens with the big stride instead of s_hat."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.s_hat = self.stride


@pytest.mark.parametrize("mutant", [_Argmin, _LastOfTies, _NoIntervalSampling])
def test_equivalence_check_catches_mutants(mutant) -> None:
    """assert_same_as_oracle fails for a policy that deviates from the documented rule."""
    # Position 0 takes all the attention: every other score is exactly 0, so segments tie.
    logits = np.zeros((40, 2, 40))
    logits[:, :, 0] = 1.0e4
    logits[:, 1, 5::7] = 1.0e4 + 1.0  # head 1: some heavy hitters, so argmin differs from argmax
    policy = mutant(sink=1, window=2, stride=3, threshold=6)
    assert policy.name == "buzz"  # the oracle reads it as plain BUZZ
    with pytest.raises(AssertionError):
        assert_same_as_oracle(policy, logits, 0)


# ---------------------------------------------------------------------------- validation: bad input raises a ValueError naming the parameter


@pytest.mark.parametrize(
    "shape",
    [(5, 5), (5, 1, 4), (4, 1, 5), (0, 1, 0), (5,), (2, 5, 1, 5)],
)
def test_logits_of_the_wrong_shape(shape) -> None:
    with pytest.raises(ValueError, match=r"logits must have shape \[steps, heads, steps\]"):
        replay(BUZZ(sink=1, window=2, stride=3, threshold=3), np.zeros(shape))


def _same_kept(a, b, first: int) -> bool:
    return all(x is not None and y is not None and np.array_equal(x, y) for x, y in zip(a.kept[first:], b.kept[first:]))


@given(replay_cases(st.one_of(buzz_policies(), h2o_policies(), tova_policies(), snapkv_policies(), streaming_policies())),
       st.integers(1, 40))
def test_prompt_chunks_of_one_token_are_decode_steps_and_one_chunk_is_the_prompt(case, extra) -> None:
    """prompt_chunk: a chunk of one token is a decode step (the whole prompt in chunks of one
    replays like no prompt at all), and a chunk at least as long as the prompt is the prompt."""
    policy, logits, prompt_len = case
    steps = logits.shape[0]
    one_shot = replay(policy, logits, prompt_len)
    assert _same_kept(replay(policy, logits, prompt_len, prompt_chunk=prompt_len + extra - 1 if prompt_len else extra), one_shot,
                      max(prompt_len - 1, 0))
    by_token = replay(policy, logits, prompt_len, prompt_chunk=1)
    decode = replay(policy, logits, 0)
    assert _same_kept(by_token, decode, 0)
    assert by_token.evictions == decode.evictions and steps == len(by_token.kept)


def test_prompt_chunks_score_what_each_chunk_sees() -> None:
    """A chunked prompt, by hand: H2O(heavy=1, recent=1) (2 tokens) with prompt chunks of 2. The
    first chunk keeps both tokens (token 0: 1.5, token 1: 0.5); the second chunk's rows see them
    and, causally, their own, and give token 1 nearly 2 more: it is the heavy hitter."""
    logits = np.full((4, 1, 4), -30.0)
    logits[:2, 0, 0] = logits[1, 0, 1] = 0.0  # row 0 on token 0, row 1 halved between tokens 0 and 1
    logits[2:, 0, 1] = 5.0  # the second chunk's rows on token 1
    trace = replay(H2O(heavy=1, recent=1), logits, prompt_len=4, prompt_chunk=2)
    assert trace.kept[1].tolist() == [[0, 1]]  # nothing to evict after the first chunk
    assert trace.kept[3].tolist() == [[1, 3]]
    with pytest.raises(ValueError, match="prompt_chunk must be >= 1"):
        replay(H2O(heavy=1, recent=1), logits, prompt_len=4, prompt_chunk=0)


def test_prompt_len_out_of_range() -> None:
    with pytest.raises(ValueError, match="prompt_len must be >= 0 and <= 5, got 6"):
        replay(LocalWindow(2), np.zeros((5, 1, 5)), prompt_len=6)
    with pytest.raises(ValueError, match="prompt_len must be >= 0"):
        replay(LocalWindow(2), np.zeros((5, 1, 5)), prompt_len=-1)


def test_values_of_the_wrong_shape() -> None:
    with pytest.raises(ValueError, match=r"values must have shape \[steps, heads, d\]"):
        replay(LocalWindow(2), np.zeros((5, 2, 5)), values=np.zeros((5, 1, 3)))


def test_output_error_needs_values() -> None:
    with pytest.raises(ValueError, match="values were not given"):
        replay(LocalWindow(2), np.zeros((5, 1, 5))).output_error()


def _replays():
    """Both replay backends (torch when installed): they must refuse the same inputs."""
    out = [pytest.param(replay, id="numpy")]
    try:
        import kvpolicy_torch

        out.append(pytest.param(kvpolicy_torch.replay, id="torch"))
    except ImportError:  # pragma: no cover - torch is a test dependency
        pass
    return out


REPLAYS = _replays()


@pytest.mark.parametrize("run", REPLAYS)
@pytest.mark.parametrize("bad", ["buzz", BUZZ, None, 3])
def test_replay_needs_a_policy_instance(run, bad) -> None:
    with pytest.raises(ValueError, match=r"^policy must be an EvictionPolicy instance .*, got") as info:
        run(bad, np.zeros((4, 1, 4)))
    if bad == "buzz":
        assert "kvpolicy.create_policy('buzz', ...)" in str(info.value)
    if bad is BUZZ:
        assert "instantiate the class first, e.g. BUZZ(...)" in str(info.value)


def _torch_or_numpy(kind: str, x: np.ndarray):
    if kind == "torch-tensor":
        torch = pytest.importorskip("torch")
        return torch.as_tensor(x)
    return x


@pytest.mark.parametrize("run", REPLAYS)
@pytest.mark.parametrize("kind", ["ndarray", "torch-tensor"])
def test_complex_logits_and_values(run, kind) -> None:
    logits = np.zeros((4, 1, 4), dtype=np.complex128)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # refused before numpy's ComplexWarning could be issued
        with pytest.raises(ValueError, match=r"^logits must be real numbers, got a complex array"):
            run(BUZZ(), _torch_or_numpy(kind, logits))
        with pytest.raises(ValueError, match=r"^values must be real numbers, got a complex array"):
            run(BUZZ(), np.zeros((4, 1, 4)), values=_torch_or_numpy(kind, np.zeros((4, 1, 2), dtype=np.complex64)))


@pytest.mark.parametrize("run", REPLAYS)
def test_non_numeric_logits(run) -> None:
    with pytest.raises(ValueError, match=r"^logits must be a real numeric array, got dtype"):
        run(BUZZ(), np.full((2, 1, 2), "x"))


@pytest.mark.parametrize("run", REPLAYS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("prompt_len", [0, 5])
@pytest.mark.parametrize("where", [(0, 0, 0), (3, 1, 2), (7, 2, 7), (4, 0, 1)])
def test_non_finite_logits_raise_with_step_and_head(run, bad, prompt_len, where) -> None:
    """The reference never lets a NaN or infinite logit decide: it names the step and head."""
    t, h, j = where
    logits = np.random.default_rng(0).normal(size=(8, 3, 8))
    logits[t, h, j] = bad
    if t < 7:
        logits[7, 0, 6] = bad  # a later one: the first (in step order) is reported
    with pytest.raises(ValueError, match=rf"logits must be finite .* logits\[{t}, {h}, {j}\] is {bad} \(step {t}, head {h}\)$"):
        run(H2O(heavy=2, recent=2), logits, prompt_len=prompt_len)


@pytest.mark.parametrize("run", REPLAYS)
def test_logits_above_the_diagonal_are_never_read(run) -> None:
    """Only ``j <= t`` is read, so padding above the diagonal may be anything."""
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(10, 2, 10))
    padded = logits.copy()
    upper = np.triu(np.ones((10, 10), dtype=bool), k=1)[:, None, :].repeat(2, axis=1)
    padded[upper] = np.nan
    policy = BUZZ(sink=1, window=2, stride=3, threshold=3)
    a, b = run(policy, logits, prompt_len=3), run(policy, padded, prompt_len=3)
    assert all((x is None and y is None) or np.array_equal(x, y) for x, y in zip(a.kept, b.kept))
