"""Small helpers with no heavy imports (the timing code and the bench command use them without hypothesis)."""

from __future__ import annotations

import importlib.util


def torch_available() -> bool:
    """Whether torch (and so :mod:`kvpolicy_torch`) can be imported."""
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):  # a blocked or broken torch
        return False
