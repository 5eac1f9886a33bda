"""KeyDiff's refresh interval: the NumPy reference keeps what the literal rule keeps (scores from
the keys after a prompt and at every N-th decode step, held in between, the tokens appended since
``UNSCORED``), and the torch backend keeps what the reference keeps (the conformance kit). Its
every-step rule is held by tests/core/test_statistics.py (key_diff on every backend)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvpolicy_numpy
from kvpolicy import KeyDiff
from kvpolicy.statistics import UNSCORED, key_scores
from oracle import refresh_oracle


def literal_keep(policy: KeyDiff, keys: np.ndarray, prompt_len: int) -> list[list[list[int]]]:
    """Per step and head, the positions kept, written out loop by loop (one head at a time): the
    keys scored after the prompt and at every ``refresh``-th decode step, held in between, the
    tokens appended since ``UNSCORED`` (:func:`oracle.refresh_oracle`)."""
    steps, heads, _ = keys.shape

    def head_scores(h: int, held: list[int], t: int) -> list[float]:
        pos = np.array(held)
        return key_scores("key_diff", keys[pos, h][None], pos[None], t + 1, policy.recent)[0].tolist()

    # (from the prompt's last step on: the tests' prompts have two tokens or more)
    return refresh_oracle(policy, steps, heads, prompt_len, head_scores, lambda p: UNSCORED)[prompt_len - 1 :]  # type: ignore[return-value]


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(size=st.integers(2, 6), recent=st.integers(0, 1), refresh=st.integers(2, 4), heads=st.integers(1, 2),
       prompt=st.integers(2, 9), extra=st.integers(1, 14), seed=st.integers(0, 2**16))
def test_reference_with_a_refresh_interval_equals_the_literal_rule(size, recent, refresh, heads, prompt, extra, seed) -> None:
    policy = KeyDiff(size=size, recent=min(recent, size - 1), refresh=refresh)
    steps = prompt + extra
    keys = np.random.default_rng(seed).normal(size=(steps, heads, 4))
    result = kvpolicy_numpy.replay(policy, np.zeros((steps, heads, steps)), prompt, keys=keys)
    want = literal_keep(policy, keys, prompt)
    got = [[sorted(k[h].tolist()) for h in range(heads)] for k in result.kept[prompt - 1:]]
    assert got == [[sorted(h) for h in step] for step in want]


def test_a_refresh_interval_changes_what_is_kept() -> None:
    rng = np.random.default_rng(3)
    steps, keys = 40, rng.normal(size=(40, 1, 8))
    logits = np.zeros((steps, 1, steps))
    every = kvpolicy_numpy.replay(KeyDiff(size=6, refresh=1), logits, 10, keys=keys)
    sparse = kvpolicy_numpy.replay(KeyDiff(size=6, refresh=4), logits, 10, keys=keys)
    assert any(a.tolist() != b.tolist() for a, b in zip(every.kept[10:], sparse.kept[10:]))


def test_the_default_scores_every_64th_decode_step() -> None:
    """The default refresh interval is 64 (the paper's every-step rule is ``refresh=1``): on one
    sequence (random keys, 150 steps, size 16) the default keeps what ``refresh=64`` keeps, not
    what the every-step rule keeps."""
    assert KeyDiff(size=8).refresh == 64
    rng = np.random.default_rng(3)
    steps, keys = 150, rng.normal(size=(150, 1, 8))
    logits = np.zeros((steps, 1, steps))
    default = kvpolicy_numpy.replay(KeyDiff(size=16), logits, 20, keys=keys)
    same = kvpolicy_numpy.replay(KeyDiff(size=16, refresh=64), logits, 20, keys=keys)
    every = kvpolicy_numpy.replay(KeyDiff(size=16, refresh=1), logits, 20, keys=keys)
    assert all(a.tolist() == b.tolist() for a, b in zip(default.kept[19:], same.kept[19:]))
    assert any(a.tolist() != b.tolist() for a, b in zip(default.kept[19:], every.kept[19:]))


def test_the_kit_holds_torch_to_the_reference_with_a_refresh_interval() -> None:
    pytest.importorskip("torch")
    from kvpolicy.testing import check_policy

    quick = settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    report = check_policy(KeyDiff, {"size": st.integers(1, 6), "recent": st.just(0), "refresh": st.integers(1, 4)},
                          checks=["backends", "replay", "stateful"], torch=True, settings=quick)
    assert report.results["backends"] == "passed", report.results
