"""The victims of a one-token eviction by lowest score (H2O, TOVA, Knorm, KeyDiff): the rule, the
search in one layer, and the search of every layer of a cache at once.

**The rule.** A row's victim is its lowest score outside the newest ``recent`` tokens, the earliest
position of a tie; a hole is never picked (it holds ``+inf``; accumulated scores, whose hole a NaN
step can turn NaN, are ranked by position: :func:`eviction_ranks`); :func:`first_argmin` is the
first index of the lowest, exact and free of host-device syncs.

**One layer.** :func:`lowest_victims` is the plain scan; above a size (:class:`CandidateSearch`) a
CPU layer finds it among a candidate set instead, which reads ``O(candidates)`` scores a step
rather than all of them (``tests/torch/test_victims.py`` holds it to the plain scan, ``kvpolicy
bench --what complexity`` measures it); :class:`OneTokenEviction` is a layer's one-token eviction.

**The layers of one cache** (:class:`LayerGroup`). A one-token eviction by lowest score (H2O,
TOVA) costs each layer a victim search and three writes per decode step, a handful of tiny ops
whose fixed cost (a few microseconds each, more with the model's weights streaming through the
caches) adds up over a model's layers. Yet a layer's
victim only has to be gone before that layer attends again, at the next step, and every layer of a
cache holds as many tokens at the same slots. So the layers of a :class:`LayerGroup` keep their
positions, scores and bias as slices of one tensor ``[layers, batch, kv_heads, slots]``; a layer's
:meth:`LayerCache.evict` does its host bookkeeping at once and leaves the victim to the group, and
the last layer's eviction of the step finds every layer's victim with one search and frees them
with one write per tensor. Any read of a layer before then (its next append, a property, a
snapshot) makes the group finish first, layer by layer where it must, so the deferral is never
visible: each layer's kept tokens are exactly those of its own eviction. (The eager layout's
optimisation: a static-shaped layer evicts on the device, :mod:`kvpolicy_torch.static`.)
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch

from kvpolicy.policy import DecodeEviction

from .rows import Rows
from .storage import Storage, hole_bookkeeping

__all__ = ["CandidateSearch", "LayerGroup", "OneTokenEviction", "PendingVictims", "eviction_ranks", "first_argmin",
           "free_victims", "lowest_victims", "mark_holes"]


# ---------------------------------------------------------------------- the rule
#: Blocks of :func:`first_argmin`'s CPU path: 1,024 elements, then 32 inside the chosen block.
_BLOCK, _SUB = 1024, 32
#: Up to this many elements ``torch.argmin`` itself is the faster choice on CPU.
_DIRECT = 1 << 16


def first_argmin(x: torch.Tensor) -> torch.Tensor:
    """Index of the first minimum along the last axis (``torch.argmin``'s documented tie rule).

    On CUDA, and for small inputs, this is ``torch.argmin``. On CPU ``torch.argmin`` is a scalar
    loop (930 us for ``[8, 65536]`` float32 on one core) while ``amin`` is vectorised (46 us), so
    a large input is searched in three levels: the minimum of each block of 1,024 (``amin``), the
    first block that holds the smallest, the first of its 32 sub-blocks that does, and the first
    position inside that one, then the last partial block on its own; the same answer (each level
    keeps the *first* minimum). ``[1, 8, 65536]`` on one core: about 110 us against argmin's 770.

    Args:
        x: ``[..., n]`` floating point, ``n >= 1``, no NaN (callers map NaN to ``-inf`` first).

    Returns:
        ``[...]`` int64 indices.

    Example:
        >>> first_argmin(torch.tensor([[3.0, 1.0, 2.0, 1.0]])).tolist()
        [1]
    """
    if x.device.type != "cpu" or x.numel() <= _DIRECT:
        return torch.argmin(x, dim=-1)
    n = x.shape[-1]
    whole = n - n % _BLOCK
    if whole == 0:
        return torch.argmin(x, dim=-1)
    # the whole blocks are searched in place (a view, whatever x's strides): padding x to a
    # multiple of the block would copy all of it, which costs more than the search
    blocks = x[..., :whole].unflatten(-1, (whole // _BLOCK, _BLOCK))
    minima = blocks.amin(dim=-1)  # [..., blocks]
    first = torch.argmin(minima, dim=-1, keepdim=True)  # [..., 1]
    lead = first.shape[:-1]
    block = torch.gather(blocks, -2, first[..., None].expand(*lead, 1, _BLOCK)).squeeze(-2)  # [..., BLOCK]
    subs = block.unflatten(-1, (_BLOCK // _SUB, _SUB))
    second = torch.argmin(subs.amin(dim=-1), dim=-1, keepdim=True)
    inner = torch.gather(subs, -2, second[..., None].expand(*lead, 1, _SUB)).squeeze(-2)  # [..., SUB]
    third = torch.argmin(inner, dim=-1, keepdim=True)
    found = (first * _BLOCK + second * _SUB + third).squeeze(-1)
    if whole == n:
        return found
    # the last partial block: it wins only with a strictly smaller value (a tie goes to the
    # earlier position, in the whole blocks)
    tail = x[..., whole:]
    best = torch.gather(minima, -1, first).squeeze(-1)
    return torch.where(tail.amin(dim=-1) < best, torch.argmin(tail, dim=-1) + whole, found)


def eviction_ranks(scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``scores`` as a lowest-score victim search ranks them (a new tensor, same shape): a NaN as
    ``-inf`` (the NaN rule: that token goes first), and a hole (``positions`` ``-1``) as ``+inf``
    whatever its score, so a hole is never a victim.

    A hole's score is ``+inf`` when it is made, but a decode step whose attention is NaN
    throughout (a NaN query, an overflow upstream, NaN reaches the holes' probabilities too) folds
    ``-inf`` into every score, and ``+inf - inf`` is NaN: ranked by its score, the hole would be
    "evicted" in place of a token, which would stay attended while the counts said it was gone.

    Example:
        >>> inf, nan = float("inf"), float("nan")
        >>> eviction_ranks(torch.tensor([[0.5, nan, nan, -inf]]), torch.tensor([[0, 1, -1, 3]])).tolist()
        [[0.5, -inf, inf, -inf]]
    """
    return torch.nan_to_num(scores, nan=-math.inf, posinf=math.inf, neginf=-math.inf).masked_fill_(positions < 0, math.inf)


# ---------------------------------------------------------------------- the layers of one cache
class PendingVictims(NamedTuple):
    """One layer's victims of a decode step, waiting for the group (:meth:`LayerGroup.defer`)."""

    index: int  #: the layer's index in the group
    hi: int  #: the eligible slots, ``[0, hi)``
    #: the layer's eviction: the group clears its ``deferred`` when it freed them, or hands them
    #: back (``free_alone(store, rows)``) when it could not search them with the others'
    eviction: OneTokenEviction
    store: Storage  #: the layer's storage
    rows: Rows  #: its rows
    shared: bool  #: one victim for all heads, by the scores summed over the heads
    holes_by_position: bool  #: holes ranked ``+inf`` by their position (accumulated scores)


def mark_holes(pos: torch.Tensor, scores: torch.Tensor, bias: torch.Tensor, dim: int, index: torch.Tensor) -> None:
    """The slots ``index`` along ``dim`` become holes: position ``-1``, score ``+inf`` (never a
    victim again), bias ``-inf`` (never attended).

    Example:
        >>> pos, scores, bias = torch.tensor([[3, 4]]), torch.zeros(1, 2), torch.zeros(1, 2)
        >>> mark_holes(pos, scores, bias, 1, torch.tensor([[1]]))
        >>> pos.tolist(), scores.tolist(), bias.tolist()
        ([[3, -1]], [[0.0, inf]], [[0.0, -inf]])
    """
    pos.scatter_(dim, index, -1)
    scores.scatter_(dim, index, math.inf)
    bias.scatter_(dim, index, -math.inf)


class LayerGroup:
    """Storage and deferred one-token evictions shared by the ``layers`` layers of one cache.

    Pass the same group to every layer's :class:`~kvpolicy_torch.LayerCache` (``group=``), in
    layer order. The first layer to allocate fixes the shape ``[batch, kv_heads, slots]``, and the
    layers keep their positions, scores and bias as slices of one tensor ``[layers, batch,
    kv_heads, slots]``. Layers of different sizes (PyramidKV's capacities) are :attr:`ragged`:
    each keeps its own tensors through the prompt, and at its decode steps asks to
    :meth:`join`; once every layer has asked, their positions, scores and bias move into one
    flat tensor ``[batch, kv_heads, total slots]``, each layer's slots a segment of it, and the
    group searches every segment's victim at once again. A layer whose storage changes after
    that (a growing full cache, AdaKV's widest head) keeps its own tensors and evicts alone, and
    then so does every layer (the group's search needs all of them).

    Args:
        layers: how many layers will join.

    Example:
        >>> import torch
        >>> from kvpolicy import H2O
        >>> from kvpolicy_torch import LayerCache
        >>> group = LayerGroup(2)
        >>> stack = [LayerCache(H2O(heavy=2, recent=2), group=group) for _ in range(2)]
        >>> for t in range(8):
        ...     for layer in stack:
        ...         K, V = layer.append(torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4))
        ...         layer.accumulate(torch.rand(1, 1, K.shape[2]))
        ...         rounds = layer.evict()
        >>> group.batched_evictions > 0, [layer.length for layer in stack]
        (True, [4, 4])
    """

    def __init__(self, layers: int) -> None:
        if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
            raise ValueError(f"layers must be an integer >= 1, got {layers!r}")
        self.layers = layers
        self._joined = 0  # layers registered so far
        self._members: set[int] = set()  # indices whose storage is a slice of the group's tensors
        self._members_changed()
        self._pending: list[PendingVictims] = []  # layers whose victims wait for the group, in layer order
        self._pos: torch.Tensor | None = None  # [layers, batch, kv_heads, slots]
        self._scores: torch.Tensor | None = None
        self._bias: torch.Tensor | None = None
        # layers moving to tensors of another shape together (:meth:`move`), and those tensors:
        # they become the group's when the last layer has left the old ones
        self._moved: set[int] = set()
        self._next: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        #: Whether the layers differ in slots (PyramidKV): their tensors, once every layer has
        #: asked to :meth:`join`, are one flat ``[batch, kv_heads, total slots]``.
        self.ragged = False
        #: Whether a layer should ask to :meth:`join` at its decode step (ragged layers that are
        #: not all in the flat tensors yet, none refused: a refusal ends it until every layer has
        #: left): read by every decode step, an attribute.
        self.assembling = False
        self._asked: dict[int, tuple[tuple[int, int, int], torch.dtype, torch.device, torch.dtype]] = {}  # (join: the layers' shapes, dtypes, device)
        self._segments: _Segments | None = None  # (ragged: each layer's slots in the flat tensors)
        #: Decode steps whose victims the group found for every layer at once (a diagnostic).
        self.batched_evictions = 0

    def register(self) -> int:
        """A layer joins (its constructor calls this): its index in the group."""
        if self._joined >= self.layers:
            raise ValueError(f"this LayerGroup was made for {self.layers} layers; a layer more joined it")
        self._joined += 1
        return self._joined - 1

    @property
    def nbytes(self) -> int:
        """Bytes of the positions, scores and bias the group holds for its layers."""
        return sum(t.numel() * t.element_size() for t in (self._pos, self._scores, self._bias) if t is not None)

    def _members_changed(self) -> None:
        #: Whether every layer keeps its positions, scores and bias in the group's tensors (an
        #: attribute, kept here whenever the members change: every decode step of every layer reads it)
        self.complete = len(self._members) == self.layers

    def storage(
        self, index: int, shape: tuple[int, int, int], score_dtype: torch.dtype, device: torch.device,
        bias_dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Layer ``index``'s positions, scores and bias ``[batch, kv_heads, slots]`` (``-1``,
        ``+inf``, ``-inf``: all holes; the bias in ``bias_dtype``) as slices of the group's
        tensors, or ``None`` when they cannot be (another shape, dtype or device than the group's)."""
        if self.ragged:
            return None  # (its own tensors until every layer asks to join)
        if self._pos is None or not self._members - {index}:  # the first layer (again) fixes the shape
            full = (self.layers, *shape)
            self._pos, self._scores, self._bias = hole_bookkeeping(full, score_dtype, device, bias_dtype)
        assert self._scores is not None and self._bias is not None
        alike = self._scores.dtype == score_dtype and self._bias.dtype == bias_dtype and self._pos.device == device
        if tuple(self._pos.shape[1:]) != shape or not alike:
            if tuple(self._pos.shape[1:3]) == shape[:2] and alike:
                self._become_ragged()  # another size (PyramidKV): one flat tensor once every layer has allocated
            else:
                self.leave(index)
            return None
        pos, scores, bias = self._pos[index], self._scores[index], self._bias[index]
        pos.fill_(-1)
        scores.fill_(math.inf)
        bias.fill_(-math.inf)
        self._members.add(index)
        self._members_changed()
        return pos, scores, bias

    def move(
        self, index: int, shape: tuple[int, int, int], score_dtype: torch.dtype, device: torch.device,
        bias_dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Layer ``index`` reallocates to ``shape`` ``[batch, kv_heads, slots]`` while the others
        will follow (every layer giving back a chunked prefill's room at its first decode step):
        its positions, scores and bias (all holes) as slices of the group's next tensors, which
        become the group's when no layer is left in the old ones; the group stays whole, where
        :meth:`storage` after :meth:`leave` would leave every layer on its own. ``None`` for
        :attr:`ragged` layers: the layer keeps its own tensors and asks to :meth:`join` again.

        Example:
            >>> group, cpu = LayerGroup(2), torch.device("cpu")
            >>> views = [group.storage(i, (1, 1, 4), torch.float32, cpu, torch.float32) for i in range(2)]
            >>> moved = [group.move(i, (1, 1, 2), torch.float32, cpu, torch.float32) for i in range(2)]
            >>> group.complete, tuple(group.views(1)[0].shape)
            (True, (1, 1, 2))
        """
        if self.ragged:  # (a flat segment does not move: the layer leaves, and asks to join with its new shape)
            self.leave(index)
            return None
        self._members.discard(index)
        self._members_changed()
        self._pending = [p for p in self._pending if p.index != index]
        nxt = self._next
        if (nxt is None or tuple(nxt[0].shape[1:]) != shape or nxt[1].dtype != score_dtype or nxt[2].dtype != bias_dtype
                or nxt[0].device != device):
            full = (self.layers, *shape)
            nxt = self._next = hole_bookkeeping(full, score_dtype, device, bias_dtype)
            self._moved = set()
        self._moved.add(index)
        views = nxt[0][index], nxt[1][index], nxt[2][index]
        self._promote()
        return views

    def _become_ragged(self) -> None:
        """Layers of different sizes: the stacked tensors are given up (a layer that holds slices
        of them keeps them alive until it joins the flat ones), every layer evicts alone until all
        have asked to :meth:`join`."""
        self.flush()
        self.ragged = self.assembling = True
        self._pos = self._scores = self._bias = self._next = None
        self._members, self._moved = set(), set()
        self._members_changed()

    def join(self, index: int, storage: Storage) -> Storage | None:
        """Ragged layers (:attr:`ragged`), at a decode step of layer ``index`` (while
        :attr:`assembling`): ``storage`` with its positions, scores and bias moved into the
        group's flat tensors (keys and values stay), or ``None`` while it keeps its own: not every
        layer has asked yet (the flat tensors are laid out from every layer's storage as it stood
        when it asked, after a chunked prefill gave its room back), or its storage no longer fits
        its segment (then no layer joins until they all leave, e.g. at a reset).

        Example:
            >>> from kvpolicy_torch.storage import Storage
            >>> group, cpu = LayerGroup(2), torch.device("cpu")
            >>> first = group.storage(0, (1, 1, 4), torch.float32, cpu, torch.float32)
            >>> group.storage(1, (1, 1, 2), torch.float32, cpu, torch.float32) is None, group.ragged
            (True, True)
            >>> stores = [Storage.allocate(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2), n, torch.float32) for n in (4, 2)]
            >>> group.join(0, stores[0]) is None  # layer 1 has not asked yet
            True
            >>> joined = [group.join(1, stores[1]), group.join(0, stores[0])]
            >>> group.complete, tuple(joined[0].positions.shape), tuple(group.views(0)[0].shape)
            (True, (1, 1, 2), (1, 1, 4))
        """
        b, h, slots = storage.positions.shape
        asked = ((int(b), int(h), int(slots)), storage.scores.dtype, storage.positions.device, storage.bias.dtype)
        if self._segments is None:
            self._asked[index] = asked
            if len(self._asked) < self.layers:
                return None
            shapes = [self._asked[i] for i in range(self.layers)]
            if any(s[0][:2] != shapes[0][0][:2] or s[1:] != shapes[0][1:] for s in shapes):
                self.assembling = False  # (rows, heads, dtype or device differ: alone)
                return None
            self._segments = _Segments([s[0][2] for s in shapes], shapes[0][2])
            self._pos, self._scores, self._bias = hole_bookkeeping((*shapes[0][0][:2], self._segments.total), *shapes[0][1:])
        if asked != self._asked.get(index) or not self.assembling:
            self.assembling = False  # (its storage no longer fits its segment, or a layer's did not)
            return None
        self._members.add(index)
        self._members_changed()
        self.assembling = not self.complete
        return self.relink(index, storage)

    def _promote(self) -> None:
        """The next tensors become the group's once no layer is left in the current ones."""
        if self._next is not None and not self._members:
            self._pos, self._scores, self._bias = self._next
            self._members, self._moved, self._next = self._moved, set(), None
            self._members_changed()

    def views(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Layer ``index``'s positions, scores and bias as the slices of the group's tensors it
        keeps them in, or ``None`` when it keeps its own (a restored copy re-links to them)."""
        if index in self._moved and self._next is not None:
            return self._next[0][index], self._next[1][index], self._next[2][index]
        if index not in self._members or self._pos is None or self._scores is None or self._bias is None:
            return None
        if self._segments is not None:  # (ragged: the layer's segment of the flat tensors)
            lo, n = self._segments.offsets[index], self._segments.slots[index]
            return self._pos.narrow(2, lo, n), self._scores.narrow(2, lo, n), self._bias.narrow(2, lo, n)
        return self._pos[index], self._scores[index], self._bias[index]

    def relink(self, index: int, storage: Storage) -> Storage:
        """``storage`` of a copied layer ``index`` (deepcopy, pickle) with its positions, scores and
        bias back in this group's tensors: a copy holds them apart, and the group's one search
        must see the layer's writes. Unchanged when the layer keeps its own tensors.

        Example:
            >>> group = LayerGroup(1)
            >>> pos, scores, bias = group.storage(0, (1, 1, 2), torch.float32, torch.device("cpu"), torch.float32)
            >>> apart = Storage(torch.zeros(1, 1, 2, 1), torch.zeros(1, 1, 2, 1), pos.clone().fill_(7), scores.clone(), bias.clone())
            >>> linked = group.relink(0, apart)
            >>> linked.positions is apart.positions, group.views(0)[0].tolist()
            (False, [[[7, 7]]])
        """
        views = self.views(index)
        if views is None:
            return storage
        for mine, theirs in zip(storage.bookkeeping(), views):
            theirs.copy_(mine)
        return Storage(storage.keys, storage.values, *views)

    def leave(self, index: int) -> None:
        """Layer ``index`` no longer keeps its storage in the group (it reallocated or was reset)."""
        self._members.discard(index)
        self._members_changed()
        self._moved.discard(index)
        self._pending = [p for p in self._pending if p.index != index]
        if self.ragged:
            self._asked.pop(index, None)
            self.assembling = self.assembling and self._segments is None  # (a member left: the flat tensors stay incomplete)
        if not self._members:  # nobody's storage any more: free it (the next layer to allocate sets a new one)
            self._pos = self._scores = self._bias = None
            if self.ragged:  # (every layer left, e.g. a reset: they lay out new flat tensors when they all ask again)
                self._segments, self.assembling = None, True
            self._promote()

    def defer(self, index: int, hi: int, eviction: OneTokenEviction, store: Storage, rows: Rows,
              shared: bool = False, holes_by_position: bool = True) -> None:
        """Take layer ``index``'s victims of this step: the lowest score of slots ``[0, hi)`` per
        row and head (``shared``: per row, by the scores summed over the heads, one victim for all
        heads; ``holes_by_position``: holes ranked ``+inf`` by their position, as
        :func:`~kvpolicy_torch.victims.lowest_victims` ranks accumulated scores), in ``store``
        by ``rows``. The group clears ``eviction.deferred`` once it freed them, or hands them back
        to :meth:`OneTokenEviction.free_alone` when it cannot search them with the others'. Once
        every layer has deferred, they are all found at once."""
        if self._pending and self._pending[-1].index >= index:
            # layers defer in layer order: what waits is an earlier step's (a layer that deferred
            # while the others freed alone, as in the step the group moved to new tensors): free it
            # now, or every later step would wait for a layer one step behind and never search at once
            self.flush()
        self._pending.append(PendingVictims(index, hi, eviction, store, rows, shared, holes_by_position))
        if len(self._pending) == self.layers:
            self.flush()

    def flush(self) -> None:
        """Free every pending layer's victims: with one search and one write per tensor when all
        layers wait with the same eligible slots, else layer by layer."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        hi, shared = pending[0].hi, pending[0].shared
        # (a loop, no generator: the last layer of every decode step asks; a generator is a call each)
        alike, by_position, flat = len(pending) == self.layers and self.complete, False, self._segments is not None
        for p in pending:
            alike = alike and (p.hi == hi or flat) and p.shared == shared
            by_position = by_position or p.holes_by_position
        if alike and flat:
            self._flush_segments(pending, shared, by_position)
            return
        if alike:
            assert self._pos is not None and self._scores is not None and self._bias is not None
            # each layer's plain scan (victims.lowest_victims), for every layer at once: the same answer
            window = self._scores.narrow(3, 0, hi)
            if by_position:
                window = eviction_ranks(window, self._pos.narrow(3, 0, hi))
            if shared:  # the heads' scores summed as each layer sums them, one victim for all heads
                victims = first_argmin(window.sum(dim=2, keepdim=True)).unsqueeze(-1).expand(-1, -1, window.shape[2], -1)
            else:
                victims = first_argmin(window).unsqueeze(-1)  # [layers, batch, heads, 1]
            mark_holes(self._pos, self._scores, self._bias, 3, victims)
            for p in pending:
                p.eviction.deferred = False  # (an attribute, no call a layer: every decode step)
            self.batched_evictions += 1
            return
        for p in pending:
            p.eviction.free_alone(p.store, p.rows)

    def _flush_segments(self, pending: list[PendingVictims], shared: bool, by_position: bool) -> None:
        """:meth:`flush` of ragged layers: each segment's plain scan of its slots ``[0, hi)``, for
        every segment at once. The segments are gathered into a grid ``[batch, kv_heads, layers,
        widest]`` (a segment's columns past its own slots repeat its last one), the columns at or
        past a layer's ``hi`` ranked ``+inf`` (after its eligible slots, so a tie of ``+inf``
        still goes to the earliest eligible slot, as the layer's own scan has it)."""
        pos, scores, bias, seg = self._pos, self._scores, self._bias, self._segments
        assert pos is not None and scores is not None and bias is not None and seg is not None
        ranks = eviction_ranks(scores, pos) if by_position else scores
        b, h = ranks.shape[:2]
        grid = ranks.index_select(2, seg.grid).view(b, h, self.layers, seg.widest)
        his = torch.tensor([p.hi for p in pending], device=grid.device).view(-1, 1)  # (pending: in layer order)
        grid.masked_fill_(seg.columns >= his, math.inf)
        if shared:  # the heads' scores summed as each layer sums them, one victim for all heads
            victims = first_argmin(grid.sum(dim=1, keepdim=True)).expand(b, h, self.layers)
        else:
            victims = first_argmin(grid)  # [batch, heads, layers]
        mark_holes(pos, scores, bias, 2, victims + seg.starts)
        for p in pending:
            p.eviction.deferred = False
        self.batched_evictions += 1


class _Segments:
    """Where each layer's slots lie in a :class:`LayerGroup`'s flat tensors (ragged layers)."""

    def __init__(self, slots: list[int], device: torch.device) -> None:
        self.slots = slots
        self.offsets = [sum(slots[:i]) for i in range(len(slots))]
        self.total = sum(slots)
        self.widest = max(slots)
        #: the flat column of each grid cell ``[layers * widest]``: a segment's columns past its
        #: slots repeat its last slot (ranked ``+inf`` by the search: past every layer's ``hi``)
        self.grid = torch.tensor([o + min(j, n - 1) for o, n in zip(self.offsets, slots) for j in range(self.widest)],
                                 device=device)
        self.columns = torch.arange(self.widest, device=device)  # a grid cell's column within its segment
        self.starts = torch.tensor(self.offsets, device=device)  # [layers]: added to a segment's victim


# ---------------------------------------------------------------------- one layer
def lowest_victims(
    scores: torch.Tensor,
    front: list[int],
    rule: DecodeEviction,
    shared: bool,
    reduce_scores: Callable[[torch.Tensor], torch.Tensor] | None = None,
    *,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Victim slot ``[rows, kv_heads]`` of each row of ``scores`` ``[rows, kv_heads, slots]``: the
    lowest score below the row's ``front`` outside its newest ``rule.recent`` slots, ties to the
    earliest slot (below a frontier, slot order is position order). ``shared``: one victim for
    all heads, by the scores summed over the heads (then ``reduce_scores``, e.g. over
    tensor-parallel ranks). ``positions``: given, a hole ranks ``+inf`` by its position and a NaN
    as ``-inf`` (:func:`eviction_ranks`), which accumulated scores need (a
    step whose attention is NaN throughout turns a hole's ``+inf`` into NaN); without, the scores
    are ranked as they are (a statistic that rewrites every score puts ``+inf`` at holes itself).

    Example:
        >>> from kvpolicy import DecodeEviction
        >>> scores, positions = torch.tensor([[[3.0, float("nan"), 1.0, 0.0]]]), torch.tensor([[[0, -1, 2, 3]]])
        >>> lowest_victims(scores, [4], DecodeEviction(limit=3, victim="lowest", recent=1), shared=False, positions=positions).tolist()
        [[2]]
    """
    hi = max(front) - rule.recent
    cand = scores[:, :, :hi] if positions is None else eviction_ranks(scores[:, :, :hi], positions[:, :, :hi])
    if any(f != front[0] for f in front):  # rows on other schedules: protect each row's own recent tokens
        if positions is None:
            cand = cand.clone()
        for i, f in enumerate(front):
            cand[i, :, f - rule.recent :] = math.inf
    if shared:
        summed = cand.sum(dim=1, keepdim=True)
        if reduce_scores is not None:
            summed = reduce_scores(summed)
        return first_argmin(summed).expand(cand.shape[0], cand.shape[1])
    return first_argmin(cand)


def free_victims(pos: torch.Tensor, scores: torch.Tensor, bias: torch.Tensor, victims: torch.Tensor,
                 rows: list[int]) -> None:
    """The slots ``victims`` ``[len(rows), kv_heads]`` of ``rows`` become holes (every row when
    ``rows`` covers the batch: one scatter per tensor)."""
    index = victims.unsqueeze(-1)
    if len(rows) == pos.shape[0]:
        mark_holes(pos, scores, bias, 2, index)
        return
    r_t = torch.tensor(rows, device=pos.device)
    for t, fill in ((pos, -1), (scores, math.inf), (bias, -math.inf)):
        part = t.index_select(0, r_t)
        part.scatter_(2, index, fill)
        t.index_copy_(0, r_t, part)


class CandidateSearch:
    """H2O's victim among candidates: :func:`lowest_victims` without reading every score.

    A full search (``topk``) keeps the ``candidates`` lowest-scored eligible slots per row and
    head, and the next lowest score as a ``bound`` every other eligible slot is at or above.
    Accumulated scores only grow (the layer calls :meth:`forget` when a received value is
    negative or NaN), so a slot at or above the bound then still is: while the lowest score among
    the candidates (and the slots that became eligible since) is strictly below the bound, it is
    the lowest eligible score, and every slot tied with it was searched, so "earliest of a tie" is
    the lowest such slot. A victim becomes a hole (``+inf``) and is never picked again. A full
    search runs again when the bound stops separating, when as many slots became eligible as there
    are candidates, or when slots moved: amortised over the steps between. ``O(batch x heads x
    candidates)`` a step.

    Example:
        >>> search = CandidateSearch()
        >>> search.applies(torch.zeros(1, 1, 10), hi=10, candidates=2, min_scores=1)
        True
    """

    #: eligible slots up to this many times ``candidates`` take the plain scan (small caches)
    PLAIN_SCAN_FACTOR = 4

    def __init__(self) -> None:
        self.searches = 0  # full searches so far (LayerCache.candidate_searches)
        self.pause = 0  # decode steps left on full scans (the candidates drained too fast)
        self.age = 0  # searches answered since the last full search
        self.forget()

    def forget(self) -> None:
        """Slots moved or a score may have gone down: the next search starts afresh."""
        self.slots: torch.Tensor | None = None  # [b, h, 2K] slots searched for the next victim
        self.bound: torch.Tensor | None = None  # [b, h, 1]: every other eligible slot's score is >= it
        self.hi = 0  # slots [0, hi) were eligible at the last full search; later ones are searched too
        self.top = -1  # eligible slots ended here at the last search (or plain scan)

    @property
    def active(self) -> bool:
        return self.slots is not None

    @staticmethod
    def applies(scores: torch.Tensor, hi: int, candidates: int, min_scores: int) -> bool:
        """Whether rows alike, with eligible slots ``[0, hi)``, are worth a candidate search (large
        CPU caches); the caller checks that the policy's scores only grow and are per head."""
        return (
            hi > CandidateSearch.PLAIN_SCAN_FACTOR * candidates  # small caches: the plain scan, decided first (every decode step)
            and scores.device.type == "cpu"
            and scores.shape[0] * scores.shape[1] * hi >= min_scores
        )

    def _rescan(self, scores: torch.Tensor, hi: int, candidates: int) -> bool:
        """The full search of ``[0, hi)``; False (nothing set) when a score is NaN (a full scan puts
        NaN first, ``topk`` last)."""
        searched = scores[:, :, :hi]
        if bool(torch.isnan(searched).any()):
            return False
        values, slots = torch.topk(searched, candidates + 1, dim=-1, largest=False, sorted=False)
        bound = values.amax(dim=-1, keepdim=True)
        # the largest of the k + 1 lowest is the bound; the others are the candidates (a tie with
        # the bound may leave a bound-valued slot out: the strict test below then rescans)
        last = values.argmax(dim=-1, keepdim=True)
        keep = torch.ones_like(slots, dtype=torch.bool).scatter_(2, last, False)
        # the candidates, then room for the slots that become eligible before the next search
        self.slots = torch.empty(*slots.shape[:2], 2 * candidates, dtype=slots.dtype, device=slots.device)
        self.slots[..., :candidates] = slots[keep].view(*slots.shape[:2], candidates)
        self.bound = bound
        self.hi = self.top = hi
        self.searches += 1
        return True

    def lowest(self, scores: torch.Tensor, hi: int, candidates: int) -> torch.Tensor | None:
        """Victim slot ``[batch, kv_heads]`` among slots ``[0, hi)``, or ``None`` when a plain scan
        must decide (the first step after slots moved, a bound that no longer separates)."""
        if self.slots is not None and (hi - self.top not in (0, 1) or hi - self.hi > candidates):
            # slots moved, more than one became eligible at once, or as many became eligible as
            # there are candidates: search again
            self.forget()
        if self.slots is None:
            if self.pause > 0:
                self.pause -= 1
                return None
            if self.top != hi - 1:
                # the first step after slots moved (or a cold start) takes the plain scan: the
                # candidates' topk pays off over a run of decode steps, not for one eviction
                self.top = hi
                return None
            if not self._rescan(scores, hi, candidates):
                self.pause = candidates
                return None
            self.age = 0
        k = candidates
        for attempt in range(2):
            cand, bound, lo = self.slots, self.bound, self.hi
            assert cand is not None and bound is not None
            if hi > lo:  # the slot that became eligible at this step (one per decode step)
                cand.select(2, k + hi - lo - 1).fill_(hi - 1)
            self.top = hi
            slots = cand[..., : k + hi - lo]
            searched = scores.gather(2, slots)
            low = searched.amin(dim=-1, keepdim=True)
            if bool((low < bound).all()):
                self.age += 1
                # the earliest (lowest) slot of those tied at the minimum
                return torch.where(searched == low, slots, torch.iinfo(torch.int64).max).amin(dim=-1)
            if attempt == 0:
                if self.age < candidates // 8 or not self._rescan(scores, hi, candidates):
                    break  # the bound fails soon after each search: full scans are cheaper for a while
                self.age = 0
        # more slots tie at the minimum than the candidates hold, or the candidates drain too fast
        self.forget()
        self.pause = candidates
        return None


class OneTokenEviction:
    """A layer's one-token decode eviction (:class:`~kvpolicy.DecodeEviction`) on the eager layout:
    which slot of each row that holds ``limit + 1`` tokens becomes a hole.

    ``"oldest"`` (StreamingLLM, the local window): the oldest token after the sinks, found from
    host integers (the rows' ring pointer); only its position is written, since the row's next
    append refills the slot before anything attends to it or searches it. ``"lowest"`` (H2O, TOVA,
    Knorm, KeyDiff): the lowest score outside the newest ``recent``, by the plain scan
    (:func:`lowest_victims`), among candidates (:class:`CandidateSearch`), or left to the layer's
    :class:`~kvpolicy_torch.LayerGroup` (:attr:`deferred`), which searches every layer's victims
    at once when the last layer of the step has evicted.

    Args:
        rule: the policy's decode eviction.
        shared: one victim for all heads of a row (the policy's ``selection == "shared"``).
        grows: whether the policy's scores only grow (``"accumulate"``: the candidates' bound holds).
        reduce_scores: applied to head-summed scores of a shared selection.
        group, index: the layer's group and its index there (``None``, ``-1``: alone).

    Example:
        >>> from kvpolicy import DecodeEviction
        >>> from kvpolicy_torch.rows import Rows
        >>> from kvpolicy_torch.storage import Storage
        >>> store = Storage.allocate(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2), 4, torch.float32)
        >>> _ = store.positions.copy_(torch.arange(4).view(1, 1, 4))
        >>> _ = store.scores.copy_(torch.tensor([[[5.0, 1.0, 3.0, 0.0]]]))
        >>> rows = Rows([4], [4], [4], [{}], [None], [[]])
        >>> OneTokenEviction(DecodeEviction(limit=3, victim="lowest", recent=1), shared=False, grows=True).evict(store, rows, [0], 1, 1)
        >>> store.positions[0, 0].tolist(), rows.count
        ([0, -1, 2, 3], [3])
    """

    def __init__(self, rule: DecodeEviction, *, shared: bool, grows: bool,
                 reduce_scores: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 group: LayerGroup | None = None, index: int = -1) -> None:
        self.rule = rule
        self.shared = shared
        self.grows = grows
        self.reduce_scores = reduce_scores
        self.group = group
        self.index = index
        self.search = CandidateSearch()
        #: this step's victims are left to the group (never visible: any read of the layer flushes it)
        self.deferred = False
        self._every: list[int] = []  # (every row of the batch: evict_due's usual answer, kept)

    def uses_candidates(self, scores: torch.Tensor, hi: int, candidates: int, min_scores: int) -> bool:
        """Whether rows alike, with eligible slots ``[0, hi)``, search among candidates."""
        return CandidateSearch.applies(scores, hi, candidates, min_scores) and not self.shared and self.grows

    def evict_due(self, store: Storage, rows: Rows, candidates: int, min_scores: int) -> list[tuple[int, int]] | None:
        """After a decode step: free one slot in each row that holds ``limit + 1`` tokens
        (:meth:`evict`); ``[(limit + 1, limit)]`` when some row did, ``[]`` when none holds that
        many, ``None`` (nothing freed) when a row holds more: a padded row after its prompt, which
        a general eviction serves (:class:`~kvpolicy_torch.eviction.HostEviction`).

        Example:
            >>> from kvpolicy import DecodeEviction
            >>> from kvpolicy_torch.rows import Rows
            >>> store = Storage.allocate(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2), 4, torch.float32)
            >>> _ = store.positions.copy_(torch.arange(4).view(1, 1, 4))
            >>> rows = Rows([4], [4], [4], [{}], [None], [[]])
            >>> OneTokenEviction(DecodeEviction(limit=3, victim="lowest", recent=1), shared=False, grows=True).evict_due(store, rows, 1, 1)
            [(4, 3)]
        """
        count = rows.count
        over = self.rule.limit + 1
        batch = len(count)  # (rows.batch, without the property's call)
        # (list.count: every decode step of every layer asks, and most batches have rows alike)
        if count.count(over) == batch:
            which = self._every
            if len(which) != batch:
                which = self._every = list(range(batch))
        elif any(c > over for c in count):
            return None
        else:
            which = [r for r, c in enumerate(count) if c == over]
            if not which:
                return []
        self.evict(store, rows, which, candidates, min_scores)
        return [(over, over - 1)]

    def evict(self, store: Storage, rows: Rows, which: list[int], candidates: int, min_scores: int) -> None:
        """Free one slot in each row of ``which`` (all heads): ``O(batch x heads)`` writes, nothing moves."""
        rule = self.rule
        every = len(which) == len(rows.count)  # (rows.batch without the property's call)
        if rule.victim == "oldest":
            slots = []
            for r in which:
                # a dense row's oldest non-sink token is at slot `sink`; later ones follow it
                # around the ring [sink, front) (the next append refills the freed slot)
                fifo = rows.fifo[r]
                slot = rule.sink if fifo is None else fifo
                slots.append(slot)
                rows.free[r].append(slot)
                rows.fifo[r] = slot + 1 if slot + 1 < rows.front[r] else rule.sink
            # only the position says "hole": every other read goes by positions
            pos = store.positions
            if every and all(s == slots[0] for s in slots):
                pos.select(2, slots[0]).fill_(-1)
            else:
                dev = pos.device
                pos[torch.tensor(which, device=dev), :, torch.tensor(slots, device=dev)] = -1
        elif every and self._deferrable(store, rows, candidates, min_scores):
            self.deferred = True  # the group frees the victims: after the counts below
        else:
            free_victims(*store.bookkeeping(), self.lowest(store, rows, which, candidates, min_scores), which)
        for r in which:
            rows.count[r] -= 1
        if self.deferred and self.group is not None:
            self.group.defer(self.index, rows.front[0] - rule.recent, self, store, rows, self.shared,
                             holes_by_position=self.grows)

    def _deferrable(self, store: Storage, rows: Rows, candidates: int, min_scores: int) -> bool:
        """Whether this step's victims may wait for the group: every layer keeps its storage in it,
        the rows stand alike, and the plain scan would find them (not candidates; a shared selection
        only without ``reduce_scores``, which each layer applies to its own summed scores)."""
        group, front = self.group, rows.front
        if group is None or not group.complete or (self.shared and self.reduce_scores is not None):
            return False
        hi = front[0] - self.rule.recent
        # (small caches take the plain scan, CandidateSearch.applies' first test, asked here first:
        # every decode step of every layer asks)
        if front.count(front[0]) != len(front) or (
            hi > CandidateSearch.PLAIN_SCAN_FACTOR * candidates and self.uses_candidates(store.scores, hi, candidates, min_scores)
        ):
            return False
        if self.search.slots is not None:  # (search.active)
            self.search.forget()  # (as the plain scan would)
        return True

    def free_alone(self, store: Storage, rows: Rows) -> None:
        """Free this step's victims, deferred to the group (:attr:`deferred`), here: the group
        could not search them with the others' (:meth:`LayerGroup.flush`)."""
        self.deferred = False
        every = list(range(rows.batch))
        free_victims(*store.bookkeeping(), lowest_victims(store.scores, rows.front, self.rule, self.shared,
                                                          self.reduce_scores, positions=self._holes(store)), every)

    def lowest(self, store: Storage, rows: Rows, which: list[int], candidates: int, min_scores: int) -> torch.Tensor:
        """Victim slot ``[len(which), heads]`` of each row of ``which``."""
        scores = store.scores
        front = [rows.front[r] for r in which]
        hi = max(front) - self.rule.recent
        if len(which) == rows.batch and all(f == front[0] for f in front) and self.uses_candidates(
            scores, hi, candidates, min_scores
        ):
            victims = self.search.lowest(scores, hi, candidates)
            if victims is not None:
                return victims
        elif self.search.active:
            self.search.forget()
        positions = self._holes(store)
        if len(which) < rows.batch:
            index = torch.tensor(which, device=scores.device)
            scores = scores.index_select(0, index)
            positions = None if positions is None else positions.index_select(0, index)
        return lowest_victims(scores, front, self.rule, self.shared, self.reduce_scores, positions=positions)

    def _holes(self, store: Storage) -> torch.Tensor | None:
        """The positions a search ranks holes by: accumulated scores only (see :func:`lowest_victims`)."""
        return store.positions if self.grows else None
