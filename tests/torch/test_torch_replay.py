"""The torch replay (kvpolicy_torch/replay.py): what it refuses beyond the inputs both replays check
(those are held on both backends in tests/numpy/test_numpy_replay.py)."""

from __future__ import annotations

import numpy as np
import pytest

from kvpolicy import H2O


def test_torch_replay_refuses_logits_that_overflow_in_its_dtype() -> None:
    torch = pytest.importorskip("torch")
    import kvpolicy_torch

    logits = np.zeros((4, 2, 4))
    logits[2, 1, 0] = 1e39  # finite in float64, inf in float32
    kvpolicy_torch.replay(H2O(heavy=1, recent=1), logits, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"logits\[2, 1, 0\] is inf \(step 2, head 1\)$"):
        kvpolicy_torch.replay(H2O(heavy=1, recent=1), logits, dtype=torch.float32)
