"""H2O (kvpolicy/policies/h2o.py): its parameters and its rule, heavy hitters plus a recent window."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpolicy import H2O
from kvpolicy.policy import CacheView
from kvpolicy_numpy import replay
from replay_scores import reconstruct_scores
from strategies import LOGIT_LEVELS, h2o_policies, logits_arrays


def test_h2o_selection() -> None:
    with pytest.raises(ValueError, match="selection must be one of 'per_head', 'shared'"):
        H2O(heavy=2, recent=2, selection="both")


# ---------------------------------------------------------------------------- one-token eviction by argmin (issue 7's fast path)
def _h2o_by_sort(policy: H2O, view: CacheView) -> np.ndarray:
    """H2O's keep array through the general (stable sort) path."""
    n = view.n_cached
    candidates = n - policy.recent
    order = np.argsort(view.scores[..., :candidates], axis=-1, kind="stable")
    heavy = np.sort(order[..., n - policy.heavy - policy.recent :], axis=-1)
    return np.concatenate([heavy, np.broadcast_to(np.arange(candidates, n), heavy.shape[:2] + (policy.recent,))], -1)


@given(st.integers(1, 8), st.integers(1, 6), st.integers(1, 3), st.integers(1, 3), st.integers(0, 2**31 - 1), st.booleans())
def test_h2o_argmin_path_equals_the_stable_sort(heavy, recent, batch, heads, seed, ties) -> None:
    rng = np.random.default_rng(seed)
    n = heavy + recent + 1  # a decode step: exactly one token to evict
    scores = rng.integers(0, 3, (batch, heads, n)).astype(float) if ties else rng.random((batch, heads, n))
    view = CacheView(np.broadcast_to(np.arange(n), (batch, heads, n)), scores, n)
    policy = H2O(heavy, recent)
    np.testing.assert_array_equal(np.asarray(policy.select(view)), _h2o_by_sort(policy, view))


def test_h2o_argmin_path_on_torch_matches_numpy() -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 2, (2, 3, 9)).astype(float)  # many ties
    pos = np.broadcast_to(np.arange(9), (2, 3, 9))
    policy = H2O(4, 4)
    a = policy.select(CacheView(pos, scores, 9))
    b = policy.select(CacheView(torch.as_tensor(pos.copy()), torch.as_tensor(scores), 9))
    np.testing.assert_array_equal(np.asarray(a), b.numpy())


# ---------------------------------------------------------------------------- H2O's rule: one decision and replays


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
