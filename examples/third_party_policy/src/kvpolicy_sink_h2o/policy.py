"""SinkH2O: H2O's heavy hitters and recent window, plus StreamingLLM's attention sinks."""

from __future__ import annotations

from typing import Any

from kvpolicy import EvictionPolicy


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


class SinkH2O(EvictionPolicy):
    """Keep the first ``sink`` positions, the last ``recent`` ones and, in between, the ``heavy``
    tokens with the highest accumulated attention (ties: the earliest is evicted first).

    Parameters: sink (>= 1), heavy (>= 1), recent (>= 1), selection (``"per_head"`` or ``"shared"``).
    """

    name = "sink_h2o"

    def __init__(self, sink: int = 4, heavy: int = 32, recent: int = 32, *, selection: str = "per_head") -> None:
        super().__init__(selection=selection)  # type: ignore[arg-type]
        self.sink = _positive("sink", sink)
        self.heavy = _positive("heavy", heavy)
        self.recent = _positive("recent", recent)

    @property
    def capacity(self) -> int:
        return self.sink + self.heavy + self.recent + 1

    def select(self, view):
        n = view.n_cached
        if n <= self.sink + self.heavy + self.recent:  # host ints only
            return None
        xp = view.xp
        lo, hi = self.sink, n - self.recent
        n_evict = n - self.sink - self.heavy - self.recent
        # stable ascending sort: equal scores keep position order, so the earliest goes first
        order = xp.argsort(view.scores[..., lo:hi], axis=-1, stable=True)
        heavy = xp.sort(order[..., n_evict:], axis=-1) + lo
        return view.keep(view.arange(self.sink), heavy, view.arange(hi, n))

    def params(self) -> dict[str, Any]:
        return {"sink": self.sink, "heavy": self.heavy, "recent": self.recent}

    def invariants(self, kept, t: int) -> None:
        """What this policy promises (checked by kvpolicy.testing after every step): the sink
        and the recent window are always kept."""
        for row in kept.tolist():
            want = set(range(min(self.sink, t + 1))) | set(range(max(0, t - self.recent + 1), t + 1))
            assert want <= set(row), f"sink or recent window lost after token {t}: kept {row}"

    @classmethod
    def from_size(cls, size: int, **overrides: Any) -> "SinkH2O":
        """About ``size`` tokens: 4 sinks (fewer for tiny sizes), the rest split evenly."""
        sink = overrides.pop("sink", min(4, max(1, size // 4)))
        heavy = overrides.pop("heavy", max(1, (size - sink) // 2))
        recent = overrides.pop("recent", max(1, size - sink - heavy))
        return cls(sink=sink, heavy=heavy, recent=recent, **overrides)
