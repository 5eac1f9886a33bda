"""Parameter checks: one ``ValueError`` format, naming the parameter and its allowed range.

Every policy, planner, integration and command of kvpolicy checks user input with these four
functions, and a third-party policy should too: a bad value is refused with a message that names the
parameter and what it accepts, never an ``assert`` and never a silent fix.

Example:
    >>> from kvpolicy.validation import check_bool, check_choice, check_float, check_int
    >>> check_int("window", 8, minimum=1)
    8
    >>> check_int("window", 0, minimum=1)
    Traceback (most recent call last):
    ...
    ValueError: window must be >= 1, got 0
    >>> check_float("budget", 1.5, low=0.0, high=1.0, low_open=True)
    Traceback (most recent call last):
    ...
    ValueError: budget must be in (0.0, 1.0], got 1.5
    >>> check_choice("mode", "fast", ("eager", "static"))
    Traceback (most recent call last):
    ...
    ValueError: mode must be one of 'eager', 'static'; got 'fast'
    >>> check_bool("log_n", "no")
    Traceback (most recent call last):
    ...
    ValueError: log_n must be True or False, got 'no'
"""

from __future__ import annotations

import numbers
import numpy as np

__all__ = ["check_int", "check_float", "check_choice", "check_bool"]


def check_int(name: str, value: object, *, minimum: int = 1, maximum: int | None = None) -> int:
    """Return ``value`` as an int, or raise ``ValueError`` naming ``name`` and the allowed range."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    value = int(value)
    if value < minimum or (maximum is not None and value > maximum):
        upper = f" and <= {maximum}" if maximum is not None else ""
        raise ValueError(f"{name} must be >= {minimum}{upper}, got {value}")
    return value


def check_float(
    name: str,
    value: object,
    *,
    low: float,
    high: float,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """Return ``value`` as a float inside the interval, or raise ``ValueError`` naming it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    value = float(value)
    ok_low = value > low if low_open else value >= low
    ok_high = value < high if high_open else value <= high
    if not (ok_low and ok_high) or value != value:
        interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise ValueError(f"{name} must be in {interval}, got {value}")
    return value


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    """Return ``value`` if it is one of ``choices``, else raise ``ValueError`` listing them."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")
    return value  # type: ignore[return-value]


def check_bool(name: str, value: object, *, allow_none: bool = False) -> bool | None:
    """Return ``value`` as a bool, or raise ``ValueError`` naming ``name``.

    Only ``True`` and ``False`` (and NumPy's ``np.True_``/``np.False_``) are accepted: a truthy
    string such as ``"no"`` or a number would otherwise silently switch a flag on. With
    ``allow_none``, ``None`` (usually "decide automatically") is returned as is.
    """
    if allow_none and value is None:
        return None
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    allowed = "True, False or None" if allow_none else "True or False"
    raise ValueError(f"{name} must be {allowed}, got {value!r}")
