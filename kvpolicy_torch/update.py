"""The update of an eager decode step and of a prompt chunk: where new tokens are written.

A decode token goes to its row's freed slot (a ring: the ``"oldest"`` eviction freed it) or to the
row's frontier (:func:`write_token`). A prompt chunk is written after the furthest frontier with
its positions numbered from each row's ``seen`` (pads get position ``-1`` and stay holes:
:func:`chunk_tokens`). Room is the layer's business (growth, compaction) and is made before.
"""

from __future__ import annotations

import math

import torch

from .rows import Rows
from .storage import Storage

__all__ = ["chunk_tokens", "ready_tail", "write_token"]


def write_token(store: Storage, rows: Rows, keys: torch.Tensor, values: torch.Tensor, *, tail_ready: bool,
                score: torch.Tensor | None = None) -> None:
    """Write one token per row ``[batch, kv_heads, 1, head_dim]`` at each row's target slot (its
    last freed slot, else its frontier) and update ``rows``: key, value, position ``seen``, and
    score and bias 0. Every row needs room (the caller grew or compacted the storage).

    ``score``: ``[batch, kv_heads, 1]``, the new token's score instead of 0 (a score the policy
    computes once per token: :func:`kvpolicy.statistics.scored_once`).

    ``tail_ready``: one row whose slots from the frontier on already hold the position, score and
    bias a frontier write gives them (:func:`ready_tail`), so such a write stores only the key and
    the value: in the eager one-row layout nothing reads past a frontier.

    Example:
        >>> store = Storage.allocate(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2), 2, torch.float32)
        >>> rows = Rows.start(1, {})
        >>> write_token(store, rows, torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2), tail_ready=False)
        >>> store.positions[0, 0].tolist(), store.bias[0, 0].tolist(), rows.count
        ([0, -1], [0.0, -inf], [1])
    """
    front, seen, count, free = rows.front, rows.seen, rows.count, rows.free
    if len(front) == 1:
        # one row (the common case): the same writes with no per-row bookkeeping
        s = free[0].pop() if free[0] else front[0]
        store.keys.narrow(2, s, 1).copy_(keys)
        store.values.narrow(2, s, 1).copy_(values)
        if s != front[0] or not tail_ready:
            store.positions.select(2, s).fill_(seen[0])
            store.scores.select(2, s).fill_(0)
            store.bias.select(2, s).fill_(0)
        if score is not None:
            store.scores.narrow(2, s, 1).copy_(score)
        if s == front[0]:
            front[0] = s + 1
        seen[0] += 1
        count[0] += 1
        rows.columns += 1
        return
    target = [f[-1] if f else front[r] for r, f in enumerate(free)]  # a freed slot, else the frontier
    if all(t == target[0] for t in target):
        # select + copy_/fill_: a decode step's writes are tiny, and indexing costs more than them
        s = target[0]
        store.keys.narrow(2, s, 1).copy_(keys)
        store.values.narrow(2, s, 1).copy_(values)
        if all(x == seen[0] for x in seen):
            store.positions.select(2, s).fill_(seen[0])  # a host scalar: no index tensor
        else:
            store.positions.select(2, s).copy_(torch.tensor(seen, device=store.positions.device)[:, None])
        if score is None:
            store.scores.select(2, s).fill_(0)
        else:
            store.scores.narrow(2, s, 1).copy_(score)
        store.bias.select(2, s).fill_(0)
    else:  # rows on their own schedules: one slot per row
        dev = store.keys.device
        index = torch.arange(rows.batch, device=dev)
        at = torch.tensor(target, device=dev)
        store.keys[index, :, at] = keys[:, :, 0]
        store.values[index, :, at] = values[:, :, 0]
        store.positions[index, :, at] = torch.tensor(seen, device=dev)[:, None]
        store.scores[index, :, at] = 0 if score is None else score[:, :, 0].to(store.scores.dtype)
        store.bias[index, :, at] = 0
    for r in range(rows.batch):
        if free[r]:
            free[r].pop()
        else:
            front[r] += 1
        seen[r] += 1
        count[r] += 1
    rows.columns += 1


def ready_tail(store: Storage, front: int, seen: int) -> None:
    """One row's slots from ``front`` on made ready for frontier writes (:func:`write_token`):
    slot ``front + i`` gets position ``seen + i``, score 0 and bias 0, what the ``i``-th next
    frontier write gives it, so that write stores only the key and the value. (A decode step's
    every small kernel costs 15-45 us inside a model: ``benchmarks/micro.py decode-ops``.) The
    slots stay past the frontier, where nothing reads, until the writes reach them; the caller
    puts holes back (:meth:`SlotLayout.drop_tail <kvpolicy_torch.layout.SlotLayout.drop_tail>`)
    before a token goes anywhere else.

    Example:
        >>> store = Storage.allocate(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2), 4, torch.float32)
        >>> ready_tail(store, 1, 7)
        >>> store.positions[0, 0].tolist(), store.scores[0, 0].tolist()
        ([-1, 7, 8, 9], [inf, 0.0, 0.0, 0.0])
    """
    n = store.slots - front
    if n <= 0:
        return
    store.positions[:, :, front:].copy_(torch.arange(seen, seen + n, device=store.positions.device))
    store.scores[:, :, front:].fill_(0)
    store.bias[:, :, front:].fill_(0)


def chunk_tokens(keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor | None, seen: list[int],
                 score_dtype: torch.dtype) -> Storage:
    """A prompt chunk ``[batch, kv_heads, q, head_dim]`` as slots: real tokens numbered from each
    row's ``seen``, pads (``valid`` False, ``[batch, q]``) at position ``-1`` with zero keys and
    values (attended by nobody but themselves: finite), score ``+inf`` and bias ``-inf``.

    Example:
        >>> chunk = chunk_tokens(torch.ones(1, 1, 3, 2), torch.ones(1, 1, 3, 2),
        ...                      torch.tensor([[False, True, True]]), [4], torch.float32)
        >>> chunk.positions.tolist(), chunk.keys[0, 0, :, 0].tolist()
        ([[[-1, 4, 5]]], [0.0, 1.0, 1.0])
    """
    b, h, q, _ = keys.shape
    dev = keys.device
    pos = torch.arange(q, device=dev).expand(b, q)
    base = torch.tensor(seen, device=dev)[:, None]
    if valid is None:
        pos = base + pos
    else:  # real tokens are numbered from each row's count; pads get -1
        pos = torch.where(valid, base + torch.cumsum(valid.to(torch.int64), dim=-1) - 1, -1)
        keys = keys.masked_fill(~valid[:, None, :, None], 0)
        values = values.masked_fill(~valid[:, None, :, None], 0)
    pos = pos[:, None, :].expand(b, h, q)
    zeros = torch.zeros((), dtype=score_dtype, device=dev)
    return Storage(keys, values, pos, torch.where(pos >= 0, zeros, math.inf), torch.where(pos >= 0, zeros, -math.inf))
