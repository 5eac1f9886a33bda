"""Local window: only the most recent tokens (the paper's "Local" baseline)."""

from __future__ import annotations

from functools import cached_property
from typing import Any

from ..params import Param
from ..policy import DecodeEviction
from ..registry import register_policy
from .lowest import KeepAtMost


@register_policy
class LocalWindow(KeepAtMost):
    """Keep the last ``window`` positions after every step.

    Parameters:
        window: tokens kept after eviction (>= 1). The next query attends to ``window + 1``.
        selection: accepted like every policy's; this policy reads no scores and keeps the same
            slots on every head, so ``"shared"`` is the same as ``"per_head"``.

    Example:
        >>> from kvpolicy import LocalWindow
        >>> LocalWindow(window=8).capacity
        9
    """

    name = "local"
    uses_scores = False

    window = Param(int, minimum=1, doc="most recent positions kept")

    @cached_property
    def rule(self) -> DecodeEviction:
        # window kept; the oldest token goes
        return DecodeEviction(limit=self.window, victim="oldest")

    @classmethod
    def from_size(cls, size: int, **overrides: Any) -> "LocalWindow":
        return cls(window=overrides.pop("window", size), **overrides)
