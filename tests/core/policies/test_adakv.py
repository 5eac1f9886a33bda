"""AdaKV head-wise budgets (kvpolicy/policies/adakv.py) on the NumPy reference.

Properties: one head-wise eviction keeps exactly the budget, every head at least its floor, and
the top of one order over all heads after the floors (held to a brute-force Python version); a
replay keeps the scorer's budget per layer at every step and its sizes; with
``alpha_safeguard = 1`` it is the per-head scorer, token for token. All on small random inputs
(fast, no model).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpolicy import H2O, TOVA, AdaKV, BUZZ, CacheView, KeyDiff, Knorm, Ranking, SnapKV, get_policy, make_policy, simulate_sizes
from kvpolicy.policies.adakv import headwise_keep
from kvpolicy_numpy import replay

from headwise_cases import decode_steps
from oracle import same_kept


# ---------------------------------------------------------------------------- one eviction
def _brute_force(held, protected, keys, budget, floor):
    """The kept slots of each head of one row, by sorting Python tuples."""
    heads, n = held.shape
    must = set()
    for h in range(heads):
        mine = [j for j in range(n) if held[h, j]]
        by_rank = sorted(mine, key=lambda j: (protected[h, j], *(k[h, j] for k in keys), j))
        must |= {(h, j) for j in by_rank[max(0, len(by_rank) - floor) :]} if floor else set()
        must |= {(h, j) for j in mine if protected[h, j]}
    tokens = [(h, j) for h in range(heads) for j in range(n) if held[h, j]]
    order = sorted(tokens, key=lambda t: ((t in must), *(k[t] for k in keys), t[0], t[1]))
    kept = set(order[len(tokens) - budget :])
    return [sorted(j for (g, j) in kept if g == h) for h in range(heads)]


@st.composite
def headwise_cases(draw):
    heads = draw(st.integers(1, 4))
    n = draw(st.integers(1, 10))
    holes = [draw(st.integers(0, n - 1)) for _ in range(heads)]
    positions = np.array([[-1] * k + list(range(k, n)) for k in holes])[None]  # leading holes
    score = np.array(draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0, np.nan]), min_size=heads * n, max_size=heads * n)))
    score = score.reshape(1, heads, n)
    protected = np.array(draw(st.lists(st.booleans(), min_size=heads * n, max_size=heads * n))).reshape(1, heads, n)
    view = CacheView(positions, score, n)
    held = view.held
    floor = draw(st.integers(0, n))
    # at least the floors and the protected tokens (AdaKV's budget, heads x share, always is)
    must = sum(max(min(floor, int(held[0, h].sum())), int((protected & held)[0, h].sum())) for h in range(heads))
    budget = draw(st.integers(must, int(held.sum())))
    # the last key breaks ties within a head: the position, as H2O's ranking
    return view, Ranking(protected, (score, positions)), budget, floor


@given(headwise_cases())
@settings(max_examples=300, deadline=None)
def test_headwise_keep_is_the_top_of_one_order_after_the_floors(case) -> None:
    view, ranking, budget, floor = case
    held = view.held[0]
    protected = ranking.protected[0] & held
    score = np.where(np.isnan(ranking.keys[0][0]), -np.inf, ranking.keys[0][0])
    keys = (score, ranking.keys[1][0])
    keep = headwise_keep(view, ranking, budget, floor)
    want = _brute_force(held, protected, keys, budget, floor)
    got = [[int(j) for j in row if j >= 0] for row in keep[0]]
    assert got == want
    # holes lead each head; the widest head has none
    assert keep.shape[-1] == max(len(w) for w in want)
    for row in keep[0]:
        holes = int((row < 0).sum())
        assert (row[:holes] == -1).all() and (np.diff(row[holes:]) > 0).all()
    # the budget exactly, each head at least its floor (fewer only if it holds fewer), every protected token
    assert sum(len(w) for w in want) == budget
    for h, w in enumerate(want):
        assert len(w) >= min(floor, int(held[h].sum()))
        assert set(np.flatnonzero(protected[h]).tolist()) <= set(w)


# ---------------------------------------------------------------------------- replays
SCORERS = st.one_of(
    st.builds(H2O, heavy=st.integers(1, 6), recent=st.integers(1, 4)),
    st.builds(TOVA, size=st.integers(1, 8), recent=st.integers(0, 0), selection=st.just("per_head")),
    st.builds(Knorm, size=st.integers(1, 8)),
    st.builds(KeyDiff, size=st.integers(2, 8), recent=st.integers(0, 1)),
    st.builds(SnapKV, size=st.integers(3, 10), window=st.integers(1, 2), kernel=st.sampled_from([1, 3, 5]),
              pooling=st.sampled_from(["avg", "max"])),
)


@st.composite
def replays(draw, alpha=st.sampled_from([0.0, 0.2, 0.5, 1.0])):
    scorer = draw(SCORERS)
    heads = draw(st.integers(1, 4))
    steps = draw(st.integers(2, 28))
    prompt = draw(st.integers(0, steps - 1))
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    # small integer logits: many ties
    logits = rng.integers(-2, 3, size=(steps, heads, steps)).astype(np.float64)
    keys = rng.integers(-2, 3, size=(steps, heads, 4)).astype(np.float64)
    return scorer, draw(alpha), logits, keys, prompt


@given(replays())
@settings(max_examples=120, deadline=None)
def test_a_layer_keeps_its_budget_and_each_head_its_floor(case) -> None:
    scorer, alpha, logits, keys, prompt = case
    heads = logits.shape[1]
    policy = AdaKV(scorer, alpha)
    trace = replay(policy, logits, prompt, keys=keys)
    alone = replay(scorer, logits, prompt, keys=keys)
    assert trace.sizes.tolist() == alone.sizes.tolist() == simulate_sizes(policy, logits.shape[0], prompt).tolist()
    for t, (kept, mine) in enumerate(zip(trace.kept, alone.kept)):
        if kept is None:
            continue
        held = kept >= 0
        per_head = held.sum(axis=1)
        assert int(held.sum()) == heads * mine.shape[1]  # the scorer's per-head budget, over the layer
        assert per_head.min() >= min(policy.floor_of(mine.shape[1]), mine.shape[1])
        assert per_head.max() == kept.shape[1]
        for h in range(heads):
            row = kept[h][held[h]]
            assert (np.diff(row) > 0).all() and (kept[h][~held[h]] == -1).all() and not held[h][: (~held[h]).sum()].any()
        if isinstance(scorer, H2O) or getattr(scorer, "recent", 0):
            recent = scorer.recent
            newest = set(range(max(0, t + 1 - recent), t + 1))
            assert all(newest <= set(kept[h].tolist()) for h in range(heads))  # the protected window, in every head


@given(replays(alpha=st.just(1.0)))
@settings(max_examples=120, deadline=None)
def test_alpha_one_is_the_per_head_scorer(case) -> None:
    scorer, alpha, logits, keys, prompt = case
    trace = replay(AdaKV(scorer, alpha), logits, prompt, keys=keys)
    alone = replay(scorer, logits, prompt, keys=keys)
    same_kept(trace.kept, alone.kept)


@given(replays())
@settings(max_examples=60, deadline=None)
def test_one_head_is_the_scorer(case) -> None:
    scorer, alpha, logits, keys, prompt = case
    logits, keys = logits[:, :1], keys[:, :1]
    trace = replay(AdaKV(scorer, alpha), logits, prompt, keys=keys)
    alone = replay(scorer, logits, prompt, keys=keys)
    same_kept(trace.kept, alone.kept)


def test_a_decode_step_takes_one_token_per_head_from_the_lowest_heads() -> None:
    # two heads, H2O(heavy=2, recent=1), floor 1; head 0 attends to token 0 only, head 1 evenly:
    # the layer keeps 6, a decode step appends one token per head and the two lowest outside the
    # floors and the recent window go (docs/policies.md's worked example)
    logits = np.zeros((6, 2, 6))
    logits[:, 0, 0] = 4.0
    trace = replay(AdaKV(H2O(heavy=2, recent=1), alpha_safeguard=0.5), logits, prompt_len=5)
    assert trace.kept[4].tolist() == [[-1, -1, 0, 4], [0, 1, 2, 4]]
    assert trace.kept[5].tolist() == [[-1, -1, 0, 5], [0, 1, 2, 5]]
    assert trace.sizes.tolist() == [4] and trace.evictions == [(4, 5, 4), (5, 5, 4)]  # rounds: the widest head's slots


# ---------------------------------------------------------------------------- the policy object
def test_parameters_registry_and_planning() -> None:
    p = AdaKV(H2O(heavy=6, recent=2), alpha_safeguard=0.25)
    assert (p.capacity, p.share, p.floor, p.head_capacity(4)) == (9, 8, 2, 27)
    assert AdaKV(SnapKV(size=16, window=4)).capacity is None and AdaKV(SnapKV(size=16, window=4)).share == 16
    assert p == AdaKV(H2O(6, 2), 0.25) and hash(p) == hash(AdaKV(H2O(6, 2), 0.25)) and p != AdaKV(H2O(6, 2), 0.5)
    assert p.params() == {"scorer": {"policy": "h2o", "heavy": 6, "recent": 2, "selection": "per_head"}, "alpha_safeguard": 0.25}
    for name, scorer in (("adakv_snapkv", SnapKV), ("adakv_h2o", H2O), ("adakv_keydiff", KeyDiff), ("adakv_tova", TOVA)):
        planned = make_policy(name, 0.3, context_length=200, prompt_length=100)
        assert isinstance(planned.scorer, scorer) and planned.scorer.selection == "per_head"
    planned = make_policy("adakv", 0.25, context_length=1024, scorer="h2o", alpha_safeguard=0.5)
    assert planned == AdaKV(make_policy("h2o", 0.25, context_length=1024), 0.5)
    assert get_policy("adakv") is AdaKV
    assert AdaKV(KeyDiff(size=8)).captures_attention is False and AdaKV(H2O(4, 4)).captures_attention is True


@pytest.mark.parametrize(
    ("args", "match"),
    [((BUZZ(sink=1, window=4, stride=3),), "rank tokens"), ((H2O(4, 4, selection="shared"),), "per head"),
     (("h2o",), "EvictionPolicy instance"), ((H2O(4, 4), 1.5), "alpha_safeguard"), ((H2O(4, 4), float("nan")), "alpha_safeguard")],
)
def test_bad_input_names_the_parameter(args, match) -> None:
    with pytest.raises(ValueError, match=match):
        AdaKV(*args)
    with pytest.raises(ValueError, match="scorer"):
        make_policy("adakv", 0.3, context_length=100)


def test_a_subclass_that_redefines_select_is_no_scorer() -> None:
    class Mine(H2O):
        decode_eviction = size_rule = None  # (a redefined select says which rules it keeps)

        def select(self, view):
            return super().select(view)

    assert H2O(2, 2).ranks_tokens and not Mine(2, 2).ranks_tokens
    with pytest.raises(ValueError, match="rank tokens"):
        AdaKV(Mine(2, 2))


def test_doc_worked_example() -> None:
    """docs/policies.md's AdaKV example, recomputed: every cache, score and kept set of its table
    is the reference's, and H2O's column is per-head H2O's."""
    from kvpolicy_numpy import softmax
    from worked_examples import DOC, floats, ints, setup, table

    text = DOC.read_text(encoding="utf-8")
    ns = setup(text, "adakv-setup")
    policy, logits = ns["policy"], ns["logits"]
    assert policy == AdaKV(H2O(heavy=2, recent=1), alpha_safeguard=0.5) and logits.shape == (6, 2, 6)
    assert "replay(policy, logits, prompt_len=5)" in text
    trace = replay(policy, logits, prompt_len=5)
    h2o = replay(policy.scorer, logits, prompt_len=5)
    rows = table(text, "adakv-steps")
    assert [(ints(r[0])[0], ints(r[1])[0]) for r in rows] == [(4, 0), (4, 1), (5, 0), (5, 1)]
    # the prompt's scores: every row of the causal softmax, summed
    causal = np.tril(np.ones((5, 5), dtype=bool))[:, None, :]
    prompt_scores = softmax(np.where(causal, logits[:5, :, :5], -np.inf)).sum(axis=0)  # [heads, 5]
    kept4 = trace.kept[4]
    for r in rows:
        t, h = ints(r[0])[0], ints(r[1])[0]
        if t == 4:
            before, scores = list(range(5)), prompt_scores[h]
        else:
            before = [int(j) for j in kept4[h] if j >= 0] + [5]
            scores = np.append(prompt_scores[h][before[:-1]], 0.0) + softmax(logits[5, h, before])
        assert ints(r[2]) == before
        np.testing.assert_allclose(floats(r[3]), scores, atol=0.005)
        assert ints(r[4]) == [int(j) for j in trace.kept[t][h] if j >= 0]
        assert ints(r[5]) == h2o.kept[t][h].tolist()
    assert [int((k >= 0).sum()) for k in (trace.kept[4], trace.kept[5])] == [6, 6]


# ---------------------------------------------------------------------------- the conformance kit
def test_the_kit_passes_adakv_over_every_scorer() -> None:
    from kvpolicy.testing import check_policy

    report = check_policy(AdaKV)  # with the torch backend in lockstep when installed
    assert report.passed == ["replay", "sizes", "full_cache", "backends", "stateful", "head_ties"]
    assert report.results["ranking"].startswith("skipped")  # (AdaKV is no scorer itself: its scorers are checked)


def test_the_kit_refuses_holes_after_tokens() -> None:
    """A head-wise policy whose rows put holes after tokens (or keep every slot without a hole)
    breaks the contract: the kit and the backends say so."""
    from kvpolicy import PolicyError
    from kvpolicy.testing import ContractViolation, check_policy

    class TrailingHoles(H2O):
        name = "trailing_holes_demo"
        ragged_heads = True  # holes are allowed, in front only
        decode_eviction = size_rule = None

        def select(self, view):
            keep = super().select(view)
            if keep is None:
                return None
            keep = keep.copy()
            keep[:, -1, -1] = -1  # the last head's newest slot as a hole, after its tokens
            return keep

    with pytest.raises(ContractViolation, match="holes"):
        check_policy(TrailingHoles, {"heavy": st.just(2), "recent": st.just(1)}, checks=["backends"], torch=False,
                     settings=settings(max_examples=5, deadline=None))
    with pytest.raises(PolicyError, match="hole"):
        replay(TrailingHoles(2, 1), np.zeros((6, 2, 6)), prompt_len=5)

    class LeadingHoles(H2O):  # not head-wise: no hole at all
        decode_eviction = size_rule = None
        def select(self, view):
            keep = super().select(view)
            if keep is not None:
                keep = keep.copy()
                keep[:, -1, 0] = -1
            return keep

    with pytest.raises(PolicyError, match="outside"):
        replay(LeadingHoles(2, 1), np.zeros((6, 2, 6)), prompt_len=5)


def test_wrapped_in_a_composition_or_a_pyramid() -> None:
    """AdaKV as a composition's decode policy (SnapKV after the prompt) or as PyramidKV's base:
    the wrapper says its heads are ragged, the reference runs it, each layer keeps its budget."""
    from kvpolicy import PyramidKV, compose

    rng = np.random.default_rng(3)
    logits = rng.normal(size=(30, 3, 30))
    p = compose(prefill=SnapKV(size=12, window=4), decode=AdaKV(H2O(heavy=5, recent=6), 0.2))
    assert p.ragged_heads
    trace = replay(p, logits, prompt_len=20)
    assert all(int((k >= 0).sum()) == 3 * 11 for k in trace.kept[20:])
    # SnapKV keeping fewer than AdaKV's share after the prompt: AdaKV waits until the heads fill up
    small = compose(prefill=SnapKV(size=8, window=4), decode=AdaKV(H2O(heavy=5, recent=6), 0.2))
    trace = replay(small, logits, prompt_len=20)
    assert [int((k >= 0).sum()) for k in trace.kept[19:25]] == [24, 27, 30, 33, 33, 33]
    pyramid = PyramidKV("adakv_h2o", size=12)
    assert pyramid.ragged_heads and pyramid.for_layer(0, 4).ragged_heads
    trace = replay(pyramid, logits, prompt_len=20)
    assert int((trace.kept[-1] >= 0).sum()) == 3 * pyramid.mean.share


# ---------------------------------------------------------------------------- the declared decode rule
@given(decode_steps())
@settings(max_examples=400, deadline=None)
def test_the_declared_decode_rule_keeps_what_select_keeps(case) -> None:
    """AdaKV's HeadwiseEviction (what the torch backend applies as a masked write) keeps exactly
    what select keeps at every decode step where it applies: ties, NaN, floors, GQA-sized layers."""
    policy, view = case
    rule = policy.headwise_eviction
    assert rule.applies(view.n_cached, view.n_seen, view.state, "decode")
    want = rule.keep(CacheView(view.positions, view.scores, view.n_seen, dict(view.state)))
    got = policy.select(view)
    np.testing.assert_array_equal(got, want)
    assert view.state == rule.state_after(view.n_seen)
    assert int((got >= 0).sum()) == view.heads * rule.limit  # H tokens went: one per head on average


def test_the_rule_is_declared_over_one_token_scorers_only() -> None:
    from kvpolicy import ExpectedAttention, HeadwiseEviction

    for scorer in (H2O(4, 2), TOVA(size=6, selection="per_head"), Knorm(size=6), KeyDiff(size=6, recent=1, refresh=1), ExpectedAttention(size=6)):
        rule = AdaKV(scorer, 0.5).headwise_eviction
        assert rule == HeadwiseEviction(limit=scorer.rule.limit, recent=scorer.rule.recent, floor=3)
    # CriticalKV changes the scores only: AdaKV over it applies its scorer's rule (rule_policy), on
    # CriticalKV's scores (the kit holds it to select: test_critical's AdaKV replays)
    from kvpolicy import CriticalKV

    for scorer in (Knorm(size=6), ExpectedAttention(size=6)):
        critical = AdaKV(CriticalKV(scorer), 0.5)
        assert critical.headwise_eviction == HeadwiseEviction(limit=6, recent=0, floor=3) == AdaKV(scorer, 0.5).headwise_eviction
    assert AdaKV(SnapKV(size=40)).headwise_eviction is None
    assert AdaKV(H2O(4, 2)).decode_eviction is None  # (the one-token rule per head does not describe AdaKV)
    for bad, match in [({"limit": 0}, "limit"), ({"limit": 3, "recent": 3}, "recent"), ({"limit": 3, "floor": 4}, "floor")]:
        with pytest.raises(ValueError, match=match):
            HeadwiseEviction(**bad)


def test_the_kit_fails_a_wrong_headwise_declaration() -> None:
    """A head-wise policy declaring the rule with another floor than select's: the kit names it."""
    from kvpolicy import HeadwiseEviction
    from kvpolicy.testing import ContractViolation, check_policy

    class WrongFloor(AdaKV):
        name = "adakv_wrong_floor_test"

        @property
        def headwise_eviction(self):
            rule = super().headwise_eviction
            return None if rule is None else HeadwiseEviction(rule.limit, rule.recent, 0)

    with pytest.raises(ContractViolation, match=r"declares HeadwiseEviction\(.*floor=0\), but at"):
        check_policy(lambda heavy, recent: WrongFloor(H2O(heavy, recent), 1.0), {"heavy": st.integers(1, 4), "recent": st.integers(1, 2)},
                     checks=["backends"], torch=False, settings=settings(max_examples=40, deadline=None))
