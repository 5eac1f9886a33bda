"""One layer's evicting KV store on torch: slots that stay put, batched, per KV head, CPU and CUDA.

:class:`LayerCache` is the facade of named parts, each in its own module (docs/design.md, "The
parts of LayerCache"):

* :mod:`~kvpolicy_torch.storage`: the slots (keys, values, and per slot a position, a score and an
  attention bias; a hole has position ``-1``) and how many are allocated (:class:`SlotPlan`);
* :mod:`~kvpolicy_torch.allocation`: the first allocation, growth, and room for the next append;
* :mod:`~kvpolicy_torch.layout`: the eager layout: the storage, per-row host bookkeeping
  (:mod:`~kvpolicy_torch.rows`), what the last append returned, where a decode token and a prompt
  chunk are written, ordered reads and compaction;
* :mod:`~kvpolicy_torch.attention`: the eager decode step's attention over the slots and its score
  accumulation (``attend_slots``), beside the attention kernels;
* :mod:`~kvpolicy_torch.eviction`: which rule decides after a step (one token, nothing, general);
* :mod:`~kvpolicy_torch.victims`: the one-token victim search by lowest score, in one layer or in
  every layer of a cache (:class:`~kvpolicy_torch.victims.LayerGroup`);
* :mod:`~kvpolicy_torch.general`: a policy's general ``select``, applied by compaction;
* :mod:`~kvpolicy_torch.posshift`: StreamingLLM's pos-shift of the sinks' keys;
* :mod:`~kvpolicy_torch.static`: the same decode step with its bookkeeping on the device (one graph);
* :mod:`~kvpolicy_torch.queries` and :mod:`~kvpolicy_torch.headwise`: Expected Attention's query
  moments and AdaKV's head-wise budgets.

A policy's :class:`~kvpolicy.DecodeEviction` (H2O, StreamingLLM, the local window) turns one slot
per row and head into a hole: ``O(batch x kv_heads)`` writes, and no kept token moves; for
``victim="oldest"`` the next append writes into the freed slot (a ring, never compacted). A general
eviction (:meth:`EvictionPolicy.select`, e.g. BUZZ's, or any prefill's) sees each row dense at
``[0, count)`` and is applied by compacting the kept tokens to the front in place. Rows also compact
when a frontier reaches the end of the storage: once per ``slack`` steps for one-token evictions
(about 5% of the capacity: the storage allocates at most
:data:`~kvpolicy_torch.storage.MEMORY_BOUND` x the keys and values it holds).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch

from kvpolicy.policy import KEY_STATISTICS, EvictionPolicy
from kvpolicy.statistics import UNSCORED, Rotary, refresh_interval, refresh_sink, scored_once
from kvpolicy.validation import check_int

from .checks import (
    check_append, check_batch_index, check_layer, check_like, check_query, check_received, check_step_kv, checked_valid,
)
from .allocation import SlotAllocator
from .attention import add_received, attend_slots, query_record
from .eviction import HostEviction
from .layout import SlotLayout
from .posshift import KeyShift, PrefixShift, SinkShift
from .queries import CandidateSums, RunningMoments, token_scores
from .reads import LayerReads
from .rows import LayerSnapshot
from .static import StaticSteps, StepOptions
from .storage import SlotPlan, Storage
from .victims import CandidateSearch, LayerGroup, OneTokenEviction

__all__ = ["LayerCache", "LayerSnapshot", "PrefixShift"]


class LayerCache(LayerReads):
    """Evicting KV storage for one attention layer.

    Usage per forward step (the protocol of :mod:`kvpolicy_torch`): :meth:`append` the new
    keys/values (returns the slots the current queries attend to); for a decode step
    :meth:`attend`, for a prompt chunk compute attention yourself (masking with
    :meth:`chunk_mask`) and :meth:`accumulate` what each slot received; then :meth:`evict`.

    Storage is allocated once to the policy's ``capacity`` (plus ``slack`` slots for policies that
    evict one token at a time by score); unbounded policies grow in bounded chunks
    (:class:`~kvpolicy_torch.storage.SlotPlan`) or are sized from ``reserve``. A prefill chunk
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
        prompt_chunk: the chunk size of a chunked prefill, if the prompt comes in chunks: a
            bounded policy whose first append is a chunk of exactly this many tokens allocates
            one chunk beyond its capacity, so each later chunk is written in place and a chunked
            prefill never holds more than the capacity (plus spare slots) and one chunk
            (:class:`~kvpolicy_torch.storage.SlotPlan`); the first decode step gives the room
            back (:meth:`SlotAllocator.release_room
            <kvpolicy_torch.allocation.SlotAllocator.release_room>`); ``None`` (default): no room (a chunk that
            does not fit is held transiently beside the storage). Not with ``static_shapes``
            (whose decode steps attend over every allocated slot).
        pooled_capacity: where the layers of one cache differ in capacity (PyramidKV), the mean
            of their capacities (rounded down): this layer takes that capacity's spare slots, the
            memory bound holding over the layers together (:attr:`SlotPlan.pooled
            <kvpolicy_torch.storage.SlotPlan.pooled>`); ``None`` (default): its own capacity's.

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
    #: capacity and within :data:`~kvpolicy_torch.storage.MEMORY_BOUND` (:meth:`SlotPlan.spare
    #: <kvpolicy_torch.storage.SlotPlan.spare>`; ``benchmarks/slack_sweep.py``).
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
        prompt_chunk: int | None = None,
        pooled_capacity: int | None = None,
    ) -> None:
        check_layer(policy, static_shapes=static_shapes, key_shift=key_shift, group=group)
        self.prompt_chunk = None if prompt_chunk is None else check_int("prompt_chunk", prompt_chunk, minimum=1)
        self.pooled_capacity = None if pooled_capacity is None else check_int("pooled_capacity", pooled_capacity, minimum=1)
        self.policy = policy
        self.reduce_scores = reduce_scores
        self.static_shapes = bool(static_shapes)
        self.reserve = reserve
        self.rule = policy.decode_eviction
        self._reconstructs = policy.needs_reconstruction  # (KVzip: asked once, after its reconstruction pass)
        self._once = scored_once(policy)  # (kvpolicy.statistics.scored_once: decode tokens scored when cached)
        # head-wise budgets (AdaKV): a row's count is its widest head's, the others hold holes
        self._ragged = bool(policy.ragged_heads)
        self._key_shift = key_shift
        self.group = group
        self._group_index = group.register() if group is not None else -1
        self.evictions = 0
        self._clear()

    def _clear(self) -> None:
        self._peak = 0  # (peak_bytes)
        self._step_store: Storage | None = None  # (append: the storage and shapes a decode step last passed its checks in)
        self._step_like: tuple[Any, ...] | None = None
        self._query_store: Storage | None = None  # (attend: the same for a decode query)
        self._query_like: tuple[Any, ...] | None = None
        # (needs_settle: its answer, for the storage and planned slots it was given for)
        self._settle_store: Storage | None = None
        self._settle_planned, self._settle_needed = -1, False
        if self.group is not None:
            self.group.leave(self._group_index)
        rule, policy = self.rule, self.policy
        # the one-token eviction: its victims among candidates (large CPU caches, H2O) or left to
        # the group (LayerGroup: one search for every layer)
        self._victims = None if rule is None else OneTokenEviction(
            # (scores that only grow, or never change once given: the candidates' bound holds)
            rule, shared=policy.selection == "shared", grows=policy.score_statistic == "accumulate" or self._once,
            reduce_scores=self.reduce_scores, group=None if self.static_shapes else self.group, index=self._group_index,
        )
        # only the sinks of an "oldest" rule are shifted (a PrefixShift); other layouts shift per slot
        sinks = (
            SinkShift(self._key_shift, rule.sink)
            if self._key_shift is not None and rule is not None and rule.victim == "oldest" and rule.sink > 0
            and not self.static_shapes else None
        )
        # a score from the cache under a refresh interval (Expected Attention, KeyDiff, LagKV):
        # eager decode tokens are written unscored, as the steps between two scorings leave them
        refreshes = policy.score_statistic in KEY_STATISTICS and refresh_interval(policy) > 1
        self._layout = SlotLayout(CandidateSearch() if self._victims is None else self._victims.search, sinks,
                                  static=self.static_shapes, ragged=self._ragged,
                                  fresh_score=UNSCORED if refreshes and not self.static_shapes else 0.0)
        # static shapes: a decode step's bookkeeping in device tensors (kvpolicy_torch.static)
        self._static = StaticSteps(policy, self.reduce_scores) if self.static_shapes else None
        plan = SlotPlan(policy.capacity, self.reserve, slack=rule is not None and rule.victim != "oldest" and not self.static_shapes,
                        chunk=0 if self.static_shapes or self.prompt_chunk is None else self.prompt_chunk,
                        pooled=self.pooled_capacity)
        self._slots = SlotAllocator(policy, plan, group=self.group, index=self._group_index, static=self._static, ragged=self._ragged)
        # a score declared as a sum over the candidates (KeyDiff's anchor): kept between eager decode
        # steps, per head (not for scores summed over heads, keys rotated in place, or a refresh interval)
        parts = policy.statistic_policy.candidate_sum
        sums = CandidateSums(parts) if (
            parts is not None and policy.selection != "shared" and self._key_shift is None and self.reduce_scores is None
            and not self.static_shapes and refresh_interval(policy) == 1 and not policy.observes_queries
        ) else None
        self._eviction = HostEviction(policy, self._victims, self._slots, self.reduce_scores, sums=sums)
        #: a policy scored by a context reconstruction (KVzip): whether its scores came
        #: (:meth:`evict_reconstructed`); until then no eviction asks the policy
        self.reconstructed = False
        #: Expected Attention: the running moments of the queries seen (:meth:`observe_queries`)
        #: (and a refresh interval's bookkeeping for any score from the cache that declares one)
        # (eager under a refresh interval, the decode queries are held until a scoring reads the sums)
        self.running_queries = RunningMoments(
            refresh_sink(policy), buffered=not self.static_shapes and refresh_interval(policy) > 1,
        ) if policy.observes_queries or refreshes else None

    # ------------------------------------------------------------------ copies (pickle, deepcopy, torch.save)
    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self._layout.store is not None and self.group is not None:
            self._layout.store = self.group.relink(self._group_index, self._layout.store)

    # ------------------------------------------------------------------ reads (the rest: LayerReads)
    def synced(self, storage: bool = True) -> SlotLayout:
        """The slot layout, decode steps the device ran handed to the host first (static shapes);
        with ``storage``, after the first append only, and this step's victims freed if the group
        still holds them (:class:`~kvpolicy_torch.reads.LayerReads`)."""
        if storage:
            self._layout.storage()
            if self._victims is not None and self._victims.deferred and self.group is not None:
                self.group.flush()
        if self._static is not None:
            self._static.to_host(self._layout, settled=self.needs_settle)
        return self._layout

    def unsynced(self) -> SlotLayout:
        """The slot layout as it stands, nothing handed over (what the shapes tell: :class:`LayerReads`)."""
        return self._layout

    @property
    def has_holes(self) -> bool:
        """Whether some slot the last decode :meth:`append` returned is a hole in some row, so that
        attention over them needs :attr:`bias`; answered from host integers, where :attr:`bias`
        builds the tensor (an attention choosing its kernel asks this at every step).

        Example:
            >>> from kvpolicy import H2O
            >>> layer = LayerCache(H2O(heavy=2, recent=2))
            >>> K, V = layer.append(torch.randn(1, 1, 8, 2), torch.randn(1, 1, 8, 2))
            >>> layer.accumulate(torch.rand(1, 1, 8)); rounds = layer.evict()
            >>> for t in range(2):  # the first step's victim leaves a hole the second attends over
            ...     K, V = layer.append(torch.randn(1, 1, 1, 2), torch.randn(1, 1, 1, 2))
            ...     print(layer.has_holes, layer.bias is not None)
            ...     layer.accumulate(torch.rand(1, 1, K.shape[2])); rounds = layer.evict()
            False False
            True True
        """
        layout = self._layout
        if layout.store is None or self._static is not None or (self._victims is not None and self._victims.deferred):
            layout = self.synced()
        return layout.bias_needed

    @property
    def on_device(self) -> bool:
        """Whether the newest decode steps ran on the device (``static_shapes``) and the host rows
        have not read them back yet; any read of the layer's state reads them back first."""
        return self._static is not None and self._static.newer

    @property
    def sequence_length(self) -> int | torch.Tensor:
        """Columns appended so far, pads included (transformers' sequence length). Inside
        ``torch.compile`` a static-shaped layer answers with a ``[]`` device tensor (no host read,
        as transformers' ``StaticCache``); elsewhere an int."""
        state = None if self._static is None else self._static.state
        if state is not None and torch.compiler.is_compiling():
            return state.sequence_length()  # (kept current by every reload: valid whoever ran last)
        if state is not None and self._static.newer:  # type: ignore[union-attr]
            return int(state.sequence_length())
        return self._layout.rows.columns

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
        layout = self._layout
        if layout.store is None:
            check_append(self, keys, values)  # (later appends: held to the first one's shapes below)
        if self._victims is not None and self._victims.deferred and self.group is not None:
            self.group.flush()
        store = layout.store
        # a decode step shaped as the last one, into the same storage, passed the checks below
        # already (one tuple comparison a step; the check functions say what differs)
        step_like = (keys.shape, values.shape, keys.dtype, values.dtype, keys.device)
        if store is None or store is not self._step_store or step_like != self._step_like:
            check_step_kv(keys, values)
            if store is not None:
                check_like(store, keys, values)
                if keys.shape[2] == 1:
                    self._step_store, self._step_like = store, step_like
        if layout.extra is not None:
            raise RuntimeError(
                "append() called while the previous step was not evicted: call accumulate() and evict() "
                "after each attention (with transformers, use the 'kvpolicy_sdpa' attention implementation)"
            )
        b, h, q, d = keys.shape
        static = self._static
        if static is not None and static.state is not None and store is not None and q == 1 and valid is None:
            # (StaticSteps.takes, inlined: a decode token, no pads, a state)
            # static shapes: the step's bookkeeping in device tensors (kvpolicy_torch.static), no
            # host read and no branch on data, so a compiled step is one graph
            static.append(store, keys, values)  # type: ignore[arg-type]
            layout.phase, layout.chunk = "decode", None
            return store.keys, store.values  # type: ignore[union-attr]
        if static is not None:
            static.to_host(layout, settled=self.needs_settle)
        chunk_bytes = self.compaction_chunk_bytes
        if store is None:
            self._slots.start(layout, keys, values, min_slack=self.min_slack, chunk_bytes=chunk_bytes)
        if valid is not None:
            valid, real = checked_valid(valid, real, keys)
        if q == 1:
            if self._slots.plan.room or layout.rows_at_end():  # (room_for_token's own tests: a step asks them here)
                self._slots.room_for_token(layout, chunk_bytes=chunk_bytes)
            group = self.group
            if group is not None and group.assembling:  # layers of different sizes: into the group's flat tensors
                joined = group.join(self._group_index, layout.storage())
                if joined is not None:
                    layout.store = joined
                    layout.moved()
            # a score from the cache that is the token's own (Knorm): computed once, here
            score = token_scores(self.policy, keys, values, layout.rows.seen, layout.store.scores.dtype) if self._once else None
            layout.write_one(keys, values, score)
            if layout.sink_shift is not None:
                layout.shift_sinks()
        else:
            layout.unshift()
            self._slots.room_for_chunk(layout, q, chunk_bytes=chunk_bytes)
            layout.write_chunk(keys, values, valid, [q] * b if real is None else real)
            held = layout.storage().nbytes + (0 if layout.extra is None else layout.extra.nbytes)
            self._peak = max(self._peak, held)
        layout.phase = "prefill" if q > 1 else "decode"
        if layout.extra is not None:
            return layout.extra.keys, layout.extra.values
        views = layout.views  # (the layout's kept views of the returned range: every decode step reads them)
        if views is None:
            store = layout.storage()
            return store.keys.narrow(2, 0, layout.returned), store.values.narrow(2, 0, layout.returned)
        return views.keys, views.values

    @property
    def peak_bytes(self) -> int:
        """The most bytes this layer's slots took at once since the last :meth:`reset`: its
        storage (:attr:`nbytes`), plus, while a prompt chunk did not fit in it, the transient set
        that held the kept tokens and the chunk beside it until the eviction. A chunked prefill
        with room for its chunk (``prompt_chunk``) writes every chunk in place, so its peak is the
        storage; a one-shot prompt longer than the storage peaks at the storage plus the prompt.

        Example:
            >>> from kvpolicy import StreamingLLM
            >>> layer = LayerCache(StreamingLLM(sink=1, window=3))
            >>> K, V = layer.append(torch.randn(1, 1, 10, 2), torch.randn(1, 1, 10, 2))
            >>> rounds = layer.evict()
            >>> layer.slots, layer.nbytes, layer.peak_bytes  # and 10 more slots while the prompt was evicted
            (5, 160, 480)
        """
        return max(self._peak, self.nbytes)

    # ------------------------------------------------------------------ attend and accumulate
    def accumulate(self, received: torch.Tensor) -> None:
        """Fold ``received`` ``[batch, kv_heads, n]`` (the attention each returned slot just received,
        summed over query heads and real queries) into the scores by the policy's
        ``score_statistic``, as :func:`~kvpolicy_torch.scores.fold_received` says (H2O adds it, TOVA
        replaces the scores, Scissorhands shifts a record of low attention in; a NaN counts as
        ``-inf``; holes and pads keep ``+inf``). A statistic from keys (Knorm, KeyDiff:
        :data:`kvpolicy.KEY_STATISTICS`) checks and ignores it: :meth:`evict` scores the keys held."""
        layout = self.synced()
        scores = layout.returned_scores()
        check_received(received, scores.shape)
        add_received(layout, self.policy, scores, received)

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
        self.accumulate(query_record(self.synced(), self.policy, received, group))

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
        when the policy uses them, in one pass over the keys (:func:`~kvpolicy_torch.attention.attend_slots`). Then
        call :meth:`evict`.

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
        store = self._layout.store
        # a query shaped as the last one, over the same storage, passed check_query already
        if store is None or store is not self._query_store or (query.shape, query.dtype) != self._query_like:
            check_query(query, None if store is None else store.keys)
            self._query_store, self._query_like = store, (query.shape, query.dtype)
        if self._static is not None and self._static.newer and store is not None:
            # a static-shaped decode step: everything on the device
            if extra_bias is not None or row_scale is not None or prefix is not None:
                raise ValueError("with static_shapes, pass the window, log n and pos-shift as options=StepOptions(...)")
            return self._static.attend(store, query, scaling, options or StepOptions())
        # (synced() inlined where it has nothing to do: eager, no victims left to the group)
        layout = self._layout
        if store is None or self._static is not None or (self._victims is not None and self._victims.deferred):
            layout = self.synced()
        if layout.phase != "decode" or layout.extra is not None:
            raise ValueError("attend() serves a decode step (one token appended per row); a prompt chunk takes chunk_mask() and accumulate()")
        return attend_slots(layout, self.policy, query, scaling, extra_bias=extra_bias, row_scale=row_scale, prefix=prefix)

    # ------------------------------------------------------------------ evict
    def evict(self) -> list[tuple[int, int]]:
        """Let the policy evict until it is satisfied; return ``(size_before, size_after)`` per round
        (per group of rows that evicted together).

        With ``static_shapes``, after a decode step a one-token eviction is a masked write on the
        device (no rounds are reported: whether a row evicted is not read back); a general
        eviction (BUZZ, Scissorhands) runs here in eager code, and is left to :meth:`settle`
        inside ``torch.compile``."""
        store, static = self._layout.store, self._static
        if static is not None and static.newer and store is not None:
            ran = static.evict(store, self.running_queries)
            if torch.compiler.is_compiling() or (ran and not self.needs_settle):
                return []  # (compiled: announced by needs_settle, the caller runs settle() between steps)
            return self.settle()
        if self._reconstructs and not self.reconstructed:
            if self._layout.phase == "decode":
                raise ValueError(
                    f"{self.policy!r} scores the prompt by a context reconstruction, which has not run: run it after the "
                    "prompt, before any decode step (kvpolicy_integrations.reconstruction.reconstruct(model, cache, prompt_ids, "
                    "repeat_prompts(tokenizer)); "
                    "kvpolicy_integrations.hf.generate does), or give LayerCache.evict_reconstructed its scores"
                )
            return self._evicted([])  # the prompt is kept whole until its reconstruction scores it
        layout = self._layout
        if store is None or static is not None or (self._victims is not None and self._victims.deferred):
            layout = self.synced()  # (else it has nothing to do: inlined, as in attend)
        alone = self._eviction.one_token_alone
        rounds = None
        if alone is not None and layout.phase == "decode" and layout.extra is None and layout.store is not None:
            # a decode step its one-token eviction decides alone: straight to it
            rounds = alone.evict_due(layout.store, layout.rows, self.candidates, self.candidate_min_scores)
        if rounds is None:
            rounds = self._eviction.evict(layout, self.running_queries, candidates=self.candidates,
                                          min_scores=self.candidate_min_scores, chunk_bytes=self.compaction_chunk_bytes)
        if static is not None:
            return self._evicted(rounds)
        layout.chunk = None  # (_evicted, without a device to hand the layer to)
        self.evictions += len(rounds)
        return rounds

    def evict_reconstructed(self, scores: torch.Tensor) -> list[tuple[int, int]]:
        """For a policy scored by a context reconstruction (KVzip,
        :attr:`~kvpolicy.EvictionPolicy.needs_reconstruction`): take ``scores`` ``[batch, kv_heads,
        n]`` as the held prompt tokens' scores (in position order; what
        :func:`kvpolicy.statistics.reconstruction_scores` gives them) and let the policy evict, as
        after a prompt (``phase="prefill"``); once per sequence, before any decode step. Every
        row must hold its whole prompt of ``n`` tokens (no pads, nothing evicted).

        Example:
            >>> from kvpolicy import KVzip
            >>> layer = LayerCache(KVzip(size=3, sink=1))
            >>> K, V = layer.append(torch.randn(1, 1, 6, 4), torch.randn(1, 1, 6, 4))
            >>> layer.evict()  # the prompt is kept until its reconstruction scores it
            []
            >>> layer.evict_reconstructed(torch.tensor([[[0.0, 0.9, 0.1, 0.8, 0.2, 0.3]]])), layer.positions.tolist()
            ([(6, 3)], [[[0, 1, 3]]])
        """
        policy = self.policy
        if not policy.needs_reconstruction:
            raise ValueError(f"evict_reconstructed serves a policy scored by a context reconstruction (KVzip); {policy!r} is not")
        if self.reconstructed:
            raise ValueError(f"{policy!r}: the prompt was already scored by its reconstruction (once per sequence; reset() first)")
        if self._static is not None and self._static.newer:
            raise ValueError("evict_reconstructed comes right after the prompt, before any decode step")
        layout = self.synced()
        rows = layout.rows
        n = rows.count[0]
        if not layout.dense() or any(c != n for c in rows.count) or any(s != n for s in rows.seen):
            raise NotImplementedError(
                f"{policy!r}: a context reconstruction needs every row to hold its whole prompt, all of one length "
                f"(no pads, nothing evicted); rows hold {rows.count} of {rows.seen} tokens seen"
            )
        working = layout.working()
        expected = (rows.batch, int(working.scores.shape[1]), n)
        if tuple(scores.shape) != expected:
            raise ValueError(f"scores must have shape [batch, kv_heads, n] = {list(expected)}, got {list(scores.shape)}")
        held = working.scores[..., :n]
        held.copy_(torch.nan_to_num(scores.to(device=held.device, dtype=held.dtype), nan=-math.inf))
        layout.phase = "prefill"
        self.reconstructed = True
        return self.evict()

    def _evicted(self, rounds: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """After an eviction on the host: count it, and (static shapes) hand the layer to the device."""
        self._layout.chunk = None
        self.evictions += len(rounds)
        self._reload()
        return rounds

    @property
    def needs_settle(self) -> bool:
        """Whether a compiled (static-shaped) decode step may leave work to :meth:`settle`: a
        bounded policy without a one-token decode eviction (BUZZ, Scissorhands) evicts on the
        host, between steps; and a storage that may still grow (an unbounded policy, one
        sized for ``reserve`` tokens that may be given more, or head-wise budgets' storage sized
        by the widest head held) grows there, before a step would find no free slot. Then call
        :meth:`settle` after every compiled step."""
        static = self._static
        if static is None:
            return False
        store, planned = self._layout.store, self._slots.plan.planned
        if store is not self._settle_store or planned != self._settle_planned:
            # (fixed while the storage and the plan are: answered from here at every decode step)
            self._settle_store, self._settle_planned = store, planned
            self._settle_needed = static.needs_settle or self._grows_between_steps()
        return self._settle_needed

    def _grows_between_steps(self) -> bool:
        store = self._layout.store
        return self._slots.plan.grows_between_steps(None if store is None else store.slots,
                                                    None if self.rule is None else self.rule.limit)

    def settle(self) -> list[tuple[int, int]]:
        """Between compiled decode steps (static shapes): run the general eviction the last
        steps left to the host, if the policy's rule says one is due, and grow a storage whose
        next step would find a row without a free slot (one read of the device's counts, only
        then); nothing for a policy whose decode eviction ran on the device in a storage that
        cannot grow.

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
        static, layout = self._static, self._layout
        if static is None or not static.newer or layout.store is None:
            return []
        general, grows = static.needs_settle, self._grows_between_steps()
        if not general and not grows:
            return []
        # A decode step appends one real token per row and evicts nothing on the device (no rule,
        # or rows below the rule's limit + 1), so the host rows follow without reading the device
        # (settle() comes after every compiled step; DecodeState.to_host checks it); the device is
        # read only when the size rule says "evict" or the next token would find no free slot.
        static.follow(layout)
        eviction = self._eviction
        due = general and not eviction.declines(layout)
        if not due and not (grows and max(layout.rows.count) >= layout.store.slots):
            return []
        self.synced(storage=False)  # (then _evicted's reload grows the storage where it is full)
        if not (due and not eviction.declines(layout)):
            return self._evicted([])
        if self.policy.score_statistic in KEY_STATISTICS:
            # a score from the cache is recomputed before the policy decides, as an eager step does
            # (ChunkKV over Knorm: no one-token rule, so its eviction is this one)
            eviction.score_keys(layout, self.running_queries)
        return self._evicted(eviction.general(layout, chunk_bytes=self.compaction_chunk_bytes))

    def _reload(self) -> None:
        """Static shapes, after host code changed the layer: compact it and hand the counts to the
        device, so the next decode step runs there."""
        layout = self._layout
        state = None if self._static is None else self._static.state
        if state is None or layout.extra is not None or layout.store is None:
            return
        self._slots.ready_for_device(layout, chunk_bytes=self.compaction_chunk_bytes)
        self._static.load(layout)  # type: ignore[union-attr]

    # ------------------------------------------------------------------ Expected Attention
    def observe_queries(self, queries: torch.Tensor, positions: torch.Tensor | list[int] | None = None,
                        rotary: Rotary | None = None, *, inverse: torch.Tensor | None = None) -> None:
        """Expected Attention: add the step's queries ``[batch, q_heads, q, head_dim]``, before
        RoPE, to the running moments the scores come from (:mod:`kvpolicy_torch.queries`); a no-op
        for any other policy. ``positions`` ``[batch, q]``: theirs (default
        :meth:`host_positions` where the host knows them, else :meth:`query_positions`; ``-1`` at
        pads); ``rotary``: the RoPE they were rotated back from, whose rotations the scores average
        over the next positions (``None``: none); ``inverse``: a decode step's queries still
        rotated, and their ``[batch, head_dim, head_dim]`` rotation back
        (:meth:`~kvpolicy_torch.queries.RunningMoments.observe`). Call it after :meth:`append`
        and before :meth:`evict`.

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
        if self.running_queries is None or not self.policy.observes_queries:
            return
        store = self._layout.store
        if store is None:
            raise ValueError("observe_queries() follows append(): nothing was appended to this LayerCache yet")
        if positions is None:
            q = queries.shape[2]
            host = self.host_positions(q)
            positions = host if host is not None else self.query_positions(q)
        self.running_queries.observe(queries, positions, int(store.keys.shape[1]), rotary, inverse=inverse)

    def host_positions(self, q: int) -> list[int] | None:
        """The original position of the token the last :meth:`append` added to each row, as host
        integers, at a decode step (``q == 1``) whose positions the host knows (eager; a
        static-shaped step keeps them on the device: ``None``, as for a prompt chunk).

        Example:
            >>> from kvpolicy import H2O
            >>> layer = LayerCache(H2O(heavy=2, recent=2))
            >>> K, V = layer.append(torch.randn(2, 1, 5, 4), torch.randn(2, 1, 5, 4))
            >>> rounds = layer.evict()
            >>> K, V = layer.append(torch.randn(2, 1, 1, 4), torch.randn(2, 1, 1, 4))
            >>> layer.host_positions(1), layer.host_positions(2)
            ([5, 5], None)
        """
        if q != 1 or self._layout.chunk is not None or (self._static is not None and self._static.newer and self._static.state is not None):
            return None
        return [s - 1 for s in self._layout.rows.seen]

    def query_positions(self, q: int) -> torch.Tensor:
        """Int64 ``[batch, q]``: the original positions of the ``q`` tokens the last :meth:`append`
        added (``-1`` at pads); on the device for a static-shaped decode step (no host read)."""
        if self._static is not None and self._static.newer and self._static.state is not None:
            return self._static.state.seen.view(-1, 1) - 1
        layout = self._layout
        host = self.host_positions(q)
        if host is not None:
            return torch.tensor(host, device=layout.storage().keys.device).view(-1, 1)
        return layout.returned_positions()[:, 0, -q:]

    # ------------------------------------------------------------------ snapshots, batch ops
    def snapshot(self) -> LayerSnapshot:
        """A copy of the bookkeeping (see :class:`LayerSnapshot`), between steps."""
        layout = self.synced()
        if layout.extra is not None:
            raise RuntimeError("snapshot() between append() and evict()")
        layout.drop_tail()  # (the copy holds holes past the frontier, not the positions written ahead)
        return LayerSnapshot.of(layout.rows, layout.storage())

    def restore(self, snap: LayerSnapshot) -> None:
        """Put the bookkeeping of ``snap`` back (keys and values stay as they are). Slots at or
        beyond a row's ``front`` become holes."""
        self.synced().restore(snap)
        self._eviction.forget_sums()
        self._reload()

    @property
    def candidate_sums(self) -> CandidateSums | None:
        """The sum over the candidates a score declared as one keeps between eager decode steps
        (:class:`~kvpolicy.CandidateSum`: KeyDiff's anchor at every step, ``refresh=1``; ``None``
        for other scores, a refresh interval, static shapes, scores summed over heads): a
        diagnostic (its ``full_sums`` counts the sums taken afresh).

        Example:
            >>> from kvpolicy import H2O, KeyDiff
            >>> LayerCache(KeyDiff(size=4, refresh=1)).candidate_sums is not None, LayerCache(KeyDiff(size=4)).candidate_sums
            (True, None)
        """
        return self._eviction.sums

    def select_batch(self, index: torch.Tensor) -> None:
        """Keep (or repeat) batch rows by ``index``, e.g. for beam search."""
        layout = self._layout
        if layout.store is None:
            return
        check_batch_index(index, self.batch)
        if layout.extra is not None:
            raise RuntimeError("select_batch() between append() and evict()")
        self.synced()
        if self.group is not None:
            self.group.leave(self._group_index)  # rows change: tensors of its own
        layout.take_rows(index)
        self._eviction.forget_sums()  # (rows alike in positions may now hold other keys)
        if self.running_queries is not None:
            self.running_queries.select(index)
        if self._static is not None:
            store = layout.storage()
            self._static.fit(store.keys.shape[0], store.keys.shape[1], store.keys.device, fresh=True)
            self._reload()

    def reset(self) -> None:
        """Forget everything (storage is freed)."""
        self._clear()
