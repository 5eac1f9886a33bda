"""A decode step as one graph: the bookkeeping of a static-shaped layer in device tensors.

The decode-step protocol of every evicting layer is *update -> attend -> accumulate -> evict*:
the new token's key and value are written into the storage, the query attends over the slots,
what each slot received is added to its score, and the policy frees what it must. In the eager
layout (:class:`~kvpolicy_torch.LayerCache` without ``static_shapes``) each of those steps is
driven by host integers (per-row counts, the frontier, a ring pointer), which is the fastest
way on a CPU but cannot be captured: ``torch.compile(fullgraph=True)`` and CUDA graphs need one
graph with fixed shapes and no host reads.

:class:`DecodeState` holds the same bookkeeping as device tensors, and its methods are the
step's four parts written without a Python branch on data:

* ``seen`` ``[batch]``: real tokens appended per row; the newest token's original position is
  ``seen - 1``;
* ``count`` ``[batch]``: kept tokens per row (every head holds as many; under head-wise budgets,
  :class:`~kvpolicy.AdaKV`, the mean over the heads, which every step raises by one);
* ``free`` ``[batch, kv_heads]``: the slot the next token is written to. After a host-side
  compaction the kept tokens stand at ``[0, count)`` and ``free = count``; a one-token eviction
  turns its victim into a hole and the next token is written *there*, so a full layer never needs
  compacting while it decodes (slot order stops being position order; nothing reads it: attention
  is order-free, and victims are chosen by position, never by slot). Under head-wise budgets a
  head may lose two tokens at a step and another none, so the next token goes to each head's first
  hole (one reduction at the append);
* ``overflow`` ``[]`` bool: set when a row was asked to write past its last slot (a policy without
  a one-token eviction, whose host-side eviction was not run in time); checked on the host.

The one-token eviction (:class:`~kvpolicy.DecodeEviction`, ``"lowest"`` or ``"oldest"``) is a
masked write that always runs: the victim is searched in every row and freed only where the row
holds ``limit + 1`` tokens, so a step does the same work whether or not the cache is full. So is
head-wise budgets' decode eviction (:class:`~kvpolicy.HeadwiseEviction`: the layer's ``H``
lowest outside the floors, :func:`~kvpolicy_torch.headwise.step_victims`), where the heads hold
``limit + 1`` tokens on average; its storage is sized by the widest head held plus a growth step,
and grows between steps (``LayerCache.settle``) when the host's bound on the widest head (one
more a step, no read) reaches its end, up to the widest a head may hold
(:meth:`~kvpolicy.AdaKV.head_capacity`): each growth is a new shape, so a new graph.
Everything else (prompt chunks, a policy's general ``select``, compaction) changes shapes or asks
the policy on the host; it runs between compiled steps (see ``LayerCache.settle``).
"""

from __future__ import annotations

import math

import torch

from kvpolicy.policy import KEY_STATISTICS, DecodeEviction, EvictionPolicy, HeadwiseEviction
from kvpolicy.statistics import low_attention, scored_once

from .attention import window_limit
from .compaction import sort_by_position
from .headwise import step_victims
from .layout import SlotLayout
from .posshift import rope_rotate
from .queries import RunningMoments, held_scores, token_scores
from .rows import Rows
from .scores import fold_received
from .storage import Storage, fixed_addresses

__all__ = ["DecodeState", "StaticSteps", "StepOptions", "device_total"]

#: Larger than any position: where(mask, positions, _FAR).argmin() is "the smallest position where mask".
_FAR = torch.iinfo(torch.int64).max


class StepOptions:
    """What a layer's decode attention adds to plain attention, fixed for a run (so a compiled step
    traces it as constants): a sliding or chunked ``window`` on original positions, BUZZ's log n,
    StreamingLLM's pos-shift of the first ``shift_prefix`` slots (the sinks).

    Args:
        window: ``("sliding" | "chunked", size)`` or ``None``.
        log_n: a :class:`~kvpolicy.LogNScaling` or ``None``.
        shift_prefix: slots ``[0, k)`` whose keys sit ``seen - count`` positions later under
            pos-shift (0: none).
        rope: ``(inv_freq, style, rotary_dim)`` to rotate the query back for those slots.
    """

    __slots__ = ("window", "log_n", "shift_prefix", "rope")

    def __init__(self, window=None, log_n=None, shift_prefix: int = 0, rope=None) -> None:  # type: ignore[no-untyped-def]
        self.window = window
        self.log_n = log_n
        self.shift_prefix = shift_prefix if rope is not None else 0
        self.rope = rope


class DecodeState:
    """Device bookkeeping of one static-shaped layer (see the module docstring).

    Args:
        batch, kv_heads: the storage's rows and heads.
        device: where the storage lives.

    Example:
        >>> import torch
        >>> state = DecodeState(1, 2, torch.device("cpu"))
        >>> state.load([3], [3], columns=3)
        >>> state.free.tolist(), state.seen.tolist()
        ([[3, 3]], [3])
    """

    def __init__(self, batch: int, kv_heads: int, device: torch.device) -> None:
        # allocated once and only ever written in place: a compiled step reads them as inputs at
        # fixed addresses (CUDA graphs replay on the same memory)
        self.seen = torch.zeros(batch, dtype=torch.int64, device=device)
        self.count = torch.zeros(batch, dtype=torch.int64, device=device)
        self.free = torch.zeros(batch, kv_heads, dtype=torch.int64, device=device)
        self.overflow = torch.zeros((), dtype=torch.bool, device=device)
        #: ``[]``: columns appended (pads included) minus row 0's ``seen``, fixed between loads (a
        #: decode step adds one to both): see :meth:`sequence_length`
        self.column_offset = torch.zeros((), dtype=torch.int64, device=device)
        #: ``[batch, kv_heads]``: each cell's row and head, never written: with a slot per row and
        #: head they index one slot of each (``t[row_of, head_of, slot]``); a step writes there by
        #: ``index_put_``, which inductor writes in place, where a ``scatter_`` into a step's input
        #: became a copy of the whole storage, the write and a copy back (the keys' and values'
        #: bytes four times a layer and step)
        self.row_of = torch.arange(batch, device=device).view(batch, 1).expand(batch, kv_heads).contiguous()
        self.head_of = torch.arange(kv_heads, device=device).view(1, kv_heads).expand(batch, kv_heads).contiguous()
        self._mark_static()

    def _mark_static(self) -> None:
        fixed_addresses(self.seen, self.count, self.free, self.overflow, self.column_offset, self.row_of, self.head_of)

    def __setstate__(self, state: dict[str, torch.Tensor]) -> None:
        # a copy (deepcopy, pickle) holds new tensors: a compiled step must find them static too
        self.__dict__.update(state)
        self._mark_static()

    def load(self, seen: list[int], count: list[int], columns: int = 0) -> None:
        """From the host, after a compaction (kept tokens at ``[0, count)`` in every row)."""
        dev = self.seen.device
        self.seen.copy_(torch.tensor(seen, device=dev))
        self.count.copy_(torch.tensor(count, device=dev))
        self.free.copy_(self.count[:, None].expand_as(self.free))
        self.overflow.fill_(False)
        self.column_offset.fill_(columns - seen[0])

    def to_host(self, layout: SlotLayout, *, scattered: bool, settled: bool, what: str,
                headwise: HeadwiseEviction | None = None) -> None:
        """Hand the decode steps the device ran to the host (one read): ``layout``'s rows take the
        device's counts and each row's kept tokens are put back at ``[0, count)`` in position order
        (``scattered``: one-token evictions wrote into their victims' slots), holes masked, so host
        code sees the layout it expects; the device state is reloaded from them. ``settled``: the
        host must have settled after every step (a general eviction may be due at each); ``what``
        names the policy in errors. ``headwise``: head-wise budgets' rule, whose heads hold
        different numbers: each head's tokens then end at its row's widest head's count, a
        narrower head's holes first (the eager head-wise layout), and the policy's state says
        the mean the device counted (:meth:`~kvpolicy.HeadwiseEviction.mean_tokens`)."""
        store = layout.storage()
        seen, count, columns, overflow = self.read()
        if overflow:
            raise RuntimeError(
                f"{what} ran out of its {store.slots} slots in a compiled decode step: a general eviction was "
                f"due, or the storage had to grow, and settle() did not run. Call settle() (EvictingCache.settle) "
                f"after every compiled decode step when needs_settle is True (kvpolicy.hf.generate does), or "
                f"give the layer room for the whole run (reserve=, EvictingCache's max_tokens=)"
            )
        if settled and seen[0] - layout.rows.seen[0] > 1:
            raise RuntimeError(
                f"{what}: {seen[0] - layout.rows.seen[0]} compiled decode steps ran since the host last settled: "
                f"call settle() (EvictingCache.settle) after every compiled decode step while needs_settle is True "
                f"(kvpolicy.hf.greedy_decode does)"
            )
        states = layout.rows.states
        kept = count  # (every head holds as many)
        if headwise is not None:
            held = (store.positions >= 0).sum(-1)  # [batch, kv_heads]
            sort_by_position(store, lead=held.amax(-1, keepdim=True) - held)
            per_head = held.tolist()
            kept = [max(row) for row in per_head]
            # after a device eviction the state says the mean the device counts (it equals the
            # widest head's count only while every head holds as many)
            states = [s if s["kept"] == 0 and mean == widest else {**s, **headwise.state_after(n - (mean - headwise.limit))}
                      for s, n, mean, widest in zip(states, seen, count, kept)]
        elif scattered:
            sort_by_position(store)
        store.bias.copy_(torch.where(store.positions >= 0, 0.0, -math.inf).to(store.bias.dtype))
        layout.rows = Rows(seen, kept, list(kept), states, [None] * len(count), [[] for _ in count], columns)
        layout.returned = store.slots
        layout.bias_needed = True
        layout.moved()
        if headwise is not None:
            layout.head_counts = per_head
        self.load(seen, count, columns)

    def sequence_length(self) -> torch.Tensor:
        """``[]``: columns appended so far, pads included (transformers' sequence length)."""
        return self.column_offset + self.seen[0]

    def read(self) -> tuple[list[int], list[int], int, bool]:
        """``(seen, count, columns, overflow)`` on the host: one transfer."""
        flat = torch.cat([self.seen, self.count, self.column_offset.view(1), self.overflow.view(1).to(torch.int64)]).tolist()
        b = self.seen.shape[0]
        return flat[:b], flat[b : 2 * b], flat[-2] + flat[0], bool(flat[-1])

    # ------------------------------------------------------------------ update
    def append(self, storage: Storage, keys: torch.Tensor, values: torch.Tensor,
               may_overflow: bool = True, score: torch.Tensor | None = None, first_hole: bool = False) -> None:
        """Write one token per row ``[batch, kv_heads, 1, head_dim]`` at each row's free slot:
        key, value, position ``seen``; score 0 (a first statistic for every rule), or ``score``
        ``[batch, kv_heads, 1]`` (a score the policy gives each token once, when it is cached).
        ``may_overflow=False``: the layer knows no row can run out of slots (a one-token eviction
        frees one at every step from ``limit + 1`` tokens on, and the storage holds more), so the
        check is left out of the step. ``first_hole``: each head's free slot is its first hole
        (head-wise budgets, whose heads lose different numbers at a step); a head without one
        raises the overflow flag."""
        k, v, pos, scores = storage.keys, storage.values, storage.positions, storage.scores
        slots = k.shape[2]  # (storage.slots, without the property's call)
        if first_hole:
            hole = pos < 0
            self.free.copy_(hole.to(torch.int8).argmax(dim=-1))
            self.overflow |= ~hole.any(dim=-1).all()
        elif may_overflow:
            self.overflow |= (self.free >= slots).any()
        at = self.row_of, self.head_of, self.free.clamp(max=slots - 1)  # (index writes: see row_of)
        k.index_put_(at, keys.squeeze(2))
        v.index_put_(at, values.squeeze(2))
        pos.index_put_(at, self.seen[:, None].expand_as(self.free))
        scores.index_put_(at, scores.new_zeros(()) if score is None else score.squeeze(2).to(scores.dtype))
        self.seen += 1
        self.count += 1
        self.free += 1  # the next free slot, unless an eviction frees one (evict sets it)

    # ------------------------------------------------------------------ attend
    def attend(
        self,
        storage: Storage,
        query: torch.Tensor,
        scaling: float,
        options: StepOptions,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of one query per head over every slot, holes and tokens outside a window
        masked: ``(out [batch, 1, q_heads, head_dim], received [batch, kv_heads, slots])``,
        ``received`` the probabilities summed over each KV head's query heads (float32, float64
        for float64 keys)."""
        k, v, pos = storage.keys, storage.values, storage.positions
        b, hq, _, d = query.shape
        h, n = k.shape[1], k.shape[2]
        r = hq // h
        work = torch.float64 if k.dtype == torch.float64 else torch.float32
        visible = pos >= 0
        if options.window is not None:
            kind, w = options.window
            visible = visible & (pos > window_limit((self.seen - 1)[:, None, None], kind, w))
        q3 = query.reshape(b * h, r, d)
        logits = torch.bmm(q3, k.view(b * h, n, d).transpose(1, 2)).to(work).view(b, h, r, n)
        if options.shift_prefix:
            # StreamingLLM's pos-shift: the sinks' keys count as `seen - count` positions later,
            # the same as rotating the query back by as much for those slots
            inv_freq, style, rotary_dim = options.rope
            s = options.shift_prefix
            back = rope_rotate(query, -(self.seen - self.count).view(b, 1, 1), inv_freq, style=style,
                               rotary_dim=rotary_dim)
            head = torch.bmm(back.reshape(b * h, r, d), k[:, :, :s].reshape(b * h, s, d).transpose(1, 2))
            logits = torch.cat([head.to(work).view(b, h, r, s), logits[..., s:]], dim=-1)
        logits = logits * scaling
        if options.log_n is not None:  # n: the keys this query attends to (paper, section 3.5)
            logits = logits * options.log_n.scales(self.count).to(work).view(b, 1, 1, 1)
        logits = logits.masked_fill(~visible[:, :, None, :], -math.inf)
        probs = torch.softmax(logits, dim=-1)
        out = torch.bmm(probs.view(b * h, r, n).to(v.dtype), v.view(b * h, n, -1))
        return out.view(b, 1, hq, -1), probs.sum(dim=2)

    # ------------------------------------------------------------------ evict
    def evict(self, storage: Storage, rule: DecodeEviction, shared: bool,
              reduce_scores=None) -> None:  # type: ignore[no-untyped-def]
        """The one-token eviction as a masked write: in each row holding ``limit + 1`` tokens the
        victim (per head, or one for all heads when ``shared``) becomes a hole and the next token
        is written to its slot; other rows are left as they are."""
        pos, scores = storage.positions, storage.scores
        if rule.victim == "oldest":
            candidate = pos >= rule.sink  # holes (-1) are never candidates
            victim = torch.where(candidate, pos, _FAR).argmin(dim=-1)  # [b, h]: the oldest after the sinks
        else:
            candidate = (pos >= 0) & (pos < (self.seen - rule.recent)[:, None, None])
            ranked = torch.where(candidate, scores, math.inf)
            if shared:
                ranked = ranked.sum(dim=1, keepdim=True)  # every head holds the same positions at the same slots
                if reduce_scores is not None:  # e.g. summed over tensor-parallel ranks
                    ranked = reduce_scores(ranked)
                candidate = candidate[:, :1]
            low = ranked.amin(dim=-1, keepdim=True)
            # the lowest score, and of those tied with it the earliest position
            tied = candidate & (ranked == low)
            victim = torch.where(tied, pos[:, : tied.shape[1]], _FAR).argmin(dim=-1).expand_as(self.free)
        over = (self.count > rule.limit)[:, None]  # [b, 1]
        at = self.row_of, self.head_of, victim  # (index writes: see row_of)
        pos.index_put_(at, torch.where(over, -1, pos[at]))
        scores.index_put_(at, torch.where(over, math.inf, scores[at]))
        self.count -= over[:, 0].to(torch.int64)
        self.free.copy_(torch.where(over, victim, self.free))

    def evict_headwise(self, storage: Storage, rule: HeadwiseEviction) -> None:
        """Head-wise budgets' decode eviction as a masked write: in each row whose heads hold
        ``limit + 1`` tokens on average (``count``), the layer's ``H`` lowest outside the floors
        and the recent window (:func:`~kvpolicy_torch.headwise.step_victims`) become holes;
        other rows are left as they are. The next append finds each head's first hole."""
        pos, scores = storage.positions, storage.scores
        over = (self.count > rule.limit)[:, None]  # [b, 1]
        head, slot = step_victims(pos, scores, self.seen.view(-1, 1, 1), rule, over[:, 0])  # [b, H] each
        at = self.row_of, head, slot
        pos.index_put_(at, torch.where(over, -1, pos[at]))
        scores.index_put_(at, torch.where(over, math.inf, scores[at]))
        self.count -= over[:, 0].to(torch.int64)


class StaticSteps:
    """The decode steps of one static-shaped layer: its :class:`DecodeState` (``None`` before the
    storage is allocated) and whether the device holds steps the host rows have not read yet.

    :class:`~kvpolicy_torch.LayerCache` hands it every decode step (one real token per row) while it
    holds a state: :meth:`append`, :meth:`attend` (with the scores' update) and :meth:`evict` run on
    the device, with no host read. Everything else runs on the host layout, after :meth:`to_host`
    handed the device's steps over; :meth:`DecodeState.load` hands the layout back.

    Args:
        policy: the layer's policy (its decode eviction, statistic and selection).
        reduce_scores: applied to head-summed scores of a shared selection (tensor parallelism).

    Example:
        >>> from kvpolicy import StreamingLLM
        >>> from kvpolicy_torch import LayerCache
        >>> layer = LayerCache(StreamingLLM(sink=1, window=2), static_shapes=True)
        >>> K, V = layer.append(torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4))
        >>> layer.accumulate(torch.rand(1, 1, 3)); rounds = layer.evict()
        >>> K, V = layer.append(torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4))  # on the device
        >>> out = layer.attend(torch.randn(1, 1, 1, 4), 0.5); rounds = layer.evict()
        >>> layer.on_device, layer.positions.tolist(), layer.on_device  # a read hands the steps over
        (True, [[[0, 2, 3]]], False)
    """

    def __init__(self, policy: EvictionPolicy, reduce_scores=None) -> None:  # type: ignore[no-untyped-def]
        self.policy = policy
        self.rule = policy.decode_eviction
        #: head-wise budgets' decode eviction (AdaKV over H2O, TOVA, Knorm, KeyDiff, Expected
        #: Attention): the layer's H lowest freed on the device, as a one-token rule's victim
        self.headwise = policy.headwise_eviction
        self.once = scored_once(policy)  # decode tokens scored when cached (Knorm), never rescored
        self.captures = policy.captures_attention  # (read at every step)
        self.reduce_scores = reduce_scores
        self.state: DecodeState | None = None
        #: the device ran decode steps the host layout has not seen yet
        self.newer = False

    @property
    def needs_settle(self) -> bool:
        """A bounded policy without a one-token or head-wise decode eviction (BUZZ, Scissorhands)
        evicts on the host, between compiled steps."""
        return self.rule is None and self.headwise is None and self.policy.capacity is not None

    def fit(self, batch: int, kv_heads: int, device: torch.device, *, fresh: bool = False) -> None:
        """A state for ``batch`` rows of ``kv_heads`` heads: the one held while its shape fits (a
        compiled step keeps reading the same tensors), else (or ``fresh``) a new one."""
        if fresh or self.state is None or self.state.free.shape != (batch, kv_heads):
            self.state = DecodeState(batch, kv_heads, device)

    def takes(self, store: Storage | None, q: int, valid: torch.Tensor | None) -> bool:
        """Whether an append of ``q`` tokens runs on the device: a decode token, no pads, a state."""
        return self.state is not None and store is not None and q == 1 and valid is None

    def append(self, store: Storage, keys: torch.Tensor, values: torch.Tensor) -> None:
        """A decode token written at each row's free slot (:meth:`DecodeState.append`)."""
        state = self.state
        assert state is not None  # (takes() said so)
        # a score from the cache that is the token's own (Knorm): computed once, here
        score = token_scores(self.policy, keys, values, state.seen.view(-1, 1, 1), store.scores.dtype) if self.once else None
        # a one-token eviction keeps every row at or below limit + 1 tokens: no overflow while the
        # storage holds more than the limit
        state.append(store, keys, values, may_overflow=self.rule is None or store.keys.shape[2] <= self.rule.limit, score=score,
                     first_hole=self.headwise is not None)
        self.newer = True

    def load(self, layout: SlotLayout) -> None:
        """Hand ``layout``'s rows to the device (:meth:`DecodeState.load`), after host code changed
        them: under head-wise budgets the count the device keeps is the heads' mean
        (:meth:`~kvpolicy.HeadwiseEviction.mean_tokens`), not the widest head's."""
        rows, rule = layout.rows, self.headwise
        count = rows.count if rule is None else [rule.mean_tokens(*r) for r in zip(rows.count, rows.seen, rows.states)]
        self.state.load(rows.seen, count, rows.columns)  # type: ignore[union-attr]

    def attend(self, store: Storage, query: torch.Tensor, scaling: float, options: StepOptions) -> torch.Tensor:
        """The step's attention over every slot, what each slot received folded into the scores
        when the policy uses them (:func:`~kvpolicy_torch.scores.fold_received`, the eager layer's
        rule; a ``"low_history"`` query's as its record of low attention); returns ``[batch, 1,
        q_heads, head_dim]``."""
        policy = self.policy
        out, received = self.state.attend(store, query, scaling, options)  # type: ignore[union-attr]
        if self.captures:
            statistic, history, pos = policy.score_statistic, None, store.positions
            if statistic == "low_history":
                history = policy.score_history  # type: ignore[attr-defined]
                received = low_attention(received, query.shape[1] // store.keys.shape[1], kept=pos >= 0).to(torch.float64)
            fold_received(store.scores, pos, received, statistic, history=history)
        return out

    def evict(self, store: Storage, running: RunningMoments | None) -> bool:
        """The one-token or head-wise eviction as a masked write (scores from the cache recomputed
        first for a key statistic); ``False`` when the policy has none (its eviction is the host's:
        settle)."""
        if self.rule is None and self.headwise is None:
            return False
        policy = self.policy
        if policy.score_statistic in KEY_STATISTICS and not self.once:  # scores from the cache (KeyDiff, Expected Attention)
            store.scores.copy_(held_scores(policy, running, store, self.state.seen.view(-1, 1, 1), "decode"))  # type: ignore[union-attr]
        if self.headwise is not None:
            self.state.evict_headwise(store, self.headwise)  # type: ignore[union-attr]
        else:
            self.state.evict(store, self.rule, policy.selection == "shared", self.reduce_scores)  # type: ignore[union-attr,arg-type]
        return True

    def to_host(self, layout: SlotLayout, *, settled: bool) -> None:
        """Hand the steps the device ran to ``layout`` (:meth:`DecodeState.to_host`), if any;
        ``settled``: the host followed every step (the layer's ``needs_settle``)."""
        if self.newer and self.state is not None:
            self.newer = False
            self.state.to_host(layout, scattered=self.rule is not None, settled=settled, what=repr(self.policy),
                               headwise=self.headwise)

    @staticmethod
    def follow(layout: SlotLayout) -> None:
        """The host rows after one compiled step that evicted nothing on the device (a policy that
        needs settling): one real token more in every row, without reading the device."""
        rows = layout.rows
        rows.seen = [s + 1 for s in rows.seen]
        rows.count = [c + 1 for c in rows.count]
        rows.columns += 1
        layout.phase = "decode"


def device_total(device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A ``[]`` tensor of ``dtype`` on ``device``, 0, for a step to add each output's sum to in
    place (``total.add_(out.sum(dtype=total.dtype))``, two kernels where a bool flag raised by
    ``~isfinite(out).all()`` takes four): it stays finite while every output was (a NaN or an
    infinity stays, and ``inf - inf`` is NaN), for the host to read when it reads anyway.
    Allocated once at a fixed address, as :class:`DecodeState`'s tensors (CUDA graphs replay on
    the same memory).

    Example:
        >>> total = device_total(torch.device("cpu"))
        >>> _ = total.add_(torch.tensor([1.0, 2.0]).sum()); bool(total.isfinite())
        True
        >>> _ = total.add_(torch.tensor([float("nan")]).sum()); _ = total.add_(torch.tensor(3.0)); bool(total.isfinite())
        False
    """
    total = torch.zeros((), dtype=dtype, device=device)
    fixed_addresses(total)
    return total
