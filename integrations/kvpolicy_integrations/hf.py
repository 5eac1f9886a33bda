"""Hugging Face transformers (5.x) integration: an evicting cache that ``generate()`` uses.

Pieces:

* :class:`EvictingCache` / :class:`EvictingLayer`: a ``transformers.Cache`` whose layers hold a
  :class:`kvpolicy_torch.LayerCache`. ``update`` appends the new keys/values and returns
  everything cached (the current queries attend to all of it, as in the paper); eviction runs
  right after that layer's attention.
* the attention function ``"kvpolicy_sdpa"``: SDPA computes the output; one extra product of
  the current queries with the cached keys gives the probabilities each cached token received
  (summed per KV head under GQA); BUZZ's log-n scaling is applied in the same function. A decode
  step (one query) of a policy that reads scores takes the fused path instead: one product of the
  query with the keys, one softmax, one product with the values, so the probabilities SDPA would
  compute internally are the scores (``fused_decode=False`` restores SDPA plus the extra product).
  It is registered in ``AttentionInterface`` *and* ``AttentionMaskInterface`` (without the latter
  transformers passes no mask, and SDPA's top-left ``is_causal`` then drops keys during a
  chunked prefill).
* :func:`generate`: the one-line helper.

Positions: ``get_seq_length`` is the number of tokens *seen* (like transformers' own
sliding-window layer), so positions built from it stay right after eviction, and
``get_mask_sizes`` reports the cached length plus the query, which is what ``update`` returns.
Two position modes: ``"original"`` (a key keeps the RoPE position it was computed at; default for
H2O and BUZZ) and ``"cache"`` (StreamingLLM's pos-shift: keys are re-rotated so that the
distances between query and keys are distances between cache slots).
"""

from __future__ import annotations

import contextvars

from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Sequence

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvpolicy._validation import check_bool
from kvpolicy.policy import EvictionPolicy
from kvpolicy_torch import LayerCache, LayerGroup, PrefixShift, received_attention, rope_matrix, rope_rotate

from .capabilities import LayerAttention, ModelCapabilities, RopeLayout, cache_kwargs, detect, rope_layouts

__all__ = [
    "ATTENTION_NAME",
    "EvictingCache",
    "EvictingLayer",
    "GenerationResult",
    "ShiftMatrices",
    "cache_kwargs",
    "generate",
    "register_attention",
    "use_kvpolicy_attention",
]

ATTENTION_NAME = "kvpolicy_sdpa"
PositionsMode = Literal["original", "cache"]

# The layer whose update() ran last in this thread/context: the attention call that follows
# belongs to it (transformers passes no cache to attention functions).
_ACTIVE: contextvars.ContextVar["EvictingLayer | None"] = contextvars.ContextVar("kvpolicy_active_layer", default=None)
# The EvictingCache whose get_mask_sizes() ran last: the mask function called right after it
# takes the forward's 2-D padding mask for that cache instead of building a 4-D mask.
_MASK_FOR: contextvars.ContextVar["EvictingCache | None"] = contextvars.ContextVar("kvpolicy_mask_for", default=None)


def kvpolicy_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """SDPA output plus score capture and eviction for the :class:`EvictingLayer` that just updated.

    The mask comes from the layer's slots (holes, pads, causal order inside a prompt chunk), not
    from transformers: slot order is not sequence order once tokens are evicted.
    """
    layer = _ACTIVE.get()
    if layer is None or not layer.pending or layer.layer_idx != getattr(module, "layer_idx", None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    _ACTIVE.set(None)
    if attention_mask is not None:
        layer.pending = False
        raise ValueError(
            f"EvictingCache builds the attention mask from the kept tokens' positions; layer {layer.layer_idx} got a "
            f"4-D attention mask, which cannot be applied to an evicting cache: a custom mask passed to the forward "
            f"(pass the usual 2-D padding mask instead), or one the model builds itself (e.g. Doge's dynamic mask: "
            f"such models are not supported)"
        )
    store = layer.store
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q_len = query.shape[2]
    log_n = layer.policy.log_n
    uses_scores = layer.policy.captures_attention  # (scores from keys: no capture, the store computes them)
    if q_len == 1:
        window = layer.window_bias()
        prefix = layer.take_prefix(query)
        # log n: n = the keys the query attends to (paper, section 3.5): the row's kept tokens
        scales = [log_n.scale(n) for n in store.lengths] if log_n is not None else None
        # (the fused path never needs `plain`: store.bias, a slice, is read only when SDPA may serve)
        sdpa = not (uses_scores and layer.fused_decode) and window is None and prefix is None
        if sdpa and store.bias is None and (scales is None or all(x == scales[0] for x in scales)):
            # SDPA: nothing to mask or shift, and no scores wanted (or the unfused path asked for)
            sdpa_scale = scale * scales[0] if scales else scale
            out, _ = sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=sdpa_scale, **kwargs)
            if uses_scores:
                store.accumulate_query(received_attention(query, key, sdpa_scale), query.shape[1] // key.shape[1])
            layer.finish_received(None)
            return out, None
        if dropout or not _fusable(kwargs):
            raise ValueError(f"kvpolicy's decode attention takes no dropout, softcap or position bias; got {sorted(kwargs)}")
        row_scale = torch.tensor(scales, device=query.device) if scales is not None else None
        out = store.attend(query, scale, extra_bias=window, row_scale=row_scale, prefix=prefix)
        layer.finish_received(None)
        return out, None
    mask = layer.window_chunk_mask(store.chunk_mask())
    query_scale = None
    sdpa_query = query
    if log_n is not None:
        query_scale = _chunk_log_n_scales(log_n, store, q_len, query.device)
        sdpa_query = query * query_scale[:, None, :, None].to(query.dtype)
    out, _ = sdpa_attention_forward(module, sdpa_query, key, value, mask, dropout=dropout, scaling=scale, **kwargs)
    received = None
    if uses_scores:
        received = received_attention(
            query, key, scale, query_scale=query_scale, mask=mask, query_valid=store.query_valid,
            rows=layer.policy.prompt_rows, history=layer.history,
        )
    layer.finish_received(received)
    return out, None


def _chunk_log_n_scales(log_n: Any, store: LayerCache, q: int, device: torch.device) -> torch.Tensor:
    """``[batch, q]`` log-n scale of each query of a chunk, ``n`` the keys it attends to (paper,
    section 3.5): query ``i`` of row ``r`` sees the row's kept tokens before the chunk plus the
    chunk's real tokens up to ``i`` (causal)."""
    valid = store.query_valid
    kept = torch.tensor(store.lengths, device=device)[:, None]  # after the append: the chunk's real tokens included
    if valid is None:
        counts = kept - q + 1 + torch.arange(q, device=device)
    else:
        real = valid.to(torch.int64)
        counts = kept - real.sum(dim=-1, keepdim=True) + torch.cumsum(real, dim=-1)
    return log_n.scales(counts.clamp(min=1)).to(torch.float32)


def _fusable(kwargs: dict[str, Any]) -> bool:
    """Whether a decode step may take :func:`~kvpolicy_torch.decode_attention` (nothing
    SDPA-specific such as a position bias or softcap)."""
    return kwargs.get("position_bias") is None and kwargs.get("softcap") is None


def kvpolicy_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """The mask function registered with ``kvpolicy_sdpa``: for an :class:`EvictingCache` it
    hands the forward's 2-D padding mask to the cache and returns no 4-D mask (the cache's slots
    define what each query attends, and each layer applies its own sliding window or chunk, read
    from the config as transformers' ``DynamicCache`` reads it, on original positions); for any
    other cache it is transformers' ``sdpa_mask``."""
    cache = _MASK_FOR.get()
    if cache is None:
        return sdpa_mask(*args, **kwargs)
    _MASK_FOR.set(None)
    cache.note_padding(kwargs.get("attention_mask"), int(kwargs["q_length"]))
    return None


def register_attention() -> str:
    """Register ``"kvpolicy_sdpa"`` in transformers' attention and mask interfaces (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, kvpolicy_sdpa_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, kvpolicy_mask)
    return ATTENTION_NAME


register_attention()


def use_kvpolicy_attention(model: torch.nn.Module) -> None:
    """Switch ``model`` to the score-capturing SDPA attention (outputs equal plain SDPA)."""
    register_attention()
    if getattr(model.config, "_attn_implementation", None) != ATTENTION_NAME:
        try:
            model.set_attn_implementation(ATTENTION_NAME)
        except ValueError as exc:  # transformers refuses SDPA for this class (e.g. Git, VaultGemma)
            raise ValueError(
                f"model_type {getattr(model.config, 'model_type', None)!r} cannot use EvictingCache: its attention "
                f"cannot run through SDPA, which kvpolicy's attention is built on (transformers: {exc})"
            ) from exc


@dataclass
class Padding:
    """The padding of the forward in flight, shared by the layers of one :class:`EvictingCache`:
    ``valid`` ``[batch, q]`` (False: pad) and per-row real counts, or ``None`` for none. ``serial``
    counts forwards, so a layer never reuses the padding of an earlier forward."""

    valid: torch.Tensor | None = None
    real: list[int] | None = None
    q: int = 0
    serial: int = 0


class ShiftMatrices:
    """StreamingLLM's pos-shift rotations shared by the layers of one :class:`EvictingCache`.

    At a decode step every layer's sinks move by the same shift, so :meth:`rotate` turns every
    layer's sinks at once: the first layer to ask at a new shift rotates all layers' sinks in one
    batch (:func:`~kvpolicy_torch.rope_rotate` on ``[layers, batch, kv_heads, sink, head_dim]``),
    the others take their slice of it (a rotation per layer cost ~20 us of a decode step's
    per-layer bookkeeping on a CPU). Layers whose shifts or RoPE differ within a step (per-layer
    budgets, per-layer frequencies) fall back to one product per layer with a RoPE matrix per row
    (:func:`~kvpolicy_torch.rope_matrix`, built once per shift and RoPE: :meth:`get`).
    """

    def __init__(self) -> None:
        self._key: tuple[Any, ...] | None = None
        self._frequencies: torch.Tensor | None = None  # kept alive, so its id cannot be reused
        self._value: torch.Tensor | None = None
        self._sinks: dict[int, torch.Tensor] = {}  # layer -> its sinks' original keys [b, h, s, d]
        self._batch: torch.Tensor | None = None  # [layers, b, h, s, d]: every layer's sinks, rotated
        self._batch_key: tuple[Any, ...] | None = None  # (shifts, style, rotary_dim, dtype, device) of the batch
        self._batch_frequencies: torch.Tensor | None = None  # and its frequencies
        self._index: dict[int, int] = {}  # layer -> its row of the batch
        self._served: set[int] = set()  # layers that took their slice of the batch
        #: False once layers asked for different shifts or RoPE in one step: a product per layer
        self.batched = True

    def get(self, delta: Sequence[int], inv_freq: torch.Tensor, head_dim: int, style: str, rotary_dim: int,
            dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """``[batch, 1, head_dim, head_dim]`` for these shifts (see :func:`~kvpolicy_torch.rope_matrix`)."""
        key = (tuple(delta), id(inv_freq), head_dim, style, rotary_dim, dtype, device)
        if key != self._key or self._frequencies is not inv_freq:
            work = torch.float64 if dtype == torch.float64 else torch.float32
            matrix = rope_matrix(torch.tensor(list(delta), device=device), inv_freq, head_dim, style=style,
                                 rotary_dim=rotary_dim, dtype=work)
            self._key, self._frequencies, self._value = key, inv_freq, matrix
        return self._value  # type: ignore[return-value]

    def rotate(self, layer: int, keys: torch.Tensor, delta: Sequence[int], inv_freq: torch.Tensor, style: str,
               rotary_dim: int) -> torch.Tensor:
        """Layer ``layer``'s sinks ``keys`` ``[batch, kv_heads, s, head_dim]`` (their original keys)
        rotated by ``delta[r]`` positions in row ``r``, as :func:`~kvpolicy_torch.rope_rotate`.

        Example:
            >>> import torch
            >>> from kvpolicy_torch import rope_rotate
            >>> shifts, freq = ShiftMatrices(), torch.tensor([1.0, 0.1])
            >>> sinks = [torch.randn(1, 2, 3, 4) for _ in range(2)]
            >>> out = [shifts.rotate(l, sinks[l], [5], freq, "half", 4) for l in range(2)]
            >>> all(torch.allclose(o, rope_rotate(k, torch.tensor([5]), freq), atol=1e-5) for o, k in zip(out, sinks))
            True
        """
        if self.batched:
            key = (tuple(delta), style, rotary_dim, keys.dtype, keys.device)
            if self._sinks.get(layer) is not keys:  # new sinks (a first shift, or taken again after a chunk)
                self._sinks[layer] = keys
                self._batch = None
            same = self._batch_key == key and self._batch_frequencies is inv_freq
            if self._batch is not None and same and layer in self._index:
                self._served.add(layer)
                return self._batch[self._index[layer]]
            if self._batch is not None and not same and len(self._served) < len(self._index):
                self.batched = False  # a layer still waits for the last shift: shifts differ between layers
            else:
                like = [l for l, k in self._sinks.items()
                        if k.shape == keys.shape and k.dtype == keys.dtype and k.device == keys.device]
                shifts = torch.tensor(list(delta), device=keys.device).view(-1, 1, 1)  # [b, 1, 1] against [L, b, h, s]
                self._batch = rope_rotate(torch.stack([self._sinks[l] for l in like]), shifts, inv_freq, style=style,
                                          rotary_dim=rotary_dim)
                # served at this shift so far (a layer joining mid-step: its first shift) plus this one
                served = self._served if same else set()
                self._batch_key, self._batch_frequencies = key, inv_freq
                self._index, self._served = {l: i for i, l in enumerate(like)}, served | {layer}
                return self._batch[self._index[layer]]
        matrix = self.get(delta, inv_freq, keys.shape[-1], style, rotary_dim, keys.dtype, keys.device)
        b, h, s, d = keys.shape
        # one [h * s, d] x [d, d] product per row (a broadcast 4-D matmul costs twice as much here)
        rows = keys.reshape(b, h * s, d)
        if rows.dtype != matrix.dtype:
            return torch.bmm(rows.to(matrix.dtype), matrix[:, 0]).to(keys.dtype).view(b, h, s, d)
        return torch.bmm(rows, matrix[:, 0]).view(b, h, s, d)


class EvictingLayer(DynamicLayer):
    """One transformers cache layer backed by :class:`kvpolicy_torch.LayerCache`."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(
        self,
        policy: EvictionPolicy,
        layer_idx: int,
        *,
        positions: PositionsMode = "original",
        inv_freq: torch.Tensor | None = None,
        rope: RopeLayout | None = None,
        attention: LayerAttention | None = None,
        reduce_scores: Callable[[torch.Tensor], torch.Tensor] | None = None,
        fused_decode: bool = True,
        static_shapes: bool = False,
        reserve: int | None = None,
        padding: Padding | None = None,
        shift_matrices: ShiftMatrices | None = None,
        group: LayerGroup | None = None,
    ) -> None:
        super().__init__()
        self.policy = policy
        self.layer_idx = layer_idx
        self.positions_mode = positions
        self.inv_freq = inv_freq
        # pos-shift rotation: the measured layout, else (an explicit inv_freq) full half-split RoPE,
        # else none (a NoPE layer: positions do not enter its scores, so there is nothing to shift)
        self.rope = rope
        # keys move under pos-shift (positions="cache"), except in a NoPE layer
        self.shifts = positions == "cache" and (rope is not None or inv_freq is not None)
        # pos-shift of StreamingLLM's sinks is done in the storage (their keys rotated when the
        # shift changes): the decode step then attends with plain SDPA
        self.store = LayerCache(
            policy, reduce_scores=reduce_scores, static_shapes=static_shapes, reserve=reserve,
            key_shift=self._shift_keys if self.shifts else None, group=group,
        )
        self.shift_matrices = shift_matrices if shift_matrices is not None else ShiftMatrices()
        self.attention = attention if attention is not None else LayerAttention("full")
        self.fused_decode = fused_decode
        self.padding = padding if padding is not None else Padding()
        self.pending = False
        self._seen_serial = -1
        self._prefix: PrefixShift | None = None

    # transformers' base classes assign self.keys / self.values; they live in the store here.
    @property  # type: ignore[override]
    def keys(self) -> torch.Tensor | None:
        return self.store.keys if self.store.is_initialized else None

    @keys.setter
    def keys(self, value: Any) -> None:
        if value is not None:
            raise AttributeError("EvictingLayer.keys is read-only; use update()")

    @property  # type: ignore[override]
    def values(self) -> torch.Tensor | None:
        return self.store.values if self.store.is_initialized else None

    @values.setter
    def values(self, value: Any) -> None:
        if value is not None:
            raise AttributeError("EvictingLayer.values is read-only; use update()")

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``[batch, kv_heads, q, head_dim]`` keys/values; return the slots the queries attend."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.pending:
            self.pending = False
            raise RuntimeError(
                f"layer {self.layer_idx}: the previous step's attention did not go through kvpolicy, so no scores "
                f"were captured and nothing was evicted. Either the model was not switched to it (pass the model, not "
                f"its config, to EvictingCache, or call kvpolicy_integrations.hf.use_kvpolicy_attention(model), or "
                f"load it with attn_implementation='{ATTENTION_NAME}'), or this layer's attention does not dispatch "
                f"through transformers' attention interface (then kvpolicy cannot serve the model)"
            )
        q = key_states.shape[2]
        pad = self.padding
        valid = real = None
        if pad.serial != self._seen_serial:  # the padding noted for this forward (once per layer)
            self._seen_serial = pad.serial
            if pad.valid is not None and pad.q == q and q > 1:
                valid, real = pad.valid, pad.real
        keys, values = self.store.append(key_states, value_states, valid=valid, real=real)
        self._prefix = None
        if self.shifts and not self.store.keys_shifted:  # (keys_shifted: the store moved the sinks already)
            shift = self.store.shift()
            if isinstance(shift, PrefixShift):
                if shift.length and any(shift.delta):
                    self._prefix = shift  # the attention rotates the query back for those slots
            else:
                keys = self._rotate(keys, shift)
        self.pending = True
        _ACTIVE.set(self)
        return keys, values

    def take_prefix(self, query: torch.Tensor) -> tuple[int, torch.Tensor] | None:
        """For a pos-shift decode step: ``(k, query rotated back by each row's shift)`` for the
        prefix slots whose keys sit later than their original positions (see LayerCache.shift)."""
        shift, self._prefix = self._prefix, None
        if shift is None:
            return None
        delta = torch.tensor(shift.delta, device=query.device).view(-1, 1, 1)
        return shift.length, self._rotate(query, -delta)

    def _rotate(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """``x`` rotated by ``delta`` positions with this layer's RoPE (unchanged in a NoPE layer)."""
        if self.rope is not None:
            return rope_rotate(x, delta, self.rope.inv_freq, style=self.rope.style, rotary_dim=self.rope.rotary_dim)
        if self.inv_freq is not None:
            return rope_rotate(x, delta, self.inv_freq)
        return x

    def _shift_keys(self, keys: torch.Tensor, delta: list[int]) -> torch.Tensor:
        """Keys ``[batch, kv_heads, s, head_dim]`` rotated by ``delta[r]`` positions in row ``r``
        (the store's ``key_shift``: StreamingLLM's sinks, rotated with every layer's at once)."""
        if self.rope is not None:
            freq, style, dim = self.rope.inv_freq, self.rope.style, self.rope.rotary_dim
        else:
            freq, style, dim = self.inv_freq, "half", keys.shape[-1]
        return self.shift_matrices.rotate(self.layer_idx, keys, delta, freq, style, dim)  # type: ignore[arg-type]

    def _window_limits(self) -> list[int] | None:
        """Per row, the newest original position a query can no longer see in this sliding or
        chunked layer (keys at positions ``<= limit`` are masked), or ``None`` when no kept token
        can be outside the window yet (host ints only)."""
        kind, w = self.attention.kind, self.attention.window
        if kind == "full" or w is None:
            return None
        newest = [s - 1 for s in self.store.seen]  # the query's original position in each row
        if max(newest) < w:
            return None  # every position so far is inside the window (or the first chunk)
        if kind == "sliding":  # transformers: kv > q - window
            return [p - w for p in newest]
        return [p // w * w - 1 for p in newest]  # chunked: same chunk as the query

    def window_bias(self) -> torch.Tensor | None:
        """A decode step's additive bias ``[batch, kv_heads, n]`` for this sliding or chunked layer:
        ``-inf`` at kept tokens whose *original* position lies outside the window or chunk, else
        ``0`` (the holes' ``-inf`` is the store's, :attr:`LayerCache.bias`); ``None`` when no kept
        token can be outside it yet."""
        limits = self._window_limits()
        if limits is None:
            return None
        pos = self.store.slot_positions
        lim = torch.tensor(limits, device=pos.device).view(-1, 1, 1)
        zero = torch.zeros((), dtype=torch.float32, device=pos.device)
        return torch.where(pos > lim, zero, float("-inf"))

    def window_chunk_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """A prompt chunk's boolean mask ``[batch | 1, 1, q, n]`` restricted to this layer's sliding
        window or chunk, measured on original positions (pad queries keep their own column)."""
        if self._window_limits() is None:
            return mask
        kind, w = self.attention.kind, int(self.attention.window)  # type: ignore[arg-type]
        pos = self.store.slot_positions[:, 0, :]  # rows are compacted for a chunk: head 0 speaks for all
        qpos = pos[:, -mask.shape[-2] :]
        lim = qpos - w if kind == "sliding" else torch.div(qpos, w, rounding_mode="floor") * w - 1
        inside = (pos[:, None, :] > lim[:, :, None]) | (qpos < 0)[:, :, None]
        return mask & inside[:, None]

    @property
    def history(self) -> int | None:
        """The queries a token's record covers for a ``"low_history"`` policy (Scissorhands), else ``None``."""
        return self.policy.score_history if self.policy.score_statistic == "low_history" else None

    def finish_received(self, received: torch.Tensor | None) -> None:
        """After attention: accumulate ``received`` ``[batch, kv_heads, n]`` (if any), then evict."""
        if received is not None:
            self.store.accumulate(received)
        self.pending = False
        self.store.evict()

    def get_seq_length(self) -> int:
        """Columns seen so far, pads included (positions of new tokens start here), not the cached length."""
        return self.store.columns

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(columns + query_length, 0)``; no 4-D mask is built from it (see :func:`kvpolicy_mask`)."""
        return self.store.columns + query_length, 0

    def get_max_length(self) -> int:
        cap = self.policy.capacity
        return -1 if cap is None else cap

    def reset(self) -> None:
        self.store.reset()
        self.pending = False
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise ValueError("an evicting cache cannot be cropped: evicted tokens cannot be restored")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.store.select_batch(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.store.select_batch(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.store.is_initialized:
            self.store.select_batch(torch.arange(self.store.batch).repeat_interleave(repeats))




class EvictingCache(Cache):
    """A transformers ``Cache`` that evicts with a kvpolicy policy, layer by layer.

    Args:
        policy: the eviction policy (one instance is shared; state is per layer).
        model: the model (or its config). A model is needed for ``positions="cache"`` (its
            rotary frequencies) and is switched to the ``"kvpolicy_sdpa"`` attention.
        positions: ``"original"`` or ``"cache"``; default: the policy's ``default_positions``.
        reduce_scores: hook for shared selection across tensor-parallel ranks.
        fused_decode: compute a decode step's attention output and scores in one pass over the
            keys (default) instead of SDPA plus an extra score product. Outputs agree with SDPA
            to rounding; ``False`` reproduces SDPA's outputs exactly (caches without holes only).
        static_shapes: attend over every allocated slot at every decode step (holes masked), so
            a decode step's tensor shapes never change (``torch.compile``, CUDA graphs).
        max_tokens: tokens a layer will hold at most (prompt plus new tokens), if known: an
            unbounded policy (the full cache) allocates exactly that instead of growing.

    Left-padded batches work for every policy: pads are never attended, scored or kept, and each
    row evicts on its own schedule (the 2-D ``attention_mask`` says which tokens are pads).

    Example:
        >>> from kvpolicy import make_policy
        >>> from kvpolicy.models import tiny_llama
        >>> model = tiny_llama()
        >>> cache = EvictingCache(make_policy("buzz", 0.5, context_length=64), model)
        >>> out = model.generate(torch.arange(1, 33)[None], max_new_tokens=8, do_sample=False, **cache_kwargs(model, cache))
        >>> tuple(out.shape), max(cache.lengths()) <= cache.policy.capacity
        ((1, 40), True)
    """

    def __init__(
        self,
        policy: EvictionPolicy,
        model: Any,
        *,
        positions: PositionsMode | None = None,
        reduce_scores: Callable[[torch.Tensor], torch.Tensor] | None = None,
        fused_decode: bool = True,
        static_shapes: bool = False,
        max_tokens: int | None = None,
    ) -> None:
        if not isinstance(policy, EvictionPolicy):
            raise ValueError(f"policy must be an EvictionPolicy, got {policy!r}")
        caps = detect(model)
        positions = positions or policy.default_positions
        if positions not in ("original", "cache"):
            raise ValueError(f"positions must be 'original' or 'cache', got {positions!r}")
        ropes: list[RopeLayout | None] = [None] * len(caps.layers)
        if positions == "cache":
            if not isinstance(model, torch.nn.Module):
                raise ValueError(
                    "positions='cache' (pos-shift) needs the model itself, not only its config: its RoPE layout is "
                    "measured with one forward; positions='original' works with a config"
                )
            ropes = rope_layouts(model)
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1 or None, got {max_tokens!r}")
        fused_decode = check_bool("fused_decode", fused_decode)
        static_shapes = check_bool("static_shapes", static_shapes)
        if isinstance(model, torch.nn.Module):
            use_kvpolicy_attention(model)
        self.policy = policy
        self.positions_mode = positions
        self.capabilities: ModelCapabilities = caps
        self.padding = Padding()  # shared by the layers: the padding of the forward in flight
        shift_matrices = ShiftMatrices()  # shared by the layers: pos-shift rotations, built once a step
        n_layers = len(caps.layers)
        group = LayerGroup(n_layers)  # shared by the layers: one victim search a decode step for all
        layers = [
            EvictingLayer(
                policy.for_layer(i, n_layers), i, positions=positions, rope=ropes[i], attention=caps.layers[i], reduce_scores=reduce_scores,
                fused_decode=fused_decode, static_shapes=static_shapes, reserve=max_tokens, padding=self.padding,
                shift_matrices=shift_matrices, group=group,
            )
            for i in range(len(caps.layers))
        ]
        super().__init__(layers=layers)

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        """As transformers asks right before it builds a mask: the next mask function call
        (:func:`kvpolicy_mask`) hands this cache the forward's padding instead of building one."""
        _MASK_FOR.set(self)
        return super().get_mask_sizes(query_length, layer_idx)

    def note_padding(self, attention_mask: torch.Tensor | None, q_length: int) -> None:
        """Record the padding of the forward about to run (``attention_mask``: the 2-D mask of all
        columns so far, or ``None``). Read once per prompt chunk (one host sync); decode tokens
        (``q_length == 1``) are taken as real, as ``generate()`` makes them."""
        pad = self.padding
        pad.serial += 1
        pad.valid, pad.real, pad.q = None, None, q_length
        if attention_mask is None or q_length == 1 or attention_mask.ndim != 2:
            return
        valid = attention_mask[:, -q_length:].to(torch.bool)
        real = valid.sum(dim=-1).tolist()
        if any(r != q_length for r in real):
            pad.valid, pad.real = valid, real

    def lengths(self) -> list[int]:
        """Kept tokens per layer (the most any row keeps; see :meth:`row_lengths`)."""
        return [max(layer.store.lengths, default=0) for layer in self.layers]

    def row_lengths(self) -> list[list[int]]:
        """Kept tokens per layer and row (rows of a left-padded batch differ)."""
        return [layer.store.lengths for layer in self.layers]

    @property
    def kv_bytes(self) -> int:
        """Bytes of keys and values held now, all layers."""
        return sum(layer.store.kv_bytes for layer in self.layers)

    @property
    def allocated_bytes(self) -> int:
        """Bytes allocated by the stores (keys, values, positions, scores, bias), all layers."""
        return sum(layer.store.nbytes for layer in self.layers)

    def full_kv_bytes(self) -> int:
        """Bytes a full cache would hold for the (real) tokens seen so far."""
        total = 0
        for layer in self.layers:
            kept = sum(layer.store.lengths)
            if kept:
                total += layer.store.kv_bytes // kept * sum(layer.store.seen)
        return total


@dataclass
class GenerationResult:
    """What :func:`generate` returns."""

    text: str
    token_ids: list[int]
    prompt_tokens: int
    policy: EvictionPolicy
    kv_bytes: int
    full_kv_bytes: int
    cache_lengths: list[int] = field(default_factory=list)

    @property
    def cache_ratio(self) -> float:
        return self.kv_bytes / max(self.full_kv_bytes, 1)

    def __str__(self) -> str:
        return (
            f"{self.text}\n-- {self.policy!r}: cache {self.kv_bytes / 2**20:.2f} MiB vs full "
            f"{self.full_kv_bytes / 2**20:.2f} MiB ({self.cache_ratio:.0%})"
        )


def generate(
    model: Any,
    tokenizer: Any,
    prompt: str,
    policy: str | EvictionPolicy = "buzz",
    *,
    budget: float = 0.3,
    max_new_tokens: int = 64,
    chat: bool | None = None,
    positions: PositionsMode | None = None,
    **overrides: Any,
) -> GenerationResult:
    """Greedy generation of ``prompt`` with an evicting cache, in one call.

    ``policy`` is a policy or a registered name resolved with :func:`kvpolicy.make_policy` for
    ``budget`` on this prompt's length plus ``max_new_tokens``. ``chat`` applies the tokenizer's
    chat template (default: when it has one).

    Example:
        >>> from kvpolicy.models import tiny_llama
        >>> class Tok:  # a stand-in tokenizer for the doctest
        ...     chat_template = None
        ...     def __call__(self, text, return_tensors=None):
        ...         return {"input_ids": torch.tensor([[1 + ord(c) % 100 for c in text]])}
        ...     def decode(self, ids, skip_special_tokens=True):
        ...         return " ".join(map(str, ids))
        >>> res = generate(tiny_llama(), Tok(), "hello world " * 4, "h2o", budget=0.5, max_new_tokens=4)
        >>> len(res.token_ids)
        4
    """
    from kvpolicy.budget import make_policy

    chat = check_bool("chat", chat, allow_none=True)
    use_chat = chat if chat is not None else bool(getattr(tokenizer, "chat_template", None))
    if use_chat:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
    else:
        text = prompt
    enc = tokenizer(text, return_tensors="pt")
    device = next(model.parameters()).device
    input_ids = enc["input_ids"].to(device)
    n_prompt = int(input_ids.shape[1])
    if isinstance(policy, str):
        policy = make_policy(
            policy, budget, context_length=n_prompt + max_new_tokens, prompt_length=n_prompt, **overrides
        )
    cache = EvictingCache(policy, model, positions=positions, max_tokens=n_prompt + max_new_tokens)
    with torch.no_grad():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            **cache_kwargs(model, cache),
            pad_token_id=getattr(tokenizer, "pad_token_id", None) or getattr(tokenizer, "eos_token_id", None),
        )
    new_ids = out[0, n_prompt:].tolist()
    return GenerationResult(
        text=tokenizer.decode(new_ids, skip_special_tokens=True),
        token_ids=new_ids,
        prompt_tokens=n_prompt,
        policy=policy,
        kv_bytes=cache.kv_bytes,
        full_kv_bytes=cache.full_kv_bytes(),
        cache_lengths=cache.lengths(),
    )



