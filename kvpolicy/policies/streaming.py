"""StreamingLLM (Xiao et al., 2023, "Efficient Streaming Language Models with Attention Sinks")."""

from __future__ import annotations

from functools import cached_property
from typing import Any

from ..params import Param
from ..policy import DecodeEviction
from ..registry import register_policy
from .lowest import KeepAtMost


@register_policy
class StreamingLLM(KeepAtMost):
    """Keep the first ``sink`` positions (attention sinks) and the last ``window`` positions.

    Parameters:
        sink: initial tokens kept forever (>= 1; the StreamingLLM paper uses 4).
        window: most recent tokens kept after eviction (>= 1).
        selection: accepted like every policy's; this policy reads no scores and keeps the same
            slots on every head, so ``"shared"`` is the same as ``"per_head"``.

    Its HF default is ``positions="cache"`` (the paper's pos-shift: keys are re-rotated to their
    slot in the cache), since StreamingLLM was designed and evaluated that way.

    Example:
        >>> from kvpolicy import StreamingLLM
        >>> StreamingLLM(sink=4, window=60).capacity
        65
    """

    name = "streaming_llm"
    uses_scores = False
    default_positions = "cache"

    sink = Param(int, 4, minimum=1, doc="first positions kept forever (attention sinks)")
    window = Param(int, 252, minimum=1, doc="most recent positions kept")

    @cached_property
    def rule(self) -> DecodeEviction:
        # sink + window kept; the oldest token after the sinks leaves the window
        return DecodeEviction(limit=self.sink + self.window, victim="oldest", sink=self.sink)

    min_size = 2

    @classmethod
    def from_size(cls, size: int, **overrides: Any) -> "StreamingLLM":
        sink = overrides.pop("sink", min(4, max(1, size // 2)))
        return cls(sink=sink, window=overrides.pop("window", max(1, size - sink)), **overrides)
