"""kvpolicy.validation: what each check accepts it returns as the right type; everything else is a
ValueError naming the parameter."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpolicy.validation import check_bool, check_choice, check_float, check_int


@given(st.integers(-50, 50), st.integers(-10, 10), st.one_of(st.none(), st.integers(-10, 60)))
def test_check_int_accepts_exactly_the_range(value: int, minimum: int, maximum: int | None) -> None:
    inside = value >= minimum and (maximum is None or value <= maximum)
    if inside:
        got = check_int("size", np.int64(value), minimum=minimum, maximum=maximum)
        assert got == value and type(got) is int
    else:
        with pytest.raises(ValueError, match=r"^size must be >= "):
            check_int("size", value, minimum=minimum, maximum=maximum)


@pytest.mark.parametrize("bad", [True, 1.0, "3", None])
def test_check_int_refuses_non_integers_by_name(bad: object) -> None:
    with pytest.raises(ValueError, match=r"^size must be an integer"):
        check_int("size", bad)


@given(st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.booleans())
def test_check_float_accepts_exactly_the_interval(value: float, low_open: bool, high_open: bool) -> None:
    inside = (value > 0 if low_open else value >= 0) and (value < 1 if high_open else value <= 1)
    if inside and not math.isnan(value):
        assert check_float("budget", value, low=0.0, high=1.0, low_open=low_open, high_open=high_open) == value
    else:
        with pytest.raises(ValueError, match=r"^budget must be in [\[(]0.0, 1.0[\])]"):
            check_float("budget", value, low=0.0, high=1.0, low_open=low_open, high_open=high_open)


def test_check_choice_and_check_bool() -> None:
    assert check_choice("mode", "eager", ("eager", "static")) == "eager"
    with pytest.raises(ValueError, match="mode must be one of 'eager', 'static'"):
        check_choice("mode", "Eager", ("eager", "static"))
    assert check_bool("flag", np.True_) is True and check_bool("flag", None, allow_none=True) is None
    for bad in ("yes", 1, 0, None):
        with pytest.raises(ValueError, match="^flag must be True or False"):
            check_bool("flag", bad)
