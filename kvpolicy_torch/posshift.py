"""StreamingLLM's pos-shift: kept keys placed at consecutive positions ending at the newest token.

A kept token's shifted position is ``seen - count + rank`` (``rank``: its index among the kept
tokens), so it moves by the number of evicted tokens *after* it. Under an ``"oldest"`` decode
eviction (StreamingLLM) the tokens after the sinks are contiguous up to the newest, so only the
sinks move, all by the same amount: a :class:`PrefixShift`. :class:`SinkShift` then holds the
sinks' keys already rotated in the storage (kept aside as originals), so a decode step's attention
is plain SDPA; :func:`slot_shifts` gives the per-slot shift of any other layout.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from .storage import Storage

__all__ = ["KeyShift", "PrefixShift", "SinkShift", "slot_shifts"]

#: ``key_shift(keys, delta)``: keys ``[batch, kv_heads, s, head_dim]`` rotated by ``delta`` positions
#: (RoPE), ``delta`` one host int per row.
KeyShift = Callable[[torch.Tensor, list[int]], torch.Tensor]


class PrefixShift(NamedTuple):
    """Positions of a pos-shift cache whose keys differ from their original positions only in a
    prefix: slots ``[0, length)`` of row ``r`` sit ``delta[r]`` positions later, every other kept
    token at its original position (StreamingLLM: the sinks, by the number of evicted tokens)."""

    length: int
    delta: list[int]


def slot_shifts(positions: torch.Tensor, shift: list[int]) -> torch.Tensor:
    """Per-slot pos-shift ``[batch, kv_heads, n]`` of slots whose original ``positions`` are given
    (``-1``: a hole, shift 0), every slot before them a hole: a kept token sits
    ``shift[row] + rank - position`` later (``shift``: tokens each row has evicted).

    Example:
        >>> slot_shifts(torch.tensor([[[0, -1, 5, 6]]]), [4]).tolist()
        [[[4, 0, 0, 0]]]
    """
    kept = positions >= 0
    rank = torch.cumsum(kept.to(torch.int64), dim=-1) - 1
    offset = torch.tensor(shift, device=positions.device)[:, None, None]
    return torch.where(kept, offset + rank - positions, 0)


class SinkShift:
    """The sinks' keys of a ring layout held at their pos-shift positions in the storage.

    Whenever a row's shift changes (a decode step that evicted), the sinks' keys are rotated from
    their originals, kept aside (``O(batch x kv_heads x sink)``); :meth:`undo` puts the originals
    back before anything but a decode step reads or moves keys.

    Args:
        key_shift: rotates keys by a number of positions (:data:`KeyShift`).
        sink: the sinks, slots ``[0, sink)`` of every row.

    Example:
        >>> s = Storage.allocate(torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2), 4, torch.float32)
        >>> s.keys.fill_(1.0)[0, 0, 0].tolist()
        [1.0, 1.0]
        >>> shift = SinkShift(lambda keys, delta: keys * (1 + delta[0]), sink=1)
        >>> shift.apply(s, [2])
        >>> s.keys[0, 0, :2].tolist(), shift.delta
        ([[3.0, 3.0], [1.0, 1.0]], [2])
        >>> shift.undo(s)
        >>> s.keys[0, 0, 0].tolist(), shift.delta
        ([1.0, 1.0], None)
    """

    def __init__(self, key_shift: KeyShift, sink: int) -> None:
        self.key_shift = key_shift
        self.sink = sink
        self.originals: torch.Tensor | None = None  # [b, h, sink, d] while the storage holds them shifted
        self.delta: list[int] | None = None  # each row's shift of the keys in the storage
        # the sinks' slots of the storage that holds them shifted: a view made once, written at each shift
        self.held: Storage | None = None
        self.slots: torch.Tensor | None = None

    def apply(self, storage: Storage, delta: list[int]) -> None:
        """The sinks' keys rotated by ``delta`` (per row); nothing to do while it is unchanged."""
        if delta == self.delta:
            return
        if self.originals is None:
            self.originals = storage.keys[:, :, : self.sink].clone()
        if storage is not self.held:  # a first shift, or the storage grew (carrying the shifted sinks)
            self.held, self.slots = storage, storage.keys.narrow(2, 0, self.sink)
        self.slots.copy_(self.key_shift(self.originals, delta))  # type: ignore[union-attr]
        self.delta = delta

    def undo(self, storage: Storage | None) -> None:
        """Put the sinks' original keys back in their slots."""
        if self.originals is not None and storage is not None:
            storage.keys[:, :, : self.originals.shape[2]] = self.originals
        self.originals, self.delta, self.held, self.slots = None, None, None, None
