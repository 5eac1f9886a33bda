"""kvpolicy/testing/invariants.py: the invariant helpers name the positions they miss."""

from __future__ import annotations

import numpy as np
import pytest

from kvpolicy import StreamingLLM
from kvpolicy.testing import keeps_first, keeps_last


def test_invariant_helpers() -> None:
    kept = np.array([[0, 1, 7, 8, 9]])
    assert keeps_first(2)(None, kept, 9) is None and keeps_last(3)(None, kept, 9) is None
    with pytest.raises(AssertionError, match=r"keeps_last\(4\): position\(s\) \[6\]"):
        keeps_last(4)(None, kept, 9)
    with pytest.raises(AssertionError, match="keeps_first"):
        keeps_first("sink")(StreamingLLM(sink=3, window=2), kept, 9)
