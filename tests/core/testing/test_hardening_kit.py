"""Issue 28, the conformance kit (``kvpolicy.testing``): the views a policy sees are read-only, so
the kit fails a policy that writes into ``view.scores`` or ``view.positions`` (on NumPy the write
raises; torch has no read-only tensors, so the kit compares the kept tokens before and after)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st

from kvpolicy import H2O
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
    with pytest.raises(ValueError, match=r"no example for the 'replay' check.*constructor refused.*the last: H2O\(.*heavy=-3\): heavy must be"):
        check_policy(H2O, {"heavy": st.just(-3), "recent": st.just(2)}, torch=False, settings=FIXED)


def test_an_invariant_that_is_not_callable() -> None:
    with pytest.raises(TypeError, match="invariants must be callables invariant\\(policy, kept, t\\).*got 42"):
        check_policy(H2O, {"heavy": st.just(2), "recent": st.just(2)}, invariants=[42], torch=False, settings=FIXED)


@pytest.mark.parametrize("bound", ["max_steps", "max_heads", "stateful_steps"])
def test_a_bound_below_one(bound: str) -> None:
    with pytest.raises(ValueError, match=rf"{bound} must be >= 1, got 0"):
        check_policy(H2O, {"heavy": st.just(2), "recent": st.just(2)}, torch=False, settings=FIXED, **{bound: 0})
