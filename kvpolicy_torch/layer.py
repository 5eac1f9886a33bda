"""One layer's evicting KV store on torch: slots that stay put, batched, per KV head, CPU and CUDA.

The slot layout (docs/design.md, "The slot layout"):

* storage ``keys``/``values`` ``[batch, kv_heads, slots, head_dim]`` and, per slot, the original
  position ``[batch, kv_heads, slots]`` int64 (``-1``: a hole), the accumulated score (float32,
  float64 for float64 keys; ``+inf`` at a hole) and an additive attention ``bias`` (``0`` kept,
  ``-inf`` hole);
* every row has a *frontier*: new tokens are written there, and below it the row's kept tokens
  stand in position order, with holes where tokens were evicted;
* a policy's :class:`~kvpolicy.DecodeEviction` (H2O, StreamingLLM, the local window) turns one
  slot per row and head into a hole: ``O(batch x kv_heads)`` writes, plus one read of the scores
  for ``victim="lowest"``. No kept token moves. For ``victim="oldest"`` the next append writes
  into the freed slot, so the tokens after the sinks go round a ring and never need compacting;
* a general eviction (:meth:`EvictionPolicy.select`, e.g. BUZZ's, or any prefill's) sees each row
  dense at ``[0, count)`` and is applied by compacting kept tokens to the front in place, chunk by
  chunk. Rows are also compacted when a frontier reaches the end of the storage, which for
  one-token evictions happens once per ``slack`` steps: amortised ``O(kv_heads x head_dim)`` a token.

Rows may hold different numbers of tokens (left-padded prompts): pads are never kept, and each row
evicts on its own schedule. Host integers say how many tokens each row holds, so *whether* to evict
is decided without looking at tensor values, and a decode step makes no host-device sync.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Sequence

import torch

from kvpolicy._validation import check_bool
from kvpolicy.driver import kept_slots
from kvpolicy.policy import KEY_STATISTICS, DecodeEviction, EvictionPolicy
from kvpolicy.statistics import key_scores, low_attention, shift_history

from .attention import decode_attention, grouped_decode
from .checks import check_append, check_batch_index, check_capacity, check_query, check_received
from .group import LayerGroup, mark_holes
from .ops import first_argmin
from .static import DecodeState, StepOptions

__all__ = ["LayerCache", "LayerSnapshot", "PrefixShift"]

_MIN_GROWTH = 16  # slots an unbounded store grows by at least
_MAX_GROWTH = 4096  # and at most (bounded chunks: a long run never doubles its allocation at once)


def _grown(slots: int, need: int = 0) -> int:
    """Slots of an unbounded store (the full cache) that has ``slots`` and must hold ``need``:
    one chunk of 1/16 more, between 16 and 4,096 slots (amortised copies of 16 slots a token;
    a 1,000-token prompt plus a few decoded tokens allocates 1,063 slots, positions, scores and
    bias included under 1.1x a tight cache for a 64-dimensional head)."""
    return max(need, slots + min(_MAX_GROWTH, max(_MIN_GROWTH, math.ceil(slots / 16))))


class PrefixShift(NamedTuple):
    """Positions of a pos-shift cache whose keys differ from their original positions only in a
    prefix: slots ``[0, length)`` of row ``r`` sit ``delta[r]`` positions later, every other kept
    token at its original position (StreamingLLM: the sinks, by the number of evicted tokens)."""

    length: int
    delta: list[int]


def _reverse_slots(x: torch.Tensor, lo: int, hi: int, step: int) -> None:
    """Reverse ``x[:, lo:hi]`` in place, swapping chunks of at most ``step`` slots from both ends."""
    while hi - lo > 1:
        c = min(step, (hi - lo) // 2)
        left = x[:, lo : lo + c].flip(1)  # flip copies
        x[:, lo : lo + c] = x[:, hi - c : hi].flip(1)
        x[:, hi - c : hi] = left
        lo, hi = lo + c, hi - c


@dataclass
class LayerSnapshot:
    """The bookkeeping of a :class:`LayerCache`: per-row counts and policy states, and per slot
    the positions, scores and bias. Keys and values are not part of it: restoring a snapshot
    replays the same eviction decisions on the same storage (what eviction benchmarks need)
    without copying the cache. Fields may be edited (``dataclasses.replace``) before a restore."""

    columns: int
    seen: list[int]
    count: list[int]
    front: list[int]
    states: list[dict[str, int]]
    fifo: list[int | None]
    positions: torch.Tensor
    scores: torch.Tensor
    bias: torch.Tensor
    #: per row, the slots freed by ``"oldest"`` evictions that the next append refills
    free: list[list[int]] = field(default_factory=list)


class LayerCache:
    """Evicting KV storage for one attention layer.

    Usage per forward step: :meth:`append` the new keys/values (returns the slots the current
    queries attend to), compute attention over them (masking with :attr:`bias` or
    :meth:`chunk_mask`), :meth:`accumulate` the probabilities each of those slots received (summed
    over the query heads of its KV head and over the real queries), then :meth:`evict`.

    Storage is allocated once to the policy's ``capacity`` (plus ``slack`` slots for policies that
    evict one token at a time); unbounded policies grow by 1/10 (or are sized from ``reserve``). A prefill chunk that does not fit
    is held transiently until the eviction brings the layer back under capacity.

    Args:
        policy: the eviction policy.
        reduce_scores: applied to head-summed scores before a shared selection (e.g. an
            all-reduce over tensor-parallel ranks); unused for per-head selection.
        static_shapes: attend over every allocated slot (holes masked) at every decode step, so
            the decode step's shapes never change (``torch.compile``, CUDA graphs). Default: only
            up to the frontier.
        reserve: the most tokens the run will append (e.g. prompt plus ``max_new_tokens``): an
            unbounded policy allocates that at the first append instead of growing, and a bounded
            one whose capacity is larger allocates no more than that (growing up to its capacity
            if more come).
        key_shift: StreamingLLM's pos-shift done in the storage: ``key_shift(keys, delta)`` rotates
            keys ``[batch, kv_heads, s, head_dim]`` by ``delta`` positions (RoPE), ``delta`` a list
            of host ints, one per row (callers may memoise on it: it is the same in every layer).
            With it, for a policy whose decode eviction is ``"oldest"`` with sinks, a decode
            :meth:`append` returns the sinks' keys already at their shifted positions (see
            :meth:`shift`): they are rotated from their originals, kept aside, whenever the shift
            changes (``O(batch x kv_heads x sink)``), so attention needs no second query and can
            take plain SDPA. :attr:`keys_shifted` says when this is in effect; every other read
            (:attr:`keys`, a prompt chunk, a general eviction) sees the original keys.
        group: a :class:`LayerGroup` shared by the layers of one cache: their one-token
            evictions by lowest score (H2O, TOVA) are found with one search per decode step for
            all of them (never visibly deferred: any read of a layer finishes them first).

    Example:
        >>> import torch
        >>> from kvpolicy import StreamingLLM
        >>> layer = LayerCache(StreamingLLM(sink=1, window=2))
        >>> for t in range(5):
        ...     k = v = torch.randn(1, 2, 1, 4)
        ...     K, V = layer.append(k, v)
        ...     layer.accumulate(torch.ones(1, 2, K.shape[2]))
        ...     rounds = layer.evict()
        >>> layer.positions[0, 0].tolist()
        [0, 3, 4]
    """

    #: Bytes of the temporary one step of the in-place compaction copies through.
    compaction_chunk_bytes: int = 8 << 20
    #: ``victim="lowest"`` on CPU: from this many scores searched per step (batch x kv_heads x
    #: eligible slots), the victim is found among a candidate set instead of by a full scan (see
    #: :meth:`_lowest_candidates`); below it a full scan is cheaper.
    candidate_min_scores: int = 1 << 16
    #: Candidate slots per row and head (see :meth:`_lowest_candidates`).
    candidates: int = 256
    #: Floor of the spare slots of a one-token ``"lowest"`` eviction (H2O, TOVA), up to half the
    #: capacity: ``slack = max(capacity // 8, min(capacity // 2, min_slack))``, within one
    #: compaction chunk (``benchmarks/slack_sweep.py`` measures the choice).
    min_slack: int = 64

    def __init__(
        self,
        policy: EvictionPolicy,
        *,
        reduce_scores: Callable[[torch.Tensor], torch.Tensor] | None = None,
        static_shapes: bool = False,
        reserve: int | None = None,
        key_shift: Callable[[torch.Tensor, list[int]], torch.Tensor] | None = None,
        group: "LayerGroup | None" = None,
    ) -> None:
        if not isinstance(policy, EvictionPolicy):
            raise ValueError(f"policy must be an EvictionPolicy, got {policy!r}")
        check_capacity(policy)
        self.policy = policy
        self.reduce_scores = reduce_scores
        self.static_shapes = check_bool("static_shapes", static_shapes)
        self.reserve = reserve
        rule = policy.decode_eviction
        if rule is not None and not isinstance(rule, DecodeEviction):
            raise ValueError(f"{policy!r}.decode_eviction must be a DecodeEviction or None, got {rule!r}")
        if rule is not None and policy.capacity is not None and policy.capacity < rule.limit + 1:
            raise ValueError(f"{policy!r} declares capacity {policy.capacity} below its decode eviction's limit + 1")
        self.rule = rule
        # a policy without one-token evictions (BUZZ) that declares its size rule: a decode step
        # at which the rule keeps every token skips the policy's call (host integers only)
        self._size_rule = policy.size_rule() if rule is None else None
        if key_shift is not None and not callable(key_shift):
            raise ValueError(f"key_shift must be callable (keys, delta) -> keys, got {key_shift!r}")
        # only the sinks of an "oldest" rule are shifted (a PrefixShift); other layouts shift per slot
        self._sink_shift = (
            key_shift if rule is not None and rule.victim == "oldest" and rule.sink > 0 and not self.static_shapes else None
        )
        self.evictions = 0
        if group is not None and not isinstance(group, LayerGroup):
            raise ValueError(f"group must be a LayerGroup or None, got {group!r}")
        self.group = group
        self._group_index = group.register() if group is not None else -1
        self._clear()

    def _clear(self) -> None:
        if self.group is not None:
            self.group.leave(self._group_index)
        self._deferred = False  # this step's victims are left to the group (see LayerGroup)
        self._k: torch.Tensor | None = None
        # grouped views of the storage (see _set_storage); dropped with it, so reset() frees memory
        self._k3: torch.Tensor | None = None
        self._v3: torch.Tensor | None = None
        self._bias3: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self._pos: torch.Tensor | None = None
        self._scores: torch.Tensor | None = None
        self._bias: torch.Tensor | None = None
        # transient working set (keys, values, positions, scores, bias) while a chunk overflows
        self._extra: tuple[torch.Tensor, ...] | None = None
        self.columns = 0  # appended columns per row, pads included (transformers' sequence length)
        self._seen: list[int] = []  # real tokens seen per row
        self._count: list[int] = []  # kept tokens per row (every head holds as many)
        self._front: list[int] = []  # next free slot per row
        self._states: list[dict[str, int]] = []
        self._fifo: list[int | None] = []  # "oldest" rule: slot of the oldest token after the sinks
        # "oldest" rule: slots the last evictions freed; the next append writes there, so the
        # tokens after the sinks form a ring over [sink, front) and nothing is ever compacted
        self._free: list[list[int]] = []
        self._range = (0, 0)  # slots [lo, hi) the last append returned
        self._bias_needed = False  # whether a slot of that range is a hole (host-side, set by append)
        self._tail_clean = False  # one row: scores and bias are 0 from the frontier on (see _clean_tail)
        self._chunk: tuple[int, int, torch.Tensor | None] | None = None  # (start, q, valid [b, q]) of a chunk
        self._phase = "decode"
        # key_shift: the sinks' original keys [b, h, sink, d] while their slots hold them shifted
        # by _sink_delta (per row); None while the storage holds the originals
        self._sink_keys: torch.Tensor | None = None
        self._sink_delta: list[int] | None = None
        self._forget_candidates()
        self._cand_pause = 0  # decode steps left on full scans (the candidates drained too fast)
        self._cand_age = 0  # searches answered since the last full search
        self._cand_rescans = 0  # full searches so far (tests read it through candidate_searches)
        # static shapes: a decode step's bookkeeping in device tensors (kvpolicy_torch.static);
        # `_device_newer` says the device holds steps the host lists have not seen yet
        self._decode: DecodeState | None = None
        self._device_newer = False

    # ------------------------------------------------------------------ copies (pickle, deepcopy, torch.save)
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_size_rule"] = None  # a closure: rebuilt from the policy
        state["_k3"] = state["_v3"] = state["_bias3"] = None  # views: rebuilt from the storage
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._size_rule = self.policy.size_rule() if self.rule is None else None
        if self._k is not None:
            # a copy of a grouped layer keeps its positions, scores and bias in the copied group's
            # tensors again (a copy holds them apart: the group's one search must see its writes)
            shared = self.group.views(self._group_index) if self.group is not None else None
            if shared is not None:
                for mine, theirs in zip((self._pos, self._scores, self._bias), shared):
                    theirs.copy_(mine)  # type: ignore[arg-type]
                self._pos, self._scores, self._bias = shared
            self._set_storage(*self._tensors())

    # ------------------------------------------------------------------ shape and bookkeeping
    @property
    def is_initialized(self) -> bool:
        return self._k is not None

    @property
    def on_device(self) -> bool:
        """Whether the newest decode steps ran on the device (``static_shapes``: see
        :mod:`kvpolicy_torch.static`) and the host lists have not read them back yet; any read of
        the layer's state reads them back first."""
        return self._device_newer

    @property
    def sequence_length(self) -> int | torch.Tensor:
        """Columns appended so far, pads included (transformers' sequence length). Inside
        ``torch.compile`` a static-shaped layer answers with a ``[]`` device tensor (no host read,
        as transformers' ``StaticCache``); elsewhere an int."""
        if self._decode is not None and torch.compiler.is_compiling():
            return self._decode.sequence_length()  # (kept current by every reload: valid whoever ran last)
        if self._decode is not None and self._device_newer:
            return int(self._decode.sequence_length())
        return self.columns

    @property
    def batch(self) -> int:
        """Rows held."""
        return len(self._count)

    @property
    def slots(self) -> int:
        """Allocated slots per row and head."""
        return 0 if self._k is None else int(self._k.shape[2])

    def _uniform(self, values: Sequence[Any], what: str) -> Any:
        if not values:
            return 0
        first = values[0]
        if any(v != first for v in values[1:]):
            raise ValueError(f"rows differ in {what} (a left-padded batch): read the per-row list instead")
        return first

    @property
    def length(self) -> int:
        """Kept tokens per head (every row); see :attr:`lengths` for rows that differ."""
        self._host()
        return self._uniform(self._count, "kept tokens (use .lengths)")

    @property
    def lengths(self) -> list[int]:
        """Kept tokens per head, per row."""
        self._host()
        return list(self._count)

    @property
    def n_seen(self) -> int:
        """Real tokens appended so far (every row); see :attr:`seen` for rows that differ."""
        self._host()
        return self._uniform(self._seen, "tokens seen (use .seen)")

    @property
    def seen(self) -> list[int]:
        """Real (non-pad) tokens appended so far, per row."""
        self._host()
        return list(self._seen)

    @property
    def state(self) -> dict[str, int]:
        """The policy's state (every row); see :attr:`states`."""
        self._host()
        return self._uniform(self._states, "policy state (use .states)")

    @property
    def states(self) -> list[dict[str, int]]:
        """The policy's state, per row."""
        self._host()
        return [dict(s) for s in self._states]

    def _host(self) -> None:
        """Bring the host lists up to date with decode steps the device ran (static shapes)."""
        if self._device_newer:
            self._materialize()

    def _require(self) -> None:
        if self._k is None:
            raise ValueError("nothing was appended to this LayerCache yet: call append() first")
        if self._deferred:
            self.group.flush()  # type: ignore[union-attr]
        self._host()

    # ------------------------------------------------------------------ storage
    def _slack(self, capacity: int, per_slot: int) -> int:
        if self.rule is None or self.rule.victim == "oldest" or self.static_shapes:
            # general evictions compact at once; the oldest token's slot is refilled by the next
            # append (a ring), and a static-shaped decode step writes into its victim's slot: in
            # none of these do holes accumulate below the frontier
            return 0
        # A compaction costs a fixed setup (~0.1 ms on a CPU) plus a move per kept slot, once per
        # `slack` steps, while attention reads `slack / 2` extra (masked) slots on average:
        # capacity / 8 keeps the moves at 8 a step whatever the size, and at least 64 (half of a
        # tiny capacity) keeps small caches from paying the setup every few steps (128 slots: a
        # floor of 0 / 32 / 64 ran H2O at 95.1 / 96.2 / 96.7% of the limit on SmolLM2-135M,
        # benchmarks/slack_sweep.py).
        # One compaction chunk bounds it: allocated bytes stay within capacity plus one chunk.
        slack = max(capacity // 8, min(capacity // 2, self.min_slack))
        return max(1, min(slack, self.compaction_chunk_bytes // max(per_slot, 1)))

    def _allocate(self, like_k: torch.Tensor, like_v: torch.Tensor, slots: int) -> None:
        self._forget_candidates()
        b, h, _, d = like_k.shape
        dev = like_k.device
        # float64 for float64 models, and for records of low-attention events (exact integers < 2**52)
        # (and for scores from keys: computed in float64, as the reference does)
        exact = like_k.dtype == torch.float64 or self.policy.score_statistic in ("low_history", *KEY_STATISTICS)
        score_dtype = torch.float64 if exact else torch.float32
        # zeros, not empty: a hole's key and value are read by attention (masked, weight 0), and
        # 0 * NaN from uninitialised memory would poison the row
        keys = torch.zeros(b, h, slots, d, dtype=like_k.dtype, device=dev)
        values = torch.zeros(b, h, slots, like_v.shape[-1], dtype=like_v.dtype, device=dev)
        shared = None
        if self.group is not None:
            if self._k is None:
                shared = self.group.storage(self._group_index, (b, h, slots), score_dtype, dev)
            else:
                self.group.leave(self._group_index)  # growth: a shape of its own
        if shared is not None:
            pos, scores, bias = shared
        else:
            pos = torch.full((b, h, slots), -1, dtype=torch.int64, device=dev)
            scores = torch.full((b, h, slots), math.inf, dtype=score_dtype, device=dev)
            bias = torch.full((b, h, slots), -math.inf, dtype=score_dtype, device=dev)
        if self._k is not None:  # growth (unbounded policies): carry what is there
            n = max(self._front)
            for new, old in zip((keys, values, pos, scores, bias), self._tensors()):
                new[:, :, :n] = old[:, :, :n]
        self._set_storage(keys, values, pos, scores, bias)
        self._tail_clean = False
        if self.static_shapes and (self._decode is None or self._decode.free.shape != (b, h)):
            self._decode = DecodeState(b, h, dev)

    def _set_storage(self, *tensors: torch.Tensor) -> None:
        """Keys, values, positions, scores and bias, and the grouped 3-D views of keys, values and
        bias ``[batch * kv_heads, ...]`` a decode step attends with (:meth:`attend`)."""
        self._k, self._v, self._pos, self._scores, self._bias = tensors
        b, h, slots, _ = self._k.shape
        self._k3 = self._k.view(b * h, slots, -1)
        self._v3 = self._v.view(b * h, slots, -1)
        self._bias3 = self._bias.view(b * h, 1, slots)

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        return self._k, self._v, self._pos, self._scores, self._bias  # type: ignore[return-value]

    def _grown_slots(self, need: int = 0) -> int:
        """The slots after one growth step (:func:`_grown`) of a store that must hold ``need``: an
        unbounded policy's at least ``reserve``, a bounded one's at most its planned slots."""
        grown = _grown(self.slots, need)
        if self.policy.capacity is None:
            return max(grown, self.reserve or 0)
        return min(grown, self._full_slots)

    def _device_storage(self) -> tuple[torch.Tensor, ...]:
        """Keys, values, positions and scores: what a static-shaped decode step reads and writes
        (its masks come from the positions: the bias is rebuilt when the host reads the layer, and
        a compiled step guards only on what it touches)."""
        return self._k, self._v, self._pos, self._scores  # type: ignore[return-value]

    def _full(self) -> tuple[torch.Tensor, ...]:
        """The whole (contiguous) tensors compaction works in: the transient set, else the storage."""
        return self._extra if self._extra is not None else self._tensors()

    def _working(self) -> tuple[torch.Tensor, ...]:
        """Keys, values, positions, scores and bias of every slot that may hold a token: the
        transient set while a chunk overflows, else the storage up to the furthest frontier."""
        if self._extra is not None:
            return self._extra
        hi = max(self._front)
        return tuple(t[:, :, :hi] for t in self._tensors())

    @property
    def nbytes(self) -> int:
        """Bytes of the allocated storage (keys, values, positions, scores, bias)."""
        if self._k is None:
            return 0
        return sum(t.numel() * t.element_size() for t in self._tensors())

    @property
    def kv_bytes(self) -> int:
        """Bytes of the keys and values actually kept (pads and holes excluded)."""
        if self._k is None:
            return 0
        self._host()
        k, v = self._k, self._v
        per_token = k.shape[1] * (k.shape[3] * k.element_size() + v.shape[3] * v.element_size())  # type: ignore[union-attr]
        return per_token * sum(self._count)

    # ------------------------------------------------------------------ ordered views (inspection)
    def _order(self, pos: torch.Tensor, count: int) -> torch.Tensor:
        """Slots of the ``count`` kept tokens of each row and head, in position order ``[b, h, count]``."""
        if any(f is not None for f in self._fifo):  # a ring: slot order is a rotation of position order
            key = pos.masked_fill(pos < 0, torch.iinfo(torch.int64).max)
            return torch.argsort(key, dim=-1)[..., :count]
        holes = (pos < 0).to(torch.int8)  # below a frontier, slot order is position order
        return torch.argsort(holes, dim=-1, stable=True)[..., :count]

    def _ordered(self, which: int) -> torch.Tensor:
        self._require()
        if which == 0:
            self._unshift()  # reads see original keys (the next decode append shifts them again)
        count = self.length
        tensors = self._working()
        t = tensors[which]
        if self._dense():
            return t[:, :, :count]
        order = self._order(tensors[2], count)
        if t.ndim == 4:
            return torch.gather(t, 2, order[..., None].expand(*order.shape, t.shape[-1]))
        return torch.gather(t, 2, order)

    def _dense(self) -> bool:
        """Whether every row holds its kept tokens at slots ``[0, count)`` in position order."""
        return self._extra is None and self._count == self._front and all(f is None for f in self._fifo)

    @property
    def keys(self) -> torch.Tensor:
        """Kept keys in position order ``[batch, kv_heads, length, head_dim]`` (a view when dense)."""
        return self._ordered(0)

    @property
    def values(self) -> torch.Tensor:
        """Kept values in position order ``[batch, kv_heads, length, head_dim]``."""
        return self._ordered(1)

    @property
    def positions(self) -> torch.Tensor:
        """Original positions of the kept tokens, ascending ``[batch, kv_heads, length]``."""
        return self._ordered(2)

    @property
    def scores(self) -> torch.Tensor:
        """Accumulated attention of the kept tokens, in position order ``[batch, kv_heads, length]``."""
        return self._ordered(3)

    def kept(self, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(positions, scores)`` ``[kv_heads, n_row]`` of one row, in position order (rows may differ)."""
        self._require()
        tensors = self._working()
        pos = tensors[2][row : row + 1]
        order = self._order(pos, self._count[row])
        return torch.gather(pos, 2, order)[0], torch.gather(tensors[3][row : row + 1], 2, order)[0]

    # ------------------------------------------------------------------ what attention sees
    @property
    def slot_positions(self) -> torch.Tensor:
        """Original positions of the slots the last :meth:`append` returned ``[batch, kv_heads, n]``
        (``-1`` at a hole or pad): ``received`` in :meth:`accumulate` is aligned with these."""
        self._require()
        lo, hi = self._range
        return self._extra[2] if self._extra is not None else self._pos[:, :, lo:hi]  # type: ignore[index]

    @property
    def bias(self) -> torch.Tensor | None:
        """Additive attention bias ``[batch, kv_heads, n]`` (``0`` or ``-inf``) of the slots the last
        decode :meth:`append` returned, or ``None`` when none of them is a hole."""
        self._require()
        if not self._bias_needed:
            return None
        lo, hi = self._range
        return self._bias[:, :, lo:hi]  # type: ignore[index]

    def _needs_bias(self) -> bool:
        """Whether a slot in the returned range is a hole for some row (host ints only)."""
        if self.static_shapes or self._extra is not None:
            return True
        lo, hi = self._range
        if lo == 0 and self._count == self._front and all(f == hi for f in self._front):
            return False  # the common case, decided without a loop
        return any(self._front[r] != hi or self._front[r] != self._count[r] for r in range(self.batch))

    def chunk_mask(self) -> torch.Tensor:
        """Boolean mask ``[batch | 1, 1, q, n]`` (True: attend) for the chunk the last :meth:`append`
        added: every kept token before the chunk, causal inside it, pads attended by nobody (a pad
        query sees only itself, so its row stays finite)."""
        self._require()
        if self._chunk is None:
            raise ValueError("chunk_mask() follows an append of more than one token")
        start, q, valid = self._chunk
        pos = self.slot_positions
        n = pos.shape[-1]
        dev = pos.device
        rows = torch.arange(q, device=dev)[:, None]
        cols = torch.arange(n, device=dev)[None, :]
        causal = cols <= start + rows  # [q, n]
        if valid is None and all(c == start + q for c in self._count):  # no pads, no holes before the chunk
            return causal[None, None]
        kept = (pos[:, 0, :] >= 0)[:, None, :]  # [b, 1, n]: rows are compacted, so head 0 speaks for all
        mask = causal[None] & kept
        if valid is not None:
            mask = mask | ((cols == start + rows)[None] & ~valid[:, :, None])
        return mask[:, None]

    @property
    def query_valid(self) -> torch.Tensor | None:
        """``[batch, q]`` bool: which queries of the last chunk are real (``None``: all)."""
        return self._chunk[2] if self._chunk is not None else None

    @property
    def keys_shifted(self) -> bool:
        """Whether the keys the last :meth:`append` returned already sit at their pos-shift
        positions (``key_shift`` given, a decode step of an ``"oldest"`` rule): :meth:`shift` then
        describes what was done, and nothing is left for attention to rotate."""
        return self._sink_delta is not None

    def _shift_sinks(self) -> None:
        """After a decode append: hold the sinks' keys rotated by each row's shift (evicted tokens
        so far), from their originals; nothing to do while the shift is unchanged."""
        sink = self.rule.sink  # type: ignore[union-attr]
        delta = [s - c for s, c in zip(self._seen, self._count)]
        if delta == self._sink_delta:
            return
        if self._sink_keys is None:
            if not any(delta) or min(self._front) < sink or self._extra is not None:
                return  # nothing shifted yet (or a row without its sinks: attention rotates the query)
            self._sink_keys = self._k[:, :, :sink].clone()  # type: ignore[index]
        self._k[:, :, :sink] = self._sink_shift(self._sink_keys, delta)  # type: ignore[index,misc]
        self._sink_delta = delta

    def _unshift(self) -> None:
        """Put the sinks' original keys back in their slots (before anything but a decode step reads
        or moves keys)."""
        if self._sink_keys is not None:
            self._k[:, :, : self._sink_keys.shape[2]] = self._sink_keys  # type: ignore[index]
        self._sink_keys, self._sink_delta = None, None

    def shift(self) -> PrefixShift | torch.Tensor:
        """How far each returned slot sits from its original position under StreamingLLM's
        pos-shift (keys placed at consecutive positions ending at the newest token).

        A kept token's shifted position is ``seen - count + rank`` (``rank``: its index among the
        kept tokens), so it moves by the number of evicted tokens *after* it: a token is shifted
        only when something newer than it was evicted. For a policy whose decode eviction is
        ``"oldest"`` (StreamingLLM) the tokens after the sinks are contiguous up to the newest, so
        only the sinks are shifted, all by the same amount: a :class:`PrefixShift`, ``O(1)`` to
        build. Otherwise the per-slot shifts ``[batch, kv_heads, n]`` (0 at holes) are returned.
        """
        self._require()
        if self.rule is not None and self.rule.victim == "oldest" and self._extra is None and self._chunk is None:
            return PrefixShift(self.rule.sink, [s - c for s, c in zip(self._seen, self._count)])
        pos = self.slot_positions  # slots before the range are holes, so ranks count from its start
        kept = pos >= 0
        rank = torch.cumsum(kept.to(torch.int64), dim=-1) - 1
        offset = torch.tensor([s - c for s, c in zip(self._seen, self._count)], device=pos.device)[:, None, None]
        return torch.where(kept, offset + rank - pos, 0)

    # ------------------------------------------------------------------ the step
    def append(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        *,
        valid: torch.Tensor | None = None,
        real: Sequence[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``q`` new tokens ``[batch, kv_heads, q, head_dim]``; return the keys and values
        ``[batch, kv_heads, n, head_dim]`` of the slots the current queries attend to.

        Args:
            valid: ``[batch, q]`` bool, False for pad tokens (a left-padded prompt); pads are never
                attended, scored or kept. Read once per chunk (one sync); decode tokens are real.
            real: per-row counts of True in ``valid`` when the caller already has them on the host.
        """
        check_append(self, keys, values)
        if self._deferred:
            self.group.flush()  # type: ignore[union-attr]
        ks, vs = keys.shape, values.shape
        if len(ks) != 4 or len(vs) != 4 or ks[0] != vs[0] or ks[1] != vs[1] or ks[2] != vs[2]:
            raise ValueError(
                "keys and values must be [batch, kv_heads, q, head_dim] with equal first three dims, "
                f"got {tuple(keys.shape)} and {tuple(values.shape)}"
            )
        if self._extra is not None:
            raise RuntimeError(
                "append() called while the previous step was not evicted: call accumulate() and evict() "
                "after each attention (with transformers, use the 'kvpolicy_sdpa' attention implementation)"
            )
        b, h, q, d = ks
        if q == 0:
            raise ValueError("keys must hold at least one token (q >= 1)")
        if self._decode is not None and q == 1 and valid is None:
            # static shapes: the step's bookkeeping in device tensors (kvpolicy_torch.static), no
            # host read and no branch on data, so a compiled step is one graph
            if (b, h, d, vs[3], keys.dtype, values.dtype, keys.device) != self._like:
                self._check_like(keys, values)
            # (a one-token eviction keeps every row at or below limit + 1 tokens: no overflow while
            # the storage holds more than the limit)
            self._decode.append(self._device_storage(), keys, values,
                                may_overflow=self.rule is None or self.slots <= self.rule.limit)
            self._device_newer = True
            self._phase = "decode"
            self._chunk = None
            return self._k, self._v  # type: ignore[return-value]
        self._host()
        if self._k is None:
            self._start(keys, values)
        elif (b, h, d, vs[3], keys.dtype, values.dtype, keys.device) != self._like:
            self._check_like(keys, values)
        if valid is not None:
            if valid.shape != (b, q):
                raise ValueError(f"valid must have shape [batch, q] = [{b}, {q}], got {tuple(valid.shape)}")
            valid = valid.to(device=keys.device, dtype=torch.bool)
            if real is None:
                real = valid.sum(dim=-1).tolist()  # once per chunk
            if list(real) == [q] * b:
                valid = None
            elif q == 1:
                raise ValueError("a padded decode token: pads are supported in prompts (chunks of q > 1) only")
        if q == 1:
            self._append_one(keys, values)
            if self._sink_shift is not None:
                self._shift_sinks()
        else:
            self._unshift()
            self._append_chunk(keys, values, valid, [q] * b if real is None else list(real))
        self._phase = "prefill" if q > 1 else "decode"
        lo, hi = self._range
        if self._extra is not None:
            return self._extra[0], self._extra[1]
        return self._k[:, :, lo:hi], self._v[:, :, lo:hi]  # type: ignore[index]

    def _start(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        b, _, q, _ = keys.shape
        capacity = self.policy.capacity
        per_slot = keys.shape[1] * (keys.shape[3] * keys.element_size() + values.shape[3] * values.element_size())
        if capacity is None:
            slots = max(q, self.reserve or 0)
        else:
            slots = capacity + self._slack(capacity, per_slot)
            if self.reserve is not None and max(q, self.reserve) + 1 < slots:
                # the run needs at most `reserve` tokens (generate(): the prompt plus the new tokens):
                # allocate those (and one spare a step appends into), growing only if more come
                slots = max(q, self.reserve) + 1
        self._full_slots = slots if capacity is None else capacity + self._slack(capacity, per_slot)
        self._seen, self._count, self._front = [0] * b, [0] * b, [0] * b
        self._states = [self.policy.init_state() for _ in range(b)]
        self._fifo = [None] * b
        self._free = [[] for _ in range(b)]
        self._allocate(keys, values, slots)
        # what later appends must match (one tuple comparison per step; _check_like says what differs)
        self._like = (b, keys.shape[1], keys.shape[3], values.shape[3], keys.dtype, values.dtype, keys.device)

    def _check_like(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        k, v = self._k, self._v
        assert k is not None and v is not None
        if (keys.shape[0], keys.shape[1]) != (k.shape[0], k.shape[1]):
            raise ValueError(f"batch and kv_heads changed from {tuple(k.shape[:2])} to {tuple(keys.shape[:2])}")
        if keys.shape[3] != k.shape[3] or values.shape[3] != v.shape[3]:
            raise ValueError(
                f"head_dim changed from {k.shape[3]}/{v.shape[3]} (keys/values) to {keys.shape[3]}/{values.shape[3]}"
            )
        if keys.dtype != k.dtype or values.dtype != v.dtype:
            raise ValueError(f"keys/values dtype changed from {k.dtype}/{v.dtype} to {keys.dtype}/{values.dtype}")
        if keys.device != k.device:
            raise ValueError(f"keys moved from {k.device} to {keys.device}")

    def _append_one(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        front, seen, count, free = self._front, self._seen, self._count, self._free
        if len(front) == 1 and (free[0] or front[0] < self._k.shape[2]):  # type: ignore[union-attr]
            # one row (the common case): the same writes with no per-row bookkeeping
            s = free[0].pop() if free[0] else front[0]
            self._k.narrow(2, s, 1).copy_(keys)  # type: ignore[union-attr]
            self._v.narrow(2, s, 1).copy_(values)  # type: ignore[union-attr]
            self._pos.select(2, s).fill_(seen[0])  # type: ignore[union-attr]
            if s == front[0] and not self.static_shapes:
                # a frontier slot: no attention reads past the frontier here, so the slots from it
                # on can hold score and bias 0 ahead of time (two writes fewer a step)
                if not self._tail_clean:
                    self._clean_tail()
            else:
                self._scores.select(2, s).fill_(0)  # type: ignore[union-attr]
                self._bias.select(2, s).fill_(0)  # type: ignore[union-attr]
            if s == front[0]:
                front[0] = s + 1
            seen[0] += 1
            count[0] += 1
            self.columns += 1
            self._chunk = None
            self._range = (0, self.slots if self.static_shapes else front[0])
            self._bias_needed = self.static_shapes or front[0] != count[0]
            return
        full = [r for r, f in enumerate(self._front) if f >= self.slots and not free[r]]
        if full:
            if self.policy.capacity is None or self.slots < self._full_slots:  # unbounded, or fewer than planned
                self._allocate(keys, values, self._grown_slots())
            else:
                self._compact_rows([r for r in full if self._count[r] < self._front[r]])
                if any(self._front[r] >= self.slots for r in full):
                    raise RuntimeError(
                        f"{self.policy!r} holds {max(self._count)} tokens, more than its capacity {self.policy.capacity}"
                    )
        front, seen = self._front, self._seen
        target = [f[-1] if f else front[r] for r, f in enumerate(free)]  # a freed slot, else the frontier
        k, v, pos, scores, bias = self._tensors()
        if all(t == target[0] for t in target):
            # select + copy_/fill_: a decode step's writes are tiny, and indexing costs more than them
            s = target[0]
            k.narrow(2, s, 1).copy_(keys)
            v.narrow(2, s, 1).copy_(values)
            if all(x == seen[0] for x in seen):
                pos.select(2, s).fill_(seen[0])  # a host scalar: no index tensor
            else:
                pos.select(2, s).copy_(torch.tensor(seen, device=pos.device)[:, None])
            scores.select(2, s).fill_(0)
            bias.select(2, s).fill_(0)
        else:  # rows on their own schedules: one slot per row
            dev = k.device
            rows = torch.arange(self.batch, device=dev)
            at = torch.tensor(target, device=dev)
            k[rows, :, at] = keys[:, :, 0]
            v[rows, :, at] = values[:, :, 0]
            pos[rows, :, at] = torch.tensor(seen, device=dev)[:, None]
            scores[rows, :, at] = 0
            bias[rows, :, at] = 0
        for r in range(self.batch):
            if free[r]:
                free[r].pop()
            else:
                front[r] += 1
            seen[r] += 1
            self._count[r] += 1
        self.columns += 1
        self._chunk = None
        self._range = (0, self.slots if self.static_shapes else max(front))
        self._bias_needed = self._needs_bias()

    def _clean_tail(self) -> None:
        """One row, shapes not static: score and bias 0 at the frontier and every slot after it
        (attention and the victim search read below the frontier only), so that a frontier append
        writes neither. Whatever marks those slots as holes again clears :attr:`_tail_clean`."""
        f = self._front[0]
        self._scores[:, :, f:].fill_(0)  # type: ignore[index]
        self._bias[:, :, f:].fill_(0)  # type: ignore[index]
        self._tail_clean = True

    def _append_chunk(self, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor | None, real: list[int]) -> None:
        self._forget_candidates()
        self._tail_clean = False
        b, h, q, _ = keys.shape
        if not self._dense():
            self._compact_rows(list(range(b)))  # chunks see dense rows in position order
        start = max(self._front)
        dev = keys.device
        new_pos = torch.arange(q, device=dev).expand(b, q)
        base = torch.tensor(self._seen, device=dev)[:, None]
        if valid is None:
            new_pos = base + new_pos
        else:  # real tokens are numbered from each row's count; pads get -1
            new_pos = torch.where(valid, base + torch.cumsum(valid.to(torch.int64), dim=-1) - 1, -1)
        new_pos = new_pos[:, None, :].expand(b, h, q)
        if valid is not None:  # pads are attended by nobody but themselves: keep them finite and zero
            keys = keys.masked_fill(~valid[:, None, :, None], 0)
            values = values.masked_fill(~valid[:, None, :, None], 0)
        zeros = torch.zeros((), dtype=self._scores.dtype, device=dev)  # type: ignore[union-attr]
        new_scores = torch.where(new_pos >= 0, zeros, math.inf)
        new_bias = torch.where(new_pos >= 0, zeros, -math.inf)
        if (self.policy.capacity is None or self.slots < self._full_slots) and start + q > self.slots:
            self._allocate(keys, values, self._grown_slots(start + q))  # (unbounded, or more than `reserve` came)
        if start + q <= self.slots:
            for t, new in zip(self._tensors(), (keys, values, new_pos, new_scores, new_bias)):
                t[:, :, start : start + q] = new
            self._range = (0, start + q)  # a chunk ends the range (received_attention reads its keys as the last q), static or not
        else:  # the prompt exceeds the storage: attention needs all of it for this step
            old = [t[:, :, :start] for t in self._tensors()]
            self._extra = tuple(torch.cat([o, n], dim=2) for o, n in zip(old, (keys, values, new_pos, new_scores, new_bias)))
            self._range = (0, start + q)
        for r in range(b):
            self._seen[r] += real[r]
            self._count[r] += real[r]
            self._front[r] = start + q
        self.columns += q
        self._chunk = (start, q, valid)
        self._bias_needed = self._needs_bias()

    def accumulate(self, received: torch.Tensor) -> None:
        """Add ``received`` ``[batch, kv_heads, n]`` (the attention each returned slot just received,
        summed over query heads and real queries) to the accumulated scores. A NaN counts as
        ``-inf``: that token is evicted first by score-based policies, never kept by a NaN.

        For a policy whose ``score_statistic`` is ``"latest"`` (TOVA) ``received`` replaces the
        scores of the tokens instead; with ``"low_history"`` (Scissorhands) ``received`` is the
        step's record of low-attention events (:func:`kvpolicy.statistics.history_record` of the
        chunk's rows, or of the decode query's :func:`~kvpolicy.statistics.low_attention`), shifted
        into each token's record. Holes and pads keep ``+inf``. For a statistic from keys (Knorm,
        KeyDiff: :data:`kvpolicy.KEY_STATISTICS`) ``received`` is checked and ignored: :meth:`evict`
        computes the scores from the keys held."""
        self._require()
        scores = self._returned(3)
        check_received(received, scores.shape)
        self._add(scores, received)

    def accumulate_query(self, received: torch.Tensor, group: int) -> None:
        """:meth:`accumulate` for a decode step: ``received`` ``[batch, kv_heads, n]`` is what its one
        query gave each returned slot, summed over the ``group`` query heads of each KV head (what
        :func:`~kvpolicy_torch.decode_attention` returns). For a ``"low_history"`` policy
        (Scissorhands) it becomes that query's record of low attention first
        (:func:`kvpolicy.statistics.low_attention`); a chunk's record comes from
        ``received_attention(history=...)``.

        Example:
            >>> from kvpolicy import H2O
            >>> layer = LayerCache(H2O(heavy=2, recent=2))
            >>> K, V = layer.append(torch.ones(1, 1, 1, 4), torch.ones(1, 1, 1, 4))
            >>> layer.accumulate_query(torch.ones(1, 1, 1), group=1)
            >>> layer.scores.tolist()
            [[[1.0]]]
        """
        if self.policy.score_statistic == "low_history":
            received = low_attention(received, group, kept=self.slot_positions >= 0).to(torch.float64)
        self.accumulate(received)

    def attend(
        self,
        query: torch.Tensor,
        scaling: float,
        *,
        extra_bias: torch.Tensor | None = None,
        row_scale: torch.Tensor | None = None,
        prefix: tuple[int, torch.Tensor] | None = None,
        options: StepOptions | None = None,
    ) -> torch.Tensor:
        """A decode step's attention over the slots the last (one-token) :meth:`append` returned,
        holes masked, with what each slot received added to the scores (:meth:`accumulate_query`)
        when the policy uses them: one pass over the keys
        (:func:`~kvpolicy_torch.decode_attention`), and no re-validation of a ``received`` this
        method computed itself (a decode step is a few dozen tiny ops per layer). Then call
        :meth:`evict`.

        Args:
            query: ``[batch, q_heads, 1, head_dim]``, ``q_heads`` a multiple of the KV heads (GQA).
            scaling: the logit scale.
            extra_bias: ``[batch, kv_heads, n]`` additive bias on top of the holes' (``-inf`` where a
                sliding window hides a kept token), or ``None``.
            row_scale, prefix: as in :func:`~kvpolicy_torch.decode_attention` (BUZZ's log n; the
                query rotated back for StreamingLLM's pos-shifted sinks).
            options: with ``static_shapes``, the same three as a
                :class:`~kvpolicy_torch.static.StepOptions` (a window, log n, the pos-shifted
                prefix), computed on the device from its own counts (the three arguments above
                need host counts, which a static-shaped decode step does not read).

        Returns:
            ``[batch, 1, q_heads, head_dim]``: the layout transformers' attention functions return.

        Example:
            >>> from kvpolicy import H2O
            >>> layer = LayerCache(H2O(heavy=2, recent=2))
            >>> for t in range(6):
            ...     K, V = layer.append(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8))
            ...     out = layer.attend(torch.randn(1, 4, 1, 8), 8 ** -0.5)
            ...     rounds = layer.evict()
            >>> out.shape, layer.length
            (torch.Size([1, 1, 4, 8]), 4)
        """
        check_query(query, self._k)
        if self._device_newer:  # a static-shaped decode step: everything on the device
            if extra_bias is not None or row_scale is not None or prefix is not None:
                raise ValueError("with static_shapes, pass the window, log n and pos-shift as options=StepOptions(...)")
            storage = self._device_storage()
            out, received = self._decode.attend(storage, query, scaling, options or StepOptions())  # type: ignore[union-attr]
            if self.policy.captures_attention:
                history = self.policy.score_history if self.policy.score_statistic == "low_history" else None
                DecodeState.accumulate(storage, received, self.policy.score_statistic, query.shape[1] // storage[0].shape[1],
                                       history)
            return out
        self._require()
        if self._phase != "decode" or self._extra is not None:
            raise ValueError("attend() serves a decode step (one token appended per row); a prompt chunk takes chunk_mask() and accumulate()")
        hi = self._range[1]
        scores = self._scores
        if (
            extra_bias is None and row_scale is None and prefix is None and self._cand is None
            and query.dtype == scores.dtype == self._k.dtype  # type: ignore[union-attr]
            and self.policy.score_statistic == "accumulate" and self.policy.uses_scores
        ):
            # the common step (H2O, BUZZ) on the storage's grouped views: grouped_decode, then the
            # probabilities summed per KV head into the scores (as accumulate, without re-validating)
            b, hq, _, d = query.shape
            bh = self._k3.shape[0]  # type: ignore[union-attr]
            r = hq * b // bh
            out3, probs3 = grouped_decode(
                query.reshape(bh, r, d), self._k3.narrow(1, 0, hi).transpose(1, 2), self._v3.narrow(1, 0, hi),  # type: ignore[union-attr]
                scaling, self._bias3.narrow(2, 0, hi) if self._bias_needed else None,  # type: ignore[union-attr]
            )
            self._add(scores.narrow(2, 0, hi), probs3.view(b, bh // b, r, hi).sum(dim=2))  # type: ignore[union-attr]
            return out3.view(b, 1, hq, -1)
        key, value = self._k.narrow(2, 0, hi), self._v.narrow(2, 0, hi)  # type: ignore[union-attr]
        bias = self.bias
        if extra_bias is not None:
            bias = extra_bias if bias is None else bias + extra_bias
        out, received = decode_attention(query, key, value, scaling, bias=bias, row_scale=row_scale, prefix=prefix)
        if self.policy.captures_attention:
            if self.policy.score_statistic == "low_history":
                self.accumulate_query(received, query.shape[1] // key.shape[1])
            else:  # received comes from a softmax: its shape is right and it is real
                self._add(self._scores.narrow(2, 0, hi), received)  # type: ignore[union-attr]
        return out

    def _returned(self, which: int) -> torch.Tensor:
        """Tensor ``which`` (0 keys, 1 values, 2 positions, 3 scores, 4 bias) at the slots the last
        :meth:`append` returned."""
        if self._extra is not None:
            return self._extra[which]
        lo, hi = self._range
        return self._tensors()[which][:, :, lo:hi]

    def _add(self, scores: torch.Tensor, received: torch.Tensor) -> None:
        """The body of :meth:`accumulate` on the returned slots' ``scores``."""
        if received.dtype != scores.dtype:
            received = received.to(scores.dtype)
        received = torch.nan_to_num(received, nan=-math.inf, posinf=math.inf, neginf=-math.inf)
        statistic = self.policy.score_statistic
        if statistic in KEY_STATISTICS:
            return  # scores come from the keys (evict computes them)
        if statistic == "latest":
            scores.copy_(torch.where(self._returned(2) >= 0, received, math.inf))
        elif statistic == "low_history":
            # `received` is the step's record (kvpolicy.statistics.history_record): shift it in,
            # by the chunk's real rows (a left-padded row has fewer) or by one decode query
            pos = self._returned(2)
            rows: Any = 1
            if self._chunk is not None:
                valid = self._chunk[2]
                rows = self._chunk[1] if valid is None else valid.sum(dim=-1).view(-1, 1, 1)
            history = shift_history(scores, received, rows, self.policy.score_history)  # type: ignore[arg-type]
            scores.copy_(torch.where(pos >= 0, history, math.inf))
        else:
            if self._cand is not None:
                low, high = torch.aminmax(received)
                if not bool((low >= 0) & (high < math.inf)):
                    # a score may go down (negative, NaN, or -inf + inf): the candidates' bound no longer holds
                    self._forget_candidates()
            scores += received

    def evict(self) -> list[tuple[int, int]]:
        """Let the policy evict until it is satisfied; return ``(size_before, size_after)`` per round
        (per group of rows that evicted together).

        With ``static_shapes``, after a decode step a one-token eviction is a masked write on the
        device (no rounds are reported: whether a row evicted is not read back); a general
        eviction (BUZZ, Scissorhands) runs here in eager code, and is left to :meth:`settle`
        inside ``torch.compile``."""
        if self._device_newer:
            if self.rule is not None:
                if self.policy.score_statistic in KEY_STATISTICS:  # scores from the keys held (Knorm, KeyDiff)
                    k, _, pos, scores = self._device_storage()
                    seen = self._decode.seen.view(-1, 1, 1)  # type: ignore[union-attr]
                    scores.copy_(key_scores(self.policy.score_statistic, k, pos, seen, self.policy.key_recent))
                self._decode.evict(self._device_storage(), self.rule, self.policy.selection == "shared", self.reduce_scores)  # type: ignore[union-attr]
                return []
            if torch.compiler.is_compiling():
                return []  # announced by needs_settle: the caller runs settle() between compiled steps
            return self.settle()
        self._require()
        rule = self.rule
        if self.policy.score_statistic in KEY_STATISTICS and (
            rule is None or self._phase != "decode" or self._extra is not None or max(self._count) > rule.limit
        ):  # (a decode step under the one-token rule's limit evicts nothing: no scores needed)
            self._score_keys()
        if self._phase == "decode" and rule is not None and self._extra is None:
            over = rule.limit + 1
            rows = list(range(self.batch)) if all(c == over for c in self._count) else [r for r, c in enumerate(self._count) if c == over]
            if len(rows) < self.batch and any(c > over for c in self._count):
                rounds = self._evict_general()
            elif rows:
                self._evict_one(rule, rows)
                rounds = [(rule.limit + 1, rule.limit)]
            else:
                rounds = []
        elif self._declines():
            rounds = []
        else:
            rounds = self._evict_general()
        self._chunk = None
        self.evictions += len(rounds)
        self._reload()
        return rounds

    @property
    def needs_settle(self) -> bool:
        """Whether a compiled (static-shaped) decode step may leave work to :meth:`settle`: a
        bounded policy without a one-token decode eviction (BUZZ, Scissorhands) evicts on the
        host, between steps."""
        return self.static_shapes and self.rule is None and self.policy.capacity is not None

    def settle(self) -> list[tuple[int, int]]:
        """Between compiled decode steps (static shapes): run the general eviction the last
        steps left to the host, if the policy's rule says one is due (one read of the device's
        counts); nothing for a policy whose decode eviction ran on the device.

        Example:
            >>> from kvpolicy import BUZZ
            >>> layer = LayerCache(BUZZ(sink=1, window=2, stride=3), static_shapes=True)
            >>> K, V = layer.append(torch.randn(1, 1, 6, 4), torch.randn(1, 1, 6, 4))
            >>> layer.accumulate(torch.rand(1, 1, 6)); rounds = layer.evict()
            >>> K, V = layer.append(torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4))
            >>> out = layer.attend(torch.randn(1, 1, 1, 4), 0.5)
            >>> layer.evict() == layer.settle() == []  # (eager code: evict() settled it)
            True
        """
        if not self._device_newer or not self.needs_settle:
            return []
        # A decode step appends one real token per row and evicts nothing on the device, so the
        # host lists follow without reading the device (settle() comes after every compiled step;
        # _materialize checks it); the device is read only when the size rule says "evict".
        self._seen = [s + 1 for s in self._seen]
        self._count = [c + 1 for c in self._count]
        self.columns += 1
        self._phase = "decode"
        if self._declines():
            return []
        self._materialize()
        rounds = [] if self._declines() else self._evict_general()
        self._chunk = None
        self.evictions += len(rounds)
        self._reload()
        return rounds

    def _materialize(self) -> None:
        """Static shapes: take the device's counts after the decode steps it ran (one read) and
        put each row's kept tokens back at ``[0, count)`` in position order (a step writes into
        its victim's slot), so host code sees the layout it expects; the device state is reloaded."""
        decode = self._decode
        assert decode is not None
        self._device_newer = False
        seen, count, columns, overflow = decode.read()
        if overflow:
            raise RuntimeError(
                f"{self.policy!r} ran out of its {self.slots} slots in a compiled decode step: a general eviction was "
                f"due and did not run. Call settle() (EvictingCache.settle) between compiled decode steps when "
                f"needs_settle is True (kvpolicy.hf.generate does)"
            )
        if self.needs_settle and seen[0] - self._seen[0] > 1:
            raise RuntimeError(
                f"{self.policy!r}: {seen[0] - self._seen[0]} compiled decode steps ran since the host last settled: "
                f"call settle() (EvictingCache.settle) after every compiled decode step while needs_settle is True "
                f"(kvpolicy.hf.greedy_decode does)"
            )
        self.columns = columns
        self._seen, self._count = seen, count
        k, v, pos, scores, bias = self._tensors()
        if self.rule is not None:  # one-token evictions scattered the kept tokens: sort by position
            order = torch.argsort(pos.masked_fill(pos < 0, torch.iinfo(torch.int64).max), dim=-1)
            for t in (k, v):
                t.copy_(torch.gather(t, 2, order[..., None].expand_as(t)))
            for t in (pos, scores):
                t.copy_(torch.gather(t, 2, order))
        bias.copy_(torch.where(pos >= 0, 0.0, -math.inf).to(bias.dtype))
        self._front = list(count)
        self._fifo = [None] * len(count)
        self._free = [[] for _ in count]
        self._range = (0, self.slots)
        self._bias_needed = True
        self._tail_clean = False
        self._forget_candidates()
        decode.load(self._seen, self._count, self.columns)

    def _reload(self) -> None:
        """Static shapes, after host code changed the layer: compact it and hand the counts to the
        device, so the next decode step runs there."""
        if self._decode is None or self._extra is not None or self._k is None:
            return
        if not self._dense():
            self._compact_rows(list(range(self.batch)))
        if (self.policy.capacity is None or self.slots < self._full_slots) and max(self._count) >= self.slots:
            # a store without room for the next token grows here, between steps (an unbounded policy;
            # a bounded one sized for `reserve` tokens that is given more)
            like_k, like_v = self._k[:, :, :1], self._v[:, :, :1]  # type: ignore[index]
            self._allocate(like_k, like_v, self._grown_slots())
        self._decode.load(self._seen, self._count, self.columns)

    def _score_keys(self) -> None:
        """A statistic from keys (Knorm, KeyDiff): every held token's score, recomputed from the
        keys held (:func:`kvpolicy.statistics.key_scores`) before the policy decides; holes and
        pads ``+inf``."""
        k, _, pos, scores, _ = self._working()
        seen: Any = self._seen[0]
        if any(s != seen for s in self._seen):
            seen = torch.tensor(self._seen, device=pos.device).view(-1, 1, 1)
        scores.copy_(key_scores(self.policy.score_statistic, k, pos, seen, self.policy.key_recent))

    def _declines(self) -> bool:
        """A decode step at which the policy's size rule keeps every row's tokens: the policy
        would decline (its rule is held to its ``select`` by the tests), so it is not asked."""
        if self._size_rule is None or self._phase != "decode" or self._extra is not None:
            return False
        rule = self._size_rule
        return all(rule(c, dict(s)) == c for c, s in zip(self._count, self._states))

    def _evict_one(self, rule: DecodeEviction, rows: list[int]) -> None:
        """Free one slot in each of ``rows`` (all heads): O(batch x heads) writes, nothing moves."""
        every = len(rows) == self.batch
        if rule.victim == "oldest":
            slots = []
            for r in rows:
                # a dense row's oldest non-sink token is at slot `sink`; later ones follow it
                # around the ring [sink, front) (the next append refills the freed slot)
                slot = rule.sink if self._fifo[r] is None else self._fifo[r]
                slots.append(slot)
                self._free[r].append(slot)  # type: ignore[arg-type]
                self._fifo[r] = slot + 1 if slot + 1 < self._front[r] else rule.sink  # type: ignore[operator]
            # only the position says "hole": the row's next append refills the slot (score and
            # bias 0) before anything attends to it or searches it, and every other read goes by
            # positions (ordered views, compaction)
            pos = self._pos
            assert pos is not None
            if every and all(s == slots[0] for s in slots):
                pos.select(2, slots[0]).fill_(-1)
            else:
                dev = pos.device
                pos[torch.tensor(rows, device=dev), :, torch.tensor(slots, device=dev)] = -1
        elif every and self._deferrable(rule):
            self._deferred = True  # the group frees the victims (LayerGroup): after the counts below
        else:
            self._free_lowest(rule, rows)
        for r in rows:
            self._count[r] -= 1
        if self._deferred:
            hi = self._front[0] - rule.recent
            self.group.defer(self._group_index, hi, self._free_deferred, self._group_freed)  # type: ignore[union-attr]

    def _deferrable(self, rule: DecodeEviction) -> bool:
        """Whether this step's victims may wait for the group: every layer keeps its storage in it,
        the rows stand alike, and the plain scan would find them (not shared, not candidates)."""
        group = self.group
        if group is None or not group.complete or self.policy.selection == "shared" or self.static_shapes:
            return False
        front = self._front
        if any(f != front[0] for f in front) or self._uses_candidates(front[0] - rule.recent):
            return False
        if self._cand is not None:
            self._forget_candidates()  # (as the plain scan would)
        return True

    def _group_freed(self) -> None:
        self._deferred = False

    def _free_deferred(self) -> None:
        """Free this step's victims here (the group could not search them with the others')."""
        self._deferred = False
        assert self.rule is not None
        self._free_lowest(self.rule, list(range(self.batch)))

    def _free_lowest(self, rule: DecodeEviction, rows: list[int]) -> None:
        """The lowest-scored victim of each of ``rows`` and heads becomes a hole."""
        pos, scores, bias = self._tensors()[2:]
        victims = self._lowest(rule, rows)  # [len(rows) or batch, heads]
        index = victims.unsqueeze(-1)
        if len(rows) == self.batch:
            mark_holes(pos, scores, bias, 2, index)
        else:
            r_t = torch.tensor(rows, device=pos.device)
            for t, fill in ((pos, -1), (scores, math.inf), (bias, -math.inf)):
                part = t.index_select(0, r_t)
                part.scatter_(2, index, fill)
                t.index_copy_(0, r_t, part)

    def _lowest(self, rule: DecodeEviction, rows: list[int]) -> torch.Tensor:
        """Victim slot ``[len(rows), heads]`` of each row: the lowest score outside the newest
        ``recent`` tokens, ties to the earliest position (holes hold +inf)."""
        scores = self._scores
        assert scores is not None
        front = [self._front[r] for r in rows]
        hi = max(front) - rule.recent
        if len(rows) == self.batch and all(f == front[0] for f in front) and self._uses_candidates(hi):
            victims = self._lowest_candidates(hi)
            if victims is not None:
                return victims
        elif self._cand is not None:
            self._forget_candidates()
        if len(rows) < self.batch:
            scores = scores.index_select(0, torch.tensor(rows, device=scores.device))
        cand = scores[:, :, :hi]
        if any(f != front[0] for f in front):  # rows on other schedules: protect each row's own recent tokens
            cand = cand.clone()
            for i, f in enumerate(front):
                cand[i, :, f - rule.recent :] = math.inf
        if self.policy.selection == "shared":
            summed = cand.sum(dim=1, keepdim=True)
            if self.reduce_scores is not None:
                summed = self.reduce_scores(summed)
            return first_argmin(summed).expand(cand.shape[0], cand.shape[1])
        return first_argmin(cand)

    # ------------------------------------------------------------------ H2O's victim among candidates
    def _uses_candidates(self, hi: int) -> bool:
        """Whether rows alike, with eligible slots ``[0, hi)``, search among candidates (see
        :meth:`_lowest_candidates`) rather than by the plain scan."""
        scores = self._scores
        assert scores is not None
        return (
            hi > 4 * self.candidates  # small caches: the plain scan, decided first (every decode step)
            and self.policy.selection != "shared"
            and self.policy.score_statistic == "accumulate"  # the bound needs scores that only grow
            and scores.device.type == "cpu"
            and scores.shape[0] * scores.shape[1] * hi >= self.candidate_min_scores
        )

    def _forget_candidates(self) -> None:
        self._cand: torch.Tensor | None = None  # [b, h, K] slots searched for the next victim
        self._cand_bound: torch.Tensor | None = None  # [b, h, 1]: every other eligible slot's score is >= it
        self._cand_hi = 0  # slots [0, cand_hi) were eligible at the last full search; later ones are searched too
        self._cand_top = -1  # eligible slots ended here at the last search (or plain scan)

    @property
    def candidate_searches(self) -> int:
        """Full searches of H2O-like victims made so far on the candidate path (see
        :attr:`candidate_min_scores`): a diagnostic for benchmarks and tests."""
        return self._cand_rescans

    def _rescan(self, hi: int) -> bool:
        """The ``candidates`` lowest-scored slots of ``[0, hi)`` per row and head, and the next
        lowest score as the bound every other slot there is at or above; False (nothing set) when
        a score is NaN (a full scan puts NaN first, ``topk`` last)."""
        assert self._scores is not None
        searched = self._scores[:, :, :hi]
        if bool(torch.isnan(searched).any()):
            return False
        values, slots = torch.topk(searched, self.candidates + 1, dim=-1, largest=False, sorted=False)
        bound = values.amax(dim=-1, keepdim=True)
        # the largest of the k + 1 lowest is the bound; the others are the candidates (a tie with
        # the bound may leave a bound-valued slot out: the strict test below then rescans)
        last = values.argmax(dim=-1, keepdim=True)
        keep = torch.ones_like(slots, dtype=torch.bool).scatter_(2, last, False)
        # the candidates, then room for the slots that become eligible before the next search
        self._cand = torch.empty(*slots.shape[:2], 2 * self.candidates, dtype=slots.dtype, device=slots.device)
        self._cand[..., : self.candidates] = slots[keep].view(*slots.shape[:2], self.candidates)
        self._cand_bound = bound
        self._cand_hi = self._cand_top = hi
        self._cand_rescans += 1
        return True

    def _lowest_candidates(self, hi: int) -> torch.Tensor | None:
        """``_lowest`` without reading every score: the victim among the candidate slots and the
        slots that became eligible since the last full search, ``O(batch x heads x candidates)`` a
        step; ``None`` when a full scan must decide.

        Accumulated scores only grow (:meth:`accumulate` forgets the candidates when a received
        value is negative or NaN), so a slot whose score was at or above ``bound`` at the last full
        search still is: while the lowest score searched is strictly below ``bound`` it is the
        lowest eligible score, and every slot tied with it was searched, so "earliest of a tie" is
        the lowest such slot (slot order is position order below the frontier). A victim becomes
        a hole (``+inf``) and is never picked again. A full search (``topk``) runs again when the
        bound stops separating, when as many slots became eligible as there are candidates, or
        when slots moved (compaction): amortised over the steps between.
        """
        assert self._scores is not None
        if self._cand is not None and (hi - self._cand_top not in (0, 1) or hi - self._cand_hi > self.candidates):
            # slots moved, more than one became eligible at once, or as many became eligible as
            # there are candidates: search again
            self._forget_candidates()
        if self._cand is None:
            if self._cand_pause > 0:
                self._cand_pause -= 1
                return None
            if self._cand_top != hi - 1:
                # the first step after slots moved (or a cold start) takes the plain scan: the
                # candidates' topk pays off over a run of decode steps, not for one eviction
                self._cand_top = hi
                return None
            if not self._rescan(hi):
                self._cand_pause = self.candidates
                return None
            self._cand_age = 0
        k = self.candidates
        for attempt in range(2):
            cand, bound, lo = self._cand, self._cand_bound, self._cand_hi
            assert cand is not None and bound is not None
            if hi > lo:  # the slot that became eligible at this step (one per decode step)
                cand.select(2, k + hi - lo - 1).fill_(hi - 1)
            self._cand_top = hi
            slots = cand[..., : k + hi - lo]
            scores = self._scores.gather(2, slots)
            low = scores.amin(dim=-1, keepdim=True)
            if bool((low < bound).all()):
                self._cand_age += 1
                # the earliest (lowest) slot of those tied at the minimum
                return torch.where(scores == low, slots, torch.iinfo(torch.int64).max).amin(dim=-1)
            if attempt == 0:
                if self._cand_age < self.candidates // 8 or not self._rescan(hi):
                    break  # the bound fails soon after each search: full scans are cheaper for a while
                self._cand_age = 0
        # more slots tie at the minimum than the candidates hold, or the candidates drain too fast
        self._forget_candidates()
        self._cand_pause = self.candidates
        return None

    def _evict_general(self) -> list[tuple[int, int]]:
        """Ask the policy (``select``) on dense, ordered views, group by group of rows in the same
        host state, until it keeps everything (the core's loop, :func:`kvpolicy.driver.kept_slots`);
        apply all of a group's rounds in one compaction."""
        self._unshift()
        if not self._dense():
            self._compact_rows(list(range(self.batch)))
        rounds: list[tuple[int, int]] = []
        for rows in self._groups():
            r0 = rows[0]
            n = self._count[r0]
            pos, scores = self._full()[2:4]
            if len(rows) < self.batch:
                index = torch.tensor(rows, device=pos.device)
                pos, scores = pos.index_select(0, index), scores.index_select(0, index)
            state = dict(self._states[r0])
            keep, done = kept_slots(self.policy, pos[:, :, :n], scores[:, :, :n], self._seen[r0], state, self._phase,
                                    decide=lambda view: self.policy.evict(view, self.reduce_scores))
            if keep is None:
                continue
            self._keep_rows(rows, keep)
            for r in rows:
                self._states[r] = dict(state)
            rounds += done
        if self._extra is not None:
            if max(self._count) > self.slots:
                raise RuntimeError(
                    f"{self.policy!r} left {max(self._count)} tokens but declared capacity {self.policy.capacity}"
                )
            self._settle()
        return rounds

    def _groups(self) -> list[list[int]]:
        """Rows in the same host state (count, seen, policy state) decide together."""
        groups: dict[tuple[Any, ...], list[int]] = {}
        for r in range(self.batch):
            key = (self._count[r], self._seen[r], tuple(sorted(self._states[r].items())))
            groups.setdefault(key, []).append(r)
        return list(groups.values())

    # ------------------------------------------------------------------ compaction
    def _compact_rows(self, rows: list[int]) -> None:
        """Move the kept tokens of ``rows`` to ``[0, count)`` in position order (holes removed)."""
        rows = [r for r in rows if self._count[r] != self._front[r] or self._fifo[r] is not None] if self._extra is None else rows
        if not rows:
            return
        self._unshift()
        self._unwrap([r for r in rows if self._fifo[r] is not None])
        for r in rows:
            self._fifo[r] = None
            self._free[r] = []
        for count, group in self._by_count(rows).items():
            pos = self._working()[2]
            if len(group) < self.batch:
                pos = pos.index_select(0, torch.tensor(group, device=pos.device))
            self._keep_rows(group, self._order(pos, count))

    def _unwrap(self, rows: list[int]) -> None:
        """Put each ring row (``"oldest"`` rule) back in position order: its tokens after the sinks
        run from slot ``fifo`` (the oldest) to ``front``, then on from ``sink``, so the segment
        ``[sink, front)`` is rotated left by ``fifo - sink``. In place by three reversals, each a
        swap of chunks from both ends (at most two chunks of temporary memory); rare (a prompt
        chunk or a general eviction after decode steps), so a loop over rows is fine."""
        if not rows:
            return
        assert self.rule is not None  # only "oldest" rules make rings
        sink = self.rule.sink
        for r in rows:
            fifo, front = self._fifo[r], self._front[r]
            if fifo is None or fifo == sink:
                continue
            for t in self._tensors():
                x = t[r]  # [heads, slots(, dim)]: a view
                per_slot = x.shape[0] * (x.shape[2] if x.ndim == 3 else 1) * x.element_size()
                step = max(1, self.compaction_chunk_bytes // (2 * per_slot))
                for lo, hi in ((sink, fifo), (fifo, front), (sink, front)):
                    _reverse_slots(x, lo, hi, step)

    def _by_count(self, rows: list[int]) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for r in rows:
            out.setdefault(self._count[r], []).append(r)
        return out

    def _keep_rows(self, rows: list[int], keep: torch.Tensor) -> None:
        """Keep slots ``keep`` ``[len(rows), heads, k]`` (ascending) of ``rows`` at ``[0, k)``.

        In place, chunk by chunk along the slots: kept slot ``j`` comes from slot ``keep[j] >= j``,
        so once chunk ``[j0, j1)`` is read into a temporary, writing it to the front never
        overwrites a slot a later chunk still reads. No allocation of the cache's size, and each
        kept token moves once (not at all when it is already in place).
        """
        self._forget_candidates()  # slots move
        sources = self._full()
        slots = sources[0].shape[2]
        g, h, kept = keep.shape
        dev = sources[0].device
        row_t = torch.tensor(rows, device=dev, dtype=torch.int64)
        # Storage seen as one flat tensor of rows [batch * heads * slots, ...]: the kept slots of
        # every (row, head) are one index_select of whole rows (torch.gather with a
        # [.., kept, head_dim] index is 7-17x slower on CPU).
        starts = ((row_t[:, None] * h + torch.arange(h, device=dev)) * slots)[..., None]  # [g, h, 1]
        src_rows = keep.to(device=dev, dtype=torch.int64) + starts
        flat = [t.reshape(-1, t.shape[3]) if t.ndim == 4 else t.reshape(-1) for t in sources]
        per_slot = g * h * sum(t.element_size() * (t.shape[-1] if t.ndim == 4 else 1) for t in sources)
        step = max(1, self.compaction_chunk_bytes // max(per_slot, 1))
        for j0 in range(0, kept, step):
            j1 = min(kept, j0 + step)
            r = src_rows[:, :, j0:j1].reshape(-1)
            dst = (starts + torch.arange(j0, j1, device=dev)).reshape(-1)
            for t in flat:
                t.index_copy_(0, dst, t.index_select(0, r))
        # what lies between the new and the old frontier becomes holes
        self._tail_clean = False
        old = max(self._front[r] for r in rows)
        if old > kept:
            for t, fill in zip(sources[2:], (-1, math.inf, -math.inf)):
                if len(rows) == self.batch:
                    t[:, :, kept:old] = fill
                else:
                    part = t.index_select(0, row_t)
                    part[:, :, kept:old] = fill
                    t.index_copy_(0, row_t, part)
        for r in rows:
            self._count[r] = kept
            self._front[r] = kept

    def _settle(self) -> None:
        """Move the transient working set back into the storage once it fits."""
        assert self._extra is not None
        self._forget_candidates()
        n = max(self._front)
        extra, self._extra = self._extra, None
        self._tail_clean = False
        for t, e, fill in zip(self._tensors(), extra, (None, None, -1, math.inf, -math.inf)):
            t[:, :, :n] = e[:, :, :n]
            if fill is not None:
                t[:, :, n:] = fill
        self._range = (0, n)
        self._bias_needed = self._needs_bias()

    # ------------------------------------------------------------------ ordered <-> slots
    def to_slots(self, ordered: torch.Tensor) -> torch.Tensor:
        """Place per-token values given in position order ``[batch, kv_heads, length]`` at the slots
        the last :meth:`append` returned ``[batch, kv_heads, n]`` (0 at holes): for callers that
        compute received attention over :attr:`positions` rather than :attr:`slot_positions`."""
        pos = self.slot_positions
        count = self.length
        out = torch.zeros(pos.shape, dtype=ordered.dtype, device=pos.device)
        if self._dense() and self._range[0] == 0:
            out[:, :, :count] = ordered
            return out
        return out.scatter_(2, self._order(pos, count), ordered)

    # ------------------------------------------------------------------ snapshots (benchmarks)
    @property
    def compaction_period(self) -> int | None:
        """Decode steps between two compactions while a :class:`~kvpolicy.DecodeEviction` evicts
        one token per step (``None``: the policy has none, or nothing is allocated yet)."""
        if self.rule is None or self.rule.victim == "oldest" or self._k is None or self.policy.capacity is None:
            return None  # ("oldest": a ring, never compacted while decoding)
        return self.slots - self.policy.capacity + 1

    def snapshot(self) -> LayerSnapshot:
        """A copy of the bookkeeping (see :class:`LayerSnapshot`), between steps."""
        self._require()
        if self._extra is not None:
            raise RuntimeError("snapshot() between append() and evict()")
        return LayerSnapshot(
            self.columns, list(self._seen), list(self._count), list(self._front),
            [dict(s) for s in self._states], list(self._fifo),
            self._pos.clone(), self._scores.clone(), self._bias.clone(),  # type: ignore[union-attr]
            [list(f) for f in self._free],
        )

    def restore(self, snap: LayerSnapshot) -> None:
        """Put the bookkeeping of ``snap`` back (keys and values stay as they are). Slots at or
        beyond a row's ``front`` become holes."""
        self._require()
        if snap.positions.shape != self._pos.shape or len(snap.count) != self.batch:  # type: ignore[union-attr]
            raise ValueError(f"snapshot of shape {tuple(snap.positions.shape)} does not fit this layer's {tuple(self._pos.shape)}")  # type: ignore[union-attr]
        if any(c > f for c, f in zip(snap.count, snap.front)) or any(f > self.slots for f in snap.front):
            raise ValueError("snapshot counts must satisfy count <= front <= slots per row")
        self._unshift()
        self._forget_candidates()
        self._extra, self._chunk = None, None
        self.columns = snap.columns
        self._seen, self._count, self._front = list(snap.seen), list(snap.count), list(snap.front)
        self._states = [dict(s) for s in snap.states]
        self._fifo = list(snap.fifo)
        self._free = [list(f) for f in snap.free] if snap.free else [[] for _ in range(self.batch)]
        if any(slot >= f for fr, f in zip(self._free, self._front) for slot in fr):
            raise ValueError("snapshot free slots must lie below their row's front")
        self._tail_clean = False
        for t, src, fill in zip((self._pos, self._scores, self._bias), (snap.positions, snap.scores, snap.bias), (-1, math.inf, -math.inf)):
            t.copy_(src)  # type: ignore[union-attr]
            for f in sorted(set(self._front)):
                rows = [r for r, x in enumerate(self._front) if x == f]
                if f < self.slots:
                    if len(rows) == self.batch:
                        t[:, :, f:] = fill  # type: ignore[index]
                    else:
                        for r in rows:
                            t[r, :, f:] = fill  # type: ignore[index]
        self._range = (0, max(self._front))
        self._bias_needed = self._needs_bias()
        self._phase = "decode"
        self._reload()

    # ------------------------------------------------------------------ batch ops (beam search etc.)
    def select_batch(self, index: torch.Tensor) -> None:
        """Keep (or repeat) batch rows by ``index``, e.g. for beam search."""
        if self._k is None:
            return
        check_batch_index(index, self.batch)
        if self._extra is not None:
            raise RuntimeError("select_batch() between append() and evict()")
        self._require()
        if self.group is not None:
            self.group.leave(self._group_index)  # rows change: tensors of its own
        self._unshift()
        self._forget_candidates()
        host = [
            self._seen, self._count, self._front, self._states, self._fifo, self._free,
        ]
        if all(all(x == lst[0] for x in lst) for lst in host):  # rows alike: no need to read the index
            n = int(index.shape[0])
            self._seen, self._count, self._front = [self._seen[0]] * n, [self._count[0]] * n, [self._front[0]] * n
            self._states = [dict(self._states[0]) for _ in range(n)]
            self._fifo = [self._fifo[0]] * n
            self._free = [list(self._free[0]) for _ in range(n)]
        else:
            idx = index.tolist()
            self._seen = [self._seen[i] for i in idx]
            self._count = [self._count[i] for i in idx]
            self._front = [self._front[i] for i in idx]
            self._states = [dict(self._states[i]) for i in idx]
            self._fifo = [self._fifo[i] for i in idx]
            self._free = [list(self._free[i]) for i in idx]
        self._set_storage(*(t.index_select(0, index.to(t.device)) for t in self._tensors()))
        self._tail_clean = False
        if self.static_shapes:
            k = self._k
            assert k is not None
            self._decode = DecodeState(k.shape[0], k.shape[1], k.device)
            self._reload()

    def reset(self) -> None:
        """Forget everything (storage is freed)."""
        self._clear()
