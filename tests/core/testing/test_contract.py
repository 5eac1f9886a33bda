"""kvpolicy.testing, the conformance kit (kvpolicy/testing/contract.py, with the drivers and timing behind
it): every built-in policy passes it (through the pytest fixture third parties use), its pieces do what
they say, and it catches deliberately broken
policies, printing code that replays the shrunk example."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

import kvpolicy.policies
import kvpolicy_numpy
from kvpolicy import BUZZ, H2O, TOVA, EvictionPolicy, ExpectedAttention, FullCache, KeyDiff, Knorm, LocalWindow, Param, PolicyError, Scissorhands, SnapKV, StreamingLLM, get_policy
from kvpolicy.policy import DECLARED_RULES
from kvpolicy.validation import check_int
from kvpolicy.testing import (
    ContractViolation,
    example_inputs,
    benchmark_policy,
    check_policy,
    check_replay,
    follows_builtin_rules,
    keeps_first,
    make_logits,
    policy_workload,
)
from kvpolicy.testing.strategies import replay_cases

ROOT = Path(__file__).resolve().parents[3]

#: Broken policies are searched deterministically, with a fixed budget (whatever the profile).
FIXED = settings(max_examples=30, derandomize=True, database=None, deadline=None)


# ============================================================================ built-ins pass
BUILTINS = [BUZZ, H2O, StreamingLLM, LocalWindow, FullCache, get_policy("buzz_logn"), TOVA, SnapKV, Scissorhands, Knorm, KeyDiff, ExpectedAttention]


@pytest.mark.parametrize(
    "factory", BUILTINS, ids=["buzz", "h2o", "streaming_llm", "local", "full", "buzz_logn", "tova", "snapkv", "scissorhands", "knorm", "keydiff", "expected_attention"]
)
def test_builtin_policy_keeps_the_contract(kvpolicy_contract, factory) -> None:
    """Each built-in, each property of the contract (the fixture parametrizes over them), with
    the policies' own promises (sink / window / recent kept, the full cache keeps all)."""
    report = kvpolicy_contract(factory, invariants=follows_builtin_rules)
    # (ranking: for the policies that rank tokens; head_ties: for AdaKV, tests/core/policies/test_adakv.py)
    scorer = factory in (H2O, TOVA, SnapKV, Knorm, KeyDiff, ExpectedAttention)
    assert list(report.results) and all(v.startswith("passed") or (k == "head_ties" or (k == "ranking" and not scorer))
                                        and v.startswith("skipped") for k, v in report.results.items()), report.results


def test_the_lockstep_driver_is_the_reference_replay() -> None:
    """The kit's NumPy/torch driver, on one sequence, keeps exactly what kvpolicy_numpy.replay
    keeps (same operations, same bits), so its verdicts are about the policy, not the driver."""
    from kvpolicy.testing._driver import run_replay

    @FIXED
    @given(replay_cases())
    def check(case) -> None:
        policy, logits, prompt_len = case
        ref = kvpolicy_numpy.replay(policy, logits, prompt_len, **example_inputs(policy, logits))
        mine = run_replay(policy, logits[None], prompt_len, torch=False)
        for t, (a, b) in enumerate(zip(ref.kept, mine)):
            assert (a is None) == (b is None), t
            if a is not None:
                assert np.array_equal(a, b[0]), (policy, prompt_len, t)

    check()


# ============================================================================ broken policies
class RarelyOverCapacity(EvictionPolicy):
    """StreamingLLM's rule with a rare bug: after a prefill of exactly 7 tokens on a cache of 3
    KV heads it forgets to evict, so the cache exceeds its capacity. Among the replay inputs the
    kit draws (``replay_cases`` of this policy) about one in 1,250 triggers it (measured over
    5,000 draws); the kit's ``sizes`` sweep finds it within a few examples."""

    name = "rarely_over_capacity"
    uses_scores = False

    def __init__(self, sink: int = 1, window: int = 4) -> None:
        super().__init__()
        self.sink = check_int("sink", sink, minimum=1)
        self.window = check_int("window", window, minimum=1)

    @property
    def capacity(self) -> int:
        return self.sink + self.window + 1

    def select(self, view):
        n = view.n_cached
        if n <= self.sink + self.window:
            return None
        if view.phase == "prefill" and view.n_seen == 7 and view.heads == 3:
            return None  # the bug
        return view.keep(view.arange(self.sink), view.arange(n - self.window, n))

    def params(self) -> dict[str, Any]:
        return {"sink": self.sink, "window": self.window}


class TopkHeavy(EvictionPolicy):
    """Heavy hitters plus a recent window, written twice: NumPy keeps the earliest of tied scores
    (a stable argsort), torch the latest (a stable sort of the reversed scores: on purpose, so
    that every tie disagrees; ``torch.topk``'s own tie order is implementation-defined and let the
    kit's examples pass once). Correct on NumPy alone."""

    name = "topk_heavy"

    def __init__(self, heavy: int = 4, recent: int = 2) -> None:
        super().__init__()
        self.heavy = check_int("heavy", heavy, minimum=1)
        self.recent = check_int("recent", recent, minimum=1)

    @property
    def capacity(self) -> int:
        return self.heavy + self.recent + 1

    def select(self, view):
        n = view.n_cached
        if n <= self.heavy + self.recent:
            return None
        xp = view.xp
        candidates = view.scores[..., : n - self.recent]
        if "torch" in xp.__name__:
            import torch

            width = candidates.shape[-1]
            order = torch.argsort(candidates.flip(-1), dim=-1, descending=True, stable=True)
            top = (width - 1 - order)[..., : self.heavy]  # ties: latest
        else:
            top = np.argsort(-candidates, axis=-1, kind="stable")[..., : self.heavy]  # ties: earliest
        return view.keep(xp.sort(top, axis=-1), view.arange(n - self.recent, n))

    def params(self) -> dict[str, Any]:
        return {"heavy": self.heavy, "recent": self.recent}


def _replay_block(message: str) -> str:
    """The code after 'Replay it:' in a ContractViolation message."""
    assert "Replay it:\n" in message, message
    return textwrap.dedent(message.split("Replay it:\n", 1)[1])


def test_rare_capacity_bug_is_caught_and_replayable(capsys) -> None:
    with pytest.raises(ContractViolation) as exc:
        check_policy(
            RarelyOverCapacity,
            {"sink": st.integers(1, 3), "window": st.integers(1, 4)},
            checks=["replay", "sizes"],
            torch=False,
            settings=FIXED,
        )
    msg = str(exc.value)
    assert "kept 7 tokens after a prefill of 7 tokens" in msg
    assert "from test_contract import RarelyOverCapacity" in msg
    # the shrunk example, as a kvpolicy_numpy.replay call
    call = re.search(r"kvpolicy_numpy\.replay\((RarelyOverCapacity\(.*?\)), np\.zeros\(\(7, 3, 7\)\), prompt_len=7\)", msg)
    assert call, msg
    code = _replay_block(msg)
    namespace: dict = {}
    with pytest.raises(ContractViolation, match="kept 7 tokens"):
        exec(compile(code, "<replay>", "exec"), namespace)  # the last line re-raises the error
    assert eval(call.group(1), {"RarelyOverCapacity": RarelyOverCapacity}).capacity < 7


def test_rare_bug_replays_through_kvpolicy_numpy() -> None:
    """The printed replay, by itself, shows the capacity exceeded (no kit involved): the reference
    backend refuses to go on with more tokens than the capacity."""
    policy = RarelyOverCapacity(sink=1, window=1)
    with pytest.raises(PolicyError, match="stopped evicting with 7 tokens cached, more than its capacity 3"):
        kvpolicy_numpy.replay(policy, np.zeros((7, 3, 7)), prompt_len=7)
    assert kvpolicy_numpy.replay(policy, np.zeros((8, 2, 8)), prompt_len=7).kept[6].shape[1] == 2  # 2 heads: fine


def test_torch_numpy_tie_disagreement_is_caught_and_replayable() -> None:
    pytest.importorskip("torch")
    # correct on NumPy alone
    check_policy(TopkHeavy, checks=["replay", "full_cache"], torch=False, settings=FIXED)
    with pytest.raises(ContractViolation) as exc:
        check_policy(TopkHeavy, checks=["backends"], settings=FIXED)
    msg = str(exc.value)
    assert "NumPy and torch kept different positions" in msg
    assert "kvpolicy.testing.compare_backends(TopkHeavy(" in msg and "from test_contract import TopkHeavy" in msg
    with pytest.raises(ContractViolation, match="NumPy and torch kept different positions"):
        exec(compile(_replay_block(msg), "<replay>", "exec"), {})
    # and the shrunk logits are one-hot attention: ties are what broke it
    assert "10000.0" in msg


# Smaller mutants: one per rule, each caught by the property that owns the rule.
class ScoreGated(LocalWindow):
    """Decides *whether* from the score values (a device sync on CUDA)."""

    decode_eviction = size_rule = None  # its own select: no inherited rule

    def select(self, view):
        if float(view.xp.max(view.scores)) > 0.5:
            return super().select(view)
        return None


class Forgetful(LocalWindow):
    """Keeps per-sequence state on the policy object, so two replays differ."""

    def __init__(self, window: int) -> None:
        super().__init__(window)
        self.calls = 0

    decode_eviction = size_rule = None  # its own select: no inherited rule

    def select(self, view):
        self.calls += 1
        keep = super().select(view)
        if keep is not None and self.calls % 7 == 0 and self.window > 1:
            return view.keep(view.arange(view.n_cached - self.window + 1, view.n_cached))  # one fewer, now and then
        return keep


class Eager(StreamingLLM):
    """Evicts one token before its declared capacity is reached."""

    decode_eviction = size_rule = None  # its own select: no inherited rule

    def select(self, view):
        n = view.n_cached
        if n < self.sink + self.window:
            return None
        return view.keep(view.arange(self.sink), view.arange(n - self.window + 1, n))


class Descending(LocalWindow):
    """Returns its slots in descending order."""

    decode_eviction = size_rule = None  # its own select: no inherited rule

    def select(self, view):
        keep = super().select(view)
        return None if keep is None else view.xp.flip(keep, axis=-1)


class SinkLoser(StreamingLLM):
    """Drops the first sink token on odd steps: breaks its own (declared) invariant."""

    decode_eviction = size_rule = None  # its own select: no inherited rule

    def select(self, view):
        n = view.n_cached
        if n <= self.sink + self.window:
            return None
        first = 1 if view.n_seen % 2 and self.sink > 1 else 0
        return view.keep(view.arange(first, self.sink), view.arange(n - self.window, n))

    def invariants(self, kept, t):
        return keeps_first("sink")(self, kept, t)


@pytest.mark.parametrize(
    "policy_factory, params, check, expected",
    [
        (ScoreGated, {"window": st.integers(1, 4)}, "backends", "depends on the score values"),
        (Forgetful, {"window": st.integers(2, 4)}, "replay", "select() changed self.calls"),
        (Eager, {"sink": st.integers(1, 3), "window": st.integers(2, 5)}, "full_cache", "before its cache reached its capacity"),
        (Descending, {"window": st.integers(2, 5)}, "backends", "not strictly ascending"),
        (SinkLoser, {"sink": st.integers(2, 3), "window": st.integers(1, 3)}, "replay", "keeps_first('sink')"),
        (SinkLoser, {"sink": st.integers(2, 3), "window": st.integers(1, 3)}, "stateful", "keeps_first('sink')"),
    ],
    ids=["whether-from-scores", "state-on-self", "evicts-early", "unsorted-slots", "invariant-replay", "invariant-stateful"],
)
def test_each_rule_catches_its_mutant(policy_factory, params, check, expected) -> None:
    # detection only: no shrinking (the tests above check the shrunk examples and their replays)
    no_shrink = settings(FIXED, phases=[Phase.explicit, Phase.reuse, Phase.generate])
    with pytest.raises(ContractViolation, match=re.escape(expected)) as exc:
        check_policy(policy_factory, params, checks=[check], torch=False, settings=no_shrink)
    assert f"[{check}]" in str(exc.value) and "Replay it:" in str(exc.value)


def test_invariants_argument_and_false_return() -> None:
    def never(policy, kept, t):
        return t < 3  # False from token 3 on

    with pytest.raises(ContractViolation, match=r"never does not hold after token \d+"):
        check_policy(LocalWindow, {"window": st.just(2)}, invariants=never, checks=["replay"], torch=False, settings=FIXED)


# ============================================================================ the kit's pieces
def test_check_policy_arguments_and_report() -> None:
    with pytest.raises(ValueError, match="unknown checks"):
        check_policy(LocalWindow, checks=["nope"])
    report = check_policy(LocalWindow(window=3), checks=["replay", "backends"], torch=False, settings=settings(max_examples=3))
    assert report.passed == ["replay", "backends"] and report.results["backends"].startswith("passed (NumPy only")
    assert "LocalWindow(window=3)" in str(report)
    trace = check_replay(H2O(heavy=2, recent=2), make_logits(12, 2, kind="onehot", seed=1), prompt_len=3)
    assert trace.kept[-1].shape == (2, 4)


def test_compare_backends_batch_rows_are_independent() -> None:
    from kvpolicy.testing import compare_backends

    class RowLeak(H2O):
        """Decides on scores summed over the batch: rows leak into each other."""

        decode_eviction = size_rule = None  # its own select: no inherited rule

        def select(self, view):
            n = view.n_cached
            if n <= self.heavy + self.recent:
                return None
            xp = view.xp
            summed = xp.sum(view.scores, axis=0, keepdims=True) + 0 * view.scores
            order = xp.argsort(summed[..., : n - self.recent], axis=-1, stable=True)
            heavy = xp.sort(order[..., n - self.heavy - self.recent :], axis=-1)
            return view.keep(heavy, view.arange(n - self.recent, n))

    logits = make_logits(16, 2, kind="onehot", seed=3, batch=2)
    compare_backends(H2O(heavy=2, recent=2), logits, 0, group=2, torch=False)
    with pytest.raises(ContractViolation, match="rows of a batch must be independent"):
        compare_backends(RowLeak(heavy=2, recent=2), logits, 0, group=2, torch=False)


# ============================================================================ the pytest plugin
def test_kit_without_torch() -> None:
    """kvpolicy.testing imports and runs with torch blocked; loading the plugin imports neither
    torch nor hypothesis."""
    from blocked import run_blocked

    res = run_blocked(
        """
        import sys
        import kvpolicy.testing.plugin
        assert "hypothesis" not in sys.modules and "torch" not in sys.modules
        from hypothesis import settings
        from kvpolicy import H2O
        from kvpolicy.testing import check_policy, benchmark_policy
        report = check_policy(H2O, settings=settings(max_examples=5))
        assert report.results["backends"] == "passed (NumPy only: torch is not installed)", report.results
        result = benchmark_policy(H2O, sizes=(32, 64), rounds=1, target_s=0.001)
        assert {r["backend"] for r in result.rows} == {"numpy"}
        assert "torch" not in sys.modules
        print("ok")
        """
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"


# ============================================================================ complexity timing
class EveryOther(EvictionPolicy):
    """Keeps the last ``window`` positions and thins the older ones to every other one when they
    reach ``limit`` (evicts every ``limit / 2`` steps or so)."""

    name = "every_other_test"
    uses_scores = False

    def __init__(self, window: int = 8, limit: int = 8) -> None:
        super().__init__()
        self.window = check_int("window", window, minimum=1)
        self.limit = check_int("limit", limit, minimum=2)

    @property
    def capacity(self) -> int:
        return self.limit + self.window

    def select(self, view):
        past = view.n_cached - self.window
        if past < self.limit:
            return None
        return view.keep(view.arange(0, past, 2), view.arange(past, view.n_cached))

    def params(self) -> dict[str, Any]:
        return {"window": self.window, "limit": self.limit}

    @classmethod
    def from_size(cls, size: int, **overrides: Any) -> "EveryOther":
        return cls(window=size // 2, limit=size - size // 2)


def sized_window(size: int) -> LocalWindow:
    """A size factory for ``kvpolicy bench --policy test_contract:sized_window``."""
    return LocalWindow(window=size - 1)


def budget_window(budget, context_length, prompt_length) -> LocalWindow:
    """A budget factory: decode benchmarks take it, complexity timing cannot."""
    return LocalWindow(window=max(1, int(budget * context_length)))


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_policy_workload_measures_what_it_claims(backend) -> None:
    if backend == "torch":
        pytest.importorskip("torch")
    w = policy_workload(EveryOther, 64, backend, heads=2, head_dim=4)
    length = (lambda: w.layer.length) if backend == "torch" else (lambda: w.length)
    assert w.steady.size == w.policy.capacity == 64 and w.period > 1
    w.reset_before_eviction()
    assert length() == 64
    w.one_eviction()
    assert length() == w.steady.after < 64
    w.reset_after_eviction()
    w.decode_round()  # one whole cycle: back where it started
    assert length() == w.steady.after


def test_steady_state_of_the_builtin_benchmark_policies() -> None:
    from kvpolicy_tools.perf.eviction import policy_at_size
    from kvpolicy.testing.timing import steady_state

    for name in ("buzz", "h2o", "streaming_llm", "local"):
        policy = policy_at_size(name, 256)
        mine = steady_state(policy, 256)
        assert mine.size == policy.capacity <= 256, name
        if name == "buzz":  # one eviction thins the middle; the next comes once it refills
            assert mine.after < mine.size and mine.period == mine.size - mine.after
        else:  # one token per step, at exactly the size
            assert mine.size == 256, name
            assert (mine.after, mine.period, mine.seen_after) == (255, 1, mine.seen_before), name


def test_benchmark_policy_rows_slopes_table_plot(tmp_path) -> None:
    result = benchmark_policy(EveryOther, sizes=(32, 64, 128), backends=("numpy",), heads=2, rounds=1, target_s=0.001)
    assert [r["cache_size"] for r in result.rows] == [32, 64, 128]
    assert all(r["one_eviction_s"] > 0 and r["per_token_s"] > 0 for r in result.rows)
    k = result.slope("one_eviction", "numpy")
    assert np.isfinite(k) and -1.0 < k < 3.0
    assert "| numpy | 32 |" in result.table() and "one eviction k" in result.table()
    png = result.plot(tmp_path / "c.png")
    assert png.stat().st_size > 1000
    assert json.loads(json.dumps(result.as_dict()))["policy"] == "EveryOther"


def test_kvpolicy_benchmark_fixture(kvpolicy_benchmark) -> None:
    w = kvpolicy_benchmark(sized_window, 64, measure="per_token", rounds=2, heads=2)
    from kvpolicy_tools.perf.eviction import EVERY_STEP_ROUND

    assert w.steady.size == 64 and w.period == EVERY_STEP_ROUND


def test_bench_command_times_a_third_party_factory(tmp_path) -> None:
    from kvpolicy_tools.perf.bench import main

    out = tmp_path / "bench"
    status = main([
        "--what", "complexity", "--sizes", "32,64,128", "--rounds", "1", "--configs", "1x2", "--backends", "numpy",
        "--no-progress", "--out", str(out), "--policy", "test_contract:sized_window", "--policy", "test_contract:budget_window",
        "--policy", "test_contract:EveryOther",
    ])
    assert status == 0
    data = json.loads((out / "results.json").read_text())
    entries = {e["spec"]: e for e in data["policy_complexity"]}
    assert [r["cache_size"] for r in entries["test_contract:sized_window"]["rows"]] == [32, 64, 128]
    assert "not a size factory" in entries["test_contract:budget_window"]["skipped"]
    report = (out / "report.md").read_text()
    assert "test_contract:EveryOther" in report and "per token k" in report
    assert (out / "complexity_sized_window.png").exists() and (out / "complexity_EveryOther.png").exists()


def test_a_wrong_decode_eviction_is_caught() -> None:
    """A policy whose declared one-token eviction disagrees with its select() (here: protects one
    recent token fewer) is caught by the kit, on the NumPy side alone."""
    from kvpolicy import DecodeEviction
    from kvpolicy.testing import compare_backends

    class WrongRule(H2O):
        @property
        def decode_eviction(self):
            return DecodeEviction(limit=self.heavy + self.recent, victim="lowest", recent=self.recent - 1)

    logits = make_logits(16, 2, kind="onehot", seed=3, batch=1)
    compare_backends(H2O(heavy=2, recent=2), logits, 0, group=1, torch=False)
    with pytest.raises(ContractViolation, match="declares DecodeEviction"):
        compare_backends(WrongRule(heavy=2, recent=2), logits, 0, group=1, torch=False)


#: Every policy class kvpolicy ships (the registered ones and the bases they share).
BUILTIN_CLASSES = [c for c in vars(kvpolicy.policies).values() if isinstance(c, type) and issubclass(c, EvictionPolicy)]


@pytest.mark.parametrize("parent", BUILTIN_CLASSES, ids=lambda c: c.__name__)
def test_redefining_select_never_loses_an_inherited_rule_silently(parent) -> None:
    """A subclass that redefines select (or evict) of a built-in with a declared rule says what
    becomes of it: none (``= None``), the parent's, or its own; saying nothing is a TypeError at
    class creation naming what it would lose and the three ways out."""
    declared = [a for a in DECLARED_RULES if getattr(parent, a) is not getattr(EvictionPolicy, a)]
    for method in ("select", "evict"):
        body = {method: lambda self, *args: None}
        if declared:
            with pytest.raises(TypeError, match=f"redefines {method}, so the {' and '.join(declared)} it inherits from {parent.__name__}"):
                type("Silent", (parent,), dict(body))
        else:  # nothing to lose
            type("Silent", (parent,), dict(body))
        none = type("WithoutRules", (parent,), {**body, **{a: None for a in declared}})
        assert none.decode_eviction is None if "decode_eviction" in declared else True
        assert none.size_rule(object.__new__(none)) is None  # `size_rule = None` reads as the base's (none)
        if "decode_size_rule" in declared:  # (likewise; a policy not declaring it takes its size_rule)
            assert none.decode_size_rule(object.__new__(none)) is None
        kept = type("KeepsRules", (parent,), {**body, **{a: getattr(parent, a) for a in declared}})
        assert all(getattr(kept, a) is getattr(parent, a) for a in declared)
    # a subclass that keeps select keeps the rules without a word
    assert all(getattr(type("Quiet", (parent,), {}), a) is getattr(parent, a) for a in declared)


def test_a_subclass_going_without_rules_runs_its_select() -> None:
    class Mine(H2O):
        decode_eviction = size_rule = None  # its own select: no inherited rule

        def select(self, view):
            return super().select(view)

    from kvpolicy.testing import compare_backends

    assert H2O(2, 2).decode_eviction is not None and Mine(2, 2).decode_eviction is None and Mine(2, 2).size_rule() is None
    logits = make_logits(16, 2, kind="onehot", seed=3, batch=1)
    compare_backends(Mine(heavy=2, recent=2), logits, 0, group=1)


class _LowestOf(EvictionPolicy):
    """H2O's rule (keep ``limit``, the ``recent`` newest protected), written as a third party would."""

    limit = Param(int, 4, minimum=2)
    recent = Param(int, 1, minimum=0, maximum=lambda p: p.limit - 1)

    @property
    def capacity(self) -> int:
        return self.limit + 1

    def select(self, view):
        n = view.n_cached
        return None if n <= self.limit else view.drop_lowest(n - self.limit, self.recent)


def test_a_size_rule_wrong_only_for_long_prompts_is_caught() -> None:
    """A declared size rule is what budget planning simulates: the sizes property holds it to
    select's sizes at every prompt length it sweeps (one wrong above 30 tokens passed before)."""
    from kvpolicy.testing import check_sizes

    class LongPromptsWhole(_LowestOf):
        def size_rule(self):
            limit = self.limit
            return lambda n, state: n if n > 30 else min(n, limit)

    check_sizes(_LowestOf(limit=4, recent=1))
    with pytest.raises(ContractViolation, match="size_rule says the decode step of token 31"):
        check_sizes(LongPromptsWhole(limit=4, recent=1))


def test_a_wrong_decode_size_rule_is_caught() -> None:
    """A declared decode size rule is what the torch backend skips asking select by: the sizes
    property holds it to select's sizes at every decode step (SnapKV's, that a decode step never
    evicts, and a composition's, its decode policy's, hold)."""
    from kvpolicy import compose
    from kvpolicy.testing import check_sizes

    class CutsDecodeSteps(SnapKV):
        def decode_size_rule(self):
            return lambda n, state: min(n, 5)

    check_sizes(SnapKV(size=4, window=1))
    check_sizes(compose(prefill=SnapKV(size=8, window=2), decode=BUZZ(sink=1, window=2, stride=3, threshold=6)))
    with pytest.raises(ContractViolation, match="decode_size_rule says the decode step of token 5 keeps 5 of its 6 tokens"):
        check_sizes(CutsDecodeSteps(size=4, window=1))


def test_a_policy_reading_scores_it_says_it_does_not_use_is_caught() -> None:
    """``uses_scores = False`` means backends capture nothing for the policy (its scores stay 0):
    one whose select reads them would evict blind on the decode path (a local window in effect),
    so the replay property negates the logits and requires the same tokens kept."""

    class Blind(_LowestOf):
        uses_scores = False

    logits = make_logits(12, 1, kind="normal", seed=0)
    check_replay(_LowestOf(limit=3, recent=1), logits)
    with pytest.raises(ContractViolation, match="declares uses_scores = False"):
        check_replay(Blind(limit=3, recent=1), logits)
    check_replay(LocalWindow(window=3), logits)  # (a policy that truly reads none passes)


@pytest.mark.parametrize("factory", ["kvzip", "kvzip_headwise", "instance", "prefill_only"])
def test_a_policy_scored_by_a_reconstruction_is_refused_by_name(factory) -> None:
    """The kit drives policies on attention logits step by step; KVzip's scores come from a second
    forward after the prompt, so check_policy says so (NotImplementedError) rather than failing it
    as a contract breach (its selection is held to the reference in tests/core/policies/test_kvzip.py)."""
    from kvpolicy import KVzip, prefill_only

    made = {"kvzip": get_policy("kvzip"), "kvzip_headwise": get_policy("kvzip_headwise"), "instance": KVzip(size=6),
            "prefill_only": prefill_only(KVzip(size=6), 0.5)}[factory]
    with pytest.raises(NotImplementedError, match="context reconstruction"):
        check_policy(made, torch=False, settings=settings(max_examples=2))
