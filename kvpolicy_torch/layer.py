"""One layer's evicting KV store on torch: preallocated, batched, per KV head, CPU and CUDA.

Shapes: keys and values ``[batch, kv_heads, slots, head_dim]``; original positions
``[batch, kv_heads, slots]`` (int64); accumulated scores ``[batch, kv_heads, slots]`` (always
float32, or float64 when the keys are float64, whatever the key dtype).

The hot path has no Python loop over heads, rows or tokens and no host-device sync: lengths
and token counts are host ints, the policy decides *whether* from them, and *which* slots are
kept is one batched gather on the device.
"""

from __future__ import annotations

from typing import Callable

import torch

from kvpolicy.policy import CacheView, EvictionPolicy

__all__ = ["LayerCache"]

_MIN_GROWTH = 256


class LayerCache:
    """Evicting KV storage for one attention layer.

    Usage per forward step: :meth:`append` the new keys/values (returns everything the current
    queries attend to), compute attention, :meth:`accumulate` the probabilities each cached token
    received (summed over the query heads of its KV head and over the queries), then
    :meth:`evict`.

    Storage is allocated once to the policy's ``capacity`` (unbounded policies grow by doubling).
    A prefill chunk that does not fit is held transiently until the eviction brings the layer back
    under capacity.

    Args:
        policy: the eviction policy.
        reduce_scores: applied to head-summed scores before a shared selection (e.g. an
            all-reduce over tensor-parallel ranks); unused for per-head selection.

    Example:
        >>> import torch
        >>> from kvpolicy import StreamingLLM
        >>> layer = LayerCache(StreamingLLM(sink=1, window=2))
        >>> for t in range(5):
        ...     k = v = torch.randn(1, 2, 1, 4)
        ...     K, V = layer.append(k, v)
        ...     layer.accumulate(torch.ones(1, 2, K.shape[2]))
        ...     layer.evict()
        >>> layer.positions[0, 0].tolist()
        [0, 3, 4]
    """

    def __init__(
        self,
        policy: EvictionPolicy,
        *,
        reduce_scores: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.policy = policy
        self.reduce_scores = reduce_scores
        self.state: dict[str, int] = policy.init_state()
        self.length = 0  # cached tokens per head (host int)
        self.n_seen = 0  # tokens appended so far (host int)
        self.evictions = 0
        self._keys: torch.Tensor | None = None
        self._values: torch.Tensor | None = None
        self._pos: torch.Tensor | None = None
        self._scores: torch.Tensor | None = None
        # Transient tensors (keys, values, positions, scores) while a chunk overflows the storage.
        self._overflow: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._phase = "decode"

    # ------------------------------------------------------------------ storage
    @property
    def is_initialized(self) -> bool:
        return self._keys is not None

    @property
    def slots(self) -> int:
        """Allocated slots per head."""
        return 0 if self._keys is None else int(self._keys.shape[2])

    def _allocate(self, like_k: torch.Tensor, like_v: torch.Tensor, slots: int) -> None:
        b, h, _, d = like_k.shape
        dv = like_v.shape[-1]
        score_dtype = torch.float64 if like_k.dtype == torch.float64 else torch.float32
        dev = like_k.device
        keys = torch.empty(b, h, slots, d, dtype=like_k.dtype, device=dev)
        values = torch.empty(b, h, slots, dv, dtype=like_v.dtype, device=dev)
        pos = torch.zeros(b, h, slots, dtype=torch.int64, device=dev)
        scores = torch.zeros(b, h, slots, dtype=score_dtype, device=dev)
        if self._keys is not None and self.length:
            n = self.length
            keys[:, :, :n] = self._keys[:, :, :n]
            values[:, :, :n] = self._values[:, :, :n]  # type: ignore[index]
            pos[:, :, :n] = self._pos[:, :, :n]  # type: ignore[index]
            scores[:, :, :n] = self._scores[:, :, :n]  # type: ignore[index]
        self._keys, self._values, self._pos, self._scores = keys, values, pos, scores

    def _current(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._overflow is not None:
            return self._overflow
        n = self.length
        return (
            self._keys[:, :, :n],  # type: ignore[index]
            self._values[:, :, :n],  # type: ignore[index]
            self._pos[:, :, :n],  # type: ignore[index]
            self._scores[:, :, :n],  # type: ignore[index]
        )

    @property
    def keys(self) -> torch.Tensor:
        """Cached keys ``[batch, kv_heads, length, head_dim]`` (a view)."""
        return self._current()[0]

    @property
    def values(self) -> torch.Tensor:
        """Cached values ``[batch, kv_heads, length, head_dim]`` (a view)."""
        return self._current()[1]

    @property
    def positions(self) -> torch.Tensor:
        """Original positions of the cached tokens ``[batch, kv_heads, length]``."""
        return self._current()[2]

    @property
    def scores(self) -> torch.Tensor:
        """Accumulated attention of the cached tokens ``[batch, kv_heads, length]``."""
        return self._current()[3]

    @property
    def nbytes(self) -> int:
        """Bytes of the allocated storage (keys, values, positions, scores)."""
        if self._keys is None:
            return 0
        return sum(t.numel() * t.element_size() for t in (self._keys, self._values, self._pos, self._scores))  # type: ignore[union-attr]

    @property
    def kv_bytes(self) -> int:
        """Bytes of the cached keys and values actually held (``length`` tokens)."""
        if self._keys is None:
            return 0
        k, v = self._keys, self._values
        per_slot = (k.shape[0] * k.shape[1]) * (k.shape[3] * k.element_size() + v.shape[3] * v.element_size())  # type: ignore[union-attr]
        return per_slot * self.length

    # ------------------------------------------------------------------ the step
    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``q`` new tokens ``[batch, kv_heads, q, head_dim]``; return all keys and values
        the current queries attend to (cached first, then the new ones)."""
        if keys.ndim != 4 or values.ndim != 4 or keys.shape[:3] != values.shape[:3]:
            raise ValueError(
                "keys and values must be [batch, kv_heads, q, head_dim] with equal first three dims, "
                f"got {tuple(keys.shape)} and {tuple(values.shape)}"
            )
        if self._overflow is not None:
            raise RuntimeError(
                "append() called while the previous step was not evicted: call accumulate() and evict() "
                "after each attention (with transformers, use the 'kvpolicy_sdpa' attention implementation)"
            )
        b, h, q, _ = keys.shape
        if self._keys is not None and tuple(self._keys.shape[:2]) != (b, h):
            raise ValueError(f"batch and kv_heads changed from {tuple(self._keys.shape[:2])} to {(b, h)}")
        capacity = self.policy.capacity
        if self._keys is None:
            self._allocate(keys, values, capacity if capacity is not None else max(_MIN_GROWTH, q))
        elif capacity is None and self.length + q > self.slots:
            self._allocate(keys, values, max(2 * self.slots, self.length + q))

        n, total = self.length, self.length + q
        first = self.n_seen
        self.n_seen += q
        self._phase = "prefill" if q > 1 else "decode"
        if total <= self.slots:
            self._keys[:, :, n:total] = keys  # type: ignore[index]
            self._values[:, :, n:total] = values  # type: ignore[index]
            if q == 1:  # decode: fill with a host scalar, no index tensor to build
                self._pos[:, :, n] = first  # type: ignore[index]
                self._scores[:, :, n] = 0  # type: ignore[index]
            else:
                self._pos[:, :, n:total] = torch.arange(first, first + q, device=keys.device, dtype=torch.int64)  # type: ignore[index]
                self._scores[:, :, n:total] = 0  # type: ignore[index]
            self.length = total
            return self._keys[:, :, :total], self._values[:, :, :total]  # type: ignore[index]
        # A prompt larger than the capacity: attention needs all its keys for this step.
        new_pos = torch.arange(first, first + q, device=keys.device, dtype=torch.int64).expand(b, h, q)
        k_old, v_old, p_old, s_old = self._current()
        self._overflow = (
            torch.cat([k_old, keys], dim=2),
            torch.cat([v_old, values], dim=2),
            torch.cat([p_old, new_pos], dim=2),
            torch.cat([s_old, torch.zeros(b, h, q, dtype=s_old.dtype, device=s_old.device)], dim=2),
        )
        self.length = total
        return self._overflow[0], self._overflow[1]

    def accumulate(self, received: torch.Tensor) -> None:
        """Add ``received`` ``[batch, kv_heads, length]`` (the attention each cached token just
        received, summed over query heads and queries) to the accumulated scores."""
        scores = self._overflow[3] if self._overflow is not None else self._scores[:, :, : self.length]  # type: ignore[index]
        if received.shape != scores.shape:
            raise ValueError(f"received must have shape {tuple(scores.shape)}, got {tuple(received.shape)}")
        scores += received.to(scores.dtype)

    def evict(self) -> list[tuple[int, int]]:
        """Let the policy evict until it is satisfied; return ``(size_before, size_after)`` per round."""
        rounds: list[tuple[int, int]] = []
        while True:
            if self._overflow is not None:
                p, s = self._overflow[2], self._overflow[3]
            else:  # only the views the policy reads; keys and values are sliced on a gather
                p, s = self._pos[:, :, : self.length], self._scores[:, :, : self.length]  # type: ignore[index]
            view = CacheView(p, s, self.n_seen, self.state, self._phase)  # type: ignore[arg-type]
            keep = self.policy.evict(view, self.reduce_scores)
            if keep is None:
                break
            kept = int(keep.shape[-1])
            if kept >= self.length:
                raise RuntimeError(f"{self.policy!r} asked to evict but kept {kept} of {self.length} tokens")
            rounds.append((self.length, kept))
            self._gather(keep)
        if self._overflow is not None:
            raise RuntimeError(
                f"{self.policy!r} left {self.length} tokens but declared capacity {self.policy.capacity}"
            )
        self.evictions += len(rounds)
        return rounds

    #: Bytes of the temporary one step of the in-place compaction copies through (see
    #: :meth:`_gather`); ``None`` gathers the whole kept cache into fresh tensors first.
    compaction_chunk_bytes: int | None = 8 << 20

    def _gather(self, keep: torch.Tensor) -> None:
        b, h, kept = keep.shape
        overflow = self._overflow is not None
        if overflow:
            sources, slots = self._overflow, self.length
        else:
            sources, slots = (self._keys, self._values, self._pos, self._scores), self.slots  # type: ignore[assignment]
        dev = sources[0].device
        # Storage is contiguous [batch, heads, slots, ...]: seen as rows of one flat tensor, the kept
        # slots of every (row, head) are one index_select of whole rows (torch.gather with a
        # [batch, heads, kept, head_dim] index is 7-17x slower on CPU).
        starts = torch.arange(0, b * h * slots, slots, device=dev, dtype=torch.int64).view(b, h, 1)
        rows = keep.to(device=dev, dtype=torch.int64) + starts  # [b, h, kept]
        flat = (
            sources[0].reshape(b * h * slots, -1),
            sources[1].reshape(b * h * slots, -1),
            sources[2].reshape(-1),
            sources[3].reshape(-1),
        )
        self.length = kept
        chunk_bytes = self.compaction_chunk_bytes
        if not overflow and chunk_bytes is not None:
            # In place, chunk by chunk along the slots: kept slot j comes from slot keep[j] >= j
            # (keep is ascending), so once chunk [j0, j1) is copied out to a temporary, writing
            # it to the front never overwrites a slot a later chunk still reads. No allocation of
            # the cache's size, and each kept token moves once.
            per_slot = b * h * sum(t.element_size() * (t.shape[-1] if t.ndim == 4 else 1) for t in sources)
            step = max(1, chunk_bytes // max(per_slot, 1))
            for j0 in range(0, kept, step):
                j1 = min(kept, j0 + step)
                r = rows[:, :, j0:j1].reshape(-1)
                for src, dst in zip(flat, sources):
                    part = src.index_select(0, r)
                    dst[:, :, j0:j1] = part.view(b, h, j1 - j0, *dst.shape[3:])
            self._overflow = None
            return
        r = rows.reshape(-1)
        nk = flat[0].index_select(0, r).view(b, h, kept, -1)
        nv = flat[1].index_select(0, r).view(b, h, kept, -1)
        np_ = flat[2].index_select(0, r).view(b, h, kept)
        ns = flat[3].index_select(0, r).view(b, h, kept)
        if kept > self.slots:  # still above capacity (e.g. between prefill rounds of BUZZ)
            self._overflow = (nk, nv, np_, ns)
            return
        self._overflow = None
        self._keys[:, :, :kept] = nk  # type: ignore[index]
        self._values[:, :, :kept] = nv  # type: ignore[index]
        self._pos[:, :, :kept] = np_  # type: ignore[index]
        self._scores[:, :, :kept] = ns  # type: ignore[index]

    # ------------------------------------------------------------------ batch ops (beam search etc.)
    def select_batch(self, index: torch.Tensor) -> None:
        """Keep (or repeat) batch rows by ``index``, e.g. for beam search."""
        if self._keys is None:
            return
        self._keys, self._values, self._pos, self._scores = (
            t.index_select(0, index.to(t.device)) for t in (self._keys, self._values, self._pos, self._scores)  # type: ignore[union-attr]
        )

    def reset(self) -> None:
        """Forget everything (storage is freed)."""
        self.__init__(self.policy, reduce_scores=self.reduce_scores)  # type: ignore[misc]
