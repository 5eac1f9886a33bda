"""Per-row host bookkeeping of a layer: how many tokens each row has seen and keeps, where its next
token goes, and its policy state.

Rows may differ (a left-padded batch): pads are never kept and each row evicts on its own
schedule. These are host integers, so *whether* to evict is decided without reading a tensor, and
an eager decode step makes no host-device sync. (A static-shaped decode step keeps the same numbers
on the device: :class:`kvpolicy_torch.static.DecodeState`.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .storage import HOLE, Storage

__all__ = ["LayerSnapshot", "Rows"]


@dataclass
class Rows:
    """The host bookkeeping of a layer's rows.

    Fields, one entry per row:
        seen: real (non-pad) tokens appended.
        count: kept tokens (every KV head of a row keeps as many).
        front: the row's frontier, the next slot a new token is written to; below it the row's
            kept tokens stand in position order, with holes where tokens were evicted.
        states: the policy's state (:meth:`~kvpolicy.EvictionPolicy.init_state`).
        fifo: for an ``"oldest"`` decode eviction, the slot of the oldest token after the sinks
            (``None``: the row is dense, the oldest is at slot ``sink``).
        free: for an ``"oldest"`` decode eviction, the slots the last evictions freed; the next
            append writes there, so the tokens after the sinks form a ring over ``[sink, front)``
            and are never compacted.
        columns: columns appended per row, pads included (transformers' sequence length).

    Example:
        >>> rows = Rows.start(2, {})
        >>> rows.seen, rows.dense(), rows.groups()
        ([0, 0], True, [[0, 1]])
    """

    seen: list[int] = field(default_factory=list)
    count: list[int] = field(default_factory=list)
    front: list[int] = field(default_factory=list)
    states: list[dict[str, int]] = field(default_factory=list)
    fifo: list[int | None] = field(default_factory=list)
    free: list[list[int]] = field(default_factory=list)
    columns: int = 0

    @classmethod
    def start(cls, batch: int, state: dict[str, int]) -> "Rows":
        """``batch`` empty rows, each with its own copy of the policy's initial ``state``."""
        return cls([0] * batch, [0] * batch, [0] * batch, [dict(state) for _ in range(batch)],
                   [None] * batch, [[] for _ in range(batch)])

    @property
    def batch(self) -> int:
        return len(self.count)

    def dense(self) -> bool:
        """Whether every row holds its kept tokens at slots ``[0, count)`` in position order."""
        return self.count == self.front and all(f is None for f in self.fifo)

    def ring(self) -> bool:
        """Whether some row's tokens go round a ring (slot order is then a rotation of position order)."""
        return any(f is not None for f in self.fifo)

    def shift(self) -> list[int]:
        """Per row, tokens evicted so far (``seen - count``): how far StreamingLLM's pos-shift moves
        the tokens kept before them."""
        return [s - c for s, c in zip(self.seen, self.count)]

    def groups(self) -> list[list[int]]:
        """Rows in the same state (count, seen, policy state): they decide together."""
        out: dict[tuple[Any, ...], list[int]] = {}
        for r in range(self.batch):
            out.setdefault((self.count[r], self.seen[r], tuple(sorted(self.states[r].items()))), []).append(r)
        return list(out.values())

    def by_count(self, rows: list[int]) -> dict[int, list[int]]:
        """``rows`` grouped by their kept tokens."""
        out: dict[int, list[int]] = {}
        for r in rows:
            out.setdefault(self.count[r], []).append(r)
        return out

    def kept(self, rows: list[int], kept: int) -> None:
        """``rows`` now hold ``kept`` tokens at ``[0, kept)`` (after a compaction)."""
        for r in rows:
            self.count[r] = kept
            self.front[r] = kept

    def densified(self, rows: list[int]) -> None:
        """``rows`` are no rings any more (their tokens were put back in position order)."""
        for r in rows:
            self.fifo[r] = None
            self.free[r] = []

    def take(self, index: list[int] | None, n: int) -> "Rows":
        """The rows ``index`` (repeats allowed), or ``n`` copies of row 0 when ``index`` is None (rows alike)."""
        pick = [0] * n if index is None else index
        return Rows(
            [self.seen[i] for i in pick], [self.count[i] for i in pick], [self.front[i] for i in pick],
            [dict(self.states[i]) for i in pick], [self.fifo[i] for i in pick], [list(self.free[i]) for i in pick],
            self.columns,
        )

    def alike(self) -> bool:
        """Whether every row stands exactly as row 0."""
        return all(
            all(x == lst[0] for x in lst)
            for lst in (self.seen, self.count, self.front, self.states, self.fifo, self.free)
        )


@dataclass
class LayerSnapshot:
    """The bookkeeping of a :class:`~kvpolicy_torch.LayerCache`: per-row counts and policy states,
    and per slot the positions, scores and bias. Keys and values are not part of it: restoring a
    snapshot replays the same eviction decisions on the same storage (what eviction benchmarks
    need) without copying the cache. Fields may be edited (``dataclasses.replace``) before a restore."""

    columns: int
    seen: list[int]
    count: list[int]
    front: list[int]
    states: list[dict[str, int]]
    fifo: list[int | None]
    positions: torch.Tensor
    scores: torch.Tensor
    bias: torch.Tensor
    #: per row, the slots freed by ``"oldest"`` evictions that the next append refills
    free: list[list[int]] = field(default_factory=list)

    @classmethod
    def of(cls, rows: Rows, storage: Storage) -> "LayerSnapshot":
        """A copy of ``rows`` and of the storage's positions, scores and bias."""
        return cls(
            rows.columns, list(rows.seen), list(rows.count), list(rows.front), [dict(s) for s in rows.states],
            list(rows.fifo), storage.positions.clone(), storage.scores.clone(), storage.bias.clone(),
            [list(f) for f in rows.free],
        )

    def rows(self, storage: Storage, batch: int) -> Rows:
        """The snapshot's rows, checked against a layer's ``storage`` of ``batch`` rows (ValueError
        naming what does not fit)."""
        if self.positions.shape != storage.positions.shape or len(self.count) != batch:
            raise ValueError(
                f"snapshot of shape {tuple(self.positions.shape)} does not fit this layer's {tuple(storage.positions.shape)}"
            )
        if any(c > f for c, f in zip(self.count, self.front)) or any(f > storage.slots for f in self.front):
            raise ValueError("snapshot counts must satisfy count <= front <= slots per row")
        free = [list(f) for f in self.free] if self.free else [[] for _ in range(batch)]
        if any(slot >= f for fr, f in zip(free, self.front) for slot in fr):
            raise ValueError("snapshot free slots must lie below their row's front")
        return Rows(list(self.seen), list(self.count), list(self.front), [dict(s) for s in self.states],
                    list(self.fifo), free, self.columns)

    def write(self, storage: Storage, front: list[int]) -> None:
        """The snapshot's positions, scores and bias into ``storage``; slots at or beyond each row's
        ``front`` become holes."""
        slots = storage.slots
        for t, src, fill in zip(storage.bookkeeping(), (self.positions, self.scores, self.bias), HOLE):
            t.copy_(src)
            for f in sorted(set(front)):
                if f >= slots:
                    continue
                rows = [r for r, x in enumerate(front) if x == f]
                if len(rows) == len(front):
                    t[:, :, f:] = fill
                else:
                    for r in rows:
                        t[r, :, f:] = fill
