"""Bad inputs raise ValueError naming the parameter and the allowed range."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from kvpolicy import (
    BUZZ,
    H2O,
    LocalWindow,
    StreamingLLM,
    create_policy,
    estimate_threshold,
    get_policy,
    make_policy,
    plan_policy,
    simulate_sizes,
    threshold_ratio,
)
from kvpolicy_numpy import replay

GOOD = {
    BUZZ: dict(sink=1, window=4, stride=3, threshold=6),
    H2O: dict(heavy=2, recent=2),
    StreamingLLM: dict(sink=1, window=4),
    LocalWindow: dict(window=4),
}
SIZE_PARAMS = [(cls, name) for cls, params in GOOD.items() for name in params]


@pytest.mark.parametrize("cls, param", SIZE_PARAMS, ids=lambda x: getattr(x, "__name__", x))
@pytest.mark.parametrize("bad", [0, -1, -100])
def test_zero_or_negative_sizes(cls, param, bad) -> None:
    with pytest.raises(ValueError, match=rf"^{param} must be >= \d+, got {bad}$"):
        cls(**{**GOOD[cls], param: bad})


@pytest.mark.parametrize("cls, param", SIZE_PARAMS, ids=lambda x: getattr(x, "__name__", x))
@pytest.mark.parametrize("bad", [2.5, "4", None, True])
def test_non_integer_sizes(cls, param, bad) -> None:
    if (cls, param, bad) == (BUZZ, "threshold", None):
        return  # None means "from the theorem" (tested in test_budget)
    with pytest.raises(ValueError, match=rf"^{param} must be an integer >= \d+"):
        cls(**{**GOOD[cls], param: bad})


def test_good_parameters_construct() -> None:
    """The baseline the error tests vary (so a failure above is about the one bad value)."""
    for cls, params in GOOD.items():
        assert cls(**params).params() == params


@pytest.mark.parametrize("stride", [1, 2])
def test_buzz_stride_below_3(stride) -> None:
    with pytest.raises(ValueError, match=rf"stride must be >= 3, got {stride}"):
        BUZZ(sink=1, window=4, stride=stride, threshold=6)
    with pytest.raises(ValueError, match="stride must be >= 3"):
        threshold_ratio(stride)
    with pytest.raises(ValueError, match="stride must be >= 3"):
        estimate_threshold(stride, 10)


@pytest.mark.parametrize("stride", [3, 4, 5, 8, 17])
@pytest.mark.parametrize("threshold", [1, 2])
def test_buzz_threshold_too_small(stride, threshold) -> None:
    with pytest.raises(ValueError, match=rf"threshold must be >= 3, got {threshold}"):
        BUZZ(sink=1, window=4, stride=stride, threshold=threshold)
    assert BUZZ(sink=1, window=4, stride=stride, threshold=3).threshold == 3


@pytest.mark.parametrize("stride", range(3, 30))
def test_smallest_allowed_threshold_shrinks_the_middle(stride) -> None:
    """With T = 3 every eviction leaves fewer than T middle tokens (so the capacity holds),
    and T = 2 would not: 2 old tokens thinned by s_hat >= 2 keep 1, plus 1 new one."""
    s_hat = (stride + 1) // 2
    for a in range(3):
        assert math.ceil(a / s_hat) + math.ceil((3 - a) / stride) < 3
    assert math.ceil(1 / s_hat) + math.ceil(1 / stride) == 2  # T = 2, a = 1: no shrink


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


@pytest.mark.parametrize("name", ["nope", "buzzz", "", "h20"])
def test_unknown_policy_name(name) -> None:
    for fn in (get_policy, create_policy):
        with pytest.raises(ValueError, match=r"unknown policy .*; known policies: .*buzz.*h2o"):
            fn(name)
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy(name, 0.3, context_length=100)


@pytest.mark.parametrize(
    "shape",
    [(5, 5), (5, 1, 4), (4, 1, 5), (0, 1, 0), (5,), (2, 5, 1, 5)],
)
def test_logits_of_the_wrong_shape(shape) -> None:
    with pytest.raises(ValueError, match=r"logits must have shape \[steps, heads, steps\]"):
        replay(BUZZ(sink=1, window=2, stride=3, threshold=3), np.zeros(shape))


def test_prompt_len_out_of_range() -> None:
    with pytest.raises(ValueError, match="prompt_len must be >= 0 and <= 5, got 6"):
        replay(LocalWindow(2), np.zeros((5, 1, 5)), prompt_len=6)
    with pytest.raises(ValueError, match="prompt_len must be >= 0"):
        replay(LocalWindow(2), np.zeros((5, 1, 5)), prompt_len=-1)


def test_values_of_the_wrong_shape() -> None:
    with pytest.raises(ValueError, match=r"values must have shape \[steps, heads, d\]"):
        replay(LocalWindow(2), np.zeros((5, 2, 5)), values=np.zeros((5, 1, 3)))


def test_output_error_needs_values() -> None:
    with pytest.raises(ValueError, match="values were not given"):
        replay(LocalWindow(2), np.zeros((5, 1, 5))).output_error()


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(log_n=True, log_base=1.0), "log_base"),
        (dict(log_n=True, log_base=0.5), "log_base"),
        (dict(log_n=True, log_floor=-0.1), "log_floor"),
        (dict(interval_keep="middle"), "interval_keep"),
        (dict(selection="per_layer"), "selection"),
    ],
)
def test_buzz_choice_parameters(kwargs, param) -> None:
    with pytest.raises(ValueError, match=rf"^{param} must be"):
        BUZZ(sink=1, window=2, stride=3, threshold=3, **kwargs)


def test_h2o_selection() -> None:
    with pytest.raises(ValueError, match="selection must be one of 'per_head', 'shared'"):
        H2O(heavy=2, recent=2, selection="both")


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


# ============================================================================ issue 15
# The last obscure errors: each bad input below used to fail deep inside (AttributeError,
# TypeError) or pass silently; now it is a ValueError naming the parameter and what is allowed.
import warnings  # noqa: E402

from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvpolicy import CacheView, FullCache  # noqa: E402
from kvpolicy.budget import realised_budget  # noqa: E402


@pytest.mark.parametrize("bad", [None, 123, 1.5, BUZZ(), object(), ["buzz"]])
def test_policy_name_of_the_wrong_type(bad) -> None:
    with pytest.raises(ValueError, match=r"^name must be a registered policy name .*, an EvictionPolicy subclass or a Preset; got"):
        make_policy(bad, 0.3, context_length=100)
    with pytest.raises(ValueError, match=r"^name must be a registered policy name"):
        plan_policy(bad, 0.3, context_length=100)
    for fn in (get_policy, create_policy):
        with pytest.raises(ValueError, match=r"^policy name must be a string \(one of .*buzz.*\), got"):
            fn(bad)


def test_policy_instance_hint() -> None:
    with pytest.raises(ValueError, match=r"an instance: pass its class"):
        make_policy(H2O(heavy=2, recent=2), 0.3, context_length=100)
    # the accepted forms, for contrast
    assert make_policy(H2O, 0.3, context_length=100) == make_policy("h2o", 0.3, context_length=100)
    assert make_policy(get_policy("buzz_logn"), 0.3, context_length=100).log_n is not None


def _replays():
    """Both replay backends (torch when installed): they must refuse the same inputs."""
    out = [pytest.param(replay, id="numpy")]
    try:
        import kvpolicy_torch

        out.append(pytest.param(kvpolicy_torch.replay, id="torch"))
    except ImportError:  # pragma: no cover - torch is a test dependency
        pass
    return out


REPLAYS = _replays()


@pytest.mark.parametrize("run", REPLAYS)
@pytest.mark.parametrize("bad", ["buzz", BUZZ, None, 3])
def test_replay_needs_a_policy_instance(run, bad) -> None:
    with pytest.raises(ValueError, match=r"^policy must be an EvictionPolicy instance .*, got") as info:
        run(bad, np.zeros((4, 1, 4)))
    if bad == "buzz":
        assert "kvpolicy.create_policy('buzz', ...)" in str(info.value)
    if bad is BUZZ:
        assert "instantiate the class first, e.g. BUZZ(...)" in str(info.value)


# ---------------------------------------------------------------------------- bool parameters
NOT_BOOLS = ["yes", "no", "False", 1, 0, 1.0, None, np.int64(1), [True]]


@pytest.mark.parametrize("bad", NOT_BOOLS, ids=repr)
def test_buzz_log_n_accepts_only_bools(bad) -> None:
    with pytest.raises(ValueError, match=rf"^log_n must be True or False, got {re.escape(repr(bad))}$"):
        BUZZ(sink=1, window=2, stride=3, threshold=3, log_n=bad)
    with pytest.raises(ValueError, match="^log_n must be True or False"):
        make_policy("buzz", 0.3, context_length=100, log_n=bad)


@pytest.mark.parametrize("good, expected", [(True, True), (False, False), (np.True_, True), (np.False_, False)])
def test_buzz_log_n_bools(good, expected) -> None:
    p = BUZZ(sink=1, window=2, stride=3, threshold=3, log_n=good)
    assert (p.log_n is not None) is expected
    assert p.params().get("log_n", False) is expected


def test_buzz_log_parameters_checked_even_without_log_n() -> None:
    with pytest.raises(ValueError, match="^log_base must be"):
        BUZZ(log_base="512")
    with pytest.raises(ValueError, match="^log_floor must be"):
        BUZZ(log_floor=-1.0)


def _bool_sites():
    """Every public function or constructor with a bool parameter, called with ``value`` there
    (each call raises, on a bad value, before doing any work)."""
    from kvpolicy_tools.eval.data import Passage, SummaryExample, load_wiki_articles, make_needle_example
    from kvpolicy_tools.eval.tasks import QAOptions, SummarizationOptions
    from kvpolicy_tools.perf.decode import PolicySpec, standard_candidates
    from kvpolicy_tools.perf.report import machine
    from kvpolicy.testing import check_policy, compare_backends, policy_machine, replay_events
    from kvpolicy.testing.profiles import register_profiles
    from kvpolicy.testing.stateful import run_machine
    from kvpolicy.testing.timing import bench_report

    def evaluate(v):
        from kvpolicy_tools.eval.engine import evaluate

        return evaluate(None, None, [], [], [], progress=v)

    def load(v):
        from kvpolicy_tools.models import load

        return load("smollm2-135m", progress=v)

    def split_sizes(v):
        from kvpolicy_integrations.deepspeed import split_sizes

        return split_sizes(576, 2, kv_heads=3, by_heads=v)

    def evicting_cache(**flag):
        from kvpolicy_tools.models import tiny_llama
        from kvpolicy_integrations.hf import EvictingCache

        return EvictingCache(H2O(2, 2), tiny_llama().config, **flag)

    def generate(v):
        from kvpolicy_integrations.hf import generate

        return generate(None, None, "text", "h2o", chat=v)

    small = BUZZ(sink=1, window=2, stride=3, threshold=3)
    return {
        "log_n": lambda v: BUZZ(log_n=v),
        "progress": [evaluate, load],
        "include_disambiguation": lambda v: load_wiki_articles(include_disambiguation=v),
        "snap_to_sentence": lambda v: make_needle_example("Some text. More text.", 0.5, snap_to_sentence=v),
        "include_short_answers": lambda v: QAOptions(include_short_answers=v),
        "equal_prompts": lambda v: SummarizationOptions(equal_prompts=v),
        "is_prompt": lambda v: SummaryExample("id", "article", "ref", is_prompt=v),
        "is_gold": lambda v: Passage("title", "text", is_gold=v),
        "budgeted": lambda v: PolicySpec("x", lambda b, c, p: small, budgeted=v),
        "capture_only": lambda v: standard_candidates(64, 8, capture_only=v),
        "full": lambda v: standard_candidates(64, 8, full=v),
        "plain_names": lambda v: register_profiles(plain_names=v),
        "plots": lambda v: bench_report([], ".", plots=v),
        "by_heads": split_sizes,
        "fused_decode": lambda v: evicting_cache(fused_decode=v),
        "static_shapes": lambda v: evicting_cache(static_shapes=v),
        # the ones where None means "decide automatically"
        "shared": lambda v: machine(shared=v),
        "torch": [
            lambda v: compare_backends(small, np.zeros((4, 1, 4)), torch=v),
            lambda v: check_policy(lambda: small, torch=v),
            lambda v: replay_events(small, [], torch=v),
            lambda v: policy_machine(lambda: small, torch=v),
            lambda v: run_machine(st.just(small), torch=v),
        ],
        "chat": generate,
    }


BOOL_SITES = [
    pytest.param(name, i, id=f"{name}-{i}")
    for name, fns in _bool_sites().items()
    for i in range(len(fns) if isinstance(fns, list) else 1)
]
NONE_ALLOWED = {("shared", 0), ("torch", 0), ("torch", 1), ("torch", 2), ("torch", 3), ("chat", 0)}


@pytest.mark.parametrize("name, i", BOOL_SITES)
@pytest.mark.parametrize("bad", ["yes", "no", 1, 0.0], ids=repr)
def test_every_bool_parameter_accepts_only_bools(name, i, bad) -> None:
    fns = _bool_sites()[name]
    fn = fns[i] if isinstance(fns, list) else fns
    allowed = "True, False or None" if (name, i) in NONE_ALLOWED else "True or False"
    with pytest.raises(ValueError, match=rf"^{name} must be {allowed}, got {re.escape(repr(bad))}$"):
        fn(bad)


def test_none_is_refused_where_it_means_nothing() -> None:
    with pytest.raises(ValueError, match=r"^log_n must be True or False, got None$"):
        BUZZ(log_n=None)
    from kvpolicy_integrations.deepspeed import split_sizes

    with pytest.raises(ValueError, match=r"^by_heads must be True or False, got None$"):
        split_sizes(576, 2, kv_heads=3, by_heads=None)


# ---------------------------------------------------------------------------- realised budget
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


# ---------------------------------------------------------------------------- complex, NaN, inf
def _torch_or_numpy(kind: str, x: np.ndarray):
    if kind == "torch-tensor":
        torch = pytest.importorskip("torch")
        return torch.as_tensor(x)
    return x


@pytest.mark.parametrize("run", REPLAYS)
@pytest.mark.parametrize("kind", ["ndarray", "torch-tensor"])
def test_complex_logits_and_values(run, kind) -> None:
    logits = np.zeros((4, 1, 4), dtype=np.complex128)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # refused before numpy's ComplexWarning could be issued
        with pytest.raises(ValueError, match=r"^logits must be real numbers, got a complex array"):
            run(BUZZ(), _torch_or_numpy(kind, logits))
        with pytest.raises(ValueError, match=r"^values must be real numbers, got a complex array"):
            run(BUZZ(), np.zeros((4, 1, 4)), values=_torch_or_numpy(kind, np.zeros((4, 1, 2), dtype=np.complex64)))


@pytest.mark.parametrize("run", REPLAYS)
def test_non_numeric_logits(run) -> None:
    with pytest.raises(ValueError, match=r"^logits must be a real numeric array, got dtype"):
        run(BUZZ(), np.full((2, 1, 2), "x"))


@pytest.mark.parametrize("run", REPLAYS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("prompt_len", [0, 5])
@pytest.mark.parametrize("where", [(0, 0, 0), (3, 1, 2), (7, 2, 7), (4, 0, 1)])
def test_non_finite_logits_raise_with_step_and_head(run, bad, prompt_len, where) -> None:
    """The reference never lets a NaN or infinite logit decide: it names the step and head."""
    t, h, j = where
    logits = np.random.default_rng(0).normal(size=(8, 3, 8))
    logits[t, h, j] = bad
    if t < 7:
        logits[7, 0, 6] = bad  # a later one: the first (in step order) is reported
    with pytest.raises(ValueError, match=rf"logits must be finite .* logits\[{t}, {h}, {j}\] is {bad} \(step {t}, head {h}\)$"):
        run(H2O(heavy=2, recent=2), logits, prompt_len=prompt_len)


@pytest.mark.parametrize("run", REPLAYS)
def test_logits_above_the_diagonal_are_never_read(run) -> None:
    """Only ``j <= t`` is read, so padding above the diagonal may be anything."""
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(10, 2, 10))
    padded = logits.copy()
    upper = np.triu(np.ones((10, 10), dtype=bool), k=1)[:, None, :].repeat(2, axis=1)
    padded[upper] = np.nan
    policy = BUZZ(sink=1, window=2, stride=3, threshold=3)
    a, b = run(policy, logits, prompt_len=3), run(policy, padded, prompt_len=3)
    assert all((x is None and y is None) or np.array_equal(x, y) for x, y in zip(a.kept, b.kept))


# ---------------------------------------------------------------------------- the NaN rule of the policies
# What reaches a policy's ``select`` anyway (a hand-built view, an overflow upstream): a NaN
# score counts as -inf (CacheView.ranking_scores). Tested on NumPy and torch views, which must agree.
SPECIAL = [np.nan, -np.inf, np.inf, 0.0, 0.25, 0.5, 1.0]


def _decide(policy, scores: np.ndarray, state: dict, backend: str) -> np.ndarray | None:
    b, h, n = scores.shape
    positions = np.broadcast_to(np.arange(n, dtype=np.int64), (b, h, n)).copy()
    if backend == "torch":
        torch = pytest.importorskip("torch")
        view = CacheView(torch.as_tensor(positions), torch.as_tensor(scores, dtype=torch.float32), n, dict(state))
    else:
        view = CacheView(positions, scores.copy(), n, dict(state))
    keep = policy.evict(view)
    return None if keep is None else np.asarray(keep.cpu() if backend == "torch" else keep)


@st.composite
def _views(draw, cases):
    policy, n, state = draw(cases)
    batch, heads = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    values = draw(st.lists(st.sampled_from(SPECIAL), min_size=batch * heads * n, max_size=batch * heads * n))
    return policy, np.asarray(values, dtype=np.float64).reshape(batch, heads, n), state


@st.composite
def _h2o_cases(draw):
    heavy, recent = draw(st.integers(1, 5)), draw(st.integers(1, 3))
    n = heavy + recent + draw(st.integers(1, 4))  # one surplus token: the argmin path; more: the sort
    selection = draw(st.sampled_from(["per_head", "shared"]))
    return H2O(heavy=heavy, recent=recent, selection=selection), n, {}


@st.composite
def _buzz_cases(draw):
    stride, sink, window = draw(st.integers(3, 5)), draw(st.integers(1, 2)), draw(st.integers(1, 2))
    threshold = draw(st.integers(3, 12))
    n_old = draw(st.integers(0, threshold - 1))
    selection = draw(st.sampled_from(["per_head", "shared"]))
    policy = BUZZ(sink=sink, window=window, stride=stride, threshold=threshold, selection=selection)
    return policy, sink + window + threshold, {"n_old": n_old}


# shared selection sums +inf and -inf of two heads to NaN (numpy says so); the rule then applies
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("cases", [_h2o_cases(), _buzz_cases()], ids=["h2o", "buzz"])
@given(data=st.data())
def test_nan_counts_as_minus_inf_on_both_backends(cases, data) -> None:
    pytest.importorskip("torch")
    policy, scores, state = data.draw(_views(cases))
    as_minus_inf = np.where(np.isnan(scores), -np.inf, scores)
    numpy_keep = _decide(policy, scores, state, "numpy")
    assert numpy_keep is not None
    np.testing.assert_array_equal(numpy_keep, _decide(policy, scores, state, "torch"))
    np.testing.assert_array_equal(numpy_keep, _decide(policy, as_minus_inf, state, "numpy"))


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_h2o_evicts_a_nan_score_first(backend) -> None:
    h2o = H2O(heavy=3, recent=1)
    # one surplus token (argmin path) and two (sort path): NaN goes before the lowest finite score
    for scores, kept in [
        ([0.1, np.nan, 0.0, 0.3, 9.0], [0, 2, 3, 4]),
        ([0.1, np.nan, 0.0, np.nan, 0.3, 9.0], [0, 2, 4, 5]),
        # NaN and -inf are equal: the earliest goes first
        ([0.5, -np.inf, 0.2, np.nan, 9.0], [0, 2, 3, 4]),
        ([0.5, np.nan, 0.2, -np.inf, 9.0], [0, 2, 3, 4]),
        # +inf is the highest score
        ([np.inf, 0.0, 0.2, 0.1, 9.0], [0, 2, 3, 4]),
    ]:
        keep = _decide(h2o, np.asarray([[scores]]), {}, backend)
        assert keep[0, 0].tolist() == kept, scores


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_buzz_nan_never_wins_a_segment_unless_all_are_nan(backend) -> None:
    buzz = BUZZ(sink=1, window=1, stride=3, threshold=6)  # the middle is slots 1..6: two new segments
    scores = [0.0, np.nan, 0.1, 0.0, np.nan, np.nan, np.nan, 0.0]
    keep = _decide(buzz, np.asarray([[scores]]), {"n_old": 0}, backend)
    # segment [1, 2, 3]: 0.1 at slot 2 beats NaN; segment [4, 5, 6] is all NaN: the earliest wins
    assert keep[0, 0].tolist() == [0, 2, 4, 7]


def test_ranking_scores_leave_finite_and_infinite_scores_alone() -> None:
    scores = np.asarray([[[np.nan, -np.inf, np.inf, 0.5]]])
    view = CacheView(np.arange(4)[None, None], scores, 4)
    assert view.ranking_scores.tolist() == [[[-np.inf, -np.inf, np.inf, 0.5]]]
    assert np.isnan(view.scores[0, 0, 0])  # the view itself is not modified
    assert FullCache().evict(view) is None


def test_torch_replay_refuses_logits_that_overflow_in_its_dtype() -> None:
    torch = pytest.importorskip("torch")
    import kvpolicy_torch

    logits = np.zeros((4, 2, 4))
    logits[2, 1, 0] = 1e39  # finite in float64, inf in float32
    kvpolicy_torch.replay(H2O(heavy=1, recent=1), logits, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"logits\[2, 1, 0\] is inf \(step 2, head 1\)$"):
        kvpolicy_torch.replay(H2O(heavy=1, recent=1), logits, dtype=torch.float32)


def test_layer_cache_refuses_steps_out_of_order_and_changed_inputs() -> None:
    """LayerCache: evict()/accumulate() before any append, and keys whose head_dim, dtype or
    batch/heads differ from the first append, get a ValueError saying what is wrong (no raw
    TypeError, no silent cast)."""
    torch = pytest.importorskip("torch")
    from kvpolicy import H2O
    from kvpolicy_torch import LayerCache

    layer = LayerCache(H2O(2, 2))
    with pytest.raises(ValueError, match="append\\(\\) first"):
        layer.evict()
    with pytest.raises(ValueError, match="append\\(\\) first"):
        layer.accumulate(torch.zeros(1, 2, 1))
    k = torch.zeros(1, 2, 1, 4)
    layer.append(k, k)
    layer.accumulate(torch.zeros(1, 2, 1))
    layer.evict()
    with pytest.raises(ValueError, match="head_dim changed"):
        layer.append(torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8))
    with pytest.raises(ValueError, match="dtype changed"):
        layer.append(k.double(), k.double())
    with pytest.raises(ValueError, match="batch and kv_heads changed"):
        layer.append(torch.zeros(2, 2, 1, 4), torch.zeros(2, 2, 1, 4))
    with pytest.raises(ValueError, match="must be real"):
        layer.append(k, k)
        layer.accumulate(torch.zeros(1, 2, 2, dtype=torch.complex64))


def test_layer_cache_nan_scores_count_as_minus_inf() -> None:
    """A NaN received score (an fp16 overflow upstream) is accumulated as -inf: H2O's one-token
    eviction takes that token first, as the NumPy rule (CacheView.ranking_scores) does."""
    torch = pytest.importorskip("torch")
    from kvpolicy import H2O
    from kvpolicy_torch import LayerCache

    layer = LayerCache(H2O(2, 1))
    for t in range(4):
        k = torch.zeros(1, 1, 1, 2)
        layer.append(k, k)
        received = torch.ones(1, 1, layer.slot_positions.shape[-1])
        if t == 1:
            received[..., 1] = float("nan")  # token 1 gets a NaN
        layer.accumulate(received * (layer.slot_positions >= 0))
        layer.evict()
    assert 1 not in layer.positions[0, 0].tolist() and layer.length == 3
