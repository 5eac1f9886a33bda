"""kvpolicy/budget.py: budgets, BUZZ's parameter-estimation theorem, the exact size simulation, and the
budgets, context and prompt lengths it refuses."""

from __future__ import annotations

import math
import warnings
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpolicy import (
    BUZZ,
    H2O,
    EvictionPolicy,
    Knorm,
    FullCache,
    LocalWindow,
    PolicyPlan,
    StreamingLLM,
    estimate_threshold,
    fixed_point_middle,
    make_policy,
    plan_policy,
    realised_budget,
    simulate_sizes,
    threshold_ratio,
)
from kvpolicy.budget import PLAN_TOLERANCE, plan_capacity, replay_sizes, smallest_size
from kvpolicy.policies import small_stride
from kvpolicy.testing import example_inputs
from kvpolicy_numpy import replay
from strategies import any_policy


BUDGETED = ["buzz", "buzz_logn", "h2o", "streaming_llm", "local"]
BUDGETS = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]


# ============================================================================ the theorem
def test_threshold_ratio_stride_5_is_the_papers_4_33() -> None:
    assert threshold_ratio(5) == pytest.approx(13 / 3, rel=1e-15)
    assert round(threshold_ratio(5), 2) == 4.33


@pytest.mark.parametrize("s", range(3, 52))
def test_threshold_ratio_matches_the_theorem_statement(s) -> None:
    """T/w = (s^2+1)/(s+1) for odd s, s-1 for even s (the statement; the paper's proof swaps
    the two cases)."""
    want = Fraction(s * s + 1, s + 1) if s % 2 else Fraction(s - 1)
    assert threshold_ratio(s) == pytest.approx(float(want), rel=1e-14)
    # and the proof's swapped assignment is wrong for every stride
    swapped = Fraction(s - 1) if s % 2 else Fraction(s * s + 1, s + 1)
    assert threshold_ratio(s) != pytest.approx(float(swapped), rel=1e-9)


@pytest.mark.parametrize("s", range(3, 30))
def test_small_stride(s) -> None:
    assert small_stride(s) == math.floor((s + 1) / 2)


@given(st.integers(3, 64), st.integers(1, 500))
def test_ratio_is_the_fixed_point_of_the_recurrence(s, threshold) -> None:
    """Iterating a -> a/s_hat + (T-a)/s (exact rationals) converges to T / ratio(s)."""
    s_hat = (s + 1) // 2
    a = Fraction(0)
    T = Fraction(threshold)
    for _ in range(200):
        a = a / s_hat + (T - a) / s
    assert float(a) == pytest.approx(threshold / threshold_ratio(s), rel=1e-12)
    assert fixed_point_middle(s, threshold) == pytest.approx(float(a), rel=1e-12)
    # a* is a fixed point exactly: f(a*) = a*
    a_star = T / (s - Fraction(s, s_hat) + 1)
    assert a_star / s_hat + (T - a_star) / s == a_star


@given(st.integers(3, 40), st.integers(1, 400))
def test_estimate_threshold(s, w) -> None:
    t = estimate_threshold(s, w)
    assert t == max(3, round(threshold_ratio(s) * w))
    assert BUZZ(sink=1, window=w, stride=s).threshold == t  # the default threshold


def test_estimate_threshold_examples() -> None:
    assert estimate_threshold(5, 30) == 130
    assert estimate_threshold(4, 10) == 30  # even: s - 1
    assert estimate_threshold(3, 1) == 3  # clamped to the smallest threshold that shrinks


# ============================================================================ size simulation
@given(any_policy(), st.integers(1, 80), st.data())
def test_simulate_sizes_equalsreplay_sizes(policy, steps, data) -> None:
    """Sizes depend on counts only: the planner's simulation is the replay's, on any scores."""
    prompt_len = data.draw(st.integers(0, steps))
    logits = np.random.default_rng(steps).normal(size=(steps, 1, steps))
    trace = replay(policy, logits, prompt_len, **example_inputs(policy, logits))  # keys (values, queries): Knorm, KeyDiff, Expected Attention
    assert simulate_sizes(policy, steps, prompt_len).tolist() == trace.sizes.tolist()


def test_simulate_sizes_examples() -> None:
    assert simulate_sizes(FullCache(), 5).tolist() == [1, 2, 3, 4, 5]
    assert simulate_sizes(LocalWindow(2), 5).tolist() == [1, 2, 3, 3, 3]
    assert simulate_sizes(StreamingLLM(1, 2), 6, prompt_length=2).tolist() == [3, 4, 4, 4]
    assert simulate_sizes(H2O(1, 1), 4).tolist() == [1, 2, 3, 3]


def test_realised_budget_definition() -> None:
    """Average size over the full cache's average on the same decode steps."""
    sizes = np.asarray([1, 2, 3, 3, 3])
    assert realised_budget(sizes, 5) == pytest.approx(12 / 5 / 3)
    assert realised_budget(np.asarray([3, 3]), 5, prompt_length=3) == pytest.approx(3 / 4.5)


# ============================================================================ budget realisation
@pytest.mark.parametrize("name", BUDGETED)
@pytest.mark.parametrize("context", [256, 1024, 4096])
def test_budget_realised_within_5_points(name, context) -> None:
    for budget in BUDGETS:
        plan = plan_policy(name, budget, context_length=context)
        sizes = simulate_sizes(plan.policy, context)
        realised = float(np.mean(sizes)) / float(np.mean(np.arange(1, context + 1)))
        assert abs(realised - budget) <= 0.05, (name, context, budget, realised, plan.policy)
        assert realised == pytest.approx(plan.realised_budget)
        assert plan.average_size == pytest.approx(float(np.mean(sizes)))


@pytest.mark.parametrize("name", BUDGETED)
@pytest.mark.parametrize("context, prompt", [(1024, 512), (4096, 3900)])
def test_budget_realised_with_a_prompt(name, context, prompt) -> None:
    for budget in [0.1, 0.3, 0.5, 0.9]:
        plan = plan_policy(name, budget, context_length=context, prompt_length=prompt)
        realised = realised_budget(simulate_sizes(plan.policy, context, prompt), context, prompt)
        assert abs(realised - budget) <= 0.05, (name, budget, realised, plan.policy)


@pytest.mark.parametrize("name", BUDGETED)
@pytest.mark.parametrize("context, prompt", [(300, 0), (512, 100)])
def test_budget_realised_by_a_real_replay(name, context, prompt) -> None:
    rng = np.random.default_rng(7)
    logits = rng.normal(size=(context, 1, context))
    logits[:, :, ::17] += 2.0  # a few heavy hitters
    for budget in [0.1, 0.3, 0.6, 0.9]:
        policy = make_policy(name, budget, context_length=context, prompt_length=prompt)
        trace = replay(policy, logits, prompt)
        assert abs(trace.realised_budget - budget) <= 0.05, (name, budget, trace.realised_budget, policy)


def test_make_policy_buzz_uses_the_theorem() -> None:
    p = make_policy("buzz", 0.3, context_length=4096)
    assert isinstance(p, BUZZ)
    assert p.threshold == estimate_threshold(p.stride, p.window)
    q = make_policy("buzz", 0.3, context_length=4096, stride=4, sink=1)
    assert (q.stride, q.sink) == (4, 1)
    assert q.threshold == estimate_threshold(4, q.window)
    r = make_policy("buzz", 0.3, context_length=4096, threshold=50)
    assert r.threshold == 50


def test_make_policy_examples() -> None:
    assert make_policy("h2o", 0.25, context_length=1024) == H2O(heavy=68, recent=68)
    p = make_policy("buzz_logn", 0.4, context_length=2048)
    assert isinstance(p, BUZZ) and p.log_n is not None and p.log_n.base == 512.0
    assert make_policy("full", 1.0, context_length=100) == FullCache()


def test_budget_is_monotone_in_the_request() -> None:
    sizes = [plan_policy("buzz", b, context_length=2048).average_size for b in BUDGETS]
    assert sizes == sorted(sizes)


def test_policy_plan_is_printable() -> None:
    plan = plan_policy("buzz", 0.3, context_length=4096, prompt_length=1000)
    assert isinstance(plan, PolicyPlan)
    text = str(plan)
    for needle in ["buzz", "threshold=", "capacity", "30.0%", "4096 tokens", "1000 prefilled"]:
        assert needle in text, needle
    d = plan.as_dict()
    assert d["policy"] == "buzz" and d["capacity"] == plan.policy.capacity
    assert d["params"] == plan.policy.params()
    assert plan.capacity == plan.policy.sink + plan.policy.window + plan.policy.threshold


# ---------------------------------------------------------------------------- T/w as a parameter
@given(st.floats(1.0, 8.0), st.floats(0.1, 0.6), st.sampled_from([3, 4, 5, 7]))
def test_threshold_ratio_round_trips_through_plan_policy(ratio, budget, stride) -> None:
    from kvpolicy import plan_capacity

    plan = plan_policy("buzz", budget, context_length=1056, prompt_length=32, threshold_ratio=ratio, stride=stride)
    p = plan.policy
    assert p.threshold == max(3, round(ratio * p.window))  # the ratio asked for (smallest legal T enforced)
    assert plan.threshold_ratio == ratio and plan.as_dict()["threshold_ratio"] == ratio
    # planning again with the same ratio at the realised budget gives back the same policy
    again = plan_policy("buzz", plan.realised_budget, context_length=1056, prompt_length=32, threshold_ratio=ratio,
                        stride=stride)
    assert again.policy == p
    assert make_policy("buzz", budget, context_length=1056, prompt_length=32, threshold_ratio=ratio, stride=stride) == p
    assert BUZZ.from_size(p.window * 3, threshold_ratio=ratio, stride=stride).threshold == max(
        3, round(ratio * BUZZ.from_size(p.window * 3, threshold_ratio=ratio, stride=stride).window))
    cap = plan_capacity("buzz", 80, context_length=1056, prompt_length=32, threshold_ratio=ratio, stride=stride)
    assert cap.capacity <= 80 and cap.policy.threshold == max(3, round(ratio * cap.policy.window))


def test_threshold_ratio_default_is_the_theorem() -> None:
    for budget in (0.1, 0.3, 0.5):
        a = plan_policy("buzz", budget, context_length=2048)
        b = plan_policy("buzz", budget, context_length=2048, threshold_ratio=None)
        assert a.policy == b.policy
        assert a.policy.threshold == estimate_threshold(5, a.policy.window)
    assert BUZZ.from_size(100) == BUZZ.from_size(100, threshold_ratio=None)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: plan_policy("buzz", 0.3, context_length=512, threshold_ratio=0), "threshold_ratio must be in"),
        (lambda: plan_policy("buzz", 0.3, context_length=512, threshold_ratio=-2.5), "threshold_ratio must be in"),
        (lambda: plan_policy("buzz", 0.3, context_length=512, threshold_ratio=float("inf")), "threshold_ratio must be in"),
        (lambda: plan_policy("buzz", 0.3, context_length=512, threshold_ratio="2.5"), "threshold_ratio must be a number"),
        (lambda: plan_policy("h2o", 0.3, context_length=512, threshold_ratio=2.5), "applies to BUZZ"),
        (lambda: make_policy("buzz", 0.3, context_length=512, threshold_ratio=2.5, threshold=40), "not both"),
        (lambda: BUZZ.from_size(100, threshold_ratio=2.5, threshold=40), "not both"),
        (lambda: BUZZ.from_size(100, threshold_ratio=0.0), "threshold_ratio must be in"),
    ],
)
def test_threshold_ratio_is_validated(call, message) -> None:
    with pytest.raises(ValueError, match=message):
        call()


def test_smallest_legal_threshold_still_enforced() -> None:
    p = BUZZ.from_size(12, threshold_ratio=0.1)
    assert p.threshold == 3
    assert plan_policy("buzz_logn", 0.2, context_length=400, threshold_ratio=0.05).policy.threshold == 3


# ---------------------------------------------------------------------------- equal capacity
@given(st.sampled_from(["local", "streaming_llm", "h2o", "buzz", "buzz_logn"]), st.integers(20, 400))
def test_plan_capacity_is_the_largest_policy_within_the_capacity(name, capacity) -> None:
    from kvpolicy import plan_capacity
    from kvpolicy.registry import get_policy

    plan = plan_capacity(name, capacity, context_length=1056, prompt_length=32)
    assert plan.capacity <= capacity and plan.requested_capacity == capacity
    entry = get_policy(name)
    fitting = [entry.from_size(s).capacity for s in range(entry.min_size, 2 * capacity)]
    assert plan.capacity == max(c for c in fitting if c <= capacity)  # no policy of this kind fits better
    sizes = simulate_sizes(plan.policy, 1056, 32)
    assert plan.average_size == pytest.approx(float(np.mean(sizes)))
    assert max(sizes) <= capacity


def test_plan_capacity_errors() -> None:
    from kvpolicy import plan_capacity

    with pytest.raises(ValueError, match="no capacity limit"):
        plan_capacity("full", 50, context_length=100)
    with pytest.raises(ValueError, match="capacity 3 is below the smallest"):
        plan_capacity("buzz", 3, context_length=100)
    with pytest.raises(ValueError, match="capacity must be"):
        plan_capacity("h2o", 0, context_length=100)


# ------------------------------------------------------- policies own their size rules (issue 12)
def test_the_planner_uses_a_third_party_size_rule_and_it_must_agree() -> None:
    """A policy outside the package declares its size rule; simulate_sizes calls it (not the
    replay), and a subclass that redefines select goes without it when it says so."""
    from kvpolicy import EvictionPolicy, LocalWindow
    from kvpolicy.budget import replay_sizes

    calls = []

    class Halving(EvictionPolicy):
        name = "halving_test"
        capacity = None

        def __init__(self, limit: int) -> None:
            super().__init__()
            self.limit = limit

        def select(self, view):
            n = view.n_cached
            return None if n <= self.limit else view.keep(view.arange(n - n // 2, n))

        def size_rule(self):
            def rule(n, state):  # select keeps the newest n // 2, until at most limit
                calls.append(n)
                while n > self.limit:
                    n //= 2
                return n

            return rule

    p = Halving(6)
    assert simulate_sizes(p, 40, 3).tolist() == replay_sizes(p, 40, 3).tolist()
    assert calls, "the declared rule was not used"

    class Odd(LocalWindow):
        decode_eviction = size_rule = None  # its own select: no inherited rule

        def select(self, view):
            n = view.n_cached
            return None if n <= self.window else view.keep(view.arange(0, n, 2))

    assert Odd(window=4).size_rule() is None and LocalWindow(window=4).size_rule() is not None
    assert simulate_sizes(Odd(window=4), 30).tolist() == replay_sizes(Odd(window=4), 30).tolist()


def test_every_builtin_one_token_policy_declares_its_size_rule() -> None:
    """A built-in that evicts one token a decode step (it declares a DecodeEviction) declares its
    size rule too, so the planner never replays it, and the rule gives the replay's sizes. The
    one exception is a composition: its prompt is the prefill policy's, which a rule of counts
    cannot tell from a decode step (it is replayed, exactly)."""
    from kvpolicy import Composed, available_policies
    from kvpolicy.budget import replay_sizes
    from kvpolicy.registry import Preset

    one_token = []
    for name, entry in available_policies().items():
        cls = entry.cls if isinstance(entry, Preset) else entry
        if not cls.__module__.startswith("kvpolicy.policies") or not cls.evicts:
            continue
        needs = {"compose": {"decode": "h2o"}, "pyramid": {"base": "h2o"}, "adakv": {"scorer": "h2o"}}.get(name, {})  # planned from another's name
        policy = entry.from_size(max(entry.min_size, 24), **needs)
        if policy.decode_eviction is None or isinstance(policy, Composed):
            continue
        one_token.append(name)
        assert policy.size_rule() is not None, name
        assert simulate_sizes(policy, 120, 40).tolist() == replay_sizes(policy, 120, 40).tolist(), name
    assert {"h2o", "tova", "streaming_llm", "local", "knorm", "keydiff", "pyramid_h2o"} <= set(one_token)


def test_every_builtin_builds_from_a_size_through_the_registry() -> None:
    """Each built-in that evicts is built from a size by its registry entry alone (from_size, no
    switch on its name), at its smallest size and above, and fits a capacity the same way."""
    from kvpolicy import available_policies
    from kvpolicy.budget import fit_capacity
    from kvpolicy.registry import Preset

    for name, entry in available_policies().items():
        cls = entry.cls if isinstance(entry, Preset) else entry
        if not cls.__module__.startswith("kvpolicy.policies") or not cls.evicts:
            continue
        if cls.from_size.__func__ is EvictionPolicy.from_size.__func__:  # no size knob: none today
            pytest.fail(f"{name} has no from_size")
        needs = {"compose": {"decode": "h2o"}, "pyramid": {"base": "h2o"}, "adakv": {"scorer": "h2o"}}.get(name, {})  # a class planned from another's name
        for size in (entry.min_size, entry.min_size + 1, 64, 300):
            policy = entry.from_size(size, **needs)
            assert isinstance(policy, cls) and policy == entry.from_size(size, **needs), (name, size)
        if policy.capacity is not None:
            assert fit_capacity(entry, policy.capacity, **needs).capacity == policy.capacity, name


# ---------------------------------------------------------------------------- validation: bad input raises a ValueError naming the parameter


def test_window_must_be_positive_for_estimate_threshold() -> None:
    with pytest.raises(ValueError, match="window must be >= 1"):
        estimate_threshold(5, 0)


@pytest.mark.parametrize("bad", [0, 0.0, -0.1, 1.0001, 1.5, float("nan"), float("inf")])
def test_budget_outside_0_1(bad) -> None:
    with pytest.raises(ValueError, match=r"budget must be in \(0\.0, 1\.0\]"):
        make_policy("buzz", bad, context_length=1024)
    with pytest.raises(ValueError, match=r"budget must be in \(0\.0, 1\.0\]"):
        plan_policy("h2o", bad, context_length=1024)


def test_budget_1_is_allowed() -> None:
    plan = plan_policy("streaming_llm", 1.0, context_length=256)
    assert plan.realised_budget == pytest.approx(1.0, abs=0.05)


@pytest.mark.parametrize("budget", [0.1, 0.5, 0.999])
def test_full_cache_budget_below_1(budget) -> None:
    with pytest.raises(ValueError, match="budget for the 'full' policy must be 1.0"):
        make_policy("full", budget, context_length=100)


def test_budget_below_what_the_policy_reaches() -> None:
    with pytest.raises(ValueError, match=r"budget 0.01 is below the smallest buzz reaches .*allowed range"):
        make_policy("buzz", 0.01, context_length=64)


@pytest.mark.parametrize("context", [0, -5])
def test_context_length(context) -> None:
    with pytest.raises(ValueError, match="context_length must be >= 1"):
        make_policy("buzz", 0.3, context_length=context)
    with pytest.raises(ValueError, match="context_length must be >= 1"):
        simulate_sizes(LocalWindow(3), context)


def test_prompt_length_must_leave_a_decode_step() -> None:
    with pytest.raises(ValueError, match="prompt_length must be >= 0 and <= 99"):
        make_policy("buzz", 0.3, context_length=100, prompt_length=100)


def test_unknown_parameter_override() -> None:
    # the declared parameters (kvpolicy.Param) say which names exist: a ValueError listing them
    with pytest.raises(ValueError, match="unknown parameter windw for H2O; its parameters: heavy, recent, selection"):
        make_policy("h2o", 0.3, context_length=100, windw=3)


def test_realised_budget_without_decode_steps() -> None:
    trace = replay(LocalWindow(2), np.zeros((5, 1, 5)), prompt_len=5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "mean of empty slice" on the way to the error
        with pytest.raises(ValueError, match=r"realised_budget needs at least one decode step: prompt_len must be < steps, got prompt_len = steps = 5"):
            trace.realised_budget
        with pytest.raises(ValueError, match=r"^prompt_length must be >= 0 and <= 4, got 5$"):
            realised_budget(np.zeros(0), 5, 5)
    # one decode step is enough
    assert replay(LocalWindow(2), np.zeros((5, 1, 5)), prompt_len=4).realised_budget == pytest.approx(3 / 5)


@pytest.mark.parametrize("n", [0, 2, 4])
def test_realised_budget_sizes_must_match_the_run(n) -> None:
    with pytest.raises(ValueError, match=rf"^sizes must hold one size per decode step, shape \(3,\), got \({n},\)$"):
        realised_budget(np.ones(n), 5, prompt_length=2)


# ---------------------------------------------------------------------------- the exact size simulation of the built-in policies (issue 7's fast path)


@given(any_policy(), st.integers(1, 160), st.data())
def test_size_rule_equals_replaying_the_policy(policy, context, data) -> None:
    prompt = data.draw(st.integers(0, context))
    np.testing.assert_array_equal(simulate_sizes(policy, context, prompt), replay_sizes(policy, context, prompt))


def test_subclasses_are_replayed_not_simulated() -> None:
    class EveryOther(StreamingLLM):  # a subclass may change select: the size rule must not apply
        decode_eviction = size_rule = None  # its own select: no inherited rule

        def select(self, view):
            n = view.n_cached
            if n <= self.sink + self.window:
                return None
            return view.keep(view.arange(0, n, 2))

    p = EveryOther(sink=1, window=3)
    np.testing.assert_array_equal(simulate_sizes(p, 40, 5), replay_sizes(p, 40, 5))
    assert simulate_sizes(p, 40, 5).tolist() != simulate_sizes(StreamingLLM(sink=1, window=3), 40, 5).tolist()


# ============================================================================ overrides the smallest size refuses (issue 44, class 7)
@pytest.mark.parametrize("name", ["knorm", "tova", "keydiff", "h2o", "expected_attention", "adakv_h2o", "adakv_tova",
                                  "adakv_keydiff", "adakv_expected_attention"])
@given(recent=st.integers(1, 12))
def test_an_override_plans_the_sizes_it_fits(name, recent) -> None:
    """``recent=`` needs a size with room for it: the planners start from the smallest size that
    accepts the override (they used to try ``min_size`` first and be refused, "recent must be
    >= 0 and <= 0"), and the plan keeps the override."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (a coarse plan on a short run may warn: not what this checks)
        policy = make_policy(name, 0.4, context_length=100, recent=recent)
        capped = plan_capacity(name, 40, context_length=100, recent=recent).policy
    for p in (policy, capped):
        assert getattr(getattr(p, "scorer", p), "recent") == recent
    assert capped.capacity <= 40


@pytest.mark.parametrize("plan", [lambda **kw: make_policy("knorm", 0.3, context_length=100, **kw),
                                  lambda **kw: plan_capacity("knorm", 20, context_length=100, **kw)], ids=["budget", "capacity"])
def test_overrides_the_planner_cannot_fit_are_refused_by_name(plan) -> None:
    with pytest.raises(ValueError, match=r"size=5 cannot be an override: size is what the planner sets"):
        plan(size=5)  # (was a raw TypeError: from_size() got multiple values for argument 'size')
    with pytest.raises(ValueError, match=r"recent=-1 cannot be planned for knorm: .*recent must be >= 0"):
        plan(recent=-1)


def test_smallest_size_is_the_first_size_an_override_fits() -> None:
    assert smallest_size("knorm", 100) == 1
    for recent in range(1, 20):
        first = smallest_size("knorm", 100, recent=recent)
        Knorm.from_size(first, recent=recent)
        with pytest.raises(ValueError):
            Knorm.from_size(first - 1, recent=recent)


def test_cli_plan_set_recent_plans(capsys) -> None:
    from kvpolicy_tools.cli import main
    assert main(["plan", "knorm", "--budget", "0.3", "--context", "100", "--set", "recent=1"]) == 0
    assert "recent=1" in capsys.readouterr().out


# ============================================================================ a plan far from its request (issue 44, class 13)
def test_a_plan_far_from_its_request_warns() -> None:
    with pytest.warns(UserWarning, match=r"budget 0.01 is far from what local can realise .* realises 0.039 \(3.9x"):
        plan = plan_policy("local", 0.01, context_length=100)
    assert plan.realised_budget == pytest.approx(0.0394, abs=1e-4)


@given(budget=st.floats(0.05, 1.0), context=st.integers(50, 400))
def test_a_plan_warns_exactly_when_it_is_far_from_its_request(budget, context) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            plan = plan_policy("h2o", budget, context_length=context)
        except ValueError:
            return  # below the smallest H2O reaches: refused, not planned
    far = abs(plan.realised_budget - budget) > PLAN_TOLERANCE * budget
    said = any("is far from what" in str(w.message) or "out of reach" in str(w.message) for w in caught)
    assert said == (far or plan.realised_budget < budget - 0.05)


def test_a_prompt_only_policy_planned_without_a_prompt_says_why() -> None:
    """Issue 44's re-probe: `plan snapkv --context 100 --budget 0.3` said only "allowed range: [1.000,
    1]"; SnapKV compresses a prompt, so a run without one keeps everything: the error says so."""
    import pytest

    from kvpolicy import plan_policy

    with pytest.raises(ValueError, match=r"allowed range: \[1.000, 1\] \(it keeps every token of a run without a prompt: give prompt_length"):
        plan_policy("snapkv", 0.3, context_length=100)
    assert abs(plan_policy("snapkv", 0.3, context_length=100, prompt_length=80).realised_budget - 0.3) < 0.05
