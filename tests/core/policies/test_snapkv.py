"""SnapKV (a prefill policy) on every backend: the NumPy reference against the literal oracle and
the torch replay, the observation window's prompt scores (``prompt_rows``,
``received_attention(rows=)``), the pooling, and the documented worked example."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given

import kvpolicy_numpy
from kvpolicy import SnapKV, get_policy, plan_policy, simulate_sizes
from kvpolicy.policies.snapkv import max_pool
from kvpolicy.policy import CacheView
from oracle import oracle
from strategies import replay_cases, snapkv_policies

torch = pytest.importorskip("torch")

import kvpolicy_torch  # noqa: E402


def _kept(trace) -> list:
    return [None if k is None else k.tolist() for k in trace.kept]


@given(replay_cases(snapkv_policies()))
@example((SnapKV(size=4, window=2, kernel=3), np.zeros((14, 2, 14)), 10))
def test_snapkv_torch_replay_equals_reference(case) -> None:
    """Differential: LayerCache keeps what the NumPy reference keeps, every step."""
    policy, logits, prompt_len = case
    ref = kvpolicy_numpy.replay(policy, logits, prompt_len)
    got = kvpolicy_torch.replay(policy, logits, prompt_len)
    assert _kept(ref) == _kept(got)
    assert ref.evictions == got.evictions


@pytest.mark.parametrize("n,kernel", [(1, 1), (1, 5), (2, 3), (5, 3), (9, 5), (9, 7), (4, 9)])
def test_max_pool_is_torch_max_pool1d(n, kernel) -> None:
    s = np.random.default_rng(n * kernel).normal(size=(2, 3, n))
    got = max_pool(CacheView(np.zeros((2, 3, n), dtype=np.int64), s, n), s, kernel)
    want = torch.nn.functional.max_pool1d(torch.from_numpy(s).reshape(6, 1, n), kernel, 1, kernel // 2).reshape(2, 3, n)
    np.testing.assert_array_equal(got, want.numpy())
    t = torch.from_numpy(s)
    np.testing.assert_array_equal(max_pool(CacheView(torch.zeros(2, 3, n, dtype=torch.int64), t, n), t, kernel).numpy(), got)


class _AllRows(SnapKV):
    """SnapKV scoring the prompt with every row (H2O's prompt scores): the window is ignored."""

    @property
    def prompt_rows(self):
        return None


class _NoPooling(SnapKV):
    """SnapKV ranking the raw scores (the pooling forgotten)."""

    decode_size_rule = SnapKV.decode_size_rule  # (it still evicts a prompt only)

    def select(self, view):
        kernel, self.kernel = self.kernel, 1
        try:
            return super().select(view)
        finally:
            self.kernel = kernel


@pytest.mark.parametrize("mutant", [_AllRows, _NoPooling])
def test_oracle_catches_mutants(mutant) -> None:
    logits = np.random.default_rng(3).normal(size=(30, 2, 30)) * 3
    policy = SnapKV(size=8, window=3, kernel=5)
    want = oracle(policy, logits, 24).kept
    assert _kept(kvpolicy_numpy.replay(policy, logits, 24)) == want
    assert _kept(kvpolicy_numpy.replay(mutant(size=8, window=3, kernel=5), logits, 24)) != want


def test_window_rows_score_the_prompt() -> None:
    """received_attention(rows=k) equals the sum of the chunk's last k rows' probabilities
    (causal within the chunk, after cached keys), GQA-summed."""
    g = torch.Generator().manual_seed(1)
    b, kv, r, q, cached, d, k = 1, 2, 2, 6, 3, 8, 4
    n = cached + q
    query = torch.randn(b, kv * r, q, d, generator=g, dtype=torch.float64)
    keys = torch.randn(b, kv, n, d, generator=g, dtype=torch.float64)
    got = kvpolicy_torch.received_attention(query, keys, d**-0.5, rows=k)
    logits = torch.einsum("bhqd,bhnd->bhqn", query, keys.repeat_interleave(r, dim=1)) * d**-0.5
    visible = torch.arange(n)[None, :] <= (cached + torch.arange(q))[:, None]
    probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
    want = probs[:, :, q - k :].sum(dim=2).view(b, kv, r, n).sum(dim=2)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(kvpolicy_torch.received_attention(query, keys, d**-0.5, rows=q + 5),
                               kvpolicy_torch.received_attention(query, keys, d**-0.5))


def test_snapkv_keeps_what_the_window_attends_to() -> None:
    """Prompt of 12, window 2: the window's queries attend to tokens 3 and 8; every earlier row
    attends to token 1. Max pooling (kernel 3) gives 2, 3, 4 the pooled score of 3 and 7, 8, 9 that of
    8; four are kept: 3 (its own score breaks the tie), then 2 and 4, then 8; token 1, which
    H2O-style summed scores would keep, goes."""
    logits = np.zeros((14, 1, 14))
    logits[:10, 0, 1] = 6.0
    logits[10:, 0, 3] = 6.0
    logits[10:, 0, 8] = 5.0
    trace = kvpolicy_numpy.replay(SnapKV(size=6, window=2, kernel=3, pooling="max"), logits, 12)
    assert trace.kept[11][0].tolist() == [2, 3, 4, 8, 10, 11]
    assert trace.kept[13][0].tolist() == [2, 3, 4, 8, 10, 11, 12, 13]  # decode never evicts
    assert _kept(trace) == oracle(SnapKV(size=6, window=2, kernel=3, pooling="max"), logits, 12).kept


def test_snapkv_registry_and_budget() -> None:
    assert get_policy("snapkv") is SnapKV
    assert SnapKV.from_size(64) == SnapKV(size=64, window=32)
    assert SnapKV.from_size(10) == SnapKV(size=10, window=5)
    assert simulate_sizes(SnapKV(size=3, window=1), 6, prompt_length=4).tolist() == [4, 5]
    plan = plan_policy("snapkv", 0.5, context_length=1024, prompt_length=896)
    assert abs(plan.realised_budget - 0.5) < 0.01


@pytest.mark.parametrize(
    "bad", [dict(size=2, window=2), dict(size=5, window=0), dict(size=5, window=2, kernel=4), dict(size=5, window=2, kernel=0)]
)
def test_snapkv_refuses_bad_parameters(bad) -> None:
    with pytest.raises(ValueError, match="size|window|kernel"):
        SnapKV(**bad)


def test_doc_worked_example() -> None:
    """docs/policies.md's SnapKV example, recomputed: the scores are the window rows' (rounded),
    the pooled scores are max_pool1d's, the kept column is the reference's (and the oracle's),
    and the sentences' caches are the replays'."""
    from kvpolicy import H2O
    from kvpolicy_numpy import softmax
    from worked_examples import DOC, floats, ints, setup, table

    text = DOC.read_text(encoding="utf-8")
    ns = setup(text, "snapkv-setup")
    policy, logits = ns["policy"], ns["logits"]
    assert policy == SnapKV(size=6, window=2, kernel=3, pooling="max") and logits.shape == (14, 1, 14)
    prompt = 12
    assert f"replay(policy, logits, prompt_len={prompt})" in text
    rows = table(text, "snapkv-prefill")
    prefix = prompt - policy.window
    assert [ints(r[0])[0] for r in rows] == list(range(prefix))
    causal = np.tril(np.ones((prompt, prompt), dtype=bool))
    probs = softmax(np.where(causal, logits[:prompt, 0, :prompt], -np.inf))
    own = probs[prompt - policy.window :].sum(axis=0)[:prefix]
    pooled = torch.nn.functional.max_pool1d(torch.from_numpy(own)[None, None], 3, 1, 1)[0, 0].numpy()
    np.testing.assert_allclose([floats(r[1])[0] for r in rows], own, atol=0.005)
    np.testing.assert_allclose([floats(r[2])[0] for r in rows], pooled, atol=0.005)
    trace = kvpolicy_numpy.replay(policy, logits, prompt)
    kept = trace.kept[prompt - 1][0].tolist()
    assert [r[3] == "yes" for r in rows] == [j in kept for j in range(prefix)]
    assert kept == oracle(policy, logits, prompt).kept[prompt - 1][0]
    assert "cache holds `" + " ".join(map(str, kept)) + "`" in text
    assert trace.kept[13][0].tolist() == kept + [12, 13] and "add `12 13`" in text
    h2o = kvpolicy_numpy.replay(H2O(heavy=4, recent=2), logits, prompt).kept[prompt - 1][0].tolist()
    assert "`H2O(heavy=4, recent=2)` on the same prompt keeps `" + " ".join(map(str, h2o)) + "`" in text
    avg = SnapKV(size=6, window=2, kernel=3)  # the default pooling
    kept_avg = kvpolicy_numpy.replay(avg, logits, prompt).kept[prompt - 1][0].tolist()
    assert kept_avg == oracle(avg, logits, prompt).kept[prompt - 1][0]
    assert "average pooling (the default) keeps `" + " ".join(map(str, kept_avg)) + "`" in text


def test_average_pooling_ties_by_the_rule_on_both_backends() -> None:
    """A 3-token prefix under a 5-wide kernel: every window holds the same three scores, which
    summed in different orders (centre first) parted by an ulp, and NumPy and torch, whose softmax
    rows round differently, kept different tokens (hypothesis found it in tests/torch/test_headwise.py).
    Added in ascending order they tie exactly, and the tie rule (the higher own score) decides alike."""
    rng = np.random.default_rng(374)
    logits = rng.normal(size=(12, 1, 12))
    policy = SnapKV(size=3, window=2, kernel=5)
    want = kvpolicy_numpy.replay(policy, logits, 5)
    got = kvpolicy_torch.replay(policy, logits, 5)
    assert [None if k is None else k.tolist() for k in want.kept] == [None if k is None else k.tolist() for k in got.kept]
    assert want.kept[4].tolist() == oracle(policy, logits, 5).kept[4]


@pytest.mark.parametrize("prompt,window", [(25, 6), (20, 1), (33, 6), (40, 3)])
def test_equal_prompt_scores_tie_by_the_rule_on_both_backends(prompt, window) -> None:
    """Constant logits give every key before the observation window the same prompt score in
    exact arithmetic. torch's sum over the window's rows added the columns from the 17th on in
    another order, parted the tie by an ulp and kept token 16 where the reference kept token 0
    (hypothesis found it: SnapKV(size=7, window=6, kernel=1, pooling='avg'), 25 constant steps).
    Both replays add the rows one at a time in order, so the tie rule (the earliest) decides."""
    logits = np.full((prompt + 3, 1, prompt + 3), -2.0)
    policy = SnapKV(size=window + 4, window=window, kernel=1, pooling="avg")
    want = kvpolicy_numpy.replay(policy, logits, prompt)
    got = kvpolicy_torch.replay(policy, logits, prompt)
    assert _kept(want) == _kept(got)
    assert want.kept[prompt - 1][0].tolist() == [0, 1, 2, 3, *range(prompt - window, prompt)]
