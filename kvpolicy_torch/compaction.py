"""Compaction: a layer's kept tokens moved to the front of their rows, in place and in position order.

A general eviction (a policy's ``select``, or any prefill's) keeps some slots of each row; the kept
tokens are moved to ``[0, kept)`` chunk by chunk (:func:`keep_slots`), so no temporary of the
cache's size is allocated and each kept token moves once. A ring row (an ``"oldest"`` decode
eviction writes each new token into the slot it freed) is rotated back into position order first
(:func:`unwrap_ring`). :func:`slot_order` gives the slots of the kept tokens in position order for
either layout.
"""

from __future__ import annotations

import torch

from .storage import Storage

__all__ = ["keep_slots", "slot_order", "sort_by_position", "unwrap_ring"]


def slot_order(positions: torch.Tensor, count: int, ring: bool) -> torch.Tensor:
    """Slots of the ``count`` kept tokens of each row and head, in position order ``[b, h, count]``
    (holes have position ``-1``). ``ring``: some row's slot order is a rotation of position order.
    A head holding fewer than ``count`` tokens (head-wise budgets, :class:`kvpolicy.AdaKV`) gets
    as many of its holes in front of its tokens, the core's ragged view.

    Example:
        >>> slot_order(torch.tensor([[[0, -1, 2, 3]]]), 3, ring=False).tolist()
        [[[0, 2, 3]]]
        >>> slot_order(torch.tensor([[[3, -1, 5, -1], [3, 4, 5, 6]]]), 3, ring=False).tolist()
        [[[3, 0, 2], [1, 2, 3]]]
    """
    if ring:
        key = positions.masked_fill(positions < 0, torch.iinfo(torch.int64).max)
        return torch.argsort(key, dim=-1)[..., :count]
    held = (positions >= 0).to(torch.int8)  # below a frontier, slot order is position order
    return torch.argsort(held, dim=-1, stable=True)[..., positions.shape[-1] - count :]


def keep_slots(storage: Storage, rows: list[int], keep: torch.Tensor, old_front: int, chunk_bytes: int) -> None:
    """Keep slots ``keep`` ``[len(rows), kv_heads, k]`` (ascending) of ``rows`` at ``[0, k)``; the
    slots from ``k`` up to ``old_front`` become holes.

    In place, chunk by chunk along the slots (at most ``chunk_bytes`` a chunk): kept slot ``j``
    comes from slot ``keep[j] >= j``, so once chunk ``[j0, j1)`` is read into a temporary, writing
    it to the front never overwrites a slot a later chunk still reads.

    Example:
        >>> s = Storage.allocate(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2), 4, torch.float32)
        >>> s.positions.copy_(torch.tensor([[[0, 1, 2, 3]]]))[0, 0].tolist()
        [0, 1, 2, 3]
        >>> keep_slots(s, [0], torch.tensor([[[1, 3]]]), old_front=4, chunk_bytes=1 << 20)
        >>> s.positions[0, 0].tolist()
        [1, 3, -1, -1]
    """
    slots = storage.slots
    g, h, kept = keep.shape
    dev = storage.keys.device
    batch = storage.keys.shape[0]
    row_t = torch.tensor(rows, device=dev, dtype=torch.int64)
    # Storage seen as one flat tensor of rows [batch * heads * slots, ...]: the kept slots of
    # every (row, head) are one index_select of whole rows (torch.gather with a
    # [.., kept, head_dim] index is 7-17x slower on CPU).
    starts = ((row_t[:, None] * h + torch.arange(h, device=dev)) * slots)[..., None]  # [g, h, 1]
    src_rows = keep.to(device=dev, dtype=torch.int64) + starts
    # a bookkeeping tensor that is a segment of a LayerGroup's flat one is not contiguous: it moves
    # whole rows of slots (a few bytes a slot) instead; keys, values and every other one in place
    apart = [t for t in storage.bookkeeping() if not t.is_contiguous()]
    if apart:
        rows_heads = starts.view(-1) // slots  # [g * h]: each row and head's index in [batch * kv_heads]
        order = keep.to(device=dev, dtype=torch.int64).reshape(g * h, kept)
        for t in apart:
            by_row = t.view(batch * h, slots)  # (its rows and heads merge: Storage.whole)
            part = by_row.index_select(0, rows_heads)
            part[:, :kept] = part.gather(1, order)
            by_row.index_copy_(0, rows_heads, part)
    flat = [t.reshape(-1, t.shape[3]) if t.ndim == 4 else t.reshape(-1) for t in storage if t.is_contiguous() or t.ndim == 4]
    per_slot = g * h * sum(t.element_size() * (t.shape[-1] if t.ndim == 4 else 1) for t in storage)
    step = max(1, chunk_bytes // max(per_slot, 1))
    for j0 in range(0, kept, step):
        j1 = min(kept, j0 + step)
        r = src_rows[:, :, j0:j1].reshape(-1)
        dst = (starts + torch.arange(j0, j1, device=dev)).reshape(-1)
        for t in flat:
            t.index_copy_(0, dst, t.index_select(0, r))
    # what lies between the new and the old frontier becomes holes
    if old_front > kept:
        storage.clear_from(kept, old_front, None if len(rows) == batch else row_t)


def sort_by_position(storage: Storage, lead: torch.Tensor | None = None) -> None:
    """Every row's slots in position order, holes last (after static-shaped decode steps, which
    write each new token into its victim's slot): in place. ``lead`` ``[batch, kv_heads]``: the
    holes each head puts first instead (head-wise budgets: a head holding fewer tokens than its
    row's widest starts with as many holes, so every head's tokens end at the same slot).

    Example:
        >>> s = Storage.allocate(torch.zeros(1, 2, 1, 2), torch.zeros(1, 2, 1, 2), 4, torch.float32)
        >>> _ = s.positions.copy_(torch.tensor([[[4, -1, 2, 6], [-1, 5, -1, 3]]]))
        >>> sort_by_position(s); s.positions[0].tolist()
        [[2, 4, 6, -1], [3, 5, -1, -1]]
        >>> _ = s.positions.copy_(torch.tensor([[[4, -1, 2, 6], [-1, 5, -1, 3]]]))
        >>> sort_by_position(s, lead=torch.tensor([[0, 1]])); s.positions[0].tolist()
        [[2, 4, 6, -1], [-1, 3, 5, -1]]
    """
    pos = storage.positions
    far = torch.iinfo(torch.int64).max
    hole = pos < 0
    if lead is None:
        key = pos.masked_fill(hole, far)
    else:  # (the first `lead` holes of a head sort before its tokens, the rest after)
        key = torch.where(hole, torch.where(hole.cumsum(-1) <= lead[..., None], -1, far), pos)
    order = torch.argsort(key, dim=-1, stable=True)
    for t in (storage.keys, storage.values):
        t.copy_(torch.gather(t, 2, order[..., None].expand_as(t)))
    for t in (storage.positions, storage.scores):
        t.copy_(torch.gather(t, 2, order))


def _reverse_slots(x: torch.Tensor, lo: int, hi: int, step: int) -> None:
    """Reverse ``x[:, lo:hi]`` in place, swapping chunks of at most ``step`` slots from both ends."""
    while hi - lo > 1:
        c = min(step, (hi - lo) // 2)
        left = x[:, lo : lo + c].flip(1)  # flip copies
        x[:, lo : lo + c] = x[:, hi - c : hi].flip(1)
        x[:, hi - c : hi] = left
        lo, hi = lo + c, hi - c


def unwrap_ring(storage: Storage, row: int, sink: int, fifo: int, front: int, chunk_bytes: int) -> None:
    """Put a ring row back in position order: its tokens after the ``sink`` sinks run from slot
    ``fifo`` (the oldest) to ``front``, then on from ``sink``, so the segment ``[sink, front)`` is
    rotated left by ``fifo - sink``. In place by three reversals, each a swap of chunks from both
    ends (at most two chunks of temporary memory).

    Example:
        >>> s = Storage.allocate(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2), 4, torch.float32)
        >>> s.positions.copy_(torch.tensor([[[0, 4, 2, 3]]]))[0, 0].tolist()
        [0, 4, 2, 3]
        >>> unwrap_ring(s, 0, sink=1, fifo=2, front=4, chunk_bytes=1 << 20)
        >>> s.positions[0, 0].tolist()
        [0, 2, 3, 4]
    """
    if fifo == sink:
        return
    for t in storage:
        x = t[row]  # [heads, slots(, dim)]: a view
        per_slot = x.shape[0] * (x.shape[2] if x.ndim == 3 else 1) * x.element_size()
        step = max(1, chunk_bytes // (2 * per_slot))
        for lo, hi in ((sink, fifo), (fifo, front), (sink, front)):
            _reverse_slots(x, lo, hi, step)
