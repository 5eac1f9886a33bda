"""Bad inputs raise ValueError naming the parameter and the allowed range."""

from __future__ import annotations

import math

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
    with pytest.raises(ValueError, match="budget for the full cache must be 1.0"):
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
    with pytest.raises(TypeError):
        make_policy("h2o", 0.3, context_length=100, windw=3)
