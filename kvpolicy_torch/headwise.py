"""Head-wise budgets (:class:`kvpolicy.AdaKV`) on the slot layout: heads that hold different
numbers of tokens.

A layer's rows keep one count of slots per row (:class:`~kvpolicy_torch.LayerCache`), the
widest head's; a head holding fewer tokens has holes (position ``-1``, score ``+inf``, bias
``-inf``) in its first slots, so a dense row ``[0, count)`` reads as the core's ragged
:class:`~kvpolicy.CacheView` (holes lead; :func:`~kvpolicy_torch.compaction.slot_order` keeps them
there) and attention masks them with the bias. The storage is ``[batch, kv_heads, slots,
head_dim]`` with ``slots`` the widest head's need: kept bytes are the budget, allocated bytes the
widest head's count times the heads (docs/design.md, "Head-wise budgets"). Two operations, each
one pass over ``[batch, kv_heads, slots]`` bookkeeping:

* :func:`mark_dropped`: after a compaction, the slots a keep array filled with ``-1`` become holes;
* :func:`held_tokens`: the tokens a layer holds (one host read);
* :func:`fitted_slots`: the storage follows the widest head, without reallocating at every step.
"""

from __future__ import annotations

import torch

from .storage import HOLE, Storage, grown_slots

__all__ = ["fitted_slots", "held_tokens", "mark_dropped"]


def mark_dropped(storage: Storage, rows: torch.Tensor | None, keep: torch.Tensor) -> None:
    """After a compaction that wrote kept slot ``j`` of each of ``rows`` (``None``: every row) at
    slot ``j``, turn the slots where ``keep`` (``[len(rows), heads, k]``) holds ``-1`` into holes
    (:data:`~kvpolicy_torch.storage.HOLE`). Nothing when ``keep`` has no ``-1`` (one host read:
    the general eviction path only).

    Example:
        >>> s = Storage.allocate(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2), 3, torch.float32)
        >>> s.positions.copy_(torch.tensor([[[7, 8, 9]]]))[0, 0].tolist()
        [7, 8, 9]
        >>> mark_dropped(s, None, torch.tensor([[[-1, 1]]]))
        >>> s.positions[0, 0].tolist(), s.bias[0, 0, 0].item()
        ([-1, 8, 9], -inf)
    """
    dropped = keep < 0
    if not bool(dropped.any()):
        return
    k = keep.shape[-1]
    for t, fill in zip(storage.bookkeeping(), HOLE):
        if rows is None:
            t[:, :, :k].masked_fill_(dropped, fill)
        else:
            part = t.index_select(0, rows)
            part[:, :, :k].masked_fill_(dropped, fill)
            t.index_copy_(0, rows, part)


def held_tokens(pos: torch.Tensor) -> int:
    """Tokens held in ``pos`` ``[..., slots]`` (holes and pads, ``-1``, excluded): one host read.

    Example:
        >>> held_tokens(torch.tensor([[[-1, 4, 5], [3, 4, 5]]]))
        5
    """
    return int((pos >= 0).sum())


def fitted_slots(slots: int, widest: int) -> int | None:
    """After a head-wise eviction: the slots to reallocate a storage of ``slots`` to, whose widest
    head holds ``widest`` tokens, or ``None`` to keep it. A storage holding more than twice its
    growth step above the widest head's tokens shrinks to one step above them
    (:func:`~kvpolicy_torch.storage.grown_slots`), so it neither grows nor shrinks at every step
    as the heads' shares move.

    Example:
        >>> fitted_slots(200, 100), fitted_slots(120, 100)
        (116, None)
    """
    fit = grown_slots(widest)
    return fit if slots > widest + 2 * (fit - widest) and fit < slots else None
