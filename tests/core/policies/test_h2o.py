"""H2O (kvpolicy/policies/h2o.py): its parameters and its rule, heavy hitters plus a recent window."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpolicy import H2O
from kvpolicy.policy import CacheView


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
