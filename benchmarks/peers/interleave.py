"""The timed round both sides of the peer benchmark run (standard library only: kvpress's venv
imports it too, without kvpolicy)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any


def timed_round(cands: Sequence[Any], steps: int, step: Callable[[Any], None], first: int) -> list[float]:
    """Seconds per step of each candidate over ``steps`` sweeps in which the candidates take turns
    token by token, the order rotated by one at every sweep (sweep ``k`` starts at candidate
    ``(first + k) % len(cands)``): load that lasts longer than a sweep hits them all alike."""
    n = len(cands)
    sums = [0.0] * n
    for k in range(steps):
        shift = (first + k) % n
        for i in list(range(shift, n)) + list(range(shift)):
            start = time.perf_counter()
            step(cands[i])
            sums[i] += time.perf_counter() - start
    return [s / steps for s in sums]
