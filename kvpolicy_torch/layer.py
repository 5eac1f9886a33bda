"""One layer's evicting KV store on torch: slots that stay put, batched, per KV head, CPU and CUDA.

:class:`LayerCache` ties together named parts, each in its own module (docs/design.md, "The slot
layout"):

* :mod:`~kvpolicy_torch.storage`: the slots (keys, values, and per slot a position, a score and an
  attention bias; a hole has position ``-1``);
* :mod:`~kvpolicy_torch.rows`: per-row host bookkeeping (seen, kept, the frontier new tokens go to);
* :mod:`~kvpolicy_torch.victims`: the one-token victim search by lowest score;
* :mod:`~kvpolicy_torch.compaction`: kept tokens moved to the front after a general eviction;
* :mod:`~kvpolicy_torch.posshift`: StreamingLLM's pos-shift of the sinks' keys;
* :mod:`~kvpolicy_torch.group`: the layers of one cache, whose victims are searched together;
* :mod:`~kvpolicy_torch.static`: the same decode step with its bookkeeping on the device (one graph).

A policy's :class:`~kvpolicy.DecodeEviction` (H2O, StreamingLLM, the local window) turns one slot
per row and head into a hole: ``O(batch x kv_heads)`` writes, and no kept token moves; for
``victim="oldest"`` the next append writes into the freed slot (a ring, never compacted). A general
eviction (:meth:`EvictionPolicy.select`, e.g. BUZZ's, or any prefill's) sees each row dense at
``[0, count)`` and is applied by compacting the kept tokens to the front in place. Rows also compact
when a frontier reaches the end of the storage: once per ``slack`` steps for one-token evictions.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch

from kvpolicy._validation import check_bool
from kvpolicy.driver import kept_slots
from kvpolicy.policy import KEY_STATISTICS, DecodeEviction, EvictionPolicy
from kvpolicy.statistics import Rotary, cache_scores, low_attention

from .attention import decode_attention, grouped_decode
from .checks import check_append, check_batch_index, check_capacity, check_like, check_query, check_received
from .compaction import keep_slots, slot_order, sort_by_position, unwrap_ring
from .group import LayerGroup
from .headwise import held_tokens, mark_dropped
from .posshift import KeyShift, PrefixShift, SinkShift, slot_shifts
from .queries import RunningMoments
from .rows import LayerSnapshot, Rows
from .scores import fold_received
from .static import DecodeState, StepOptions
from .storage import Storage, grown_slots
from .update import chunk_tokens, clear_tail, write_token
from .victims import CandidateSearch, OneTokenEviction

__all__ = ["LayerCache", "LayerSnapshot", "PrefixShift"]


class LayerCache:
    """Evicting KV storage for one attention layer.

    Usage per forward step (the protocol of :mod:`kvpolicy_torch`): :meth:`append` the new
    keys/values (returns the slots the current queries attend to); for a decode step
    :meth:`attend`, for a prompt chunk compute attention yourself (masking with
    :meth:`chunk_mask`) and :meth:`accumulate` what each slot received; then :meth:`evict`.

    Storage is allocated once to the policy's ``capacity`` (plus ``slack`` slots for policies that
    evict one token at a time by score); unbounded policies grow in bounded chunks
    (:func:`~kvpolicy_torch.storage.grown_slots`) or are sized from ``reserve``. A prefill chunk
    that does not fit is held transiently until the eviction brings the layer back under capacity.

    Args:
        policy: the eviction policy.
        reduce_scores: applied to head-summed scores before a shared selection (e.g. an
            all-reduce over tensor-parallel ranks); unused for per-head selection.
        static_shapes: a decode step's bookkeeping on the device and attention over every slot
            (holes masked), so its shapes never change and it has no host read
            (``torch.compile(fullgraph=True)``, CUDA graphs): :mod:`kvpolicy_torch.static`.
        reserve: the most tokens the run will append (e.g. prompt plus ``max_new_tokens``): an
            unbounded policy allocates that at the first append instead of growing, and a bounded
            one whose capacity is larger allocates no more than that (growing up to its capacity
            if more come).
        key_shift: StreamingLLM's pos-shift done in the storage (:data:`~kvpolicy_torch.posshift.KeyShift`,
            callers may memoise on ``delta``: it is the same in every layer). With it, for a policy
            whose decode eviction is ``"oldest"`` with sinks, a decode :meth:`append` returns the
            sinks' keys already at their shifted positions (:meth:`shift`), so attention can take
            plain SDPA; :attr:`keys_shifted` says when. Every other read sees the original keys.
        group: a :class:`LayerGroup` shared by the layers of one cache: their one-token
            evictions by lowest score (H2O, TOVA) are found with one search per decode step.

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
    #: eligible slots), the victim is found among candidates (:class:`~kvpolicy_torch.victims.CandidateSearch`).
    candidate_min_scores: int = 1 << 16
    #: Candidate slots per row and head.
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
        key_shift: KeyShift | None = None,
        group: LayerGroup | None = None,
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
        # head-wise budgets (AdaKV): a row's count is its widest head's, the others hold holes
        self._ragged = bool(policy.ragged_heads)
        if self._ragged and self.static_shapes:
            raise ValueError(f"{policy!r} (head-wise budgets) runs with static_shapes=False only (the eager layout)")
        # a policy without one-token evictions (BUZZ) that declares its size rule: a decode step
        # at which the rule keeps every token skips the policy's call (host integers only)
        self._size_rule = policy.size_rule() if rule is None else None
        if key_shift is not None and not callable(key_shift):
            raise ValueError(f"key_shift must be callable (keys, delta) -> keys, got {key_shift!r}")
        # only the sinks of an "oldest" rule are shifted (a PrefixShift); other layouts shift per slot
        self._sink_shift = (
            SinkShift(key_shift, rule.sink)
            if key_shift is not None and rule is not None and rule.victim == "oldest" and rule.sink > 0
            and not self.static_shapes else None
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
        self._store: Storage | None = None
        self._extra: Storage | None = None  # the transient working set while a prompt chunk overflows
        self._rows = Rows()
        self._range = (0, 0)  # slots [lo, hi) the last append returned
        self._bias_needed = False  # whether a slot of that range is a hole (host-side, set by append)
        self._chunk: tuple[int, int, torch.Tensor | None] | None = None  # (start, q, valid [b, q]) of a chunk
        self._phase = "decode"
        # Eager fast paths, each measured to pay (docs/design.md, "What a decode step costs"):
        # one row, shapes not static: scores and bias are 0 from the frontier on (_clean_tail)
        self._tail_clean = False
        # the one-token eviction: its victims among candidates (large CPU caches, H2O) or left to
        # the group (LayerGroup: one search for every layer)
        self._victims = None if self.rule is None else OneTokenEviction(
            self.rule, shared=self.policy.selection == "shared", grows=self.policy.score_statistic == "accumulate",
            reduce_scores=self.reduce_scores, group=None if self.static_shapes else self.group, index=self._group_index,
        )
        self._search = CandidateSearch() if self._victims is None else self._victims.search
        if self._sink_shift is not None:
            self._sink_shift.undo(None)
        # static shapes: a decode step's bookkeeping in device tensors (kvpolicy_torch.static);
        # `_device_newer` says the device holds steps the host rows have not seen yet
        self._decode: DecodeState | None = None
        self._device_newer = False
        #: Expected Attention: the running moments of the queries seen (:meth:`observe_queries`)
        self.running_queries = RunningMoments(self.policy.statistic_policy.sink) if self.policy.observes_queries else None  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ copies (pickle, deepcopy, torch.save)
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_size_rule"] = None  # a closure: rebuilt from the policy
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._size_rule = self.policy.size_rule() if self.rule is None else None
        shared = self.group.views(self._group_index) if self.group is not None else None
        if self._store is not None and shared is not None:
            # a copy of a grouped layer keeps its positions, scores and bias in the copied group's
            # tensors again (a copy holds them apart: the group's one search must see its writes)
            for mine, theirs in zip(self._store.bookkeeping(), shared):
                theirs.copy_(mine)
            self._store = Storage(self._store.keys, self._store.values, *shared)

    # ------------------------------------------------------------------ shape and bookkeeping
    @property
    def is_initialized(self) -> bool:
        return self._store is not None

    @property
    def on_device(self) -> bool:
        """Whether the newest decode steps ran on the device (``static_shapes``) and the host rows
        have not read them back yet; any read of the layer's state reads them back first."""
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
        return self._rows.columns

    @property
    def columns(self) -> int:
        """Columns appended per row so far, pads included (read on the host)."""
        self._host()
        return self._rows.columns

    @property
    def batch(self) -> int:
        """Rows held."""
        return self._rows.batch

    @property
    def slots(self) -> int:
        """Allocated slots per row and head."""
        return 0 if self._store is None else self._store.slots

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
        return self._uniform(self._rows.count, "kept tokens (use .lengths)")

    @property
    def mean_length(self) -> float:
        """Kept tokens per KV head on average over the heads and rows: :attr:`length`, except
        under head-wise budgets (``policy.ragged_heads``), where ``length`` is the widest head's
        count of slots and the heads hold fewer on average (one host read)."""
        if not self._ragged or self._store is None:
            return float(self.length)
        self._host()
        pos = self._working().positions
        return held_tokens(pos) / (pos.shape[0] * pos.shape[1])

    @property
    def lengths(self) -> list[int]:
        """Kept tokens per head, per row."""
        self._host()
        return list(self._rows.count)

    @property
    def n_seen(self) -> int:
        """Real tokens appended so far (every row); see :attr:`seen` for rows that differ."""
        self._host()
        return self._uniform(self._rows.seen, "tokens seen (use .seen)")

    @property
    def seen(self) -> list[int]:
        """Real (non-pad) tokens appended so far, per row."""
        self._host()
        return list(self._rows.seen)

    @property
    def state(self) -> dict[str, int]:
        """The policy's state (every row); see :attr:`states`."""
        self._host()
        return self._uniform(self._rows.states, "policy state (use .states)")

    @property
    def states(self) -> list[dict[str, int]]:
        """The policy's state, per row."""
        self._host()
        return [dict(s) for s in self._rows.states]

    def _host(self) -> None:
        """Bring the host rows up to date with decode steps the device ran (static shapes)."""
        if self._device_newer:
            self._materialize()

    def _held(self) -> Storage:
        """The storage (after the first append)."""
        if self._store is None:
            raise ValueError("nothing was appended to this LayerCache yet: call append() first")
        return self._store

    def _require(self) -> Storage:
        """The storage, every deferred or device-side step applied: what any host read needs."""
        store = self._held()
        self._flush()
        self._host()
        return store

    def _flush(self) -> None:
        """This step's victims, if the group still holds them (LayerGroup)."""
        if self._victims is not None and self._victims.deferred and self.group is not None:
            self.group.flush()

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
        self._search.forget()
        b, h = like_k.shape[:2]
        dev = like_k.device
        # float64 for float64 models, and for records of low-attention events (exact integers < 2**52)
        # (and for scores from keys: computed in float64, as the reference does)
        exact = like_k.dtype == torch.float64 or self.policy.score_statistic in ("low_history", *KEY_STATISTICS)
        score_dtype = torch.float64 if exact else torch.float32
        shared = None
        if self.group is not None:
            if self._store is None:
                shared = self.group.storage(self._group_index, (b, h, slots), score_dtype, dev)
            else:
                self.group.leave(self._group_index)  # growth: a shape of its own
        grown = Storage.allocate(like_k, like_v, slots, score_dtype, shared)
        if self._store is not None:  # growth (unbounded policies): carry what is there
            grown.copy_prefix(self._store, min(max(self._rows.front), self._store.slots))  # (the rest: the transient set)
        self._store = grown
        self._tail_clean = False
        if self.static_shapes and (self._decode is None or self._decode.free.shape != (b, h)):
            self._decode = DecodeState(b, h, dev)

    def _grown_slots(self, need: int = 0) -> int:
        """The slots after one growth step (:func:`~kvpolicy_torch.storage.grown_slots`) of a store
        that must hold ``need``: an unbounded policy's at least ``reserve``, a bounded one's at most
        its planned slots."""
        grown = grown_slots(self.slots, need)
        if self.policy.capacity is None:
            return max(grown, self.reserve or 0)
        return min(grown, self._full_slots)

    def _full(self) -> Storage:
        """The whole (contiguous) tensors compaction works in: the transient set, else the storage."""
        return self._extra if self._extra is not None else self._held()

    def _working(self) -> Storage:
        """Every slot that may hold a token: the transient set while a chunk overflows, else the
        storage up to the furthest frontier."""
        if self._extra is not None:
            return self._extra
        return self._held().narrow(0, max(self._rows.front))

    @property
    def nbytes(self) -> int:
        """Bytes of the allocated storage (keys, values, positions, scores, bias)."""
        return 0 if self._store is None else self._store.nbytes

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's key and value over a row's KV heads (0 before the first append)."""
        if self._store is None:
            return 0
        k, v = self._store.keys, self._store.values
        return k.shape[1] * (k.shape[3] * k.element_size() + v.shape[3] * v.element_size())

    @property
    def kv_bytes(self) -> int:
        """Bytes of the keys and values actually kept (pads and holes excluded)."""
        if self._store is None:
            return 0
        self._host()
        if self._ragged:  # heads hold different numbers: count them (one host read)
            return self.token_bytes // self._store.keys.shape[1] * held_tokens(self._working().positions)
        return self.token_bytes * sum(self._rows.count)

    # ------------------------------------------------------------------ ordered views (inspection)
    def _dense(self) -> bool:
        """Whether every row holds its kept tokens at slots ``[0, count)`` in position order."""
        return self._extra is None and self._rows.dense()

    def _in_order(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (a tensor of :meth:`_working`) at the kept tokens, in position order."""
        count = self.length
        if self._dense():
            return t[:, :, :count]
        order = slot_order(self._working().positions, count, self._rows.ring())
        if t.ndim == 4:
            return torch.gather(t, 2, order[..., None].expand(*order.shape, t.shape[-1]))
        return torch.gather(t, 2, order)

    @property
    def keys(self) -> torch.Tensor:
        """Kept keys in position order ``[batch, kv_heads, length, head_dim]`` (a view when dense)."""
        self._require()
        self._unshift()  # reads see original keys (the next decode append shifts them again)
        return self._in_order(self._working().keys)

    @property
    def values(self) -> torch.Tensor:
        """Kept values in position order ``[batch, kv_heads, length, head_dim]``."""
        self._require()
        return self._in_order(self._working().values)

    @property
    def positions(self) -> torch.Tensor:
        """Original positions of the kept tokens, ascending ``[batch, kv_heads, length]``."""
        self._require()
        return self._in_order(self._working().positions)

    @property
    def scores(self) -> torch.Tensor:
        """Accumulated attention of the kept tokens, in position order ``[batch, kv_heads, length]``."""
        self._require()
        return self._in_order(self._working().scores)

    def kept(self, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(positions, scores)`` ``[kv_heads, n_row]`` of one row, in position order (rows may differ)."""
        self._require()
        working = self._working()
        pos = working.positions[row : row + 1]
        order = slot_order(pos, self._rows.count[row], self._rows.ring())
        return torch.gather(pos, 2, order)[0], torch.gather(working.scores[row : row + 1], 2, order)[0]

    # ------------------------------------------------------------------ what attention sees
    def _returned_positions(self) -> torch.Tensor:
        lo, hi = self._range
        return self._extra.positions if self._extra is not None else self._held().positions[:, :, lo:hi]

    def _returned_scores(self) -> torch.Tensor:
        lo, hi = self._range
        return self._extra.scores if self._extra is not None else self._held().scores[:, :, lo:hi]

    @property
    def slot_positions(self) -> torch.Tensor:
        """Original positions of the slots the last :meth:`append` returned ``[batch, kv_heads, n]``
        (``-1`` at a hole or pad): ``received`` in :meth:`accumulate` is aligned with these."""
        self._require()
        return self._returned_positions()

    @property
    def bias(self) -> torch.Tensor | None:
        """Additive attention bias ``[batch, kv_heads, n]`` (``0`` or ``-inf``) of the slots the last
        decode :meth:`append` returned, or ``None`` when none of them is a hole."""
        store = self._require()
        if not self._bias_needed:
            return None
        lo, hi = self._range
        return store.bias[:, :, lo:hi]

    def _needs_bias(self) -> bool:
        """Whether a slot in the returned range is a hole for some row (host ints only)."""
        if self.static_shapes or self._extra is not None or self._ragged:
            return True
        lo, hi = self._range
        rows = self._rows
        if lo == 0 and rows.count == rows.front and all(f == hi for f in rows.front):
            return False  # the common case, decided without a loop
        return any(f != hi or f != c for f, c in zip(rows.front, rows.count))

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
        if self._ragged and bool(((pos >= 0) != (pos[:, :1] >= 0)).any()):
            raise NotImplementedError(
                f"{self.policy!r}: a prompt chunk after a head-wise eviction (heads holding different tokens) needs a "
                "mask per KV head, which this backend does not build yet; append the whole prompt at once"
            )
        if valid is None and all(c == start + q for c in self._rows.count):  # no pads, no holes before the chunk
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

    # ------------------------------------------------------------------ pos-shift
    @property
    def keys_shifted(self) -> bool:
        """Whether the keys the last :meth:`append` returned already sit at their pos-shift
        positions (``key_shift`` given, a decode step of an ``"oldest"`` rule): :meth:`shift` then
        describes what was done, and nothing is left for attention to rotate."""
        return self._sink_shift is not None and self._sink_shift.delta is not None

    def _shift_sinks(self, sinks: SinkShift) -> None:
        """After a decode append: hold the sinks' keys rotated by each row's shift."""
        if sinks.originals is None and (
            not any(self._rows.shift()) or min(self._rows.front) < sinks.sink or self._extra is not None
        ):
            return  # nothing shifted yet (or a row without its sinks: attention rotates the query)
        sinks.apply(self._held(), self._rows.shift())

    def _unshift(self) -> None:
        """The sinks' original keys back in their slots (before anything but a decode step reads or
        moves keys)."""
        if self._sink_shift is not None:
            self._sink_shift.undo(self._store)

    def shift(self) -> PrefixShift | torch.Tensor:
        """How far each returned slot sits from its original position under StreamingLLM's
        pos-shift (:mod:`kvpolicy_torch.posshift`): a :class:`PrefixShift` for a policy whose
        decode eviction is ``"oldest"`` (only the sinks move), else the per-slot shifts
        ``[batch, kv_heads, n]`` (0 at holes)."""
        self._require()
        if self.rule is not None and self.rule.victim == "oldest" and self._extra is None and self._chunk is None:
            return PrefixShift(self.rule.sink, self._rows.shift())
        # slots before the range are holes, so ranks count from its start
        return slot_shifts(self.slot_positions, self._rows.shift())

    # ------------------------------------------------------------------ update
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
        self._flush()
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
        if self._decode is not None and self._store is not None and q == 1 and valid is None:
            # static shapes: the step's bookkeeping in device tensors (kvpolicy_torch.static), no
            # host read and no branch on data, so a compiled step is one graph
            if (b, h, d, vs[3], keys.dtype, values.dtype, keys.device) != self._like:
                check_like(self._held(), keys, values)
            # (a one-token eviction keeps every row at or below limit + 1 tokens: no overflow while
            # the storage holds more than the limit)
            self._decode.append(self._store, keys, values,
                                may_overflow=self.rule is None or self.slots <= self.rule.limit)
            self._device_newer = True
            self._phase = "decode"
            self._chunk = None
            return self._store.keys, self._store.values
        self._host()
        if self._store is None:
            self._start(keys, values)
        elif (b, h, d, vs[3], keys.dtype, values.dtype, keys.device) != self._like:
            check_like(self._held(), keys, values)
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
                self._shift_sinks(self._sink_shift)
        else:
            self._unshift()
            self._append_chunk(keys, values, valid, [q] * b if real is None else list(real))
        self._phase = "prefill" if q > 1 else "decode"
        if self._extra is not None:
            return self._extra.keys, self._extra.values
        lo, hi = self._range
        store = self._held()
        return store.keys[:, :, lo:hi], store.values[:, :, lo:hi]

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
        if self._ragged and capacity is not None:
            # one head may hold more than the mean (up to the layer's budget less the others'
            # floors): allocated for the mean, grown to the widest head's need (kvpolicy.AdaKV)
            self._full_slots = max(self._full_slots, self.policy.head_capacity(keys.shape[1]))  # type: ignore[attr-defined]
        self._rows = Rows.start(b, self.policy.init_state())
        self._allocate(keys, values, slots)
        # what later appends must match (one tuple comparison per step; _check_like says what differs)
        self._like = (b, keys.shape[1], keys.shape[3], values.shape[3], keys.dtype, values.dtype, keys.device)

    def _append_one(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        rows, store = self._rows, self._held()
        front, free = rows.front, rows.free
        full = [r for r, f in enumerate(front) if f >= store.slots and not free[r]]
        if full:
            if self.policy.capacity is None or self.slots < self._full_slots:  # unbounded, or fewer than planned
                self._allocate(keys, values, self._grown_slots())
            else:
                self._compact_rows([r for r in full if rows.count[r] < front[r]])
                if any(front[r] >= self.slots for r in full):
                    raise RuntimeError(
                        f"{self.policy!r} holds {max(rows.count)} tokens, more than its capacity {self.policy.capacity}"
                    )
            store = self._held()
        one = rows.batch == 1 and not self.static_shapes
        if one and not free[0] and not self._tail_clean:
            # a frontier slot of one row: nothing reads past the frontier here, so the slots from it
            # on can hold score and bias 0 ahead of time (two writes fewer a step)
            clear_tail(store, front[0])
            self._tail_clean = True
        write_token(store, rows, keys, values, scores_clear=one and self._tail_clean)
        self._chunk = None
        self._range = (0, store.slots if self.static_shapes else max(front))
        self._bias_needed = self._needs_bias()

    def _append_chunk(self, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor | None, real: list[int]) -> None:
        self._search.forget()
        self._tail_clean = False
        b, _, q, _ = keys.shape
        if not self._dense():
            self._compact_rows(list(range(b)))  # chunks see dense rows in position order
        rows = self._rows
        start = max(rows.front)
        chunk = chunk_tokens(keys, values, valid, rows.seen, self._held().scores.dtype)
        if (self.policy.capacity is None or self.slots < self._full_slots) and start + q > self.slots:
            self._allocate(keys, values, self._grown_slots(start + q))  # (unbounded, or more than `reserve` came)
        if start + q <= self.slots:
            self._held().write(start, chunk)
        else:  # the prompt exceeds the storage: attention needs all of it for this step
            self._extra = self._held().concat(chunk, start)
        self._range = (0, start + q)  # a chunk ends the range (received_attention reads its keys as the last q), static or not
        for r in range(b):
            rows.seen[r] += real[r]
            rows.count[r] += real[r]
            rows.front[r] = start + q
        rows.columns += q
        self._chunk = (start, q, valid)
        self._bias_needed = self._needs_bias()

    # ------------------------------------------------------------------ attend and accumulate
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
        scores = self._returned_scores()
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
        when the policy uses them, in one pass over the keys. Then call :meth:`evict`.

        Args:
            query: ``[batch, q_heads, 1, head_dim]``, ``q_heads`` a multiple of the KV heads (GQA).
            scaling: the logit scale.
            extra_bias: ``[batch, kv_heads, n]`` additive bias on top of the holes' (``-inf`` where a
                sliding window hides a kept token), or ``None``.
            row_scale, prefix: as in :func:`~kvpolicy_torch.decode_attention` (BUZZ's log n; the
                query rotated back for StreamingLLM's pos-shifted sinks).
            options: with ``static_shapes``, the same three as a
                :class:`~kvpolicy_torch.static.StepOptions`, computed on the device from its own counts.

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
        check_query(query, None if self._store is None else self._store.keys)
        policy = self.policy
        if self._device_newer and self._decode is not None and self._store is not None:
            # a static-shaped decode step: everything on the device
            if extra_bias is not None or row_scale is not None or prefix is not None:
                raise ValueError("with static_shapes, pass the window, log n and pos-shift as options=StepOptions(...)")
            out, received = self._decode.attend(self._store, query, scaling, options or StepOptions())
            if policy.captures_attention:
                history = policy.score_history if policy.score_statistic == "low_history" else None
                DecodeState.accumulate(self._store, received, policy.score_statistic,
                                       query.shape[1] // self._store.keys.shape[1], history)
            return out
        store = self._require()
        if self._phase != "decode" or self._extra is not None:
            raise ValueError("attend() serves a decode step (one token appended per row); a prompt chunk takes chunk_mask() and accumulate()")
        hi = self._range[1]
        if (
            extra_bias is None and row_scale is None and prefix is None and not self._search.active
            and query.dtype == store.scores.dtype == store.keys.dtype
            and policy.score_statistic == "accumulate" and policy.uses_scores
        ):
            # the common step (H2O, BUZZ) on the storage's grouped views: grouped_decode, then the
            # probabilities summed per KV head into the scores (as accumulate, without re-validating)
            b, hq, _, d = query.shape
            k3, v3, bias3 = store.grouped(hi)
            bh = k3.shape[0]
            r = hq * b // bh
            out3, probs3 = grouped_decode(query.reshape(bh, r, d), k3.transpose(1, 2), v3, scaling,
                                          bias3 if self._bias_needed else None)
            self._add(store.scores.narrow(2, 0, hi), probs3.view(b, bh // b, r, hi).sum(dim=2))
            return out3.view(b, 1, hq, -1)
        key, value = store.keys.narrow(2, 0, hi), store.values.narrow(2, 0, hi)
        bias = self.bias
        if extra_bias is not None:
            bias = extra_bias if bias is None else bias + extra_bias
        out, received = decode_attention(query, key, value, scaling, bias=bias, row_scale=row_scale, prefix=prefix)
        if policy.captures_attention:
            if policy.score_statistic == "low_history":
                self.accumulate_query(received, query.shape[1] // key.shape[1])
            else:  # received comes from a softmax: its shape is right and it is real
                self._add(store.scores.narrow(2, 0, hi), received)
        return out

    def _add(self, scores: torch.Tensor, received: torch.Tensor) -> None:
        """The body of :meth:`accumulate` on the returned slots' ``scores``."""
        statistic = self.policy.score_statistic
        if statistic == "accumulate":
            if self._search.active:
                low, high = torch.aminmax(received)
                if not bool((low >= 0) & (high < math.inf)):
                    # a score may go down (negative, NaN, or -inf + inf): the candidates' bound no longer holds
                    self._search.forget()
            fold_received(scores, None, received, statistic)
            return
        # "low_history": the chunk's record is shifted in by its real rows (a left-padded row has
        # fewer), a decode query's by one
        rows: Any = 1
        if self._chunk is not None and statistic == "low_history":
            valid = self._chunk[2]
            rows = self._chunk[1] if valid is None else valid.sum(dim=-1).view(-1, 1, 1)
        fold_received(scores, self._returned_positions(), received, statistic, history=self.policy.score_history,
                      rows=rows)

    # ------------------------------------------------------------------ evict
    def evict(self) -> list[tuple[int, int]]:
        """Let the policy evict until it is satisfied; return ``(size_before, size_after)`` per round
        (per group of rows that evicted together).

        With ``static_shapes``, after a decode step a one-token eviction is a masked write on the
        device (no rounds are reported: whether a row evicted is not read back); a general
        eviction (BUZZ, Scissorhands) runs here in eager code, and is left to :meth:`settle`
        inside ``torch.compile``."""
        if self._device_newer and self._decode is not None and self._store is not None:
            if self.rule is not None:
                store, policy = self._store, self.policy
                if policy.score_statistic in KEY_STATISTICS:  # scores from the cache (Knorm, KeyDiff, Expected Attention)
                    store.scores.copy_(self._cache_scores(store, self._decode.seen.view(-1, 1, 1)))
                self._decode.evict(store, self.rule, policy.selection == "shared", self.reduce_scores)
                return []
            if torch.compiler.is_compiling():
                return []  # announced by needs_settle: the caller runs settle() between compiled steps
            return self.settle()
        self._require()
        rule, count = self.rule, self._rows.count
        if self.policy.score_statistic in KEY_STATISTICS and (
            rule is None or self._phase != "decode" or self._extra is not None or max(count) > rule.limit
        ):  # (a decode step under the one-token rule's limit evicts nothing: no scores needed)
            self._score_keys()
        if self._phase == "decode" and rule is not None and self._extra is None:
            over = rule.limit + 1
            rows = list(range(self.batch)) if all(c == over for c in count) else [r for r, c in enumerate(count) if c == over]
            if len(rows) < self.batch and any(c > over for c in count):
                rounds = self._evict_general()
            elif rows and self._victims is not None:
                self._victims.evict(self._held(), self._rows, rows, self.candidates, self.candidate_min_scores)
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
        # host rows follow without reading the device (settle() comes after every compiled step;
        # _materialize checks it); the device is read only when the size rule says "evict".
        rows = self._rows
        rows.seen = [s + 1 for s in rows.seen]
        rows.count = [c + 1 for c in rows.count]
        rows.columns += 1
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
        decode, store = self._decode, self._held()
        assert decode is not None  # (only static-shaped layers run steps on the device)
        self._device_newer = False
        seen, count, columns, overflow = decode.read()
        if overflow:
            raise RuntimeError(
                f"{self.policy!r} ran out of its {self.slots} slots in a compiled decode step: a general eviction was "
                f"due and did not run. Call settle() (EvictingCache.settle) between compiled decode steps when "
                f"needs_settle is True (kvpolicy.hf.generate does)"
            )
        if self.needs_settle and seen[0] - self._rows.seen[0] > 1:
            raise RuntimeError(
                f"{self.policy!r}: {seen[0] - self._rows.seen[0]} compiled decode steps ran since the host last settled: "
                f"call settle() (EvictingCache.settle) after every compiled decode step while needs_settle is True "
                f"(kvpolicy.hf.greedy_decode does)"
            )
        if self.rule is not None:  # one-token evictions scattered the kept tokens: sort by position
            sort_by_position(store)
        store.bias.copy_(torch.where(store.positions >= 0, 0.0, -math.inf).to(store.bias.dtype))
        states = self._rows.states
        self._rows = Rows(seen, count, list(count), states, [None] * len(count), [[] for _ in count], columns)
        self._range = (0, self.slots)
        self._bias_needed = True
        self._tail_clean = False
        self._search.forget()
        decode.load(seen, count, columns)

    def _reload(self) -> None:
        """Static shapes, after host code changed the layer: compact it and hand the counts to the
        device, so the next decode step runs there."""
        if self._decode is None or self._extra is not None or self._store is None:
            return
        if not self._dense():
            self._compact_rows(list(range(self.batch)))
        if (self.policy.capacity is None or self.slots < self._full_slots) and max(self._rows.count) >= self.slots:
            # a store without room for the next token grows here, between steps (an unbounded policy;
            # a bounded one sized for `reserve` tokens that is given more)
            store = self._store
            self._allocate(store.keys[:, :, :1], store.values[:, :, :1], self._grown_slots())
        self._decode.load(self._rows.seen, self._rows.count, self._rows.columns)

    def _score_keys(self) -> None:
        """A statistic from the cache (Knorm, KeyDiff, Expected Attention): every held token's
        score, recomputed from the keys (and values, and the queries' moments) held
        (:func:`kvpolicy.statistics.cache_scores`) before the policy decides; holes and pads ``+inf``."""
        working, seen_rows = self._working(), self._rows.seen
        seen: Any = seen_rows[0]
        if any(s != seen for s in seen_rows):
            seen = torch.tensor(seen_rows, device=working.positions.device).view(-1, 1, 1)
        working.scores.copy_(self._cache_scores(working, seen))

    def _cache_scores(self, slots: Storage, seen: Any) -> torch.Tensor:
        running = self.running_queries
        if running is None:
            return cache_scores(self.policy, slots.keys, slots.values, slots.positions, seen)
        if running.moments is None:
            raise RuntimeError(
                f"{self.policy!r} scores from the queries' moments, and no query was observed: call observe_queries() "
                f"with each step's queries before evict() (the transformers cache does)"
            )
        return cache_scores(self.policy, slots.keys, slots.values, slots.positions, seen, running.moments, running.rotary)

    def observe_queries(self, queries: torch.Tensor, positions: torch.Tensor | None = None, rotary: Rotary | None = None) -> None:
        """Expected Attention: add the step's queries ``[batch, q_heads, q, head_dim]``, before
        RoPE, to the running moments the scores come from (:mod:`kvpolicy_torch.queries`); a no-op
        for any other policy. ``positions`` ``[batch, q]``: theirs (default
        :meth:`query_positions`, ``-1`` at pads); ``rotary``: the RoPE they were rotated back from,
        whose rotations the scores average over the next positions (``None``: none). Call it
        after :meth:`append` and before :meth:`evict`.

        Example:
            >>> from kvpolicy import ExpectedAttention
            >>> layer = LayerCache(ExpectedAttention(size=2, sink=0))
            >>> for t in range(4):
            ...     K, V = layer.append(torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4))
            ...     layer.observe_queries(torch.randn(1, 2, 1, 4))
            ...     rounds = layer.evict()
            >>> layer.length, layer.running_queries.moments.count.tolist()
            (2, [4.0])
        """
        if self.running_queries is None:
            return
        if self._store is None:
            raise ValueError("observe_queries() follows append(): nothing was appended to this LayerCache yet")
        if positions is None:
            positions = self.query_positions(queries.shape[2])
        self.running_queries.observe(queries, positions, int(self._store.keys.shape[1]), rotary)

    def query_positions(self, q: int) -> torch.Tensor:
        """Int64 ``[batch, q]``: the original positions of the ``q`` tokens the last :meth:`append`
        added (``-1`` at pads); on the device for a static-shaped decode step (no host read)."""
        if self._device_newer and self._decode is not None:
            return self._decode.seen.view(-1, 1) - 1
        if q == 1 and self._chunk is None:
            return torch.tensor([s - 1 for s in self._rows.seen], device=self._held().keys.device).view(-1, 1)
        return self._returned_positions()[:, 0, -q:]

    def _declines(self) -> bool:
        """A decode step at which the policy's size rule keeps every row's tokens: the policy
        would decline (its rule is held to its ``select`` by the tests), so it is not asked."""
        if self._size_rule is None or self._phase != "decode" or self._extra is not None:
            return False
        rule = self._size_rule
        return all(rule(c, dict(s)) == c for c, s in zip(self._rows.count, self._rows.states))

    @property
    def candidate_searches(self) -> int:
        """Full searches of H2O-like victims made so far on the candidate path (see
        :attr:`candidate_min_scores`): a diagnostic for benchmarks and tests."""
        return self._search.searches

    def _evict_general(self) -> list[tuple[int, int]]:
        """Ask the policy (``select``) on dense, ordered views, group by group of rows in the same
        host state, until it keeps everything (the core's loop, :func:`kvpolicy.driver.kept_slots`);
        apply all of a group's rounds in one compaction."""
        self._unshift()
        if not self._dense():
            self._compact_rows(list(range(self.batch)))
        rounds: list[tuple[int, int]] = []
        for rows in self._rows.groups():
            r0 = rows[0]
            n = self._rows.count[r0]
            full = self._full()
            pos, scores = full.positions, full.scores
            if len(rows) < self.batch:
                index = torch.tensor(rows, device=pos.device)
                pos, scores = pos.index_select(0, index), scores.index_select(0, index)
            state = dict(self._rows.states[r0])
            keep, done = kept_slots(self.policy, pos[:, :, :n], scores[:, :, :n], self._rows.seen[r0], state, self._phase,
                                    decide=lambda view: self.policy.evict(view, self.reduce_scores))
            if keep is None:
                continue
            self._keep_rows(rows, keep)
            for r in rows:
                self._rows.states[r] = dict(state)
            rounds += done
        if self._extra is not None:
            if self._ragged and self.slots < max(self._rows.count) <= self._full_slots:
                # the widest head holds more than the mean's slots: grow the storage to fit it
                self._allocate(self._extra.keys[:, :, :1], self._extra.values[:, :, :1], self._grown_slots(max(self._rows.count) + 1))
            if max(self._rows.count) > self.slots:
                raise RuntimeError(
                    f"{self.policy!r} left {max(self._rows.count)} tokens but declared capacity {self.policy.capacity}"
                )
            self._put_back()
        if self._ragged and rounds:
            self._fit_widest()
        return rounds

    def _fit_widest(self) -> None:
        """Head-wise budgets: the storage follows the widest head. After an eviction, a store
        holding more than twice its growth step above the widest head's tokens is reallocated to
        one step above them (:func:`~kvpolicy_torch.storage.grown_slots`, so it neither grows nor
        shrinks at every step as the heads' shares move)."""
        need = max(self._rows.front)
        fit = grown_slots(need)
        if self.slots > need + 2 * (fit - need) and fit < self.slots:
            store = self._held()
            self._allocate(store.keys[:, :, :1], store.values[:, :, :1], fit)

    # ------------------------------------------------------------------ compaction
    def _compact_rows(self, rows: list[int]) -> None:
        """Move the kept tokens of ``rows`` to ``[0, count)`` in position order (holes removed)."""
        book = self._rows
        if self._extra is None:
            rows = [r for r in rows if book.count[r] != book.front[r] or book.fifo[r] is not None]
        if not rows:
            return
        self._unshift()
        for r in rows:  # rare (a prompt chunk or a general eviction after decode steps): a loop over rows is fine
            fifo = book.fifo[r]
            if fifo is not None and self.rule is not None:
                unwrap_ring(self._held(), r, self.rule.sink, fifo, book.front[r], self.compaction_chunk_bytes)
        book.densified(rows)
        for count, group in book.by_count(rows).items():
            pos = self._working().positions
            if len(group) < self.batch:
                pos = pos.index_select(0, torch.tensor(group, device=pos.device))
            self._keep_rows(group, slot_order(pos, count, book.ring()))

    def _keep_rows(self, rows: list[int], keep: torch.Tensor) -> None:
        """Keep slots ``keep`` ``[len(rows), heads, k]`` (ascending) of ``rows`` at ``[0, k)``
        (:func:`~kvpolicy_torch.compaction.keep_slots`: in place, each kept token moves once)."""
        self._search.forget()  # slots move
        self._tail_clean = False
        old_front = max(self._rows.front[r] for r in rows)
        if self._ragged:  # -1: a hole (a head keeping fewer than the widest), copied from slot 0, then marked
            keep_slots(self._full(), rows, keep.clamp(min=0), old_front, self.compaction_chunk_bytes)
            mark_dropped(self._full(), None if len(rows) == self.batch else torch.tensor(rows, device=keep.device), keep)
        else:
            keep_slots(self._full(), rows, keep, old_front, self.compaction_chunk_bytes)
        self._rows.kept(rows, keep.shape[2])

    def _put_back(self) -> None:
        """Move the transient working set back into the storage once it fits."""
        extra, self._extra = self._extra, None
        assert extra is not None  # (called after a general eviction of an overflowing chunk)
        self._search.forget()
        n = max(self._rows.front)
        self._tail_clean = False
        store = self._held()
        store.copy_prefix(extra, n)
        store.clear_from(n)
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
        return out.scatter_(2, slot_order(pos, count, self._rows.ring()), ordered)

    # ------------------------------------------------------------------ snapshots (benchmarks)
    @property
    def compaction_period(self) -> int | None:
        """Decode steps between two compactions while a :class:`~kvpolicy.DecodeEviction` evicts
        one token per step (``None``: the policy has none, or nothing is allocated yet)."""
        if self.rule is None or self.rule.victim == "oldest" or self._store is None or self.policy.capacity is None:
            return None  # ("oldest": a ring, never compacted while decoding)
        return self.slots - self.policy.capacity + 1

    def snapshot(self) -> LayerSnapshot:
        """A copy of the bookkeeping (see :class:`LayerSnapshot`), between steps."""
        store = self._require()
        if self._extra is not None:
            raise RuntimeError("snapshot() between append() and evict()")
        return LayerSnapshot.of(self._rows, store)

    def restore(self, snap: LayerSnapshot) -> None:
        """Put the bookkeeping of ``snap`` back (keys and values stay as they are). Slots at or
        beyond a row's ``front`` become holes."""
        store = self._require()
        self._rows = snap.rows(store, self.batch)  # (checks that it fits before anything changes)
        self._unshift()
        self._search.forget()
        self._extra, self._chunk = None, None
        self._tail_clean = False
        snap.write(store, self._rows.front)
        self._range = (0, max(self._rows.front))
        self._bias_needed = self._needs_bias()
        self._phase = "decode"
        self._reload()

    # ------------------------------------------------------------------ batch ops (beam search etc.)
    def select_batch(self, index: torch.Tensor) -> None:
        """Keep (or repeat) batch rows by ``index``, e.g. for beam search."""
        if self._store is None:
            return
        check_batch_index(index, self.batch)
        if self._extra is not None:
            raise RuntimeError("select_batch() between append() and evict()")
        store = self._require()
        if self.group is not None:
            self.group.leave(self._group_index)  # rows change: tensors of its own
        self._unshift()
        self._search.forget()
        n = int(index.shape[0])
        # rows alike: no need to read the index
        self._rows = self._rows.take(None if self._rows.alike() else index.tolist(), n)
        self._store = store.index_select(index)
        if self.running_queries is not None:
            self.running_queries.select(index)
        self._tail_clean = False
        if self.static_shapes:
            self._decode = DecodeState(n, self._store.keys.shape[1], self._store.keys.device)
            self._reload()

    def reset(self) -> None:
        """Forget everything (storage is freed)."""
        self._clear()
