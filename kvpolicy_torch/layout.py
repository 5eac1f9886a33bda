"""The eager slot layout of a layer: its storage and the host integers that describe it.

A layer's tokens live in slots that stay put (:class:`~kvpolicy_torch.storage.Storage`). In the
eager layout, *where* they are is told by host integers (:class:`~kvpolicy_torch.rows.Rows`: per
row the tokens seen and kept, the frontier new tokens go to, a ring pointer), so an eager step
decides what to do without reading a tensor. :class:`SlotLayout` holds the storage, those rows,
what the last append returned, and the reads and moves that depend on nothing else: the kept
tokens in position order (inspection), compaction (kept tokens moved to ``[0, count)``), the
transient working set of a prompt chunk that does not fit, and the sinks' pos-shifted keys.

It also writes new tokens, so that a decode step's update stays in this module: a decode token
goes to its row's freed slot (a ring: the ``"oldest"`` eviction freed it) or to the row's frontier
(:func:`write_token`); a prompt chunk is written after the furthest frontier with its positions
numbered from each row's ``seen`` (pads get position ``-1`` and stay holes: :func:`chunk_tokens`).
Room is the layer's business (growth, compaction) and is made before.

Whatever moves slots makes the layout :meth:`~SlotLayout.moved`: the victim search's candidates
and the one-row "ready tail" (the slots from the frontier on holding the positions, scores and
bias the next appends give them) no longer hold, and that tail is holes again.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from .compaction import keep_slots, slot_order, unwrap_ring
from .headwise import mark_dropped
from .posshift import SinkShift
from .rows import LayerSnapshot, Rows
from .storage import RangeViews, Storage, logits_dtype
from .victims import CandidateSearch

__all__ = ["SlotLayout", "chunk_tokens", "ready_tail", "uniform", "write_token"]


def uniform(values: Sequence[Any], what: str) -> Any:
    """The one value every row has (``0`` for no rows); a ``ValueError`` naming ``what`` when
    rows differ (a left-padded batch: read the per-row list instead).

    Example:
        >>> uniform([3, 3], "kept tokens")
        3
    """
    if not values:
        return 0
    first = values[0]
    if any(v != first for v in values[1:]):
        raise ValueError(f"rows differ in {what} (a left-padded batch): read the per-row list instead")
    return first


class SlotLayout:
    """A layer's slots and their host bookkeeping (the eager layout).

    Attributes:
        store: the storage (``None`` before the first append).
        extra: the transient working set while a prompt chunk overflows the storage (the kept
            tokens and the chunk, concatenated), else ``None``.
        rows: per-row host bookkeeping.
        returned: the last append returned slots ``[0, returned)`` (kept tokens are never
            below slot 0: every decode step and chunk attends from the first slot on).
        chunk: ``(start, q, valid [batch, q] | None)`` of the prompt chunk the last append added,
            or ``None`` after a decode token.
        phase: ``"prefill"`` after a chunk, ``"decode"`` after one token.
        bias_needed: whether a slot of the returned range is a hole for some row.
        tail_ready: one row, shapes not static: the slots from the frontier on hold the positions,
            scores and bias the next frontier writes give them (:func:`ready_tail`).
        views: the views of the returned range (:class:`~kvpolicy_torch.storage.RangeViews`: what
            a decode step returns and attends with), or ``None`` while the transient set holds it
            or the storage is a view of some slots.
        search: the victim search's candidates (forgotten whenever slots move).
        sink_shift: StreamingLLM's sinks held at their shifted positions, or ``None``.
        fresh_score: the score a decode token is written with: ``0`` (accumulated attention
            starts there), or :data:`~kvpolicy.statistics.UNSCORED` for a score from the cache
            under a refresh interval (between two scorings the newest token is unscored; at a
            scoring every score is recomputed), so the eviction need not mark it
            (:meth:`~kvpolicy_torch.queries.RunningMoments.mark_newest`).

    Example:
        >>> layout = SlotLayout(CandidateSearch(), None)
        >>> layout.store = Storage.allocate(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2), 4, torch.float32)
        >>> layout.rows = Rows([2], [2], [2], [{}], [None], [[]])
        >>> layout.store.positions[0, 0, :2] = torch.tensor([0, 1])
        >>> layout.dense(), layout.in_order(layout.working().positions, 2).tolist()
        (True, [[[0, 1]]])
    """

    def __init__(self, search: CandidateSearch, sink_shift: SinkShift | None, *, static: bool = False,
                 ragged: bool = False, fresh_score: float = 0.0) -> None:
        self.fresh_score = fresh_score
        #: static shapes (attention over every slot) and head-wise budgets (heads with holes of
        #: their own): fixed for the layer's life; with either, the host cannot tell that the
        #: returned range has no hole, so the bias is always read
        self.static, self.ragged = static, ragged
        #: head-wise budgets: a decode eviction left holes between a head's tokens (not only in
        #: front of them, the core's ragged view), so no row reads as dense until it is compacted
        self.scattered = False
        #: head-wise budgets: per row, each head's tokens, while the host knows them (a head-wise
        #: decode eviction counts them once and then follows them; whatever moves slots forgets them)
        self.head_counts: list[list[int]] | None = None
        self.store: Storage | None = None
        self.extra: Storage | None = None
        self.rows = Rows()
        self.returned = 0
        self.chunk: tuple[int, int, torch.Tensor | None] | None = None
        self.phase = "decode"
        self.bias_needed = False
        self.tail_ready = False
        self.views: RangeViews | None = None
        # the views of each range of the storage `_views_of`, made once (Storage.range_views) and
        # kept: a view costs a few microseconds on a CPU, seven of them a layer and step, and the
        # range of a decode step (the furthest frontier) takes few values between compactions
        self._views_of: Storage | None = None
        self._kept: dict[int, RangeViews] = {}
        self.search = search
        self.sink_shift = sink_shift
        if sink_shift is not None:
            sink_shift.undo(None)

    #: Ranges whose views the layout keeps per storage (seven views, about 4 KB of host memory a
    #: range): the furthest frontier of a one-token eviction by score takes one value per spare
    #: slot between compactions, 64 of them up to 512 kept tokens; a ring's takes one.
    kept_ranges = 64

    def __getstate__(self) -> dict[str, Any]:
        # the kept views are derived: a copy makes its own, of its own storage's tensors
        state = dict(self.__dict__)
        state["views"], state["_views_of"], state["_kept"] = None, None, {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self.extra is None and self.store is not None and self.returned:
            self.views = self.keep_views(self.store, self.returned)

    # ------------------------------------------------------------------ the slots
    def storage(self) -> Storage:
        """The storage (after the first append)."""
        if self.store is None:
            raise ValueError("nothing was appended to this LayerCache yet: call append() first")
        return self.store

    def full(self) -> Storage:
        """The whole (contiguous) tensors compaction works in: the transient set, else the storage."""
        return self.extra if self.extra is not None else self.storage()

    def working(self) -> Storage:
        """Every slot that may hold a token: the transient set while a chunk overflows, else the
        storage up to the furthest frontier."""
        if self.extra is not None:
            return self.extra
        return self.storage().narrow(0, max(self.rows.front))

    def dense(self) -> bool:
        """Whether every row holds its kept tokens at slots ``[0, count)`` in position order."""
        return self.extra is None and not self.scattered and self.rows.dense()

    def moved(self) -> None:
        """Slots moved (or new ones came): the candidates, the ready tail and the returned range's
        views no longer hold."""
        self.views = None
        self.search.forget()
        self.drop_tail()
        self.head_counts = None

    def drop_tail(self) -> None:
        """The slots past the frontier back to holes (position ``-1``, score ``+inf``, bias
        ``-inf``), if they were made ready for frontier writes: before anything moves (rows copied
        or repeated may then end at other frontiers, and a shorter row attends to the longer one's
        range, so its slots past its frontier must be masked), before a token goes to a freed slot
        (the positions ahead would no longer follow ``seen``), and before a snapshot copies them."""
        if self.tail_ready:
            self.tail_ready = False
            self.storage().clear_from(max(self.rows.front))

    # what the last append returned (what attention saw; ``received`` aligns with these), one
    # tensor each: read in every decode step of some policies, so no Storage is built for them
    def returned_positions(self) -> torch.Tensor:
        """Positions ``[batch, kv_heads, n]`` of the slots the last append returned (``-1``: a hole or pad)."""
        return self.extra.positions if self.extra is not None else self.storage().positions[:, :, : self.returned]

    def returned_scores(self) -> torch.Tensor:
        """Scores ``[batch, kv_heads, n]`` of the slots the last append returned."""
        return self.extra.scores if self.extra is not None else self.storage().scores[:, :, : self.returned]

    def returned_bias(self) -> torch.Tensor:
        """Attention bias ``[batch, kv_heads, n]`` of the slots the last append returned."""
        return self.extra.bias if self.extra is not None else self.storage().bias[:, :, : self.returned]

    def needs_bias(self) -> bool:
        """Whether a slot in the returned range is a hole for some row (host ints only; always
        under static shapes or head-wise budgets, where the host cannot tell)."""
        if self.static or self.ragged or self.extra is not None:
            return True
        front = self.rows.front
        # a row holds a hole below its frontier, or its frontier stops short of the range (list
        # comparisons: every decode step of every layer asks)
        return front != self.rows.count or front.count(self.returned) != len(front)

    # ------------------------------------------------------------------ writes
    def rows_at_end(self) -> list[int]:
        """Rows whose next token has no slot: the frontier at the end of the storage and no freed
        slot (the caller makes room: growth or compaction)."""
        # (attributes, no call: every decode step of every layer asks, benchmarks/decode_calls.py)
        store = self.store if self.store is not None else self.storage()
        front, free, slots = self.rows.front, self.rows.free, store.keys.shape[2]
        if len(front) == 1:
            return [] if front[0] < slots or free[0] else [0]
        return [r for r, f in enumerate(front) if f >= slots and not free[r]]

    def write_one(self, keys: torch.Tensor, values: torch.Tensor, score: torch.Tensor | None = None) -> None:
        """Write one decode token per row ``[batch, kv_heads, 1, head_dim]`` (every row has room:
        :meth:`rows_at_end` is empty); the range returned is the slots up to the furthest frontier
        (every slot under static shapes). ``score`` ``[batch, kv_heads, 1]``: the token's score
        where the policy scores it once (else 0)."""
        store, rows = self.store if self.store is not None else self.storage(), self.rows
        one = len(rows.count) == 1 and not self.static
        if one and rows.free[0]:
            self.drop_tail()  # (a ring's freed slot takes the token)
        elif one and not self.tail_ready:
            # a frontier slot of one row: nothing reads past the frontier here, so the slots from it
            # on can hold their position, score and bias ahead of time (three writes fewer a step)
            ready_tail(store, rows.front[0], rows.seen[0], self.fresh_score)
            self.tail_ready = True
        write_token(store, rows, keys, values, tail_ready=one and self.tail_ready, score=score, fresh=self.fresh_score)
        if self.head_counts is not None:  # (every head of every row gained the token)
            self.head_counts = [[c + 1 for c in row] for row in self.head_counts]
        self.chunk = None
        hi = self.returned = store.slots if self.static else max(rows.front)
        # (the kept views of the range inlined: every decode step of every layer reads them)
        views = self._kept.get(hi) if store is self._views_of else None
        self.views = views if views is not None else self.keep_views(store, hi)
        # (needs_bias for one eager row, inlined: its range ends at its frontier, so a hole is one
        # below it; every decode step of every layer asks)
        self.bias_needed = rows.front[0] != rows.count[0] if one and self.extra is None and not self.ragged else self.needs_bias()

    def write_chunk(self, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor | None, real: list[int]) -> None:
        """Write a prompt chunk ``[batch, kv_heads, q, head_dim]`` after the furthest frontier of
        dense rows (``valid`` ``[batch, q]``: False at pads; ``real``: per row, its real tokens),
        into the storage if it fits, else into the transient set (the storage and the chunk)."""
        rows, store = self.rows, self.storage()
        q = keys.shape[2]
        start = max(rows.front)
        chunk = chunk_tokens(keys, values, valid, rows.seen, store.scores.dtype)
        self.head_counts = None
        if start + q <= store.slots:
            store.write(start, chunk)
        else:  # the prompt exceeds the storage: attention needs all of it for this step
            self.extra = store.concat(chunk, start)
        self.returned = start + q  # a chunk ends the range (received_attention reads its keys as the last q)
        self.views = None if self.extra is not None else self.keep_views(store, start + q)
        for r in range(rows.batch):
            rows.seen[r] += real[r]
            rows.count[r] += real[r]
            rows.front[r] = start + q
        rows.columns += q
        self.chunk = (start, q, valid)
        self.bias_needed = self.needs_bias()

    def keep_views(self, store: Storage, hi: int) -> RangeViews | None:
        """The views of slots ``[0, hi)`` of ``store`` (:meth:`Storage.range_views
        <kvpolicy_torch.storage.Storage.range_views>`), kept for the storage's later steps (up to
        :attr:`kept_ranges` ranges); ``None`` for a storage that is a view of some slots.

        Example:
            >>> layout = SlotLayout(CandidateSearch(), None)
            >>> store = Storage.allocate(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4), 3, torch.float32)
            >>> views = layout.keep_views(store, 2)
            >>> tuple(views.keys3t.shape), layout.keep_views(store, 2) is views
            ((2, 4, 2), True)
        """
        if store is not self._views_of:  # another storage (allocated, grown, restored): views of its own
            self._views_of, self._kept = store, {}
        views = self._kept.get(hi)
        if views is None and store.whole:
            views = store.range_views(hi)
            if len(self._kept) < self.kept_ranges:
                self._kept[hi] = views
        return views

    # ------------------------------------------------------------------ ordered views (inspection)
    def in_order(self, t: torch.Tensor, count: int) -> torch.Tensor:
        """``t`` (a tensor of :meth:`working`) at the ``count`` kept tokens of every row, in
        position order."""
        if self.dense():
            return t[:, :, :count]
        order = slot_order(self.working().positions, count, self.rows.ring())
        if t.ndim == 4:
            return torch.gather(t, 2, order[..., None].expand(*order.shape, t.shape[-1]))
        return torch.gather(t, 2, order)

    def aligned(self, t: torch.Tensor, count: int, fill: float) -> torch.Tensor:
        """``t`` (a tensor of :meth:`working`) at each row's and head's kept tokens in position
        order, ``[batch, kv_heads, count]`` (``count``: the most any row keeps), right-aligned as in
        a left-padded batch: a row or head keeping fewer has ``fill`` in front of its tokens."""
        pos = self.working().positions
        # holes (-1) sort first, positions are distinct: the last `count` are every kept token, in order
        order = torch.argsort(pos, dim=-1, stable=True)[..., pos.shape[-1] - count :]
        held = torch.gather(pos, 2, order) >= 0
        if t.ndim == 4:
            out = torch.gather(t, 2, order[..., None].expand(*order.shape, t.shape[-1]))
            return out.masked_fill(~held[..., None], fill)
        return torch.gather(t, 2, order).masked_fill(~held, fill)

    def kept(self, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(positions, scores)`` ``[kv_heads, n_row]`` of one row, in position order."""
        working = self.working()
        pos = working.positions[row : row + 1]
        order = slot_order(pos, self.rows.count[row], self.rows.ring())
        return torch.gather(pos, 2, order)[0], torch.gather(working.scores[row : row + 1], 2, order)[0]

    def to_slots(self, ordered: torch.Tensor, count: int) -> torch.Tensor:
        """Per-token values in position order ``[batch, kv_heads, count]`` placed at the returned
        slots ``[batch, kv_heads, n]`` (0 at holes)."""
        pos = self.returned_positions()
        out = torch.zeros(pos.shape, dtype=ordered.dtype, device=pos.device)
        if self.dense():
            out[:, :, :count] = ordered
            return out
        return out.scatter_(2, slot_order(pos, count, self.rows.ring()), ordered)

    # ------------------------------------------------------------------ pos-shift of the sinks
    def shift_sinks(self) -> None:
        """After a decode append: hold the sinks' keys rotated by each row's shift."""
        sinks = self.sink_shift
        if sinks is None:
            return
        shift = self.rows.shift()
        if sinks.originals is None and (not any(shift) or min(self.rows.front) < sinks.sink or self.extra is not None):
            return  # nothing shifted yet (or a row without its sinks: attention rotates the query)
        sinks.apply(self.storage(), shift)

    def unshift(self) -> None:
        """The sinks' original keys back in their slots (before anything but a decode step reads or
        moves keys)."""
        if self.sink_shift is not None:
            self.sink_shift.undo(self.store)

    # ------------------------------------------------------------------ compaction
    def compact(self, rows: list[int], *, sink: int, chunk_bytes: int) -> None:
        """Move the kept tokens of ``rows`` to ``[0, count)`` in position order (holes removed;
        a ring of an ``"oldest"`` eviction with ``sink`` sinks unwrapped first)."""
        book = self.rows
        if self.extra is None:
            rows = [r for r in rows if book.count[r] != book.front[r] or book.fifo[r] is not None or self.scattered]
        if not rows:
            return
        if len(rows) == book.batch:
            self.scattered = False  # (every row is compacted below)
        self.unshift()
        for r in rows:  # rare (a prompt chunk or a general eviction after decode steps): a loop over rows is fine
            fifo = book.fifo[r]
            if fifo is not None:
                unwrap_ring(self.storage(), r, sink, fifo, book.front[r], chunk_bytes)
        book.densified(rows)
        for count, group in book.by_count(rows).items():
            pos = self.working().positions
            if len(group) < book.batch:
                pos = pos.index_select(0, torch.tensor(group, device=pos.device))
            self.keep(group, slot_order(pos, count, book.ring()), chunk_bytes=chunk_bytes)

    def densify(self, *, sink: int, chunk_bytes: int) -> None:
        """Every row's kept tokens at ``[0, count)`` in position order (:meth:`compact` of all rows,
        unless they are already): what a prompt chunk, a general eviction and the static layout see."""
        if not self.dense():
            self.compact(list(range(self.rows.batch)), sink=sink, chunk_bytes=chunk_bytes)

    def keep(self, rows: list[int], keep: torch.Tensor, *, chunk_bytes: int) -> None:
        """Keep slots ``keep`` ``[len(rows), heads, k]`` (ascending) of ``rows`` at ``[0, k)``
        (:func:`~kvpolicy_torch.compaction.keep_slots`: in place, each kept token moves once).
        Under head-wise budgets ``-1`` in ``keep`` is a hole, a head keeping fewer."""
        self.moved()
        old_front = max(self.rows.front[r] for r in rows)
        if self.ragged:  # -1: a hole, copied from slot 0, then marked
            # in one chunk: a head keeping fewer than the widest may move its tokens to later
            # slots (its holes lead), which a later chunk would read after an earlier one wrote them
            keep_slots(self.full(), rows, keep.clamp(min=0), old_front, 1 << 62)
            whole = len(rows) == self.rows.batch
            mark_dropped(self.full(), None if whole else torch.tensor(rows, device=keep.device), keep)
        else:
            keep_slots(self.full(), rows, keep, old_front, chunk_bytes)
        self.rows.kept(rows, keep.shape[2])

    def put_back(self) -> None:
        """Move the transient working set back into the storage once it fits."""
        extra, self.extra = self.extra, None
        if extra is None:
            return
        self.moved()
        n = max(self.rows.front)
        store = self.storage()
        store.copy_prefix(extra, n)
        store.clear_from(n)
        self.returned = n
        self.bias_needed = self.needs_bias()

    # ------------------------------------------------------------------ whole-layer changes between steps
    def restore(self, snap: LayerSnapshot) -> None:
        """Put ``snap``'s bookkeeping back (keys and values stay): its rows, dense at
        ``[0, count)``; slots at or beyond a row's frontier become holes."""
        store = self.storage()
        self.rows = snap.rows(store, self.rows.batch)  # (checks that it fits before anything changes)
        self.unshift()
        self.moved()
        self.extra, self.chunk = None, None
        snap.write(store, self.rows.front)
        self.scattered = self.ragged  # (a head-wise snapshot may hold holes between a head's tokens)
        self.returned = max(self.rows.front)
        self.bias_needed = self.needs_bias()
        self.phase = "decode"

    def take_rows(self, index: torch.Tensor) -> None:
        """Keep (or repeat) batch rows by ``index`` ``[n]`` (beam search): the storage's rows and
        their bookkeeping (the index is read only when rows differ)."""
        store = self.storage()
        self.unshift()
        self.moved()
        n = int(index.shape[0])
        self.rows = self.rows.take(None if self.rows.alike() else index.tolist(), n)
        self.store = store.index_select(index)


# ---------------------------------------------------------------------- where new tokens are written

def write_token(store: Storage, rows: Rows, keys: torch.Tensor, values: torch.Tensor, *, tail_ready: bool,
                score: torch.Tensor | None = None, fresh: float = 0.0) -> None:
    """Write one token per row ``[batch, kv_heads, 1, head_dim]`` at each row's target slot (its
    last freed slot, else its frontier) and update ``rows``: key, value, position ``seen``, score
    ``fresh`` and bias 0. Every row needs room (the caller grew or compacted the storage).

    ``score``: ``[batch, kv_heads, 1]``, the new token's score instead of ``fresh`` (a score the
    policy computes once per token: :func:`kvpolicy.statistics.scored_once`).

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
            store.scores.select(2, s).fill_(fresh)
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
            store.scores.select(2, s).fill_(fresh)
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
        store.scores[index, :, at] = fresh if score is None else score[:, :, 0].to(store.scores.dtype)
        store.bias[index, :, at] = 0
    for r in range(rows.batch):
        if free[r]:
            free[r].pop()
        else:
            front[r] += 1
        seen[r] += 1
        count[r] += 1
    rows.columns += 1


def ready_tail(store: Storage, front: int, seen: int, score: float = 0.0) -> None:
    """One row's slots from ``front`` on made ready for frontier writes (:func:`write_token`):
    slot ``front + i`` gets position ``seen + i``, score ``score`` (the writes' ``fresh``) and bias 0, what the ``i``-th next
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
    store.scores[:, :, front:].fill_(score)
    store.bias[:, :, front:].fill_(0)


def chunk_tokens(keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor | None, seen: list[int],
                 score_dtype: torch.dtype) -> Storage:
    """A prompt chunk ``[batch, kv_heads, q, head_dim]`` as slots: real tokens numbered from each
    row's ``seen``, pads (``valid`` False, ``[batch, q]``) at position ``-1`` with zero keys and
    values (attended by nobody but themselves: finite), score ``+inf`` and bias ``-inf`` (in
    :func:`~kvpolicy_torch.storage.logits_dtype`, as a storage keeps it).

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
    bias = torch.where(pos >= 0, torch.zeros((), dtype=logits_dtype(keys.dtype), device=dev), -math.inf)
    return Storage(keys, values, pos, torch.where(pos >= 0, zeros, math.inf), bias)
