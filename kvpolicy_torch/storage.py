"""The slots of one layer: keys, values and, per slot, its position, score and attention bias.

Every row (batch entry) and KV head has the same number of slots. A slot holds a kept token or is
a *hole*: position ``-1``, score ``+inf`` (never a victim), bias ``-inf`` (never attended). Keys and
values of a hole are zeros, never garbage: attention reads them with weight 0, and ``0 * NaN``
would poison the row. Shapes:

* ``keys`` ``[batch, kv_heads, slots, head_dim]``, ``values`` ``[batch, kv_heads, slots, v_dim]``;
* ``positions`` ``[batch, kv_heads, slots]`` int64: the token's original position (``-1``: hole);
* ``scores`` ``[batch, kv_heads, slots]``: float32 (float64 for float64 keys and for statistics
  that must stay exact);
* ``bias`` ``[batch, kv_heads, slots]``: additive attention bias, ``0`` kept, ``-inf`` hole, in
  the dtype attention computes its logits in (:func:`logits_dtype`: float32, float64 for float64
  keys), whatever the scores' (no cast a step, and a float64 score's bias costs no more than a
  float32 one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterator, NamedTuple, Sequence

import torch

__all__ = ["HOLE", "MEMORY_BOUND", "RangeViews", "SlotPlan", "Storage", "bookkeeping_bytes", "fixed_addresses", "grown_slots",
           "hole_bookkeeping", "logits_dtype", "pooled_capacity", "token_bytes"]

_MIN_GROWTH = 16  # slots an unbounded store grows by at least
_MAX_GROWTH = 4096  # and at most (bounded chunks: a long run never doubles its allocation at once)

#: The most a bounded layer's storage allocates (keys, values, positions, scores, bias and its spare
#: slots together) over the bytes of the keys and values its capacity holds, where the spare slots
#: decide it (:meth:`SlotPlan.spare`): a one-token eviction by lowest score in the eager layout.
MEMORY_BOUND = 1.1


def pooled_capacity(capacities: Sequence[int | None]) -> int | None:
    """The capacity whose spare slots every layer of one cache takes (:attr:`SlotPlan.pooled`):
    the mean of the layers' ``capacities`` rounded down where they differ, else ``None`` (each
    takes its own: equal capacities, an unbounded layer, or no layer).

    Example:
        >>> pooled_capacity([250, 129, 8]), pooled_capacity([129, 129]), pooled_capacity([129, None])
        (129, None, None)
    """
    if not capacities or any(c is None for c in capacities) or len(set(capacities)) == 1:
        return None
    return sum(c for c in capacities if c is not None) // len(capacities)


def grown_slots(slots: int, need: int = 0) -> int:
    """Slots of an unbounded store (the full cache) that has ``slots`` and must hold ``need``:
    one chunk of 1/16 more, between 16 and 4,096 slots (amortised copies of 16 slots a token;
    a 1,000-token prompt plus a few decoded tokens allocates 1,063 slots, positions, scores and
    bias included under 1.1x a tight cache for a 64-dimensional head).

    Example:
        >>> grown_slots(1000), grown_slots(1000, need=2000), grown_slots(100_000)
        (1063, 2000, 104096)
    """
    return max(need, slots + min(_MAX_GROWTH, max(_MIN_GROWTH, math.ceil(slots / 16))))


def logits_dtype(keys_dtype: torch.dtype) -> torch.dtype:
    """The dtype of a storage's attention bias for keys of ``keys_dtype``: the one attention
    computes its logits in (:func:`~kvpolicy_torch.decode_attention`: float64 for float64 keys,
    else float32), so a decode step adds it as it is.

    Example:
        >>> logits_dtype(torch.bfloat16), logits_dtype(torch.float64)
        (torch.float32, torch.float64)
    """
    return torch.float64 if keys_dtype == torch.float64 else torch.float32


def bookkeeping_bytes(heads: int, score_dtype: torch.dtype, bias_dtype: torch.dtype) -> int:
    """Bytes of one slot's position (int64), score (``score_dtype``) and bias (``bias_dtype``:
    :func:`logits_dtype` of the keys) over ``heads`` KV heads: what :meth:`Storage.allocate` adds
    to each slot's key and value.

    Example:
        >>> bookkeeping_bytes(3, torch.float32, torch.float32), bookkeeping_bytes(3, torch.float64, torch.float32)
        (48, 60)
    """
    return heads * (torch.int64.itemsize + score_dtype.itemsize + bias_dtype.itemsize)


def token_bytes(keys: torch.Tensor, values: torch.Tensor) -> int:
    """Bytes of one token's key and value over the KV heads, for keys ``[batch, kv_heads, n,
    head_dim]`` and values ``[batch, kv_heads, n, v_dim]`` (any ``n``).

    Example:
        >>> token_bytes(torch.zeros(1, 3, 5, 64), torch.zeros(1, 3, 5, 64))
        1536
    """
    return keys.shape[1] * (keys.shape[3] * keys.element_size() + values.shape[3] * values.element_size())


@dataclass
class SlotPlan:
    """How many slots a layer allocates: the policy's ``capacity`` plus spare slots for a one-token
    eviction by lowest score (``slack``), or what ``reserve`` says the run needs; an unbounded
    policy (``capacity`` None) grows in bounded chunks (:func:`grown_slots`).

    Attributes:
        capacity: the policy's capacity (``None``: unbounded).
        reserve: the most tokens the run will append, if known.
        slack: whether holes accumulate below the frontier (a one-token ``"lowest"`` eviction in
            the eager layout), so spare slots save compactions (as many as :data:`MEMORY_BOUND`
            leaves: :meth:`spare`).
        planned: the slots the layer may grow to (set by :meth:`first`).
        chunk: a chunked prefill's chunk size (``0``: none): a bounded policy whose first append
            is a chunk of exactly this many tokens allocates room for one more chunk beyond its
            capacity, so that every later chunk is written in place and the storage is all a
            chunked prefill ever holds (capacity, spare slots and one chunk), where a chunk that
            did not fit would be copied with the kept tokens into a transient set beside it.

    Example:
        >>> plan = SlotPlan(capacity=1000, reserve=None, slack=True)
        >>> plan.first(tokens=10, per_slot=768, min_slack=64, chunk_bytes=8 << 20, bookkeeping=48), plan.planned
        (1034, 1034)
        >>> SlotPlan(capacity=1000, reserve=100, slack=True).first(10, 768, 64, 8 << 20)
        101
        >>> SlotPlan(capacity=1000, reserve=None, slack=False, chunk=512).first(512, 768, 64, 8 << 20)
        1512
    """

    capacity: int | None
    reserve: int | None
    slack: bool
    planned: int = 0
    chunk: int = 0
    #: the capacity whose spare slots the layer takes instead of its own's (``None``: its own):
    #: where the layers of one cache differ in capacity (PyramidKV) the memory bound holds over
    #: them together, and each takes the spare slots of their mean (rounded down), so a small
    #: layer compacts as rarely as the mean one (alone, a layer of 8 tokens gets 1 spare slot and
    #: compacts at every step: PyramidKV's 30 layers at 25% of 512 tokens compacted 9.2 times a
    #: step, 4.3 pooled). The cache's spare slots are those of its layers' own, give or take one
    #: per layer, so the whole stays within :data:`MEMORY_BOUND`.
    pooled: int | None = None
    #: the slots the first allocation holds for a chunked prefill's next chunk (set by
    #: :meth:`first`), given back at the first decode step (:meth:`SlotAllocator.release_room
    #: <kvpolicy_torch.allocation.SlotAllocator.release_room>`); ``0`` once given back, or when none
    room: int = 0

    def spare(self, per_slot: int, min_slack: int, chunk_bytes: int, bookkeeping: int = 0) -> int:
        """Spare slots over the capacity (``per_slot``: bytes of one slot's key and value over the
        heads; ``bookkeeping``: of its position, score and bias)."""
        if not self.slack or self.capacity is None:
            return 0
        # A compaction costs a fixed setup (~0.1 ms on a CPU) plus a move per kept slot, once per
        # `slack` steps, while attention reads `slack / 2` extra (masked) slots on average:
        # capacity / 8 keeps the moves at 8 a step whatever the size, and at least `min_slack`
        # (half of a tiny capacity) keeps small caches from paying the setup every few steps
        # (128 slots: a floor of 0 / 32 / 64 ran H2O at 95.1 / 96.2 / 96.7% of the limit on
        # SmolLM2-135M, benchmarks/slack_sweep.py). One compaction chunk bounds it: allocated
        # bytes stay within capacity plus one chunk.
        capacity = self.capacity if self.pooled is None else self.pooled
        slack = max(capacity // 8, min(capacity // 2, min_slack))
        # ... and the memory bound: the storage (keys, values, positions, scores, bias and the spare
        # slots) allocates at most MEMORY_BOUND x the bytes of the keys and values it holds between
        # two steps (capacity - 1 tokens: a one-token eviction has just freed one), what a
        # 64-dimensional head leaves: ~5% of the capacity
        held = (capacity - 1) * per_slot
        room = math.floor(MEMORY_BOUND * held / max(per_slot + bookkeeping, 1) + 1e-9) - capacity
        slack = min(slack, room)
        return max(1, min(slack, chunk_bytes // max(per_slot, 1)))

    def first(self, tokens: int, per_slot: int, min_slack: int, chunk_bytes: int, widest: int = 0,
              bookkeeping: int = 0) -> int:
        """The slots of the first allocation, for a first append of ``tokens``; sets
        :attr:`planned` (at least ``widest``: one head's most tokens under head-wise budgets;
        ``bookkeeping``: bytes of one slot's position, score and bias over the heads)."""
        if self.capacity is None:
            slots = max(tokens, self.reserve or 0)
            self.planned = slots
            return slots
        room = self.chunk if self.chunk > 1 and tokens == self.chunk else 0  # (a chunked prefill's next chunk)
        base = self.capacity + self.spare(per_slot, min_slack, chunk_bytes, bookkeeping)
        self.planned = max(base + room, widest)
        slots = base + room
        if self.reserve is not None and max(tokens, self.reserve) + 1 < slots:
            # the run needs at most `reserve` tokens (generate(): the prompt plus the new tokens):
            # allocate those (and one spare a step appends into), growing only if more come
            slots = max(tokens, self.reserve) + 1
        self.room = max(0, slots - max(base, widest))
        return slots

    def can_grow(self, slots: int) -> bool:
        """Whether a store of ``slots`` may grow (unbounded, or fewer than planned)."""
        return self.capacity is None or slots < self.planned

    def grows_between_steps(self, slots: int | None, limit: int | None) -> bool:
        """Static shapes: whether a storage of ``slots`` (``None``: not allocated yet) may have to
        grow between decode steps: the plan allows more, and no one-token eviction (``limit``: its
        limit, ``None``: none) keeps every row below ``slots``.

        Example:
            >>> SlotPlan(capacity=None, reserve=None, slack=False).grows_between_steps(None, None)
            True
            >>> plan = SlotPlan(capacity=100, reserve=None, slack=False); plan.planned = 100
            >>> plan.grows_between_steps(100, 99), plan.grows_between_steps(50, 99)
            (False, True)
        """
        if slots is None:  # (what the plan will allow: a smaller reserve is allocated first)
            return self.capacity is None or (self.reserve is not None and self.reserve + 1 < self.capacity)
        return self.can_grow(slots) and (limit is None or slots <= limit)

    def grown(self, slots: int, need: int = 0) -> int:
        """The slots after one growth step of a store of ``slots`` that must hold ``need``: an
        unbounded policy's at least ``reserve``, a bounded one's at most :attr:`planned`."""
        grown = grown_slots(slots, need)
        if self.capacity is None:
            return max(grown, self.reserve or 0)
        return min(grown, self.planned)


#: What a hole holds in the bookkeeping tensors (positions, scores, bias).
HOLE = (-1, math.inf, -math.inf)


def hole_bookkeeping(shape: tuple[int, ...], score_dtype: torch.dtype, device: torch.device,
                     bias_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Positions (int64), scores (``score_dtype``) and bias (``bias_dtype``: :func:`logits_dtype`
    of the keys) of ``shape`` slots, every one a hole (:data:`HOLE`): a new storage's, or a
    :class:`~kvpolicy_torch.LayerGroup`'s for its layers.

    Example:
        >>> pos, scores, bias = hole_bookkeeping((1, 2), torch.float64, torch.device("cpu"), torch.float32)
        >>> pos.tolist(), scores.tolist(), bias.tolist(), bias.dtype
        ([[-1, -1]], [[inf, inf]], [[-inf, -inf]], torch.float32)
    """
    return tuple(torch.full(shape, fill, dtype=dtype, device=device)  # type: ignore[return-value]
                 for fill, dtype in zip(HOLE, (torch.int64, score_dtype, bias_dtype)))


def fixed_addresses(*tensors: torch.Tensor) -> None:
    """Tell ``torch.compile`` that these tensors keep their addresses between calls (a compiled
    decode step's state, written in place): CUDA graphs (``mode="reduce-overhead"``) then replay
    over them instead of skipping the graph for "mutated inputs" (on an H200, a 7B-shaped model's
    H2O step went from 22.6 to 6.2 ms: docs/performance.md section 7), as transformers'
    ``StaticCache`` does for its keys and values. Unguarded: another cache's tensors (another
    sequence through the same compiled step) re-record the CUDA graph rather than recompile. A
    no-op inside a compiled region and for eager use.

    Example:
        >>> t = torch.zeros(3)
        >>> fixed_addresses(t)  # t is now a static input of any compiled step that reads it
    """
    if not torch.compiler.is_compiling():
        for t in tensors:
            # torch.compiler offers no public alias of this documented call (see test_private_access)
            torch._dynamo.mark_static_address(t, guard=False)


class RangeViews(NamedTuple):
    """Views of slots ``[0, hi)``: what a decode step returns and attends with (:meth:`Storage.range_views`)."""

    keys: torch.Tensor  #: ``[batch, kv_heads, hi, head_dim]``
    values: torch.Tensor  #: ``[batch, kv_heads, hi, v_dim]``
    keys3t: torch.Tensor  #: ``[batch * kv_heads, head_dim, hi]``: the keys transposed, as :func:`~kvpolicy_torch.grouped_decode` takes them
    values3: torch.Tensor  #: ``[batch * kv_heads, hi, v_dim]``
    bias3: torch.Tensor  #: ``[batch * kv_heads, 1, hi]``
    scores: torch.Tensor  #: ``[batch, kv_heads, hi]``
    positions: torch.Tensor  #: ``[batch, kv_heads, hi]``


@dataclass
class Storage:
    """Keys, values, positions, scores and bias of one layer (shapes in the module docstring).

    A storage of whole (contiguous) tensors also holds their grouped 3-D views (:meth:`grouped`),
    made once; they are derived, never pickled (a copy rebuilds them as views of its own tensors).

    Example:
        >>> s = Storage.allocate(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4), slots=3, score_dtype=torch.float32)
        >>> s.slots, s.positions[0, 0].tolist(), s.bias[0, 0].tolist()
        (3, [-1, -1, -1], [-inf, -inf, -inf])
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    scores: torch.Tensor
    bias: torch.Tensor
    _grouped: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = field(init=False, repr=False, compare=False)
    def __post_init__(self) -> None:
        b, h, slots, d = self.keys.shape
        # (the bias may be a segment of a LayerGroup's flat tensor: its rows and heads still merge)
        bias_rows = self.bias.stride(2) == 1 and (b == 1 or self.bias.stride(0) == h * self.bias.stride(1))
        whole = self.keys.is_contiguous() and self.values.is_contiguous() and bias_rows
        self._grouped = (
            # (head dims spelled out: a view of no slots, e.g. an all-pad prompt's, has no -1 to infer)
            (self.keys.view(b * h, slots, d), self.values.view(b * h, slots, self.values.shape[3]), self.bias.view(b * h, 1, slots))
            if whole else None
        )
        if self._grouped is not None:  # a storage's own tensors (not a view of some slots): fixed for a compiled step
            fixed_addresses(self.keys, self.values, self.positions, self.scores, self.bias)

    @property
    def whole(self) -> bool:
        """Whether keys and values are contiguous and the bias is rows of slots (a storage's own
        tensors, not a view of some of their slots; its bookkeeping may be a segment of a
        :class:`~kvpolicy_torch.LayerGroup`'s): :meth:`range_views` serves it."""
        return self._grouped is not None

    def range_views(self, hi: int) -> RangeViews:
        """Views of slots ``[0, hi)``: the keys and values a decode step returns, their grouped 3-D
        views that :func:`~kvpolicy_torch.grouped_decode` attends with, and the bias, scores and
        positions it reads and updates (seven views; the layout keeps them per range:
        :meth:`SlotLayout.keep_views <kvpolicy_torch.layout.SlotLayout.keep_views>`).

        Example:
            >>> s = Storage.allocate(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4), slots=3, score_dtype=torch.float32)
            >>> views = s.range_views(2)
            >>> tuple(views.keys.shape), tuple(views.keys3t.shape), tuple(views.bias3.shape)
            ((1, 2, 2, 4), (2, 4, 2), (2, 1, 2))
        """
        if self._grouped is None:
            raise ValueError("range_views() needs a storage of whole tensors, not a view of some slots")
        k3, v3, bias3 = self._grouped
        return RangeViews(self.keys.narrow(2, 0, hi), self.values.narrow(2, 0, hi), k3.narrow(1, 0, hi).transpose(1, 2),
                          v3.narrow(1, 0, hi), bias3.narrow(2, 0, hi), self.scores.narrow(2, 0, hi),
                          self.positions.narrow(2, 0, hi))

    @classmethod
    def allocate(
        cls,
        like_k: torch.Tensor,
        like_v: torch.Tensor,
        slots: int,
        score_dtype: torch.dtype,
        bookkeeping: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> "Storage":
        """``slots`` holes per row and head, shaped like ``like_k``/``like_v`` in every other
        dimension; ``bookkeeping``: positions, scores and bias kept elsewhere (already holes)."""
        b, h, _, d = like_k.shape
        dev = like_k.device
        keys = torch.zeros(b, h, slots, d, dtype=like_k.dtype, device=dev)
        values = torch.zeros(b, h, slots, like_v.shape[-1], dtype=like_v.dtype, device=dev)
        if bookkeeping is None:
            bookkeeping = hole_bookkeeping((b, h, slots), score_dtype, dev, logits_dtype(like_k.dtype))
        return cls(keys, values, *bookkeeping)

    # ------------------------------------------------------------------ copies
    def __getstate__(self) -> dict[str, Any]:
        return {"keys": self.keys, "values": self.values, "positions": self.positions, "scores": self.scores,
                "bias": self.bias}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__post_init__()

    # ------------------------------------------------------------------ shape
    @property
    def slots(self) -> int:
        """Slots per row and head."""
        return int(self.keys.shape[2])

    @property
    def nbytes(self) -> int:
        """Bytes of the five tensors."""
        return sum(t.numel() * t.element_size() for t in self)

    def __iter__(self) -> Iterator[torch.Tensor]:
        """The five tensors, keys first: for work that treats them alike (copies, compaction)."""
        return iter((self.keys, self.values, self.positions, self.scores, self.bias))

    def bookkeeping(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(positions, scores, bias)``: the per-slot tensors a hole is marked in."""
        return self.positions, self.scores, self.bias

    # ------------------------------------------------------------------ views and copies
    def narrow(self, lo: int, hi: int) -> "Storage":
        """Views of slots ``[lo, hi)``."""
        return Storage(*(t[:, :, lo:hi] for t in self))

    def index_select(self, rows: torch.Tensor) -> "Storage":
        """Copies of the rows ``rows`` (repeats allowed)."""
        return Storage(*(t.index_select(0, rows.to(t.device)) for t in self))

    def copy_prefix(self, source: "Storage", n: int) -> None:
        """Slots ``[0, n)`` from ``source`` (growth, or the transient set put back)."""
        for mine, theirs in zip(self, source):
            mine[:, :, :n] = theirs[:, :, :n]

    def write(self, lo: int, tokens: "Storage") -> None:
        """``tokens`` (keys, values, positions, scores and bias of ``q`` slots) into ``[lo, lo + q)``."""
        hi = lo + tokens.slots
        for mine, new in zip(self, tokens):
            mine[:, :, lo:hi] = new

    def concat(self, tokens: "Storage", n: int) -> "Storage":
        """A new storage: slots ``[0, n)`` of this one, then ``tokens`` (a prompt that overflows)."""
        return Storage(*(torch.cat([mine[:, :, :n], new], dim=2) for mine, new in zip(self, tokens)))

    def clear_from(self, lo: int, hi: int | None = None, rows: torch.Tensor | None = None) -> None:
        """Slots ``[lo, hi)`` (to the end when ``hi`` is None) become holes, in ``rows`` only when given."""
        for t, fill in zip(self.bookkeeping(), HOLE):
            if rows is None:
                t[:, :, lo:hi] = fill
            else:
                part = t.index_select(0, rows)
                part[:, :, lo:hi] = fill
                t.index_copy_(0, rows, part)
