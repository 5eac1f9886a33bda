"""The layers of one cache, whose one-token evictions by lowest score are found together.

A one-token eviction by lowest score (H2O, TOVA) costs each layer a victim search and three
writes per decode step, a handful of tiny ops whose fixed cost (a few microseconds each, more with
the model's weights streaming through the caches) adds up over a model's layers. Yet a layer's
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

from .ops import eviction_ranks, first_argmin
from .storage import Storage, hole_bookkeeping

__all__ = ["LayerGroup", "PendingVictims", "mark_holes"]


class PendingVictims(NamedTuple):
    """One layer's victims of a decode step, waiting for the group (:meth:`LayerGroup.defer`)."""

    index: int  #: the layer's index in the group
    hi: int  #: the eligible slots, ``[0, hi)``
    free_alone: Callable[[], None]  #: frees them the layer's own way (the group could not search them with the others')
    freed: Callable[[], None]  #: tells the layer the group freed them
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
    layer order. The first layer to allocate fixes the shape ``[batch, kv_heads, slots]``; a layer
    whose storage differs (another capacity, e.g. PyramidKV, or a growing full cache) keeps its own
    tensors and evicts alone, and then so does every layer (the group's search needs all of them).

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
        self, index: int, shape: tuple[int, int, int], score_dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Layer ``index``'s positions, scores and bias ``[batch, kv_heads, slots]`` (``-1``,
        ``+inf``, ``-inf``: all holes) as slices of the group's tensors, or ``None`` when they
        cannot be (another shape, dtype or device than the group's)."""
        if self._pos is None or not self._members - {index}:  # the first layer (again) fixes the shape
            full = (self.layers, *shape)
            self._pos, self._scores, self._bias = hole_bookkeeping(full, score_dtype, device)
        assert self._scores is not None and self._bias is not None
        if tuple(self._pos.shape[1:]) != shape or self._scores.dtype != score_dtype or self._pos.device != device:
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
        self, index: int, shape: tuple[int, int, int], score_dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer ``index`` reallocates to ``shape`` ``[batch, kv_heads, slots]`` while the others
        will follow (every layer giving back a chunked prefill's room at its first decode step):
        its positions, scores and bias (all holes) as slices of the group's next tensors, which
        become the group's when no layer is left in the old ones; the group stays whole, where
        :meth:`storage` after :meth:`leave` would leave every layer on its own.

        Example:
            >>> group, cpu = LayerGroup(2), torch.device("cpu")
            >>> views = [group.storage(i, (1, 1, 4), torch.float32, cpu) for i in range(2)]
            >>> moved = [group.move(i, (1, 1, 2), torch.float32, cpu) for i in range(2)]
            >>> group.complete, tuple(group.views(1)[0].shape)
            (True, (1, 1, 2))
        """
        self._members.discard(index)
        self._members_changed()
        self._pending = [p for p in self._pending if p.index != index]
        nxt = self._next
        if nxt is None or tuple(nxt[0].shape[1:]) != shape or nxt[1].dtype != score_dtype or nxt[0].device != device:
            full = (self.layers, *shape)
            nxt = self._next = hole_bookkeeping(full, score_dtype, device)
            self._moved = set()
        self._moved.add(index)
        views = nxt[0][index], nxt[1][index], nxt[2][index]
        self._promote()
        return views

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
        return self._pos[index], self._scores[index], self._bias[index]

    def relink(self, index: int, storage: Storage) -> Storage:
        """``storage`` of a copied layer ``index`` (deepcopy, pickle) with its positions, scores and
        bias back in this group's tensors: a copy holds them apart, and the group's one search
        must see the layer's writes. Unchanged when the layer keeps its own tensors.

        Example:
            >>> group = LayerGroup(1)
            >>> pos, scores, bias = group.storage(0, (1, 1, 2), torch.float32, torch.device("cpu"))
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
        if not self._members:  # nobody's storage any more: free it (the next layer to allocate sets a new one)
            self._pos = self._scores = self._bias = None
            self._promote()

    def defer(self, index: int, hi: int, free_alone: Callable[[], None], freed: Callable[[], None],
              shared: bool = False, holes_by_position: bool = True) -> None:
        """Take layer ``index``'s victims of this step: the lowest score of slots ``[0, hi)`` per
        row and head (``shared``: per row, by the scores summed over the heads, one victim for all
        heads; ``holes_by_position``: holes ranked ``+inf`` by their position, as
        :func:`~kvpolicy_torch.victims.lowest_victims` ranks accumulated scores). ``free_alone()``
        frees them the layer's own way; ``freed()`` tells it the group did. Once every layer has
        deferred, they are all found at once."""
        if self._pending and self._pending[-1].index >= index:
            # layers defer in layer order: what waits is an earlier step's (a layer that deferred
            # while the others freed alone, as in the step the group moved to new tensors): free it
            # now, or every later step would wait for a layer one step behind and never search at once
            self.flush()
        self._pending.append(PendingVictims(index, hi, free_alone, freed, shared, holes_by_position))
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
        alike, by_position = len(pending) == self.layers and self.complete, False
        for p in pending:
            alike = alike and p.hi == hi and p.shared == shared
            by_position = by_position or p.holes_by_position
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
                p.freed()
            self.batched_evictions += 1
            return
        for p in pending:
            p.free_alone()
