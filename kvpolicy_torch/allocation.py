"""Where a layer's slots come from: the first allocation, growth, and room for the next append.

A layer allocates once, at its first append, as its :class:`~kvpolicy_torch.storage.SlotPlan`
says (the policy's capacity plus spare slots, or what ``reserve`` says the run needs), and grows
only while the plan allows (an unbounded policy; a bounded one sized for fewer tokens than came;
the widest head under head-wise budgets). Growth allocates a new storage and carries the kept
slots over; the old one is freed. A layer of a :class:`~kvpolicy_torch.victims.LayerGroup` starts
as a view of the group's tensors and takes a shape of its own when it grows.

Before an append writes, each row needs room: a decode token needs a slot at or after the
row's frontier (or a freed one), a prompt chunk dense rows in position order followed by room
for the whole chunk (or the transient working set, :class:`~kvpolicy_torch.layout.SlotLayout`).
Room comes from growth where the plan allows, else from compacting the rows (holes moved out).
"""

from __future__ import annotations

import torch

from kvpolicy.policy import KEY_STATISTICS, EvictionPolicy

from .victims import LayerGroup
from .layout import SlotLayout
from .rows import Rows
from .static import StaticSteps
from .headwise import fitted_slots
from .storage import SlotPlan, Storage, bookkeeping_bytes, grown_slots, logits_dtype, token_bytes

__all__ = ["SlotAllocator"]


class SlotAllocator:
    """Allocates, grows and makes room in one layer's storage (the layout's :attr:`~SlotLayout.store`).

    Args:
        policy: the layer's policy (its capacity; its statistic decides the scores' dtype).
        plan: how many slots (:class:`~kvpolicy_torch.storage.SlotPlan`).
        group: the group whose tensors the first storage views, or ``None``.
        index: the layer's index in ``group``.
        static: the layer's static decode steps, whose device state follows the storage's shape.
        ragged: head-wise budgets: the first allocation plans for the widest head.

    Example:
        >>> from kvpolicy import FullCache
        >>> from kvpolicy_torch.victims import CandidateSearch
        >>> layout = SlotLayout(CandidateSearch(), None)
        >>> slots = SlotAllocator(FullCache(), SlotPlan(None, None, slack=False))
        >>> slots.start(layout, torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), min_slack=64, chunk_bytes=1 << 20)
        >>> layout.store.slots, tuple(layout.store.keys.shape)
        (3, (1, 2, 3, 4))
        >>> slots.room_for_chunk(layout, 5, chunk_bytes=1 << 20); layout.store.slots  # one growth step: 16 slots at least
        19
    """

    def __init__(
        self,
        policy: EvictionPolicy,
        plan: SlotPlan,
        *,
        group: LayerGroup | None = None,
        index: int = -1,
        static: StaticSteps | None = None,
        ragged: bool = False,
    ) -> None:
        self.policy, self.plan = policy, plan
        self.group, self.index = group, index
        self.static, self.ragged = static, ragged
        rule = policy.decode_eviction
        #: an "oldest" ring keeps its sinks in front when it is unwrapped by a compaction
        self.sink = rule.sink if rule is not None else 0

    def start(self, layout: SlotLayout, keys: torch.Tensor, values: torch.Tensor, *, min_slack: int,
              chunk_bytes: int) -> None:
        """The first allocation, for a first append of ``keys``/``values`` ``[batch, kv_heads, q,
        head_dim]``, and the layout's rows."""
        b, h, q, _ = keys.shape
        policy = self.policy
        # head-wise budgets: one head may hold more than the mean (up to the layer's budget less
        # the others' floors): allocated for the mean, grown to the widest head's need (kvpolicy.AdaKV)
        widest = policy.head_capacity(h) if self.ragged and policy.capacity is not None else 0  # type: ignore[attr-defined]
        slots = self.plan.first(q, token_bytes(keys, values), min_slack, chunk_bytes, widest,
                                bookkeeping_bytes(h, self.score_dtype(keys), logits_dtype(keys.dtype)))
        layout.rows = Rows.start(b, policy.init_state())
        self.allocate(layout, keys, values, slots)

    def allocate(self, layout: SlotLayout, like_k: torch.Tensor, like_v: torch.Tensor, slots: int, *,
                 move: bool = False) -> None:
        """A storage of ``slots`` shaped like ``like_k``/``like_v``: the first, or a grown or shrunk
        one that takes over the kept slots (up to the furthest frontier; the rest is the transient set).
        ``move``: every layer of the group reallocates alike (:meth:`release_room`): it stays in the group."""
        b, h = like_k.shape[:2]
        dev = like_k.device
        score_dtype = self.score_dtype(like_k)
        shared = None
        if self.group is not None:
            if layout.store is None:
                shared = self.group.storage(self.index, (b, h, slots), score_dtype, dev, logits_dtype(like_k.dtype))
            elif move and self.group.views(self.index) is not None:
                shared = self.group.move(self.index, (b, h, slots), score_dtype, dev, logits_dtype(like_k.dtype))
            else:
                self.group.leave(self.index)  # growth: a shape of its own
        grown = Storage.allocate(like_k, like_v, slots, score_dtype, shared)
        if layout.store is not None:  # growth: carry what is there
            grown.copy_prefix(layout.store, min(max(layout.rows.front), layout.store.slots))
        layout.store = grown
        layout.moved()
        if self.static is not None:
            self.static.fit(b, h, dev)

    def score_dtype(self, like_k: torch.Tensor) -> torch.dtype:
        """The dtype of the scores of a storage for keys like ``like_k`` (its bias:
        :func:`~kvpolicy_torch.storage.logits_dtype`)."""
        # float64 for float64 models, and for records of low-attention events (exact integers < 2**52)
        # (and for scores from keys: computed in float64, as the reference does)
        exact = like_k.dtype == torch.float64 or self.policy.score_statistic in ("low_history", *KEY_STATISTICS)
        return torch.float64 if exact else torch.float32

    def grow(self, layout: SlotLayout, need: int = 0) -> None:
        """One growth step, to hold at least ``need`` slots (:meth:`SlotPlan.grown
        <kvpolicy_torch.storage.SlotPlan.grown>`)."""
        store = layout.storage()
        self.allocate(layout, store.keys[:, :, :1], store.values[:, :, :1], self.plan.grown(store.slots, need))

    def room_for_token(self, layout: SlotLayout, *, chunk_bytes: int) -> None:
        """Room for one decode token in every row: rows whose frontier is at the end of the storage
        (and hold no freed slot) grow it where the plan allows, else are compacted. The first
        decode step after a chunked prefill gives back the room held for a next chunk
        (:meth:`release_room`)."""
        if self.plan.room:
            self.release_room(layout, chunk_bytes=chunk_bytes)
        full = layout.rows_at_end()
        if not full:
            return
        if self.ragged and self.plan.capacity is not None:
            self.room_for_headwise(layout, full, chunk_bytes=chunk_bytes)
            return
        if self.plan.can_grow(layout.storage().slots):
            self.grow(layout)
            return
        rows = layout.rows
        layout.compact([r for r in full if rows.count[r] < rows.front[r]], sink=self.sink, chunk_bytes=chunk_bytes)
        slots = layout.storage().slots
        if any(rows.front[r] >= slots for r in full):
            raise RuntimeError(f"{self.policy!r} holds {max(rows.count)} tokens, more than its capacity {self.policy.capacity}")

    def release_room(self, layout: SlotLayout, *, chunk_bytes: int) -> None:
        """Give back the slots a chunked prefill held for its next chunk (:attr:`SlotPlan.room
        <kvpolicy_torch.storage.SlotPlan.room>`): once decoding starts the prompt is over, and a
        512-token room beside a 129-token capacity would stay allocated for the whole run (a
        prompt of exactly one chunk allocates it too). The rows are compacted if their frontier is
        inside the room, then the storage is reallocated without it; the layers of a
        :class:`~kvpolicy_torch.LayerGroup` move to the group's new tensors together
        (:meth:`LayerGroup.move <kvpolicy_torch.LayerGroup.move>`), so their one victim search a
        step goes on. A later prompt chunk makes room again as a chunk that does not fit does.

        Example:
            >>> from kvpolicy import H2O
            >>> from kvpolicy_torch import LayerCache
            >>> layer = LayerCache(H2O(heavy=2, recent=2), prompt_chunk=8)
            >>> K, V = layer.append(torch.randn(1, 1, 8, 4), torch.randn(1, 1, 8, 4))
            >>> layer.accumulate(torch.rand(1, 1, 8)); rounds = layer.evict()
            >>> before = layer.slots
            >>> K, V = layer.append(torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4))
            >>> before, layer.slots
            (14, 6)
        """
        plan, store, rows = self.plan, layout.storage(), layout.rows
        target = store.slots - plan.room
        plan.room = 0
        if self.ragged:
            return  # (head-wise budgets fit their storage to the widest head at every compaction)
        if max(rows.front) >= target:
            layout.compact([r for r in range(rows.batch) if rows.count[r] < rows.front[r]], sink=self.sink, chunk_bytes=chunk_bytes)
            if max(rows.front) >= target:
                return  # (more held than the storage without the room: kept, as the plan allows)
        plan.planned = min(plan.planned, target)
        self.allocate(layout, store.keys[:, :, :1], store.values[:, :, :1], target, move=True)

    def room_for_headwise(self, layout: SlotLayout, full: list[int], *, chunk_bytes: int) -> None:
        """Head-wise budgets (:class:`kvpolicy.AdaKV`), rows ``full`` at the end of the storage:
        compact them (a head-wise decode eviction leaves its victims as holes where they stood),
        then fit the storage to one growth step above the widest head
        (:func:`~kvpolicy_torch.storage.grown_slots`, at most :attr:`SlotPlan.planned`): grown
        when less than half a step is left, shrunk when more than two are
        (:func:`~kvpolicy_torch.headwise.fitted_slots`), so the widest head's share moving never
        reallocates at every step, and compactions come about once per half a growth step."""
        rows = layout.rows
        layout.compact([r for r in full if rows.count[r] < rows.front[r]], sink=self.sink, chunk_bytes=chunk_bytes)
        slots, widest, front = layout.storage().slots, max(rows.count), max(rows.front)
        fit, short = self._widest_room(slots, widest)
        if short or front >= slots:
            if fit <= front:
                raise RuntimeError(f"{self.policy!r} holds {widest} tokens in a head, more than it may ({self.plan.planned - 1})")
            self.fit_widest(layout, fit)
        else:
            shrunk = fitted_slots(slots, widest)
            if shrunk is not None and front < shrunk:
                self.fit_widest(layout, shrunk)

    def _widest_room(self, slots: int, widest: int) -> tuple[int, bool]:
        """Head-wise budgets' growth rule, for a storage of ``slots`` whose widest head holds
        ``widest``: the slots to fit it to (one growth step above the widest head, at most
        :attr:`SlotPlan.planned`), and whether it is short of room (less than half a step left)."""
        fit = min(grown_slots(widest), self.plan.planned)
        return fit, slots - widest < (fit - widest) / 2

    def room_for_chunk(self, layout: SlotLayout, q: int, *, chunk_bytes: int) -> None:
        """Dense rows (a chunk sees its row's kept tokens in position order) and, where the plan
        allows, slots for ``q`` more tokens; what does not fit goes to the transient set."""
        layout.moved()
        layout.densify(sink=self.sink, chunk_bytes=chunk_bytes)
        need = max(layout.rows.front) + q
        if self.plan.can_grow(layout.storage().slots) and need > layout.storage().slots:
            self.grow(layout, need)  # (unbounded, or more than `reserve` came)

    def ready_for_device(self, layout: SlotLayout, *, chunk_bytes: int) -> None:
        """Before a static-shaped layer hands its rows to the device: dense rows, and room for the
        next token (an unbounded policy, or a bounded one sized for ``reserve`` tokens that is given
        more, grows here, between steps)."""
        layout.densify(sink=self.sink, chunk_bytes=chunk_bytes)
        slots, widest = layout.storage().slots, max(layout.rows.count)
        if self.ragged and self.plan.capacity is not None:
            # head-wise budgets: sized by the widest head (every head gains a token a step, its
            # first hole takes it), grown when less than half a growth step is left above it; the
            # host follows a bound on the widest head between steps (LayerCache.settle reads the
            # device when it reaches the end), and each growth is a new shape (a new graph when
            # compiled), so it grows by a step, not a slot (measured on the embedded model, 2,048
            # tokens, 25%: the widest head of a layer moves by ~3 tokens in 128 steps)
            fit, short = self._widest_room(slots, widest)
            if short and fit > slots:
                self.fit_widest(layout, fit)
            return
        if self.plan.can_grow(slots) and widest >= slots:
            self.grow(layout)

    def fit_widest(self, layout: SlotLayout, slots: int) -> None:
        """Head-wise budgets: the storage resized to ``slots`` (the widest head's need), the kept
        slots carried over (:func:`~kvpolicy_torch.headwise.fitted_slots` says when)."""
        like = layout.extra if layout.extra is not None else layout.storage()
        self.allocate(layout, like.keys[:, :, :1], like.values[:, :, :1], slots)
