"""H2O (kvpolicy/policies/h2o.py): its parameters and its rule, heavy hitters plus a recent window."""

from __future__ import annotations

import pytest

from kvpolicy import H2O


def test_h2o_selection() -> None:
    with pytest.raises(ValueError, match="selection must be one of 'per_head', 'shared'"):
        H2O(heavy=2, recent=2, selection="both")
