"""Issue 28, the conformance kit (``kvpolicy.testing``): the views a policy sees are read-only, so
the kit fails a policy that writes into ``view.scores`` or ``view.positions`` (on NumPy the write
raises; torch has no read-only tensors, so the kit compares the kept tokens before and after)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import Phase, settings
from hypothesis import strategies as st

from kvpolicy import H2O, StreamingLLM
from kvpolicy.testing import ContractViolation, check_policy, check_replay, compare_backends
from misbehaving import Corrupting, WritesPositions, WritesScores

FIXED = settings(max_examples=10, derandomize=True, database=None, deadline=None)


def logits(steps: int = 10, heads: int = 2, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(steps, heads, steps))


@pytest.mark.parametrize("policy", [WritesScores(), WritesPositions(heavy=2, recent=2)], ids=["scores", "positions"])
def test_check_replay_fails_a_policy_that_writes_into_its_view(policy) -> None:
    with pytest.raises(ContractViolation, match="wrote into the view it was shown"):
        check_replay(policy, logits(), prompt_len=3)


def test_compare_backends_fails_a_policy_that_writes_on_torch_only() -> None:
    """The write doubles every score, so what the policy keeps is unchanged and NumPy and torch
    agree on every step: only the before/after comparison of the kept tokens sees it."""
    pytest.importorskip("torch")
    compare_backends(H2O(heavy=2, recent=2), logits(24), prompt_len=5)  # an honest eviction only moves tokens
    with pytest.raises(ContractViolation, match="wrote into the view it was shown on the torch backend"):
        compare_backends(WritesScores(torch_only=True), logits(), prompt_len=3)


def test_check_policy_fails_a_score_writer() -> None:
    with pytest.raises(ContractViolation, match="wrote into the view"):
        check_policy(WritesScores, {"heavy": st.integers(1, 3), "recent": st.integers(1, 3)},
                     checks=["replay"], torch=False, settings=FIXED)


def test_check_policy_fails_a_torch_only_score_writer() -> None:
    pytest.importorskip("torch")
    with pytest.raises(ContractViolation, match="on the torch backend"):
        check_policy(lambda heavy, recent: WritesScores(heavy, recent, torch_only=True),
                     {"heavy": st.integers(1, 3), "recent": st.integers(1, 3)},
                     checks=["backends"], torch=True, settings=FIXED)


def test_the_kit_message_for_a_bad_keep_names_the_policy_and_slot() -> None:
    with pytest.raises(ContractViolation, match=r"Corrupting\(how='negative'"):
        check_replay(Corrupting("negative"), logits(), prompt_len=0)


def test_params_the_constructor_always_refuses_are_named_not_unsatisfiable() -> None:
    """Every drawn parameter set refused by the constructor: a ValueError saying nothing was checked
    and what to draw, not hypothesis' Unsatisfiable."""
    with pytest.raises(ValueError, match=r"no example for the 'replay' check.*constructor refused.*the last: H2O\(heavy=-3[^)]*\): heavy must be"):
        check_policy(H2O, {"heavy": st.just(-3), "recent": st.just(2)}, torch=False, settings=FIXED)


def test_an_invariant_that_is_not_callable() -> None:
    with pytest.raises(TypeError, match="invariants must be callables invariant\\(policy, kept, t\\).*got 42"):
        check_policy(H2O, {"heavy": st.just(2), "recent": st.just(2)}, invariants=[42], torch=False, settings=FIXED)


@pytest.mark.parametrize("bound", ["max_steps", "max_heads", "stateful_steps"])
def test_a_bound_below_one(bound: str) -> None:
    with pytest.raises(ValueError, match=rf"{bound} must be >= 1, got 0"):
        check_policy(H2O, {"heavy": st.just(2), "recent": st.just(2)}, torch=False, settings=FIXED, **{bound: 0})


# ---------------------------------------------------------------------------- issue 44, class 18
class SlowSelect(StreamingLLM):
    """StreamingLLM whose every eviction takes 0.3 s (a sleep standing in for a slow decision)."""

    name = "slow_select_test"
    decode_eviction = StreamingLLM.decode_eviction
    size_rule = StreamingLLM.size_rule

    def select(self, view):
        keep = super().select(view)
        if keep is not None:
            time.sleep(0.3)
        return keep


class ClassCounter(StreamingLLM):
    """StreamingLLM that counts its evictions on its class and, every third, keeps one token fewer."""

    name = "class_counter_test"
    decode_eviction = None
    calls = 0

    def size_rule(self):
        return None

    def select(self, view):
        keep = super().select(view)
        if keep is not None:
            type(self).calls += 1
            if type(self).calls % 3 == 0 and keep.shape[-1] > 1:
                return view.keep(keep[0, 0, 1:])
        return keep


class RuleOffByOne(StreamingLLM):
    """StreamingLLM whose declared size rule keeps one token fewer than its select once full."""

    name = "rule_off_by_one_test"
    decode_eviction = StreamingLLM.decode_eviction

    def size_rule(self):
        rule = super().size_rule()
        return lambda n, state: rule(n, state) - (1 if n >= self.capacity else 0)


UNSHRUNK = settings(FIXED, phases=[Phase.explicit, Phase.generate])
ONE = {"sink": st.just(1), "window": st.just(2)}


def test_the_kit_enforces_its_deadline_per_select_call() -> None:
    """A select() sleeping 0.3 s passed although the settings given had a deadline (hypothesis's
    200 ms): the kit dropped it for its long examples. It now bounds each select() call by it."""
    with pytest.raises(ContractViolation, match=r"select\(\) took \d+ ms, and \d+ ms again on the same view .* over the "
                                                r"deadline of 200 ms per select\(\) call \(settings.deadline"):
        check_policy(SlowSelect, ONE, checks=["replay"], torch=False, settings=settings(UNSHRUNK, max_examples=10, deadline=200))
    fast = settings(UNSHRUNK, max_examples=3, deadline=200)
    assert check_policy(StreamingLLM, ONE, checks=["replay"], torch=False, settings=fast).passed == ["replay"]


def test_state_kept_on_the_class_is_named() -> None:
    """It failed with hypothesis's FlakyFailure (or a message blaming uses_scores): the kit now names
    the attribute select() changed."""
    with pytest.raises(ContractViolation, match=r"select\(\) changed ClassCounter.calls \(from \d+ to \d+\) .* Keep per-sequence "
                                                r"state in view.state"):
        check_policy(ClassCounter, ONE, torch=False, settings=FIXED)


def test_a_size_rule_that_disagrees_with_select_is_named() -> None:
    """It failed with "the cache sizes depend on the score values": the rule, not the scores, is wrong."""
    with pytest.raises(ContractViolation, match=r"size_rule disagrees with its select: the rule says the decode step of token "
                                                r"\d+ .* attends \d+ tokens, but select left \d+"):
        check_policy(RuleOffByOne, ONE, torch=False, settings=UNSHRUNK)
    with pytest.raises(ContractViolation, match="size_rule disagrees with its select"):
        check_replay(RuleOffByOne(sink=1, window=2), logits(10), prompt_len=0)
