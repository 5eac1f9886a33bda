"""TOVA and the score-statistic hook (``score_statistic = "latest"``) on every backend: the NumPy
reference against the literal oracle and against the torch replay, the torch prompt scoring
(``received_attention(statistic="latest")``), ``LayerCache.accumulate`` replacing scores while
holes keep ``+inf``, and the transformers cache against the reference."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given

import kvpolicy_numpy
from kvpolicy import H2O, TOVA, get_policy, make_policy, plan_policy, simulate_sizes
from kvpolicy.testing import make_logits
from oracle import oracle
from strategies import replay_cases, tova_policies

torch = pytest.importorskip("torch")

import kvpolicy_torch  # noqa: E402


def _assert_same_kept(a, b) -> None:
    for t, (x, y) in enumerate(zip(a.kept, b.kept)):
        assert (x is None) == (y is None), t
        if x is not None:
            np.testing.assert_array_equal(x, y, err_msg=f"step {t}")


def _latest_scores(policy: TOVA, logits: np.ndarray, t: int, candidates: np.ndarray) -> dict[int, np.ndarray]:
    """TOVA's score of each candidate position at step ``t``, per head: query ``t``'s attention
    probabilities over the candidates (``[heads, n]`` positions), summed over the heads for a
    shared selection. Returned as ``{head: scores in candidates' order}``."""
    probs = [kvpolicy_numpy.softmax(logits[t, h, candidates[h]]) for h in range(logits.shape[1])]
    if policy.selection == "shared":
        summed = np.sum(probs, axis=0)
        return {h: summed for h in range(logits.shape[1])}
    return dict(enumerate(probs))


def _assert_same_kept_up_to_near_ties(policy: TOVA, logits: np.ndarray, prompt_len: int, ref, got,
                                      rtol: float = 1e-9) -> None:
    """The torch replay keeps what the reference keeps, step by step, except where the two part
    at a *near-tie*: two candidates whose scores agree to ``rtol`` (relative), which float64
    cannot order the same way under two summation orders (e.g. ``e^-30/Z1`` against
    ``e^-30/Z2 + e^-60/Z1``: relative 1e-26 apart). From such a step on the histories differ
    legitimately and comparing stops; a divergence between candidates that float64 *can* tell
    apart still fails."""
    previous = None
    for t, (x, y) in enumerate(zip(ref.kept, got.kept)):
        assert (x is None) == (y is None), t
        if x is None:
            continue
        if not np.array_equal(x, y):
            if previous is None:  # the prompt's selection: every prompt token a candidate
                candidates = np.broadcast_to(np.arange(t + 1), (logits.shape[1], t + 1))
            else:
                candidates = np.array([np.append(p[p >= 0], t) for p in previous])
            scores = _latest_scores(policy, logits, t, candidates)
            for h in range(x.shape[0]):
                parted = sorted(set(x[h].tolist()) ^ set(y[h].tolist()))
                if not parted:
                    continue
                by_position = dict(zip(candidates[h].tolist(), scores[h].tolist()))
                values = np.array([by_position[p] for p in parted])
                assert values.max() - values.min() <= rtol * values.max(), (
                    f"step {t}, head {h}: reference kept {x[h].tolist()}, torch {y[h].tolist()}; the "
                    f"parted candidates {parted} score {values.tolist()}: not a near-tie"
                )
            return
        previous = x


@given(replay_cases(tova_policies()))
@example((TOVA(size=3), np.zeros((14, 2, 14)), 6))
# a float64 near-tie at step 26 (two heads' probabilities e^-30/Z apart by ~e^-90): the backends
# may order it either way; the comparison accepts either, and only there
@example((TOVA(size=4, recent=0, selection="shared"), make_logits(44, 3, kind="extremes", seed=2), 0))
def test_tova_torch_replay_equals_reference(case) -> None:
    """Differential: LayerCache (slot layout, the O(1) `lowest` eviction, score replacement)
    keeps what the NumPy reference keeps, step by step."""
    policy, logits, prompt_len = case
    ref = kvpolicy_numpy.replay(policy, logits, prompt_len)
    got = kvpolicy_torch.replay(policy, logits, prompt_len)
    _assert_same_kept_up_to_near_ties(policy, logits, prompt_len, ref, got)
    assert ref.evictions == got.evictions


def test_near_tie_comparison_still_catches_a_real_divergence() -> None:
    """Negative control for the comparison above: a TOVA that ranks accumulated scores parts from
    the reference at a step whose candidates float64 orders plainly, and the comparison fails;
    the reference against itself passes."""
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(30, 2, 30)) * 3
    policy = TOVA(size=4)
    ref = kvpolicy_numpy.replay(policy, logits, 5)
    _assert_same_kept_up_to_near_ties(policy, logits, 5, ref, ref)
    bad = kvpolicy_numpy.replay(_Accumulating(size=4), logits, 5)
    with pytest.raises(AssertionError, match="not a near-tie"):
        _assert_same_kept_up_to_near_ties(policy, logits, 5, ref, bad)


def test_tova_is_the_latest_query_not_the_sum() -> None:
    """Token 1 gets all of query 1's attention, none afterwards: H2O keeps it (its sum stays 1),
    TOVA drops it as soon as the current query ignores it. The oracle agrees."""
    steps = 8
    logits = np.zeros((steps, 1, steps))
    logits[1, 0, 1] = 50.0  # query 1 attends to key 1 only
    for t in range(2, steps):
        logits[t, 0, 1] = -50.0  # later queries ignore key 1
    tova = kvpolicy_numpy.replay(TOVA(size=3), logits)
    h2o = kvpolicy_numpy.replay(H2O(heavy=2, recent=1), logits)
    assert 1 not in tova.kept[-1][0].tolist()
    assert 1 in h2o.kept[-1][0].tolist()
    assert [k.tolist() for k in tova.kept] == oracle(TOVA(size=3), logits).kept


class _Accumulating(TOVA):
    """TOVA ranking accumulated scores (H2O's statistic): the plausible bug the hook prevents."""

    score_statistic = "accumulate"


def test_oracle_catches_an_accumulating_tova() -> None:
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(30, 2, 30)) * 3
    good = kvpolicy_numpy.replay(TOVA(size=4), logits, 5)
    bad = kvpolicy_numpy.replay(_Accumulating(size=4), logits, 5)
    want = oracle(TOVA(size=4), logits, 5).kept
    assert [None if k is None else k.tolist() for k in good.kept] == want
    assert [None if k is None else k.tolist() for k in bad.kept] != want


def test_prompt_scores_are_the_last_row() -> None:
    """received_attention(rows=1) is the last query row's probabilities, summed per
    KV head (GQA), with a slot mask and a pad row, and equals scoring that row alone."""
    g = torch.Generator().manual_seed(0)
    b, kv, r, q, n, d = 2, 2, 3, 5, 9, 8
    query = torch.randn(b, kv * r, q, d, generator=g, dtype=torch.float64)
    keys = torch.randn(b, kv, n, d, generator=g, dtype=torch.float64)
    mask = torch.ones(b, 1, q, n, dtype=torch.bool)
    mask[1, :, :, 2] = False  # a hole in row 1
    valid = torch.ones(b, q, dtype=torch.bool)
    valid[1, 0] = False  # a pad query in row 1
    got = kvpolicy_torch.received_attention(query, keys, d**-0.5, mask=mask, query_valid=valid, rows=1)
    logits = torch.einsum("bhd,bhnd->bhn", query[:, :, -1], keys.repeat_interleave(r, dim=1)) * d**-0.5
    logits = logits.masked_fill(~mask[:, :, -1], float("-inf"))
    want = torch.softmax(logits, dim=-1).view(b, kv, r, n).sum(dim=2)
    torch.testing.assert_close(got, want)
    assert float(got[1, :, 2].abs().max()) == 0.0
    summed = kvpolicy_torch.received_attention(query, keys, d**-0.5, mask=mask, query_valid=valid)
    assert not torch.allclose(summed, got)
    with pytest.raises(ValueError, match="rows"):
        kvpolicy_torch.received_attention(query, keys, d**-0.5, rows=0)


def test_layer_cache_replaces_scores_and_keeps_holes() -> None:
    """With score_statistic="latest" accumulate() replaces every kept token's score; a hole
    (position -1) keeps +inf, so the O(1) `lowest` eviction never picks it."""
    layer = kvpolicy_torch.LayerCache(TOVA(size=3))
    kv = torch.zeros(1, 1, 4, 1, dtype=torch.float64)
    layer.append(kv, kv)
    layer.accumulate(torch.tensor([[[0.4, 0.1, 0.3, 0.2]]], dtype=torch.float64))
    layer.evict()
    assert layer.positions[0, 0].tolist() == [0, 2, 3]
    one = torch.zeros(1, 1, 1, 1, dtype=torch.float64)

    def step(first: float) -> None:
        layer.append(one, one)
        received = torch.full(layer.slot_positions.shape, 0.25, dtype=torch.float64)
        received[0, 0, 0] = first
        layer.accumulate(received * (layer.slot_positions >= 0))

    step(0.05)  # token 4: position 0 now has the lowest latest score
    assert layer.scores[0, 0].tolist() == [0.05, 0.25, 0.25, 0.25]  # replaced, not added
    layer.evict()  # the O(1) path: position 0 leaves a hole in slot 0
    assert layer.positions[0, 0].tolist() == [2, 3, 4]
    step(0.05)  # token 5: slot 0 is a hole now; the lowest real score is a tie at 0.25
    assert layer.slot_positions[0, 0, 0] == -1  # received there is 0: a hole scored 0 would be the victim
    assert layer.scores[0, 0].tolist() == [0.25, 0.25, 0.25, 0.25]
    layer.evict()
    assert layer.positions[0, 0].tolist() == [3, 4, 5]  # a real token went (the earliest of the tie), not the hole


def test_tova_registry_budget_and_sizes() -> None:
    assert get_policy("tova") is TOVA
    assert TOVA.from_size(10) == TOVA(size=10)
    assert simulate_sizes(TOVA(size=2), 5).tolist() == [1, 2, 3, 3, 3]
    plan = plan_policy("tova", 0.25, context_length=1024)
    assert abs(plan.realised_budget - 0.25) < 0.01
    assert make_policy("tova", 0.25, context_length=1024) == plan.policy


@pytest.mark.parametrize("bad", [dict(size=0), dict(size=3, recent=3), dict(size=3, recent=-1), dict(size=2.5)])
def test_tova_refuses_bad_parameters(bad) -> None:
    with pytest.raises(ValueError, match="size|recent"):
        TOVA(**bad)


def test_doc_worked_example() -> None:
    """docs/policies.md's TOVA example, recomputed: every eviction step of the replay has a row
    (and no other step), the cache, the rounded scores, the victim and the kept tokens match the
    reference and the oracle, the H2O column matches H2O's replay; the prefill sentence too."""
    from kvpolicy_numpy import softmax
    from worked_examples import DOC, floats, ints, setup, table

    text = DOC.read_text(encoding="utf-8")
    ns = setup(text, "tova-setup")
    policy, logits = ns["policy"], ns["logits"]
    assert policy == TOVA(size=3) and logits.shape == (8, 1, 8)
    rows = table(text, "tova-decode")
    trace = kvpolicy_numpy.replay(policy, logits)
    ref = oracle(policy, logits)
    h2o = kvpolicy_numpy.replay(H2O(heavy=2, recent=1), logits)
    assert [int(r[0]) for r in rows] == [t for t, _, _ in trace.evictions]
    for step, before, scores, evicted, after, h2o_after in rows:
        t = int(step)
        cache = trace.kept[t - 1][0].tolist() + [t]
        assert ints(before) == cache, f"step {t}: cache before"
        probs = softmax(logits[t, 0, cache])
        np.testing.assert_allclose(floats(scores), probs, atol=0.005, err_msg=f"step {t}: scores")
        assert ints(after) == trace.kept[t][0].tolist() == ref.kept[t][0], f"step {t}: kept"
        assert ints(evicted) == sorted(set(cache) - set(ints(after))), f"step {t}: evicted"
        assert ints(h2o_after) == h2o.kept[t][0].tolist(), f"step {t}: H2O"
    assert "replay(policy, logits, prompt_len=5)" in text
    prefill = kvpolicy_numpy.replay(policy, logits, prompt_len=5)
    assert prefill.kept[4][0].tolist() == [0, 3, 4] and "cache holds `0 3 4`" in text
    last_row = softmax(logits[4, 0, :5])
    assert "`" + " ".join(f"{x:.2f}" for x in last_row) + "`" in text
