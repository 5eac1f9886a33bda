"""kvpolicy/testing/watch.py: what the kit watches around each select() call (issue 44, class 18): the
deadline per call (timed twice before failing), and state kept on the policy object or its class. The
check_policy-level cases are in test_hardening_kit.py."""

from __future__ import annotations

import time
from datetime import timedelta

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvpolicy_numpy
from kvpolicy import H2O, AdaKV, StreamingLLM
from kvpolicy.testing import ContractViolation
from kvpolicy.testing.watch import shared_state, watch, watched


class Appends(StreamingLLM):
    """StreamingLLM that records every n_seen it evicts at on the object."""

    name = "appends_test"
    decode_eviction = StreamingLLM.decode_eviction
    size_rule = StreamingLLM.size_rule

    def __init__(self, sink: int = 1, window: int = 2) -> None:
        super().__init__(sink=sink, window=window)
        self.seen: list[int] = []

    def select(self, view):
        keep = super().select(view)
        if keep is not None:
            self.seen.append(view.n_seen)
        return keep


PAUSED = [False]  # the test's switch (outside the policy: state on the policy or its class is refused)


class SlowOnce(StreamingLLM):
    """StreamingLLM whose first eviction pauses 0.2 s (a machine hiccup), the others not."""

    name = "slow_once_test"
    decode_eviction = StreamingLLM.decode_eviction
    size_rule = StreamingLLM.size_rule

    def select(self, view):
        keep = super().select(view)
        if keep is not None and not PAUSED[0]:
            PAUSED[0] = True
            time.sleep(0.2)
        return keep


def test_shared_state_sees_in_place_changes_and_nested_policies() -> None:
    policy = AdaKV(H2O(heavy=2, recent=1))
    before = shared_state(policy)
    assert before == shared_state(policy) and before["self.alpha_safeguard"] == 0.2
    policy.scorer.heavy = 3  # (what a wrapped scorer keeping state would do)
    assert shared_state(policy) != before


def test_state_on_the_object_is_named_and_the_original_is_left_alone() -> None:
    original = Appends()
    watched_policy = watch(original, deadline=None)
    assert watched_policy == original and "select" not in vars(original)
    with pytest.raises(ContractViolation, match=r"select\(\) changed self.seen \(from \[\] to \[4\]\) at n_seen=4"):
        kvpolicy_numpy.replay(watched_policy, np.zeros((8, 1, 8)))


def test_one_slow_call_is_timed_again_before_it_fails() -> None:
    """The deadline is per select() call and a call over it is timed again on the same view: one
    pause of the machine fails nothing."""
    PAUSED[0] = False
    trace = kvpolicy_numpy.replay(watch(SlowOnce(sink=1, window=2), timedelta(milliseconds=100)), np.zeros((8, 1, 8)))
    assert PAUSED[0] and trace.kept[7].tolist() == [[0, 6, 7]]


@given(st.data())
def test_watched_draws_watched_copies(data) -> None:
    policy = data.draw(watched(st.builds(H2O, st.integers(1, 3), st.integers(1, 3)), 200))
    assert "select" in vars(policy) and isinstance(policy, H2O)
