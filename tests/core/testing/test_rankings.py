"""kvpolicy/testing/rankings.py: the kit's ``ranking`` and ``head_ties`` properties (issue 44, classes 1
and 2). Every built-in scorer's ranking() agrees with its select(); AdaKV breaks ties between heads as
docs/policies.md says (the lower head's token goes first) on both backends; a scorer whose ranking is
reversed, and a head-wise policy breaking head ties the other way, fail check_policy by name."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import Phase, settings
from hypothesis import strategies as st

import kvpolicy_numpy
from kvpolicy import H2O, TOVA, AdaKV, CacheView, ExpectedAttention, KeyDiff, Knorm, SnapKV
from kvpolicy.policy import Ranking
from kvpolicy.testing import ContractViolation, check_policy
from kvpolicy.testing.rankings import check_head_ties, check_ranking, ranking_lengths

FIXED = settings(max_examples=30, derandomize=True, database=None, deadline=None)
#: For policies broken on purpose: the first failing example, unshrunk (shrinking takes a minute).
UNSHRUNK = settings(FIXED, phases=[Phase.explicit, Phase.generate])
HEADS = st.fixed_dictionaries({"heavy": st.integers(1, 4), "recent": st.integers(1, 3)})


class ReversedRanking(H2O):
    """H2O whose ranking() says the opposite of its select(): the highest score goes first."""

    name = "reversed_ranking_test"
    decode_eviction = H2O.decode_eviction
    size_rule = H2O.size_rule  # (select is H2O's: only the declared ranking is wrong)

    def ranking(self, view: CacheView) -> Ranking:
        ranked = super().ranking(view)
        return Ranking(ranked.protected, tuple(-key for key in ranked.keys))


class UpperHeadFirst(AdaKV):
    """AdaKV breaking a tie between heads the other way: it decides on the heads in reverse order."""

    name = "upper_head_first_test"
    decode_eviction = AdaKV.decode_eviction
    headwise_eviction = None  # (AdaKV's rule breaks head ties the documented way: this select does not)
    size_rule = AdaKV.size_rule  # (the same sizes: only which head loses a tied token differs)

    def select(self, view: CacheView):
        flip = CacheView(view.positions[:, ::-1], view.scores[:, ::-1], view.n_seen, view.state, view.phase)
        keep = super().select(flip)
        return None if keep is None else np.ascontiguousarray(np.asarray(keep)[:, ::-1])


@pytest.mark.parametrize("scorer", [H2O, TOVA, Knorm, KeyDiff, SnapKV, ExpectedAttention], ids=lambda c: c.__name__)
def test_every_built_in_scorer_ranks_as_it_selects(scorer) -> None:
    report = check_policy(scorer, checks=["ranking"], torch=False, settings=FIXED)
    assert report.results == {"ranking": "passed"}


def test_a_reversed_ranking_fails_the_kit_by_name() -> None:
    """Class 1: the kit never held ranking() to select(), so a reversed scorer passed, and AdaKV over it
    at alpha_safeguard=1.0 ("the scorer itself, token for token") kept the opposite tokens."""
    logits = np.random.default_rng(0).normal(size=(16, 2, 16))
    scorer = ReversedRanking(heavy=3, recent=1)
    alone = kvpolicy_numpy.replay(scorer, logits, prompt_len=6)
    wrapped = kvpolicy_numpy.replay(AdaKV(scorer, alpha_safeguard=1.0), logits, prompt_len=6)
    assert any(not np.array_equal(a, b) for a, b in zip(alone.kept[6:], wrapped.kept[6:]))  # what the kit must catch
    with pytest.raises(ContractViolation, match=r"\[ranking\] ReversedRanking\(heavy=\d, recent=\d\)'s ranking\(\) does not order "
                                                r"the tokens as its select\(\) keeps them(.|\n)*check_ranking\(ReversedRanking"):
        check_policy(ReversedRanking, HEADS, checks=["ranking"], torch=False, settings=UNSHRUNK)
    with pytest.raises(ContractViolation, match=r"select\(\) kept slots \[0, 1, 3\], but the 3 tokens .* are slots \[1, 2, 3\]"):
        check_ranking(ReversedRanking(heavy=2, recent=1), np.array([[[4.0, 3.0, 2.0, 1.0]]]))


def test_check_ranking_compares_only_where_the_policy_evicts() -> None:
    assert ranking_lengths(SnapKV(size=4, window=2), "prefill", count=2) == [5, 6]
    assert ranking_lengths(SnapKV(size=4, window=2), "decode") == []  # (SnapKV evicts after a prompt only)
    check_ranking(ReversedRanking(heavy=2, recent=1), np.array([[[4.0, 3.0, 2.0]]]))  # 3 tokens: it keeps them all


@pytest.mark.parametrize("scorer", ["h2o", "tova", "knorm", "keydiff", "snapkv", "expected_attention"])
def test_adakv_breaks_ties_between_heads_as_documented_on_both_backends(scorer) -> None:
    """Class 2: docs/policies.md said the lower head keeps a token tied with another head's; the code
    (both backends run kvpolicy.policies.headwise_keep) evicts the lower head's first, the order
    kvpress's flat top-k over [heads x tokens] gives in the earliest-first order kvpolicy uses
    within a head. The doc now says so, and the kit holds AdaKV over every scorer, NumPy and torch
    views, to the rule read literally (documented_headwise_keep)."""
    pytest.importorskip("torch")
    from kvpolicy import get_policy

    entry = get_policy(scorer)
    report = check_policy(st.builds(lambda size, alpha: AdaKV(entry.from_size(size, selection="per_head"), alpha),
                                    st.integers(entry.min_size, entry.min_size + 6), st.sampled_from([0.0, 0.3, 1.0])),
                          checks=["head_ties"], torch=True, settings=FIXED)
    assert report.results == {"head_ties": "passed"}


def test_the_lower_heads_token_goes_first_on_a_full_tie() -> None:
    """The smallest case: two heads of 3 tokens keep 4 (b = 2, no floor, the newest protected); the
    lowest is head 0's token 0, then token 1 ties in every key (score 1, position 1) in both heads:
    head 0's goes, on NumPy and torch views alike."""
    policy = AdaKV(H2O(heavy=1, recent=1), alpha_safeguard=0.0)
    positions = np.broadcast_to(np.arange(3), (1, 2, 3)).copy()
    scores = np.array([[[0.0, 1.0, 5.0], [3.0, 1.0, 5.0]]])
    assert policy.select(CacheView(positions, scores, 3, policy.init_state())).tolist() == [[[-1, -1, 2], [0, 1, 2]]]
    torch = pytest.importorskip("torch")
    view = CacheView(torch.as_tensor(positions), torch.as_tensor(scores), 3, policy.init_state())
    assert policy.select(view).tolist() == [[[-1, -1, 2], [0, 1, 2]]]
    check_head_ties(policy, scores, positions, torch=True)
    with pytest.raises(ContractViolation, match=r"head 0 keeps slots \[2\], but select\(\) kept \[1, 2\]"):
        check_head_ties(UpperHeadFirst(H2O(heavy=1, recent=1), 0.0), scores, positions)


def test_head_ties_the_other_way_fail_the_kit_by_name() -> None:
    with pytest.raises(ContractViolation, match=r"\[head_ties\] AdaKV\(.*broke ties between heads otherwise than "
                                                r"docs/policies.md says \(NumPy view(.|\n)*check_head_ties\("):
        check_policy(lambda heavy, recent: UpperHeadFirst(H2O(heavy, recent), 0.0), HEADS, checks=["head_ties"], torch=False,
                     settings=UNSHRUNK)
    report = check_policy(lambda heavy, recent: AdaKV(H2O(heavy, recent), 0.0), HEADS, checks=["head_ties", "ranking"],
                          torch=False, settings=FIXED)
    assert report.results == {"head_ties": "passed",
                              "ranking": "skipped: no drawn policy ranks tokens (ranking() and head_budget())"}
