"""What can be read from a layer between steps: counts per row, the kept tokens in position
order, and the slots the last append returned (what attention saw).

:class:`LayerReads` is the read side of :class:`~kvpolicy_torch.LayerCache`, written against one
method, :meth:`LayerReads.synced`, which brings the layer's :class:`~kvpolicy_torch.layout.SlotLayout`
up to date (a group's deferred victims freed, decode steps the device ran handed to the host).
A read never changes what the layer holds; inside a decode step, the reads that attention needs
(:attr:`~LayerReads.bias`, :meth:`~LayerReads.shift`, :meth:`~LayerReads.chunk_mask`) are cheap.
"""

from __future__ import annotations

from typing import Any

import torch

from kvpolicy.policy import DecodeEviction, EvictionPolicy

from .headwise import held_tokens
from .layout import SlotLayout, uniform
from .posshift import PrefixShift, slot_shifts
from .storage import token_bytes

__all__ = ["LayerReads"]


class LayerReads:
    """Reads of a layer's state (the base of :class:`~kvpolicy_torch.LayerCache`).

    A subclass sets :attr:`policy` and :attr:`rule` and implements :meth:`synced` and
    :meth:`unsynced`. What the shapes alone tell (``is_initialized``, ``batch``, ``slots``,
    ``nbytes``, ...) is read from :meth:`unsynced`: a static-shaped layer reads it inside a
    compiled step, where handing device steps to the host cannot run.

    Example:
        >>> from kvpolicy import H2O
        >>> from kvpolicy_torch import LayerCache
        >>> layer = LayerCache(H2O(heavy=1, recent=1))
        >>> for t in range(3):
        ...     K, V = layer.append(torch.full((1, 1, 1, 2), float(t)), torch.zeros(1, 1, 1, 2))
        ...     layer.accumulate(torch.tensor([[[1.0] * K.shape[2]]]))
        ...     rounds = layer.evict()
        >>> layer.length, layer.seen, layer.positions.tolist(), layer.keys[0, 0, :, 0].tolist()
        (2, [3], [[[0, 2]]], [0.0, 2.0])
    """

    policy: EvictionPolicy
    rule: DecodeEviction | None

    def synced(self, storage: bool = True) -> SlotLayout:
        """The layer's slot layout, every deferred or device-side step applied; with ``storage``,
        after the first append only (a ``ValueError`` before)."""
        raise NotImplementedError

    def unsynced(self) -> SlotLayout:
        """The layer's slot layout as it stands, nothing applied: what the shapes tell."""
        raise NotImplementedError

    # ------------------------------------------------------------------ shapes (read without syncing)
    @property
    def is_initialized(self) -> bool:
        """Whether something was appended (the storage is allocated)."""
        return self.unsynced().store is not None

    @property
    def batch(self) -> int:
        """Rows held."""
        return self.unsynced().rows.batch

    @property
    def slots(self) -> int:
        """Allocated slots per row and head."""
        store = self.unsynced().store
        return 0 if store is None else store.slots

    @property
    def keys_shifted(self) -> bool:
        """Whether the keys the last :meth:`append` returned already sit at their pos-shift positions
        (``key_shift`` given, a decode step of an ``"oldest"`` rule): :meth:`shift` then describes
        what was done, and nothing is left for attention to rotate."""
        sinks = self.unsynced().sink_shift
        return sinks is not None and sinks.delta is not None

    @property
    def nbytes(self) -> int:
        """Bytes of the allocated storage (keys, values, positions, scores, bias)."""
        store = self.unsynced().store
        return 0 if store is None else store.nbytes

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's key and value over a row's KV heads (0 before the first append)."""
        store = self.unsynced().store
        if store is None:
            return 0
        return token_bytes(store.keys, store.values)

    # ------------------------------------------------------------------ counts
    @property
    def columns(self) -> int:
        """Columns appended per row so far, pads included (read on the host)."""
        return self.synced(storage=False).rows.columns

    @property
    def length(self) -> int:
        """Kept tokens per head (every row); see :attr:`lengths` for rows that differ."""
        return uniform(self.synced(storage=False).rows.count, "kept tokens (use .lengths)")

    @property
    def lengths(self) -> list[int]:
        """Kept tokens per head, per row."""
        return list(self.synced(storage=False).rows.count)

    @property
    def mean_length(self) -> float:
        """Kept tokens per KV head on average over the heads and rows: :attr:`length`, except
        under head-wise budgets (``policy.ragged_heads``), where ``length`` is the widest head's
        count of slots and the heads hold fewer on average (one host read)."""
        layout = self.synced(storage=False)
        if not self.policy.ragged_heads or layout.store is None:
            return float(self.length)
        pos = layout.working().positions
        return held_tokens(pos) / (pos.shape[0] * pos.shape[1])

    @property
    def seen(self) -> list[int]:
        """Real (non-pad) tokens appended so far, per row."""
        return list(self.synced(storage=False).rows.seen)

    @property
    def n_seen(self) -> int:
        """Real tokens appended so far (every row); see :attr:`seen` for rows that differ."""
        return uniform(self.synced(storage=False).rows.seen, "tokens seen (use .seen)")

    @property
    def state(self) -> dict[str, int]:
        """The policy's state (every row); see :attr:`states`."""
        return uniform(self.synced(storage=False).rows.states, "policy state (use .states)")

    @property
    def states(self) -> list[dict[str, int]]:
        """The policy's state, per row."""
        return [dict(s) for s in self.synced(storage=False).rows.states]

    @property
    def kv_bytes(self) -> int:
        """Bytes of the keys and values actually kept (pads and holes excluded)."""
        layout = self.synced(storage=False)
        if layout.store is None:
            return 0
        per_token = token_bytes(layout.store.keys, layout.store.values)
        if self.policy.ragged_heads:  # heads hold different numbers: count them (one host read)
            return per_token // layout.store.keys.shape[1] * held_tokens(layout.working().positions)
        return per_token * sum(layout.rows.count)

    # ------------------------------------------------------------------ kept tokens in position order
    # Rows of a left-padded batch (and heads under head-wise budgets) may keep different numbers of
    # tokens: these reads then give transformers' shape [batch, kv_heads, length, ...] with `length`
    # the most any row keeps, each row's tokens in position order at the end and filler in front
    # (as a left-padded batch's pads), and `kept_mask` says which entries are kept tokens.
    def _ordered(self, name: str, fill: float) -> torch.Tensor:
        layout = self.synced()
        if name == "keys":
            layout.unshift()  # reads see original keys (the next decode append shifts them again)
        t = getattr(layout.working(), name)
        counts = layout.rows.count
        if all(c == counts[0] for c in counts):
            return layout.in_order(t, counts[0] if counts else 0)
        return layout.aligned(t, max(counts), fill)

    @property
    def keys(self) -> torch.Tensor:
        """Kept keys in position order ``[batch, kv_heads, length, head_dim]`` (a view when dense);
        ``length`` the most any row keeps, a row keeping fewer (a left-padded batch) zeros in front
        of its keys: :attr:`kept_mask` says which are kept tokens."""
        return self._ordered("keys", 0.0)

    @property
    def values(self) -> torch.Tensor:
        """Kept values in position order ``[batch, kv_heads, length, head_dim]``, laid out as :attr:`keys`."""
        return self._ordered("values", 0.0)

    @property
    def positions(self) -> torch.Tensor:
        """Original positions of the kept tokens, ascending ``[batch, kv_heads, length]``, laid out
        as :attr:`keys` (``-1`` where a row keeping fewer has no token)."""
        return self._ordered("positions", -1)

    @property
    def scores(self) -> torch.Tensor:
        """Accumulated attention of the kept tokens, in position order ``[batch, kv_heads, length]``,
        laid out as :attr:`keys` (``0`` where a row keeping fewer has no token)."""
        return self._ordered("scores", 0.0)

    @property
    def kept_mask(self) -> torch.Tensor:
        """``[batch, kv_heads, length]`` bool: which entries of :attr:`keys`, :attr:`values`,
        :attr:`positions` and :attr:`scores` are kept tokens (all True unless rows or heads keep
        different numbers: a left-padded batch, head-wise budgets).

        Example:
            >>> from kvpolicy import FullCache
            >>> from kvpolicy_torch import LayerCache
            >>> layer = LayerCache(FullCache())
            >>> valid = torch.tensor([[False, True, True], [True, True, True]])  # row 0: one left pad
            >>> K, V = layer.append(torch.ones(2, 1, 3, 2), torch.ones(2, 1, 3, 2), valid=valid)
            >>> layer.accumulate(torch.ones(2, 1, K.shape[2])); rounds = layer.evict()
            >>> layer.lengths, tuple(layer.keys.shape), layer.kept_mask[:, 0].tolist()
            ([2, 3], (2, 1, 3, 2), [[False, True, True], [True, True, True]])
            >>> layer.keys[0, 0, :, 0].tolist(), layer.positions[0, 0].tolist()
            ([0.0, 1.0, 1.0], [-1, 0, 1])
        """
        return self.positions >= 0

    def kept(self, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(positions, scores)`` ``[kv_heads, n_row]`` of one row, in position order (rows may differ)."""
        return self.synced().kept(row)

    def to_slots(self, ordered: torch.Tensor) -> torch.Tensor:
        """Place per-token values given in position order ``[batch, kv_heads, length]`` at the slots
        the last ``append`` returned ``[batch, kv_heads, n]`` (0 at holes): for callers that
        compute received attention over :attr:`positions` rather than :attr:`slot_positions`."""
        return self.synced().to_slots(ordered, self.length)

    # ------------------------------------------------------------------ what attention sees
    @property
    def slot_positions(self) -> torch.Tensor:
        """Original positions of the slots the last ``append`` returned ``[batch, kv_heads, n]``
        (``-1`` at a hole or pad): ``received`` in ``accumulate`` is aligned with these."""
        return self.synced().returned_positions()

    @property
    def bias(self) -> torch.Tensor | None:
        """Additive attention bias ``[batch, kv_heads, n]`` (``0`` or ``-inf``) of the slots the last
        decode ``append`` returned, or ``None`` when none of them is a hole."""
        layout = self.synced()
        return layout.returned_bias() if layout.bias_needed else None

    @property
    def query_valid(self) -> torch.Tensor | None:
        """``[batch, q]`` bool: which queries of the last chunk are real (``None``: all)."""
        chunk = self.synced(storage=False).chunk
        return chunk[2] if chunk is not None else None

    def chunk_log_n_scales(self, log_n: Any) -> torch.Tensor:
        """``[batch, q]`` float32: BUZZ's log-n scale (``log_n``: a :class:`~kvpolicy.LogNScaling`)
        of each query of the chunk the last ``append`` added, ``n`` the keys it attends to (the
        paper, section 3.5): query ``i`` of a row sees the row's kept tokens before the chunk plus
        the chunk's real tokens up to ``i`` (causal).

        Example:
            >>> from kvpolicy import FullCache, LogNScaling
            >>> from kvpolicy_torch import LayerCache
            >>> layer = LayerCache(FullCache())
            >>> K, V = layer.append(torch.randn(1, 1, 3, 2), torch.randn(1, 1, 3, 2))
            >>> scaling = LogNScaling(base=2.0)
            >>> torch.equal(layer.chunk_log_n_scales(scaling), scaling.scales(torch.tensor([[1, 2, 3]])).float())
            True
        """
        chunk = self.synced(storage=False).chunk
        if chunk is None:
            raise ValueError("chunk_log_n_scales() follows an append of more than one token")
        q, valid = chunk[1], chunk[2]
        kept = torch.tensor(self.lengths, device=self.slot_positions.device)[:, None]  # the chunk's real tokens included
        if valid is None:
            counts = kept - q + 1 + torch.arange(q, device=kept.device)
        else:
            real = valid.to(torch.int64)
            counts = kept - real.sum(dim=-1, keepdim=True) + torch.cumsum(real, dim=-1)
        return log_n.scales(counts.clamp(min=1)).to(torch.float32)

    @property
    def chunk_causal(self) -> bool:
        """Whether the chunk the last ``append`` added is the whole range it returned, with no pad:
        the first chunk of a prompt (nothing held before it). Its :meth:`chunk_mask` is then plain
        causal over the chunk's own keys, which attention may take as SDPA's ``is_causal=True``
        (the causal kernel skips the masked blocks; an explicit mask makes it compute them all).

        Example:
            >>> from kvpolicy import FullCache
            >>> from kvpolicy_torch import LayerCache
            >>> layer = LayerCache(FullCache())
            >>> K, V = layer.append(torch.randn(1, 1, 4, 2), torch.randn(1, 1, 4, 2))
            >>> first = layer.chunk_causal
            >>> rounds = layer.evict()
            >>> K, V = layer.append(torch.randn(1, 1, 4, 2), torch.randn(1, 1, 4, 2))
            >>> first, layer.chunk_causal
            (True, False)
        """
        layout = self.synced(storage=False)
        chunk = layout.chunk
        return chunk is not None and chunk[0] == 0 and chunk[2] is None and layout.returned == chunk[1]

    def chunk_mask(self) -> torch.Tensor:
        """Boolean mask ``[batch | 1, 1, q, n]`` (True: attend) for the chunk the last ``append``
        added: every kept token before the chunk, causal inside it, pads attended by nobody (a pad
        query sees only itself, so its row stays finite). After a head-wise eviction (AdaKV: the
        KV heads hold different tokens) the mask is per KV head, ``[batch, kv_heads, q, n]``: a
        query head reads its KV head's (:func:`~kvpolicy_torch.scores.prefill_attention` and
        :func:`~kvpolicy_torch.scores.received_attention` take either shape).

        Example:
            >>> from kvpolicy import AdaKV, H2O
            >>> from kvpolicy_torch import LayerCache
            >>> layer = LayerCache(AdaKV(H2O(heavy=2, recent=1)))
            >>> K, V = layer.append(torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4))
            >>> layer.accumulate(torch.tensor([[[9.0, 9, 9, 9, 0, 0], [0, 0, 0, 0, 0, 0]]])); rounds = layer.evict()
            >>> layer.slot_positions.tolist()  # head 0 kept five tokens, head 1 the newest one
            [[[0, 1, 2, 3, 5, -1], [-1, -1, -1, -1, 5, -1]]]
            >>> K, V = layer.append(torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4))
            >>> layer.chunk_mask()[0, 1].int().tolist()  # head 1's queries see its token 5 and the chunk, causal
            [[0, 0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 1, 1, 1]]
        """
        layout = self.synced()
        if layout.chunk is None:
            raise ValueError("chunk_mask() follows an append of more than one token")
        start, q, valid = layout.chunk
        pos = layout.returned_positions()
        rows = torch.arange(q, device=pos.device)[:, None]
        cols = torch.arange(pos.shape[-1], device=pos.device)[None, :]
        causal = cols <= start + rows  # [q, n]
        # rows are compacted for a chunk, so head 0 speaks for all, unless a head-wise eviction left
        # the heads holding different tokens (each head's kept tokens at its own front slots; a
        # row's count is then its widest head's)
        per_head = self.policy.ragged_heads and bool(((pos >= 0) != (pos[:, :1] >= 0)).any())
        if not per_head and valid is None and all(c == start + q for c in layout.rows.count):  # no pads, no holes before the chunk
            return causal[None, None]
        held = pos >= 0 if per_head else pos[:, :1] >= 0  # [b, h | 1, n]
        mask = causal[None, None] & held[:, :, None, :]  # [b, h | 1, q, n]
        if valid is not None:
            mask = mask | ((cols == start + rows)[None, None] & ~valid[:, None, :, None])
        return mask

    def shift(self) -> PrefixShift | torch.Tensor:
        """How far each returned slot sits from its original position under StreamingLLM's
        pos-shift (:mod:`kvpolicy_torch.posshift`): a :class:`PrefixShift` for a policy whose
        decode eviction is ``"oldest"`` (only the sinks move), else the per-slot shifts
        ``[batch, kv_heads, n]`` (0 at holes)."""
        layout = self.synced()
        if self.rule is not None and self.rule.victim == "oldest" and layout.extra is None and layout.chunk is None:
            return PrefixShift(self.rule.sink, layout.rows.shift())
        # slots before the range are holes, so ranks count from its start
        return slot_shifts(layout.returned_positions(), layout.rows.shift())

    # ------------------------------------------------------------------ diagnostics
    @property
    def candidate_searches(self) -> int:
        """Full searches of H2O-like victims made so far on the candidate path (see
        ``LayerCache.candidate_min_scores``): a diagnostic for benchmarks and tests."""
        return self.synced(storage=False).search.searches

    @property
    def compaction_period(self) -> int | None:
        """Decode steps between two compactions while a :class:`~kvpolicy.DecodeEviction` evicts
        one token per step (``None``: the policy has none, or nothing is allocated yet)."""
        capacity, store = self.policy.capacity, self.synced(storage=False).store
        if self.rule is None or self.rule.victim == "oldest" or store is None or capacity is None:
            return None  # ("oldest": a ring, never compacted while decoding)
        return store.slots - capacity + 1
