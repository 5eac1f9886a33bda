"""The vectorised policies (through kvpolicy_numpy.replay) equal the literal oracle, every step,
every head, with a random prompt length, per-head and shared selection."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from kvpolicy import BUZZ, H2O, TOVA, FullCache, SnapKV
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
