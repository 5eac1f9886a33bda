"""kvpolicy_torch.queries: a score declared as a sum over the candidates (CandidateSums: KeyDiff's
anchor) kept between eager decode steps, exact only near each head's lowest; Expected Attention's
decode queries held until a scoring reads their sums (RunningMoments, buffered).

Differential: the torch backend's LayerCache (which keeps the sum and rescores the few lowest
estimates) keeps what the NumPy reference (which rescores every token from scratch) keeps, for
KeyDiff alone and under AdaKV's head-wise budgets, on continuous and on tie-heavy integer keys;
the victim ``CandidateSums.scores`` implies is the full rescoring's after appends, evictions,
compactions and rows reordered; it declines (the caller rescores everything) on NaN keys and on
ties at its cut; the kit refuses a declaration that does not mean the policy's score. Tiny
shapes, random keys (no model).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvpolicy_numpy
from kvpolicy import AdaKV, KeyDiff
from kvpolicy.policies.keydiff import UnitKeySum
from kvpolicy.statistics import CachedTokens, key_scores
from kvpolicy.testing import ContractViolation, check_candidate_sum

from oracle import same_kept

torch = pytest.importorskip("torch")
import kvpolicy_torch  # noqa: E402
from kvpolicy_torch import LayerCache  # noqa: E402
from kvpolicy_torch.queries import CandidateSums  # noqa: E402


@pytest.fixture(autouse=True)
def screen_every_size(monkeypatch):
    """Small caches take the full rescoring (CandidateSums.MIN_SLOTS); here every size screens."""
    monkeypatch.setattr(CandidateSums, "MIN_SLOTS", 0)


def _first_lowest(scores: torch.Tensor, eligible: torch.Tensor) -> torch.Tensor:
    """Each head's lowest eligible score's slot, ties to the earliest."""
    s = torch.where(eligible, scores, torch.inf)
    low = s.amin(-1, keepdim=True)
    slots = torch.arange(s.shape[-1]).expand_as(s)
    return torch.where(s == low, slots, s.shape[-1]).amin(-1)


@given(st.integers(2, 40), st.integers(0, 3), st.sampled_from(["normal", "integers"]), st.integers(0, 2**16))
@settings(max_examples=60, deadline=None)
def test_torch_keeps_what_the_reference_keeps(size, recent, kind, seed) -> None:
    recent = min(recent, size - 1)
    rng = np.random.default_rng(seed)
    steps, heads = size + 60, 3
    prompt = int(rng.integers(0, steps // 2))
    keys = rng.normal(size=(steps, heads, 8)) if kind == "normal" else rng.integers(-2, 3, size=(steps, heads, 8)).astype(np.float64)
    logits = rng.normal(size=(steps, heads, steps))
    policy = KeyDiff(size=size, recent=recent, refresh=1)
    want = kvpolicy_numpy.replay(policy, logits, prompt, keys=keys)
    got = kvpolicy_torch.replay(policy, logits, prompt, keys=keys)
    same_kept(want.kept, got.kept)


@given(st.integers(3, 12), st.sampled_from([0.0, 0.5, 1.0]), st.integers(1, 6), st.integers(0, 2**16))
@settings(max_examples=40, deadline=None)
def test_headwise_budgets_keep_what_the_reference_keeps(size, alpha, heads, seed) -> None:
    # (the layer's H lowest over its heads may all come from one head: up to 6 heads here)
    rng = np.random.default_rng(seed)
    steps = size + 40
    keys = rng.normal(size=(steps, heads, 8))
    logits = rng.normal(size=(steps, heads, steps))
    policy = AdaKV(KeyDiff(size=size, refresh=1), alpha)
    want = kvpolicy_numpy.replay(policy, logits, 4, keys=keys)
    got = kvpolicy_torch.replay(policy, logits, 4, keys=keys)
    same_kept(want.kept, got.kept)


def test_a_decode_run_keeps_the_sum_and_rescores_a_few() -> None:
    # 200 decode steps past the limit: the sum is taken afresh at the first step and every RESUM
    # updates (and after compactions), not at every step
    g = torch.Generator().manual_seed(0)
    layer = LayerCache(KeyDiff(size=64, refresh=1))
    layer.append(k := torch.randn(1, 3, 80, 16, generator=g), k.clone())
    layer.evict()
    for _ in range(200):
        layer.append(k := torch.randn(1, 3, 1, 16, generator=g), k.clone())
        layer.evict()
    sums = layer.candidate_sums
    assert sums is not None and 1 <= sums.full_sums <= 200 // CandidateSums.RESUM + 30


@given(st.integers(6, 40), st.integers(0, 2), st.integers(0, 2**16), st.booleans())
@settings(max_examples=80, deadline=None)
def test_the_victim_is_the_full_rescorings(n, recent, seed, reorder) -> None:
    # random histories: tokens appended, a victim made a hole each step, sometimes the slots
    # compacted (moved) or the rows swapped; each step's lowest eligible slot equals the one
    # the full rescoring gives (or the sums decline)
    g = torch.Generator().manual_seed(seed)
    parts = UnitKeySum()
    sums = CandidateSums(parts, min_slots=0)
    b, h, d = 2, 2, 8
    keys = torch.randn(b, h, n, d, generator=g, dtype=torch.float64)
    positions = torch.arange(n).expand(b, h, n).clone()
    seen = n
    for step in range(30):
        if step % 7 == 6:  # compaction: the held tokens moved to the front
            order = torch.argsort((positions < 0).to(torch.int8), dim=-1, stable=True)
            positions = positions.gather(2, order)
            keys = keys.gather(2, order[..., None].expand_as(keys))
        if reorder and step % 11 == 10:
            positions, keys = positions.flip(0), keys.flip(0)
            sums.forget()
        free = (positions < 0).all(0).all(0).nonzero()
        slot = int(free[0]) if free.numel() else positions.shape[-1]
        if slot == positions.shape[-1]:
            positions = torch.cat([positions, torch.full((b, h, 1), -1)], -1)
            keys = torch.cat([keys, torch.zeros(b, h, 1, d, dtype=torch.float64)], 2)
        keys[:, :, slot] = torch.randn(b, h, d, generator=g, dtype=torch.float64)
        positions[:, :, slot] = seen
        seen += 1
        eligible = (positions >= 0) & (positions < seen - recent)
        full = key_scores("key_diff", keys, positions, seen, recent)
        want = _first_lowest(torch.where(positions >= 0, full, torch.inf), eligible)
        got = sums.scores(keys, positions, seen, recent)
        if got is not None:
            assert torch.equal(_first_lowest(got, eligible), want)
        victim = want
        positions.scatter_(2, victim[..., None], -1)


def _layer_lowest(scores: torch.Tensor, positions: torch.Tensor, eligible: torch.Tensor, count: int) -> list[list]:
    """Per row, the layer's ``count`` lowest eligible ``(head, position)`` by (score, position, head)."""
    out = []
    for r in range(scores.shape[0]):
        cells = [(float(scores[r, h, j]), int(positions[r, h, j]), h) for h in range(scores.shape[1])
                 for j in range(scores.shape[2]) if eligible[r, h, j]]
        out.append([(h, p) for _, p, h in sorted(cells)[:count]])
    return out


@given(st.integers(8, 40), st.integers(1, 5), st.integers(0, 2**16), st.sampled_from(["normal", "integers"]),
       st.sampled_from([2, 6]))
@settings(max_examples=80, deadline=None)
def test_the_layers_lowest_are_the_full_rescorings(n, heads, seed, kind, d) -> None:
    # head-wise budgets read the layer's H lowest over its heads (up to H from one head): with
    # need=H, wherever the sums answer, those are the full rescoring's (continuous keys, and
    # integer keys of few directions: large ties)
    g = torch.Generator().manual_seed(seed)
    sums = CandidateSums(UnitKeySum(), min_slots=0)
    keys = (torch.randn(1, heads, n, d, generator=g, dtype=torch.float64) if kind == "normal"
            else torch.randint(-1, 2, (1, heads, n, d), generator=g).to(torch.float64))
    positions = torch.arange(n).expand(1, heads, n).clone()
    seen, answered = n, 0
    for _ in range(12):
        eligible = positions >= 0
        full = key_scores("key_diff", keys, positions, seen, 0)
        got = sums.scores(keys, positions, seen, 0, need=heads)
        want = _layer_lowest(torch.where(eligible, full, torch.inf), positions, eligible, heads)
        if got is not None:
            answered += 1
            assert _layer_lowest(got, positions, eligible, heads) == want
        for h, p in want[0]:  # the victims go; a new token comes to each head
            positions[0, h][positions[0, h] == p] = -1
        slot = int((positions[0] < 0).all(0).nonzero()[0]) if bool((positions[0] < 0).all(0).any()) else None
        if slot is None:
            positions = torch.cat([positions, torch.full((1, heads, 1), -1)], -1)
            keys = torch.cat([keys, torch.zeros(1, heads, 1, d, dtype=torch.float64)], 2)
            slot = positions.shape[-1] - 1
        keys[:, :, slot] = (torch.randn(1, heads, d, generator=g, dtype=torch.float64) if kind == "normal"
                            else torch.randint(-1, 2, (1, heads, d), generator=g).to(torch.float64))
        positions[:, :, slot] = seen
        seen += 1
    assert kind == "integers" or answered > 0


def test_the_layers_lowest_may_all_come_from_one_head() -> None:
    # head 0: ten keys a hair apart (1e-8 rad: one float32 estimate, ten exact scores) beside one
    # at the anchor; head 1 scores above them all. The layer's 2 lowest are both head 0's, the
    # second among the ten: only their exact scores tell which. Reading one lowest per head
    # (need=1) would take a wrong one; need=2 declines (the caller rescores)
    phi = math.atan(1 / 10)  # the anchor of 10 unit keys along a and one along b
    head0 = [(math.cos(t), math.sin(t)) for t in [1e-8 * i for i in range(10)] + [math.pi / 2, phi]]
    head1 = [(math.cos(math.radians(t)), math.sin(math.radians(t))) for t in (0,) * 5 + (90,) * 5 + (30, 60)]
    keys = torch.tensor([[head0, head1]], dtype=torch.float64)
    positions = torch.arange(12).expand(1, 2, 12)
    held = positions >= 0
    want = _layer_lowest(key_scores("key_diff", keys, positions, 12, 0), positions, held, 2)
    assert want == [[(0, 11), (0, 9)]]
    one = CandidateSums(UnitKeySum(), min_slots=0).scores(keys, positions, 12, 0, need=1)
    assert one is not None and _layer_lowest(one, positions, held, 2) != want
    assert CandidateSums(UnitKeySum(), min_slots=0).scores(keys, positions, 12, 0, need=2) is None


def test_nan_keys_and_ties_at_the_cut_are_declined() -> None:
    sums = CandidateSums(UnitKeySum(), min_slots=0)
    keys = torch.randn(1, 1, 10, 4, dtype=torch.float64)
    positions = torch.arange(10).expand(1, 1, 10)
    nan = keys.clone()
    nan[0, 0, 3, 0] = float("nan")
    assert sums.scores(nan, positions, 10, 0) is None
    same = torch.ones(1, 1, 10, 4, dtype=torch.float64)  # every key alike: all tie, more than the rescored few
    assert CandidateSums(UnitKeySum(), min_slots=0).scores(same, positions, 10, 0) is None


class WrongEstimate(UnitKeySum):
    def estimate(self, keys, statistic):
        return super().estimate(keys, statistic) + 0.01


class WrongExact(UnitKeySum):
    def exact(self, keys, summand, statistic):
        return super().exact(keys, summand, statistic) * 2


@pytest.mark.parametrize("parts, match", [(WrongEstimate(), "declared error"), (WrongExact(), "cache_score gives")])
def test_the_kit_refuses_a_declaration_that_is_not_the_score(parts, match) -> None:
    class Declared(KeyDiff):
        name = "keydiff_declared_test"
        candidate_sum = parts

    policy = Declared(size=2)
    keys = np.random.default_rng(0).normal(size=(1, 2, 6, 4))
    positions = np.arange(6)[None, None].repeat(2, 1)
    scores = policy.cache_score(CachedTokens(keys, None, positions, 6))
    check_candidate_sum(KeyDiff(size=2, refresh=1), keys, positions, 6, scores)
    with pytest.raises(ContractViolation, match=match):
        check_candidate_sum(policy, keys, positions, 6, scores)


# ============================================================================ held decode queries
from kvpolicy_torch.queries import RunningMoments  # noqa: E402


@given(st.integers(1, 3), st.integers(1, 3), st.integers(0, 4), st.integers(1, 150), st.integers(0, 2**16))
@settings(max_examples=40, deadline=None)
def test_held_decode_queries_give_the_sums_of_adding_each(batch, group, sink, steps, seed) -> None:
    """Expected Attention under a refresh interval (eager) holds each decode query until the sums
    are read: read at any step, after any number of steps (past RunningMoments.PENDING, where
    they are taken unread), the sums equal those of adding each query as it comes, to float64
    rounding; rows reordered (beam search) with queries held keep their own queries. A query
    held still rotated by RoPE, with its step's rotation back (``inverse``, the transformers
    layer's eager decode step) and its position as host ints, is turned back when the sums take
    it: the same sums, to the rotation's rounding."""
    from kvpolicy_torch import rope_rotate
    from kvpolicy_torch.queries import PreRope

    gen = torch.Generator().manual_seed(seed)
    kv, d, prompt = 2, 4, 3
    freq, pre = torch.tensor([1.0, 0.1]), PreRope()
    held, each, turned = RunningMoments(sink, buffered=True), RunningMoments(sink), RunningMoments(sink, buffered=True)
    first = torch.randn(batch, kv * group, prompt, d, generator=gen, dtype=torch.float64)
    positions = torch.arange(prompt).expand(batch, prompt)
    for running in (held, each, turned):
        running.observe(first, positions, kv_heads=kv)
    reads = {int(x) for x in torch.randint(0, steps, (3,), generator=gen)}
    since = 0  # decode queries since the sums last took them

    def same(a, b, tol=1e-12):
        for mine, theirs in zip(a.moments, b.moments):
            torch.testing.assert_close(mine, theirs, rtol=tol, atol=tol)

    for t in range(steps):
        q = torch.randn(batch, kv * group, 1, d, generator=gen, dtype=torch.float64)
        for running in (held, each):
            running.observe(q, torch.full((batch, 1), prompt + t), kv_heads=kv)
        at = torch.tensor([[prompt + t]])  # (the forward's position_ids: one row for the batch)
        turned.observe(rope_rotate(q, at.view(1, 1, 1), freq), [prompt + t] * batch, kv_heads=kv,
                       inverse=pre.inverse(at, freq, batch, d, step=t))
        since = (since + 1) % RunningMoments.PENDING
        assert (held.held_queries, each.held_queries, turned.held_queries) == (since, 0, since)
        if t in reads:
            same(held, each)
            same(turned, each, 1e-5)  # (RoPE's angles are float32's, as transformers computes them)
            assert held.held_queries == turned.held_queries == 0
            since = 0
    index = torch.arange(batch).flip(0)
    for running in (held, each, turned):
        running.select(index)
    same(held, each)
    same(turned, each, 1e-5)
    assert held.moments.count.tolist() == turned.moments.count.tolist() == [float(prompt + steps - min(sink, prompt + steps))] * batch


def test_held_queries_refuse_positions_and_rotations_of_the_wrong_shape() -> None:
    """Positions as host ints are a decode step's, one per row; a rotation back is a decode
    step's ``[batch, head_dim, head_dim]``: anything else is a ValueError naming it."""
    running = RunningMoments(0, buffered=True)
    with pytest.raises(ValueError, match="positions as ints"):
        running.observe(torch.randn(2, 2, 1, 4), [3], kv_heads=1)
    with pytest.raises(ValueError, match="positions as ints"):
        running.observe(torch.randn(1, 2, 2, 4), [3], kv_heads=1)
    with pytest.raises(ValueError, match="inverse must be"):
        running.observe(torch.randn(1, 2, 1, 4), [3], kv_heads=1, inverse=torch.eye(4, dtype=torch.float64))


def test_a_refresh_interval_holds_the_queries_between_scorings() -> None:
    """An eager layer of Expected Attention with refresh=8 holds the decode queries it observes
    until a scoring reads the sums (at most refresh - 1 held after an eviction); refresh=1 and
    static shapes take each query at once."""
    from kvpolicy import ExpectedAttention

    def run(policy, **kw):
        layer = LayerCache(policy, **kw)
        gen = torch.Generator().manual_seed(0)
        layer.append(torch.randn(1, 1, 12, 4, generator=gen), torch.randn(1, 1, 12, 4, generator=gen))
        layer.observe_queries(torch.randn(1, 2, 12, 4, generator=gen))
        layer.evict()
        most = 0
        for _ in range(20):
            layer.append(torch.randn(1, 1, 1, 4, generator=gen), torch.randn(1, 1, 1, 4, generator=gen))
            layer.observe_queries(torch.randn(1, 2, 1, 4, generator=gen))
            layer.evict()
            most = max(most, layer.running_queries.held_queries)
        return most, layer.running_queries.moments.count.tolist()

    assert run(ExpectedAttention(size=6, sink=1, refresh=8)) == (7, [31.0])
    assert run(ExpectedAttention(size=6, sink=1, refresh=1)) == (0, [31.0])
    assert run(ExpectedAttention(size=6, sink=1)) == (20, [31.0])  # (the default, refresh=64: none taken yet)
    assert run(ExpectedAttention(size=6, sink=1, refresh=8), static_shapes=True) == (0, [31.0])
