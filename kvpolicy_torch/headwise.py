"""Head-wise budgets (:class:`kvpolicy.AdaKV`) on the slot layout: heads that hold different
numbers of tokens.

A layer's rows keep one count of slots per row (:class:`~kvpolicy_torch.LayerCache`), the
widest head's; a head holding fewer tokens has holes (position ``-1``, score ``+inf``, bias
``-inf``) in its first slots, so a dense row ``[0, count)`` reads as the core's ragged
:class:`~kvpolicy.CacheView` (holes lead; :func:`~kvpolicy_torch.compaction.slot_order` keeps them
there) and attention masks them with the bias. The storage is ``[batch, kv_heads, slots,
head_dim]`` with ``slots`` the widest head's need: kept bytes are the budget, allocated bytes the
widest head's count times the heads (docs/design.md, "Head-wise budgets").

* :func:`mark_dropped`: after a compaction, the slots a keep array filled with ``-1`` become holes;
* :func:`held_tokens`: the tokens a layer holds (one host read);
* :func:`fitted_slots`: the storage follows the widest head, without reallocating at every step;
* a decode step's eviction (:class:`kvpolicy.HeadwiseEviction`, AdaKV's declared rule), applied
  where the victims stand: :func:`likely_victims` finds them in two kernels and a small host read
  where it is sure, :func:`headwise_victims` everywhere (a constant number of kernels, exact on
  ties, NaN and floors), :func:`free_slots` makes them holes. Between two compactions a head's
  holes may then stand between its tokens, not only in front of them.
"""

from __future__ import annotations

import heapq
import math
from typing import Any

import torch

from kvpolicy.policy import HeadwiseEviction

from .storage import HOLE, Storage, grown_slots

#: Larger than any position: the key of a slot that is not a tie (or not chosen) in a ``topk`` of positions.
_FAR = torch.iinfo(torch.int64).max

__all__ = ["HOST_MERGE_HEADS", "fitted_slots", "free_slots", "headwise_victims", "held_tokens", "likely_victims", "mark_dropped",
           "step_victims"]


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


def headwise_victims(positions: torch.Tensor, scores: torch.Tensor, seen: int | torch.Tensor,
                     rule: HeadwiseEviction) -> tuple[torch.Tensor, torch.Tensor]:
    """The victims of a head-wise decode eviction (:class:`~kvpolicy.HeadwiseEviction`) in rows
    ``[rows, kv_heads, m]`` of positions and scores (holes: position ``-1``): ``(head, slot)``,
    each ``[rows, kv_heads]``, the ``kv_heads`` lowest of each row over its heads by (score,
    position, head), NaN as ``-inf``, outside the newest ``rule.recent`` positions (``seen``: tokens
    seen, an int or ``[rows, 1, 1]``) and each head's ``rule.floor`` best.

    A constant number of kernels whatever the heads, no sort of the layer and no host read (a
    compiled decode step runs it: :mod:`kvpolicy_torch.static`): each head's ``H`` lowest
    candidates by (score, position) (one ``topk`` for the ``H``-th lowest score, a second for the
    earliest positions tied at it, a third for their slots), in that order (two stable sorts of
    ``H``), of which the head may lose those outside its floor; then the ``H`` lowest of those
    ``H x H`` over the heads (three stable sorts). Only positions order tokens, never slots, so the
    slots may hold them in any order (a static step writes a token into a victim's slot). Every
    head holds the newest ``recent`` positions (they are never victims), so they are the newest
    ``recent`` slots that :class:`~kvpolicy.CacheView` ``.lowest_first`` protects in position
    order. (:func:`likely_victims` is the eager layout's common case in fewer kernels.)

    Example (head 0's two lowest go, unless its floor of 3 keeps one: then head 1's lowest):
        >>> from kvpolicy import HeadwiseEviction
        >>> pos, s = torch.arange(4).repeat(1, 2, 1), torch.tensor([[[0.1, 0.2, 0.3, 9], [5, 6, 7, 0]]])
        >>> [t.tolist() for t in headwise_victims(pos, s, 4, HeadwiseEviction(limit=3, recent=1, floor=2))]
        [[[0, 0]], [[0, 1]]]
        >>> [t.tolist() for t in headwise_victims(pos, s, 4, HeadwiseEviction(limit=3, recent=1, floor=3))]
        [[[0, 1]], [[0, 0]]]
    """
    rows, heads, m = positions.shape
    key, candidate, may_lose = _candidates(positions, scores, seen, rule)
    k = min(heads, m)
    inf = torch.tensor(math.inf, dtype=key.dtype, device=key.device)
    threshold = torch.where(candidate, key, inf).topk(k, dim=-1, largest=False, sorted=True).values[..., k - 1 :]
    below = candidate & (key < threshold)
    at = candidate & (key == threshold)  # (ties at the k-th lowest: the earliest positions)
    need = k - below.sum(-1, keepdim=True)
    tied = torch.where(at, positions, _FAR).topk(k, dim=-1, largest=False, sorted=True).values
    pick = below | (at & (positions <= tied.gather(-1, (need - 1).clamp(min=0))) & (need > 0))
    chosen = torch.where(pick, torch.arange(m, device=key.device), m).topk(k, dim=-1, largest=False, sorted=True).values
    valid = chosen < m
    chosen = chosen.clamp(max=m - 1)
    chosen_key = key.gather(-1, chosen).masked_fill(~valid, math.inf)
    chosen_pos = positions.gather(-1, chosen).masked_fill(~valid, _FAR)
    # the head's order: (score, position), fillers last: stable by position, then stable by score
    order = chosen_pos.sort(dim=-1, stable=True).indices
    order = order.gather(-1, chosen_key.gather(-1, order).sort(dim=-1, stable=True).indices)
    chosen, chosen_key, chosen_pos, valid = (x.gather(-1, order) for x in (chosen, chosen_key, chosen_pos, valid))
    losable = valid & (torch.arange(k, device=key.device) < may_lose)
    # the H lowest losable over the heads: by score, then position, then head (flattened head by head)
    flat = [x.reshape(rows, heads * k) for x in (chosen_pos, chosen_key, (~losable).to(torch.int8))]
    over = None
    for x in flat:
        x = x if over is None else x.gather(-1, over)
        step = x.argsort(dim=-1, stable=True)
        over = step if over is None else over.gather(-1, step)
    first = over[:, :heads]  # (there are always H: HeadwiseEviction's docstring)
    return torch.div(first, k, rounding_mode="floor"), chosen.reshape(rows, heads * k).gather(-1, first)


def _candidates(positions: torch.Tensor, scores: torch.Tensor, seen: int | torch.Tensor,
                rule: HeadwiseEviction) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What both searches read: the ranking key ``[rows, H, m]`` (NaN as ``-inf``), which slots are
    candidates (held, outside the newest ``rule.recent`` positions) and ``[rows, H, 1]`` how many
    each head may lose (down to ``max(floor, its protected tokens)``)."""
    held = positions >= 0
    key = torch.nan_to_num(scores, nan=-math.inf, posinf=math.inf, neginf=-math.inf)
    protected = held & (positions >= seen - rule.recent)
    may_lose = held.sum(-1, keepdim=True) - protected.sum(-1, keepdim=True).clamp(min=rule.floor)
    return key, held & ~protected, may_lose


def step_victims(positions: torch.Tensor, scores: torch.Tensor, seen: int | torch.Tensor, rule: HeadwiseEviction,
                 due: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`headwise_victims` for a decode step on the device (no host read when compiled): the
    same ``(head, slot)`` ``[rows, kv_heads]`` in the rows ``due`` ``[rows]`` (bool; the others'
    are whatever the search gives, for a masked write to leave alone).

    Where it is sure, one ``topk`` over each row's flat slots: every head may lose ``H`` tokens
    (no floor binds), the ``H``-th lowest candidate is finite and no candidate ties it (the tie
    order could matter there); the victims are then the ``H`` lowest of the layer, whatever their
    order. Else :func:`headwise_victims` (three ``topk`` and five sorts a layer, with their clones:
    ~4 ms of a 53 ms compiled step of the embedded model at 512 tokens, profiled, where this search
    put AdaKV + H2O at 98% of the compiled limit: docs/performance.md). Compiled, both are in the
    step's graph (``torch.cond``); eager, one read of the flag.

    Example:
        >>> from kvpolicy import HeadwiseEviction
        >>> pos, s = torch.arange(4).repeat(1, 2, 1), torch.tensor([[[0.1, 0.2, 0.3, 9], [5, 6, 7, 0]]])
        >>> [t.tolist() for t in step_victims(pos, s, 4, HeadwiseEviction(limit=3, recent=1, floor=1), torch.tensor([True]))]
        [[[0, 0]], [[0, 1]]]
        >>> [t.tolist() for t in step_victims(pos, s, 4, HeadwiseEviction(limit=3, recent=1, floor=3), torch.tensor([True]))]
        [[[0, 1]], [[0, 0]]]
    """
    rows, heads, m = positions.shape
    if heads * m <= heads:  # (no room for the cut's next: the exact search)
        return headwise_victims(positions, scores, seen, rule)
    key, candidate, may_lose = _candidates(positions, scores, seen, rule)
    key = torch.where(candidate, key, math.inf)
    low, at = key.view(rows, heads * m).topk(heads + 1, dim=-1, largest=False, sorted=True)
    sure = ((may_lose[..., 0] >= heads).all(-1) & (low[:, heads - 1] < math.inf) & (low[:, heads - 1] != low[:, heads])) | ~due

    def lowest() -> tuple[torch.Tensor, torch.Tensor]:
        first = at[:, :heads]
        return torch.div(first, m, rounding_mode="floor"), first.remainder(m)

    def exact() -> tuple[torch.Tensor, torch.Tensor]:
        return headwise_victims(positions, scores, seen, rule)

    if torch.compiler.is_compiling():
        return torch.cond(sure.all(), lowest, exact, ())
    return lowest() if bool(sure.all()) else exact()


#: Above this many KV heads :func:`likely_victims` merges the heads' lowest on the device (one more
#: ``topk``) rather than on the host: ``H x H`` numbers in Python take ~15 us at 3 heads, ~400 at
#: 32 (SmolLM2's shapes on one CPU core), four more kernels ~40.
HOST_MERGE_HEADS = 8


def likely_victims(candidates: torch.Tensor, counts: list[list[int]], rule: HeadwiseEviction,
                   positions: torch.Tensor | None = None) -> list[tuple[list[tuple[int, int]], list[int]]] | None:
    """:func:`headwise_victims` in two kernels and a host read, where it is sure: per row, its
    victims ``(head, slot)`` and its heads' tokens after the eviction; ``None`` where it is not
    sure for some row (the caller then asks :func:`headwise_victims`).

    ``candidates`` ``[rows, kv_heads, m]``: the scores of slots ``[0, m)``, ``+inf`` where a slot
    is no candidate (a hole; a slot of the recent window, or past ``m``); ``counts``: per row, each
    head's tokens, of which it keeps ``max(floor, recent)`` (its floor best and its recent window:
    every head holds its ``recent`` newest), so it may lose ``q`` (at most ``H``). Each head's
    ``H + 1`` lowest (one ``topk``) give its ``q`` lowest; the ``H`` lowest of those over the heads
    are the victims (on the host: at most ``H x H`` numbers). Sure where no tie falls on a cut
    (a head's ``q``-th and next, the layer's ``H``-th and next: the tie order could matter there)
    and no victim scores ``-inf`` (a NaN, or a hole's score that a NaN step left NaN) or
    ``+inf`` (holes and the recent window stand there).

    ``positions`` (``[rows, kv_heads, >= m]``, the candidate slots' positions first; optional) settles a tie
    on a cut instead of giving up: each head's lowest are then taken by a stable sort, in (score,
    slot) order, which is (score, position) order (below a frontier a head's slots hold its
    positions in order), and merged over the heads by (score, position, head), the declared rule's
    order. Ties are common under a refresh interval: a head whose scored tokens ran out between two
    scorings loses its earliest :data:`~kvpolicy.statistics.UNSCORED` ones, all of one score. (On
    the host up to :data:`HOST_MERGE_HEADS` KV heads; above, the device merges by two stable sorts,
    by position and then by score, over the heads' losable lowest in head order.)

    Example:
        >>> from kvpolicy import HeadwiseEviction
        >>> scores = torch.tensor([[[0.1, 0.2, 0.3, 9], [5, 6, 7, 0]]])[..., :3]  # (slot 3: the recent window)
        >>> likely_victims(scores, [[4, 4]], HeadwiseEviction(limit=3, recent=1, floor=2))
        [([(0, 0), (0, 1)], [2, 4])]
        >>> likely_victims(scores, [[4, 4]], HeadwiseEviction(limit=3, recent=1, floor=3))  # head 0 keeps 3: head 1 loses its lowest
        [([(0, 0), (1, 0)], [3, 3])]
        >>> tied = torch.tensor([[[0.1, 5, 5], [5, 5, 5]]])  # ties on both cuts: settled by position
        >>> likely_victims(tied, [[4, 4]], HeadwiseEviction(limit=3, recent=1, floor=1)) is None
        True
        >>> likely_victims(tied, [[4, 4]], HeadwiseEviction(limit=3, recent=1, floor=1), positions=torch.tensor([[[0, 2, 3], [0, 1, 2]]]))
        [([(0, 0), (1, 0)], [3, 3])]
    """
    rows, heads, m = candidates.shape
    k = min(heads + 1, m)
    keyed = torch.nan_to_num(candidates, nan=-math.inf)
    keeps = max(rule.floor, rule.recent)
    if heads * m > heads and all(c - keeps >= heads for count in counts for c in count):
        # no head's floor can bind (each may lose all H): the H lowest over the layer's flat slots
        # (the common case: one topk, no merge of each head's lowest)
        found = _lowest_over_heads(keyed, counts)
        if found is not _TIED:
            return found
    values, index = keyed.topk(k, dim=-1, largest=False, sorted=True)

    def merged(values: torch.Tensor, index: torch.Tensor, at: torch.Tensor | None) -> Any:
        if heads > HOST_MERGE_HEADS:
            return _merged_on_device(values, index, at, counts, keeps)
        return _merged_on_host(values.tolist(), index.tolist(), None if at is None else at.tolist(), counts, keeps)

    found = merged(values, index, None)
    if found is _TIED and positions is not None:
        # (a tie on a cut: each head's lowest in (score, slot) order, a stable sort, with their positions)
        values, index = keyed.sort(dim=-1, stable=True)
        values, index = values[..., :k], index[..., :k]
        found = merged(values, index, positions.gather(-1, index))
    return None if found is _TIED else found


#: What :func:`_merged_on_host` answers where a tie falls on a cut and no positions settle it.
_TIED = object()


def _lowest_over_heads(keyed: torch.Tensor, counts: list[list[int]]) -> Any:
    """:func:`likely_victims` where every head may lose ``H`` tokens: the ``H`` lowest of each
    row's ``keyed`` ``[rows, H, m]`` (NaN already ``-inf``) over its heads by one ``topk``, read
    back once. :data:`_TIED` where a tie falls on the layer's cut (the order among equal scores
    could matter there); ``None`` where the exact search must decide (a victim at ``+-inf``)."""
    rows, heads, m = keyed.shape
    values, index = keyed.reshape(rows, heads * m).topk(heads + 1, dim=-1, largest=False, sorted=True)
    out = []
    for lows, at, count in zip(values.tolist(), index.tolist(), counts):
        if not -math.inf < lows[0] <= lows[heads - 1] < math.inf:
            return None
        if lows[heads - 1] == lows[heads]:
            return _TIED
        count = list(count)
        victims = []
        for i in at[:heads]:
            h, j = divmod(i, m)
            count[h] -= 1
            victims.append((h, j))
        out.append((victims, count))
    return out


def _merged_on_host(scored: list[list[list[float]]], slots: list[list[list[int]]], positions: list[list[list[int]]] | None,
                    counts: list[list[int]], keeps: int) -> Any:
    """:func:`likely_victims`' merge of each head's lowest (``scored``, ``slots``: ``[rows, H,
    k]``, ascending) on the host: without ``positions``, :data:`_TIED` where a tie falls on a cut;
    with them (the lowest in (score, slot) order), the merge by (score, position, head). ``None``
    where the exact search must decide (a victim at ``+-inf``, too few slots read)."""
    out = []
    for r, (row_scores, row_slots, count) in enumerate(zip(scored, slots, counts)):
        heads, k = len(row_scores), len(row_scores[0])
        losable = []
        for h in range(heads):
            q = min(count[h] - keeps, heads)
            if q <= 0:
                continue
            if q >= k:
                return None  # (too few slots read)
            if positions is None and row_scores[h][q - 1] == row_scores[h][q]:
                return _TIED  # (the tie order could matter at the head's cut)
            where = positions[r][h] if positions is not None else row_slots[h]  # (ties settled above when None)
            losable += [(row_scores[h][i], where[i], h, row_slots[h][i]) for i in range(q)]
        if len(losable) < heads:
            return None  # pragma: no cover - (AdaKV's budget leaves H losable: HeadwiseEviction)
        lowest = heapq.nsmallest(heads + 1, losable)
        if not (-math.inf < lowest[0][0] and lowest[heads - 1][0] < math.inf):
            return None
        if positions is None and len(lowest) > heads and lowest[heads - 1][0] == lowest[heads][0]:
            return _TIED
        count = list(count)
        for _, _, h, _ in lowest[:heads]:
            count[h] -= 1
        out.append(([(h, j) for _, _, h, j in lowest[:heads]], count))
    return out


def _merged_on_device(values: torch.Tensor, index: torch.Tensor, positions: torch.Tensor | None, counts: list[list[int]],
                      keeps: int) -> Any:
    """:func:`likely_victims`' merge of each head's lowest (``values``, ``index``: ``[rows, H,
    k]``, ascending) on the device: a head's ``q`` losable, the ``H`` lowest of them over the
    heads by one ``topk``; the same checks, on what is read back: :data:`_TIED` where a tie falls
    on a cut. With ``positions`` (``[rows, H, k]``: those slots' positions, the lowest taken in
    (score, slot) order) the merge is by (score, position, head) instead, two stable sorts over
    the losable in head order, and a tie is no obstacle. ``None`` where the exact search must
    decide (a victim at ``+-inf``, too few slots read)."""
    rows, heads, k = values.shape
    quota = [[min(c - keeps, heads) for c in count] for count in counts]
    if any(q >= k for row in quota for q in row):
        return None  # (too few slots read)
    q = torch.tensor(quota, device=values.device)[..., None]  # [rows, H, 1]
    losable = torch.arange(k, device=values.device) < q
    flat = values.masked_fill(~losable, math.inf).reshape(rows, heads * k)
    if positions is None:
        low, at = flat.topk(heads + 1, dim=-1, largest=False, sorted=True)
        q = q.clamp(min=1)
        cuts = torch.cat([values.gather(-1, q - 1), values.gather(-1, q)], -1).tolist()  # each head's q-th and next
    else:
        # (score, position, head): stable by position over the head-major order, then stable by score
        by_position = positions.reshape(rows, heads * k).argsort(dim=-1, stable=True)
        by_score = flat.gather(-1, by_position).argsort(dim=-1, stable=True)
        at = by_position.gather(-1, by_score[:, : heads + 1])
        low, cuts = flat.gather(-1, at), None
    slot = index.reshape(rows, heads * k).gather(-1, at[:, :heads])
    out = []
    for r, (lows, ats, slots, count, quotas) in enumerate(zip(low.tolist(), at.tolist(), slot.tolist(), counts, quota)):
        if cuts is not None and (any(qh > 0 and c[0] == c[1] for qh, c in zip(quotas, cuts[r])) or lows[heads - 1] == lows[heads]):
            return _TIED  # (a tie at a head's cut, or at the layer's)
        if not -math.inf < lows[0] <= lows[heads - 1] < math.inf:
            return None
        count = list(count)
        victims = []
        for i, j in zip(ats[:heads], slots):
            count[i // k] -= 1
            victims.append((i // k, j))
        out.append((victims, count))
    return out


def free_slots(storage: Storage, rows: list[int], victims: list[list[tuple[int, int]]]) -> None:
    """Each row's ``victims`` ``(head, slot)`` (``rows``: the rows they belong to) become holes
    (:data:`~kvpolicy_torch.storage.HOLE`), in place: one index of host integers, one write per
    bookkeeping tensor.

    Example:
        >>> s = Storage.allocate(torch.zeros(1, 2, 1, 2), torch.zeros(1, 2, 1, 2), 3, torch.float32)
        >>> _ = s.positions.copy_(torch.arange(3).repeat(1, 2, 1))
        >>> free_slots(s, [0], [[(0, 0), (0, 2)]]); s.positions.tolist()
        [[[-1, 1, -1], [0, 1, 2]]]
    """
    _, heads, slots = storage.positions.shape
    flat = [(r * heads + h) * slots + j for r, row in zip(rows, victims) for h, j in row]
    index = torch.tensor(flat, device=storage.positions.device)
    for t, fill in zip(storage.bookkeeping(), HOLE):
        if t.is_contiguous():
            t.view(-1).index_fill_(0, index, fill)
        else:  # (tensors not in one block: by their three indices)
            t.index_put_(torch.unravel_index(index, t.shape), torch.tensor(fill, dtype=t.dtype, device=t.device))
