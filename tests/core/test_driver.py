"""kvpolicy.driver: the one NumPy eviction loop, softmax and log-n scale (shared by the reference,
the planner, eval, perf and the kit)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpolicy import BUZZ, H2O, EvictionPolicy, StreamingLLM, simulate_sizes
from kvpolicy.driver import evict_until_done, log_n_scales, softmax


class KeepsEverything(EvictionPolicy):
    """Asks to evict and keeps every slot: a loop that trusted it would never end."""

    name = "keeps_everything"
    capacity = None

    def select(self, view):  # type: ignore[no-untyped-def]
        return np.broadcast_to(np.arange(view.n_cached), (view.batch, view.heads, view.n_cached)) if view.n_cached > 2 else None


def test_a_round_that_keeps_everything_is_refused() -> None:
    p = KeepsEverything()
    with pytest.raises(RuntimeError, match="asked to evict but kept 3 of 3 tokens"):
        evict_until_done(p, np.arange(3)[None, None], None, 3, p.init_state())


@given(n=st.integers(1, 60), size=st.integers(8, 30))
def test_rounds_and_sizes_match_the_planner(n: int, size: int) -> None:
    """Driving a policy token by token with the driver gives simulate_sizes' sizes, and every
    round shrinks the cache."""
    p = BUZZ.from_size(size)
    state, pos, sizes = p.init_state(), np.zeros((1, 1, 0), dtype=np.int64), []
    for t in range(n):
        pos = np.concatenate([pos, np.full((1, 1, 1), t)], axis=-1)
        sizes.append(pos.shape[-1])
        pos, _, rounds = evict_until_done(p, pos, None, t + 1, state)
        assert all(after < before for before, after in rounds)
    assert sizes == simulate_sizes(p, n).tolist()


def test_decide_replaces_evict_and_scores_follow_positions() -> None:
    p = H2O(heavy=1, recent=1)
    scores = np.asarray([[[0.5, 0.1, 0.9, 0.2]]])
    asked = []

    def decide(view):  # type: ignore[no-untyped-def]
        asked.append(view.n_cached)
        return p.evict(view)

    pos, kept, rounds = evict_until_done(p, np.arange(4)[None, None], scores, 4, p.init_state(), decide=decide)
    assert pos.tolist() == [[[2, 3]]] and kept.tolist() == [[[0.9, 0.2]]]
    assert asked == [4, 2] and rounds == [(4, 2)]


def test_softmax_and_scales() -> None:
    x = np.asarray([[1.0, 2.0, -np.inf]])
    assert np.allclose(softmax(x).sum(-1), 1.0) and softmax(x)[0, 2] == 0.0
    assert log_n_scales(StreamingLLM(sink=1, window=2), np.asarray([5])).tolist() == [1.0]
    logn = BUZZ.from_size(40, log_n=True)
    assert np.array_equal(log_n_scales(logn, np.asarray([3, 300])), np.asarray(logn.log_n.scales(np.asarray([3, 300])), dtype=np.float64))
