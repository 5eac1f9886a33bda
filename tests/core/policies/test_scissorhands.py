"""Scissorhands and the "low_history" score statistic (issue 14) on every backend: the NumPy
reference against the literal oracle and against the torch replay, the statistic's functions
(kvpolicy.statistics), the torch prompt records (``received_attention(history=...)``) against a
row-by-row computation with GQA, holes and pads, chunked prompts, the registry and budgets, and
docs/policies.md's worked example."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import kvpolicy_numpy
from kvpolicy import H2O, Scissorhands, get_policy, make_policy, plan_policy, simulate_sizes
from kvpolicy.statistics import LOW_MARGIN, MAX_HISTORY, history_counts, history_record, low_attention, shift_history
from oracle import oracle
from strategies import replay_cases, scissorhands_policies

torch = pytest.importorskip("torch")

import kvpolicy_torch  # noqa: E402


def _kept(trace) -> list:
    return [None if k is None else np.asarray(k).tolist() for k in trace.kept]


@given(replay_cases(scissorhands_policies()))
@example((Scissorhands(size=3, history=2, drop=0.5, recent=0), np.zeros((14, 2, 14)), 6))
def test_torch_replay_and_oracle_equal_the_reference(case) -> None:
    """Differential: the reference keeps what the literal oracle keeps (lists of bits, plain loops)
    and what LayerCache keeps (records in float64 scores, general evictions, compaction), step by
    step, uniform attention (exact ties) included."""
    policy, logits, prompt_len = case
    ref = kvpolicy_numpy.replay(policy, logits, prompt_len)
    assert _kept(ref) == oracle(policy, logits, prompt_len).kept
    got = kvpolicy_torch.replay(policy, logits, prompt_len)
    assert _kept(got) == _kept(ref) and got.evictions == ref.evictions


def test_persistence_not_accumulation() -> None:
    """Token 1 takes nearly all attention from queries 1 to 3, then none: H2O keeps it for good
    (its sum stays the largest), Scissorhands drops it once its history window holds only low
    events; the recent window is never dropped."""
    steps = 16
    logits = np.zeros((steps, 1, steps))
    logits[1:4, 0, 1] = 8.0
    logits[4:, 0, 1] = -8.0
    sh = kvpolicy_numpy.replay(Scissorhands(size=6, history=3, drop=0.5, recent=2), logits)
    h2o = kvpolicy_numpy.replay(H2O(heavy=3, recent=2), logits)
    assert 1 in h2o.kept[-1][0].tolist() and 1 not in sh.kept[-1][0].tolist()
    for t, kept in enumerate(sh.kept):
        assert {t - 1, t} & set(range(t + 1)) <= set(kept[0].tolist()) | {-1}


# ---------------------------------------------------------------- the statistic's functions
@settings(max_examples=200, deadline=None)
@given(
    history=st.integers(1, MAX_HISTORY),
    steps=st.lists(st.tuples(st.integers(1, 60), st.integers(0, 2**31)), min_size=1, max_size=8),
)
def test_records_shift_exactly_like_bit_lists(history, steps) -> None:
    """A record shifted by steps of any number of rows is the list of the last ``history`` bits,
    with their count, even at 52 bits (float64 holds them exactly)."""
    rng_bits: list[int] = []
    score = np.zeros(1)
    for rows, seed in steps:
        bits = [int(b) for b in np.random.default_rng(seed).integers(0, 2, rows)]
        low = np.asarray(bits, dtype=bool)[:, None]  # [rows, 1]
        score = shift_history(score, history_record(low, history), rows, history)
        rng_bits = (rng_bits + bits)[-history:]
    want = sum(b << k for k, b in enumerate(reversed(rng_bits)))
    assert int(score[0]) == want and history_counts(score, history)[0] == sum(rng_bits)


def test_low_attention_is_below_the_groups_average_with_a_margin() -> None:
    received = np.array([[0.25, 0.25, 0.25, 0.25], [0.5, 0.3, 0.1, 0.1]]) * 2  # group 2: average 0.5
    assert low_attention(received, 2).tolist() == [[False] * 4, [False, False, True, True]]
    tie = np.full((1, 3), (1 - LOW_MARGIN / 2) / 3)  # within the margin of the average: not low
    assert not low_attention(tie, 1).any()
    kept = np.array([[True, True, False, False]])  # two keys attended: average 1/2
    assert low_attention(np.array([[0.6, 0.4, 0.0, 0.0]]), 1, kept=kept).tolist() == [[False, True, False, False]]
    assert history_counts(np.array([np.inf, 3.0]), 2).tolist() == [3, 2]


def test_prompt_records_row_by_row_with_gqa_holes_and_pads() -> None:
    """received_attention(history=w) is, per KV head, the record of the chunk's last w real rows,
    each row's group-summed attention against group / (keys it sees), as computed row by row."""
    g = torch.Generator().manual_seed(0)
    b, kv, r, q, c, d, w = 2, 2, 3, 6, 4, 8, 4
    n = c + q
    query = torch.randn(b, kv * r, q, d, generator=g, dtype=torch.float64)
    keys = torch.randn(b, kv, n, d, generator=g, dtype=torch.float64)
    mask = torch.ones(b, 1, q, n, dtype=torch.bool).tril(diagonal=c)
    mask[1, :, :, 1] = False  # a hole in row 1
    valid = torch.ones(b, q, dtype=torch.bool)
    valid[1, :2] = False  # two pads first (left padding) in row 1
    mask[1, :, :, c : c + 2] = False
    for i in range(2):
        mask[1, :, i, c + i] = True  # a pad sees only itself
    got = kvpolicy_torch.received_attention(query, keys, d**-0.5, mask=mask, query_valid=valid, history=w)
    want = torch.zeros(b, kv, n, dtype=torch.float64)
    for row in range(b):
        real = [i for i in range(q) if valid[row, i]]
        for k, i in enumerate(reversed(real[-w:])):  # k = 0: the newest real row
            logits = torch.einsum("hd,hnd->hn", query[row, :, i], keys[row].repeat_interleave(r, dim=0)) * d**-0.5
            probs = torch.softmax(logits.masked_fill(~mask[row, 0, i], float("-inf")), dim=-1).view(kv, r, n).sum(1)
            seen = mask[row, 0, i].sum()
            low = (probs < (1 - LOW_MARGIN) * r / seen) & mask[row, 0, i]
            want[row] += low.to(torch.float64) * 2.0**k
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_prompt_in_chunks_records_what_one_chunk_does() -> None:
    """LayerCache shifts each chunk's record in by the chunk's rows: two chunks give the records
    one chunk gives (a history longer than the second chunk spans both)."""
    policy = Scissorhands(size=64, history=7, drop=0.25, recent=2)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 12, 8, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2, 12, 8, generator=g, dtype=torch.float64)
    one = kvpolicy_torch.LayerCache(policy)
    one.append(k, k)
    one.accumulate(kvpolicy_torch.received_attention(q, k, 0.3, history=7))
    two = kvpolicy_torch.LayerCache(policy)
    two.append(k[:, :, :8], k[:, :, :8])
    two.accumulate(kvpolicy_torch.received_attention(q[:, :, :8], k[:, :, :8], 0.3, history=7))
    two.append(k[:, :, 8:], k[:, :, 8:])
    two.accumulate(kvpolicy_torch.received_attention(q[:, :, 8:], k, 0.3, history=7, mask=two.chunk_mask()))
    assert one.scores.dtype == torch.float64
    torch.testing.assert_close(two.scores, one.scores, rtol=0, atol=0)


# ---------------------------------------------------------------- registry, budgets, parameters
def test_registry_budget_and_sizes() -> None:
    assert get_policy("scissorhands") is Scissorhands
    p = Scissorhands(size=4, history=2, drop=0.5, recent=1)
    assert p.capacity == 4 and p.dropped == 2 and p.score_history == 2
    assert simulate_sizes(p, 8).tolist() == [1, 2, 3, 4, 3, 4, 3, 4]  # at 4 during attention, 2 after
    plan = plan_policy("scissorhands", 0.25, context_length=1024)
    assert abs(plan.realised_budget - 0.25) < 0.01 and plan.policy.capacity <= 1024
    assert make_policy("scissorhands", 0.25, context_length=1024) == plan.policy


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(size=1), "size must be >= 2"),
        (dict(size=8, history=0), "history must be >= 1"),
        (dict(size=8, history=53), "history must be >= 1 and <= 52"),
        (dict(size=8, drop=1.0), r"drop must be in \(0.0, 1.0\)"),
        (dict(size=8, drop=0.25, recent=7), "recent must be >= 0 and <= 6"),
        (dict(size=16, selection="shared"), "selection must be 'per_head' for Scissorhands"),
    ],
)
def test_bad_parameters(bad, match) -> None:
    with pytest.raises(ValueError, match=match):
        Scissorhands(**bad)


def test_doc_worked_example() -> None:
    """docs/policies.md's Scissorhands example, recomputed: one row per compression step and no
    other, the cache, query t's probabilities, its low bits, every record (rebuilt from the
    queries' bits), what is kept (the reference and the oracle) and what H2O keeps."""
    from kvpolicy_numpy import softmax
    from worked_examples import DOC, floats, ints, setup, table

    text = DOC.read_text(encoding="utf-8")
    ns = setup(text, "scissorhands-setup")
    policy, logits = ns["policy"], ns["logits"]
    assert policy == Scissorhands(size=4, history=2, drop=0.5, recent=1) and logits.shape == (9, 1, 9)
    rows = table(text, "scissorhands-decode")
    trace = kvpolicy_numpy.replay(policy, logits)
    ref = oracle(policy, logits)
    h2o = kvpolicy_numpy.replay(H2O(heavy=2, recent=1), logits)
    assert [int(r[0]) for r in rows] == [t for t, _, _ in trace.evictions]
    records: dict[int, list[int]] = {}
    steps = {int(r[0]): r for r in rows}
    for t in range(logits.shape[0]):
        cache = (trace.kept[t - 1][0].tolist() if t else []) + [t]
        probs = softmax(logits[t, 0, cache])
        low = low_attention(probs[None], 1)[0].astype(int).tolist()
        records = {j: (records.get(j, []) + [bit])[-policy.history :] for j, bit in zip(cache, low)}
        if t not in steps:
            continue
        _, before, shown, bits, recs, after, h2o_after = steps[t]
        assert ints(before) == cache, f"step {t}: cache"
        np.testing.assert_allclose(floats(shown), probs, atol=0.005, err_msg=f"step {t}: probabilities")
        assert ints(bits) == low, f"step {t}: low bits"
        assert recs.split() == ["".join(map(str, records[j])) for j in cache], f"step {t}: records"
        assert ints(after) == trace.kept[t][0].tolist() == ref.kept[t][0], f"step {t}: kept"
        assert ints(h2o_after) == h2o.kept[t][0].tolist(), f"step {t}: H2O"


def test_compose_refuses_mixing_records_with_attention_scores() -> None:
    """A composition keeps one score per token: Scissorhands' records cannot feed SnapKV's or
    H2O's ranking (nor the reverse); a policy that reads no scores composes with it."""
    from kvpolicy import SnapKV, StreamingLLM, compose

    with pytest.raises(ValueError, match="same kind of score"):
        compose(prefill=SnapKV(16, window=4), decode=Scissorhands(size=16))
    with pytest.raises(ValueError, match="same kind of score"):
        compose(prefill=Scissorhands(size=16), decode=H2O(8, 8))
    p = compose(prefill=StreamingLLM(2, 10), decode=Scissorhands(size=16, recent=4))
    assert p.score_statistic == "low_history" and p.score_history == 16
