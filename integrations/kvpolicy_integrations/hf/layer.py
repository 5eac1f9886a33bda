"""One layer of the evicting cache: :class:`EvictingLayer`, a transformers cache layer backed by
:class:`kvpolicy_torch.LayerCache`, with what the layers of one cache share (:class:`Padding`;
:class:`~kvpolicy_torch.posshift.ShiftMatrices`, re-exported) (a part of
:mod:`kvpolicy_integrations.hf`, whose docstring describes the whole). A layer appends a step's
keys and values (``update``), serves that step's attention (``attention``: SDPA, the fused decode
path, or one blocked pass over a prompt chunk) and evicts right after it. The attention functions
transformers calls (:func:`kvpolicy_sdpa_attention`, :func:`scoped_attention`) live here too,
beside the layer they hand the step to; :mod:`.attention` registers them.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvpolicy.policy import EvictionPolicy
from kvpolicy.statistics import Rotary
from kvpolicy_torch import LayerCache, LayerGroup, PrefixShift, prefill_attention, received_attention
from kvpolicy_torch.attention import window_bias, window_chunk_mask, window_limit
from kvpolicy_torch.posshift import RopeShift, ShiftMatrices
from kvpolicy_torch.queries import PreRope
from kvpolicy_torch.static import StepOptions, device_total

from ..capabilities import LayerAttention, RopeLayout

PositionsMode = Literal["original", "cache"]

ATTENTION_NAME = "kvpolicy_sdpa"
#: The attention implementation a model runs under while (and only while) a forward is given an
#: :class:`EvictingCache`: see :func:`scope_attention`.
SCOPED_ATTENTION_NAME = "kvpolicy_evicting"
#: The keyword :meth:`EvictingLayer.update` adds to the attention call's kwargs: the layer itself.
#: transformers hands the attention module's kwargs to ``cache.update(..., kwargs=kwargs)`` and
#: then unpacks the same dict into the attention function, so the attention finds its layer
#: without any global state (and a compiled step traces it as a plain argument).
LAYER_KWARG = "kvpolicy_layer"
#: attention modules (those with a ``layer_idx``) -> their model's scope (the forward hooks of
#: :func:`kvpolicy_integrations.hf.scope_attention`, which fills it), for models whose attention does
#: not pass its kwargs to ``cache.update`` (see :func:`scoped_attention`): the scoped attention reads the
#: scope's ``check_thread()`` and ``cache`` (the cache of the forward in flight)
ATTENTION_SCOPES: "weakref.WeakKeyDictionary[torch.nn.Module, Any]" = weakref.WeakKeyDictionary()


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
    """The ``"kvpolicy_sdpa"`` attention: an :class:`EvictingLayer`'s attention when the cache
    handed it over (:attr:`LAYER_KWARG`), else transformers' SDPA (a model loaded with
    ``attn_implementation="kvpolicy_sdpa"`` serves any other cache as an SDPA model would)."""
    layer = kwargs.pop(LAYER_KWARG, None)
    if layer is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    return layer.attention(module, query, key, value, dropout=dropout, scaling=scaling, **kwargs)


def scoped_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention a model runs under during a forward given an :class:`EvictingCache`."""
    layer = kwargs.pop(LAYER_KWARG, None)
    if layer is None:
        # a model whose attention does not pass its kwargs to cache.update (GPT-NeoX and a few
        # others): the layer of the same index in the cache of the forward in flight
        scope = ATTENTION_SCOPES.get(module)
        index = getattr(module, "layer_idx", None)
        if scope is not None:
            scope.check_thread()  # (another thread's forward without our cache, under our switch)
        if scope is not None and scope.cache is not None and isinstance(index, int) and index < len(scope.cache.layers):
            layer = scope.cache.layers[index]
    if layer is None:
        raise RuntimeError(
            f"layer {getattr(module, 'layer_idx', '?')}: an EvictingCache is in use but this attention was not handed "
            f"its cache layer: the model's attention does not pass its kwargs to cache.update(..., kwargs=kwargs), "
            f"as transformers' decoder models do; kvpolicy cannot serve this model"
        )
    return layer.attention(module, query, key, value, dropout=dropout, scaling=scaling, **kwargs)


#: What SDPA takes and :func:`~kvpolicy_torch.decode_attention` does not (see :func:`_fusable`).
_SDPA_ONLY = frozenset({"position_bias", "softcap"})


def _fusable(kwargs: dict[str, Any]) -> bool:
    """Whether a decode step may take :func:`~kvpolicy_torch.decode_attention` (nothing
    SDPA-specific such as a position bias or softcap: :data:`_SDPA_ONLY` given as ``None`` is nothing)."""
    return all(kwargs.get(name) is None for name in _SDPA_ONLY)


def _unfusable_message(module: torch.nn.Module, dropout: float, kwargs: dict[str, Any]) -> str:
    """Why a decode step cannot take :func:`~kvpolicy_torch.decode_attention`: what it was given
    (an attention dropout is a model in training mode: say ``model.eval()``)."""
    given = []
    if dropout:
        mode = " (the model is in training mode: call model.eval() before decoding)" if module.training else ""
        given.append(f"attention dropout {dropout:g}{mode}")
    if kwargs.get("softcap") is not None:
        given.append(f"softcap={kwargs['softcap']!r}")
    if kwargs.get("position_bias") is not None:
        given.append("a position bias (position_bias)")
    return f"kvpolicy's decode attention takes no dropout, softcap or position bias; got {'; '.join(given)}"


@dataclass
class Padding:
    """The padding of the forward in flight, shared by the layers of one :class:`EvictingCache`:
    ``valid`` ``[batch, q]`` (False: pad) and per-row real counts, or ``None`` for none. ``serial``
    counts forwards, so a layer never reuses the padding of an earlier forward."""

    valid: torch.Tensor | None = None
    real: list[int] | None = None
    q: int = 0
    serial: int = 0


class ForwardScope:
    """Whether a model's forward is using the layers of one :class:`EvictingCache` (its hooks
    :meth:`enter` and :meth:`leave`), and the model the cache was built for, shared by the cache and
    its layers: a layer's ``update`` (transformers' ``Cache.update`` hands it the call) tells a call
    from inside a forward from one made by hand, without reaching back into the cache.

    Args:
        built_for: the model the cache serves (a weak reference is kept; ``None``: built from a
            config, or a copy).

    Example:
        >>> scope = ForwardScope()
        >>> scope.enter(); inside = scope.inside; scope.leave()
        >>> inside, scope.inside
        (True, False)
    """

    def __init__(self, built_for: torch.nn.Module | None = None) -> None:
        self._busy = threading.Lock()  # one forward at a time
        self._built_for = weakref.ref(built_for) if built_for is not None else None
        #: a hooked forward holds the layers (an attribute: every layer's update reads it)
        self.active = False

    @property
    def for_model(self) -> bool:
        """Whether the cache was built for a model (not from a config, not a copy)."""
        return self._built_for is not None

    @property
    def built_for(self) -> torch.nn.Module | None:
        """The model the cache was built for (``None``: none, or that model is gone)."""
        return None if self._built_for is None else self._built_for()

    @property
    def inside(self) -> bool:
        """A hooked forward holds the layers (:attr:`active`), or a compiled step runs (its hooks
        do not run)."""
        return self.active or torch.compiler.is_compiling()

    def enter(self) -> None:
        """A forward starts using the layers: one at a time (``RuntimeError`` otherwise)."""
        if not self._busy.acquire(blocking=False):
            raise RuntimeError(
                "this EvictingCache is already in use by another forward (another thread?): a cache holds one "
                "sequence's state; give each thread its own cache"
            )
        self.active = True

    def leave(self) -> None:
        """The forward that :meth:`enter`-ed has ended."""
        if self._busy.locked():
            self.active = False
            self._busy.release()

    def __getstate__(self) -> dict[str, Any]:
        return {}  # a lock and a weak reference: a copy is free and serves a model of the same shape

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]


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
        pre_rope: PreRope | None = None,
        group: LayerGroup | None = None,
        prefill_chunk: int | None = None,
        pooled_capacity: int | None = None,
        scope: ForwardScope | None = None,
    ) -> None:
        super().__init__()
        self.policy = policy
        self.layer_idx = layer_idx
        #: the forward using this layer's cache (shared by its layers): who may call update
        self.scope = scope if scope is not None else ForwardScope()
        self.positions_mode = positions
        self.shift_matrices = shift_matrices if shift_matrices is not None else ShiftMatrices()
        #: this layer's RoPE, the one description of it (pos-shift rotations, Expected Attention's
        #: rotation back, the static step's prefix): the measured layout, its frequencies read at
        #: each use (dynamic scaling updates them), else (an explicit inv_freq) full half-split
        #: RoPE, else ``None`` (a NoPE layer: positions do not enter its scores)
        self.rope_shift: RopeShift | None = None
        if rope is not None:
            self.rope_shift = RopeShift(rope, rope.style, rope.rotary_dim, layer_idx, self.shift_matrices)
        elif inv_freq is not None:
            self.rope_shift = RopeShift(inv_freq, "half", None, layer_idx, self.shift_matrices)
        # keys move under pos-shift (positions="cache"), except in a NoPE layer
        self.shifts = positions == "cache" and self.rope_shift is not None
        # pos-shift of StreamingLLM's sinks is done in the storage (their keys rotated when the
        # shift changes): the decode step then attends with plain SDPA
        self.store = LayerCache(
            policy, reduce_scores=reduce_scores, static_shapes=static_shapes, reserve=reserve,
            key_shift=self.rope_shift if self.shifts else None, group=group, prompt_chunk=prefill_chunk,
            pooled_capacity=pooled_capacity,
        )
        #: Expected Attention's queries rotated back to before RoPE (one rotation a step for all layers)
        self.pre_rope = pre_rope if pre_rope is not None else PreRope()
        #: this layer's attention pattern (full, or a sliding or chunked window)
        self.attention_kind = attention if attention is not None else LayerAttention("full")

        self.fused_decode = fused_decode
        # what the policy needs of each attention call, fixed for the layer's life (read per step)
        self.observes, self.captures = policy.observes_queries, policy.captures_attention
        self.padding = padding if padding is not None else Padding()
        self.pending = False
        #: the step :meth:`update` appended runs on the device (a static-shaped decode step): the
        #: attention that follows takes it there, without asking the store again
        self.device_step = False
        self._seen_serial = -1
        self._prefix: PrefixShift | None = None
        #: What a static-shaped decode step of this layer adds to plain attention (fixed for the
        #: layer's life, so a compiled step traces it as constants).
        self.step_options: StepOptions = self._make_step_options()
        #: a ``[]`` device total of a log-n policy's attention outputs since the last reset, not
        #: finite where some output was not (see :meth:`EvictingCache.report_nonfinite`); ``None``
        #: before the first
        self.nonfinite: torch.Tensor | None = None

    # transformers' base classes assign self.keys / self.values; they live in the store here.
    @property  # type: ignore[override]
    def keys(self) -> torch.Tensor | None:
        """The kept keys in position order, transformers' shape ``[batch, kv_heads, length,
        head_dim]`` (``None`` before the first update). ``length`` is the most any row keeps: after
        a left-padded prompt a row keeping fewer has zeros in front of its keys, where
        ``DynamicCache`` has its pad columns; :attr:`kept_mask` says which are kept tokens
        (:attr:`kvpolicy_torch.LayerCache.keys`)."""
        return self.store.keys if self.store.is_initialized else None

    @keys.setter
    def keys(self, value: Any) -> None:
        if value is not None:
            raise AttributeError("EvictingLayer.keys is read-only; use update()")

    @property  # type: ignore[override]
    def values(self) -> torch.Tensor | None:
        """The kept values, laid out as :attr:`keys`."""
        return self.store.values if self.store.is_initialized else None

    @property
    def kept_mask(self) -> torch.Tensor | None:
        """``[batch, kv_heads, length]`` bool: which entries of :attr:`keys` and :attr:`values` are
        kept tokens (False: a row or head that keeps fewer than the longest, e.g. after a
        left-padded prompt); ``None`` before the first update.

        Example:
            >>> from kvpolicy import FullCache
            >>> from kvpolicy_integrations.hf import EvictingCache, cache_kwargs
            >>> from kvpolicy_tools.models import tiny_llama
            >>> model = tiny_llama()
            >>> cache = EvictingCache(FullCache(), model)
            >>> mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])  # row 0: two left pads
            >>> _ = model(torch.arange(1, 11).view(2, 5), attention_mask=mask, **cache_kwargs(model, cache))
            >>> layer = cache.layers[0]
            >>> tuple(layer.keys.shape), layer.kept_mask[:, 0].long().tolist()
            ((2, 2, 5, 16), [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
        """
        return self.store.kept_mask if self.store.is_initialized else None

    @values.setter
    def values(self, value: Any) -> None:
        if value is not None:
            raise AttributeError("EvictingLayer.values is read-only; use update()")

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, kwargs: dict[str, Any] | None = None,
        **extra: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``[batch, kv_heads, q, head_dim]`` keys/values; return the slots the queries attend.

        transformers' ``Cache.update`` hands each call of a model's attention here. ``kwargs``: the
        attention module's keyword arguments, which transformers then unpacks into the attention
        function: this layer adds itself there (:data:`LAYER_KWARG`), so that :meth:`attention`
        serves the call that follows (inside a forward the cache's hooks saw, a model whose
        attention passes none, GPT-NeoX's, gets an empty dict). A call without them outside such a
        forward is one made by hand, and is refused (``RuntimeError``, nothing appended): the
        layer evicts only after the step's attention, so such an append would hold the keys past
        the policy's capacity; so is a forward of another model than the one the cache was built
        for (:attr:`scope`). A caller that runs the attention itself, on a layer not built for a
        model (standalone, or a cache made from a config), passes ``kwargs={}``, then calls
        :meth:`attention` or :meth:`finish_received`."""
        if kwargs is None or not self.scope.active:  # (compiled: traced once, _outside_forward lets it by)
            kwargs = self._outside_forward(kwargs)
        kwargs[LAYER_KWARG] = self
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
        if q == 1 and self.store.static_shapes:
            # a static-shaped decode step: device bookkeeping only (kvpolicy_torch.static); the
            # first step after no prompt takes the host path inside append (on_device stays False)
            keys, values = self.store.append(key_states, value_states)
            self.device_step = self.store.on_device
            if self.device_step:
                self.pending = True
                return keys, values
            self._prefix = None  # (a first step without a prompt: the host path below)
            return self._finish_update(keys, values)
        self.device_step = False
        pad = self.padding
        valid = real = None
        if q > 1 and pad.serial != self._seen_serial:  # the padding noted for this forward (once per layer)
            self._seen_serial = pad.serial
            if pad.valid is not None and pad.q == q and q > 1:
                valid, real = pad.valid, pad.real
        keys, values = self.store.append(key_states, value_states, valid=valid, real=real)
        self._prefix = None
        if not self.shifts:  # (most layers: no pos-shift to describe, one call fewer a step)
            self.pending = True
            return keys, values
        return self._finish_update(keys, values)

    def _outside_forward(self, kwargs: dict[str, Any] | None) -> dict[str, Any]:
        """:meth:`update` without kwargs or outside a hooked forward: the kwargs to go on with, or
        ``RuntimeError`` (nothing appended) for a call made by hand."""
        scope = self.scope
        if scope.inside:  # (kwargs None: a model whose attention passes none, GPT-NeoX: its layer is found by index)
            return {} if kwargs is None else kwargs
        if kwargs is None:
            raise RuntimeError(
                f"layer {self.layer_idx}: update() was called by hand, outside a model's forward, which is "
                f"not supported: an evicting layer appends a step's keys and values and evicts by that step's attention, "
                f"which only the model's forward computes (an append without it holds the keys past the policy's "
                f"capacity). Run the model with the cache (model(ids, cache=cache) or model.generate(..., cache=cache)); to "
                f"append keys and values by hand, use transformers' DynamicCache. (To drive a layer by hand: "
                f"cache.layers[i].update(keys, values, kwargs={{}}) on a cache made from a config, then attention(module, "
                f"query, keys, values) or finish_received(scores). A model whose attention calls cache.update() without "
                f"kwargs=, as GPT-NeoX's does, is served when the cache is given the model itself: EvictingCache(policy, "
                f"model).)"
            )
        if scope.for_model:
            mine = scope.built_for
            raise RuntimeError(
                f"layer {self.layer_idx}: a forward that did not go through the hooks of the model this EvictingCache was "
                f"built for ({type(mine).__name__ if mine is not None else 'a model that is gone'}) updates it: a cache "
                "serves the model it was built for (make one per model: EvictingCache(policy, model)), given as "
                "cache= or past_key_values= (a cache passed positionally is not seen by the hooks)"
            )
        return kwargs

    def _finish_update(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.shifts and not self.store.keys_shifted:  # (keys_shifted: the store moved the sinks already)
            shift = self.store.shift()
            if isinstance(shift, PrefixShift):
                if shift.length and any(shift.delta):
                    self._prefix = shift  # the attention rotates the query back for those slots
            else:
                keys = self._rotate(keys, shift)
        self.pending = True
        return keys, values

    def attention(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        dropout: float = 0.0,
        scaling: float | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        """The attention of the step :meth:`update` just appended, then its scores and eviction:
        what the attention function calls (transformers passes no cache to attention functions;
        :meth:`update` hands this layer over through the call's kwargs).

        The mask comes from the layer's slots (holes, pads, causal order inside a prompt chunk,
        a sliding window on original positions), not from transformers: slot order is not
        sequence order once tokens are evicted.

        Returns:
            ``(output [batch, q, q_heads, head_dim], None)``: no attention weights.
        """
        if not self.pending:
            raise ValueError(
                f"layer {self.layer_idx}: the model's attention ran more than once for one cache update (e.g. DiffLlama's "
                f"differential attention): not softmax attention over a KV cache as kvpolicy serves it"
            )
        self.pending = False
        store, log_n = self.store, self.policy.log_n
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        if self.observes:  # Expected Attention: the queries' running moments, before evict()
            self.observe_queries(query, kwargs.get("position_ids"))
        if self.device_step:  # a static-shaped decode step: one graph (kvpolicy_torch.static)
            if dropout or (_SDPA_ONLY & kwargs.keys() and not _fusable(kwargs)):  # (asked only if given: every step traces this)
                raise ValueError(_unfusable_message(module, dropout, kwargs))
            out = store.attend(query, scale, options=self.step_options)
            store.evict()
            return (out if log_n is None else self._flag_nonfinite(out)), None
        q_len = query.shape[2]
        uses_scores = self.captures  # (scores from keys: no capture, the store computes them)
        if q_len == 1:
            # (two host checks first: most layers have no window and no shifted prefix)
            window = None if self.attention_kind.kind == "full" else self.window_bias()
            prefix = None if self._prefix is None else self.take_prefix(query)
            # log n: n = the keys the query attends to (paper, section 3.5): the row's kept tokens
            scales = [log_n.scale(n) for n in store.lengths] if log_n is not None else None
            if scales is not None and all(x == scales[0] for x in scales):
                # every row attends to as many keys (one row, always): one logit scale, which SDPA
                # and the store's grouped step take as they take the plain one (a tensor of row
                # scales costs BUZZ with log n ~7% of its decode step at 2,048 tokens)
                scale, scales = scale * scales[0], None
            sdpa = not (uses_scores and self.fused_decode) and window is None and prefix is None
            if sdpa and scales is None and not store.has_holes:  # (has_holes: no bias tensor made to ask)
                # SDPA: nothing to mask or shift, and no scores wanted (or the unfused path asked for)
                out, _ = sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scale, **kwargs)
                if uses_scores:
                    store.accumulate_query(received_attention(query, key, scale), query.shape[1] // key.shape[1])
                store.evict()  # (finish_received(None): the step's scores are in)
                return (out if log_n is None else self._flag_nonfinite(out)), None
            if dropout or (_SDPA_ONLY & kwargs.keys() and not _fusable(kwargs)):  # (asked only if given: every step)
                raise ValueError(_unfusable_message(module, dropout, kwargs))
            row_scale = torch.tensor(scales, device=query.device) if scales is not None else None
            out = store.attend(query, scale, extra_bias=window, row_scale=row_scale, prefix=prefix)
            store.evict()
            return (out if log_n is None else self._flag_nonfinite(out)), None
        # the first chunk of a prompt (no pads, nothing held before it, every key inside this
        # layer's window): plain causal over its own keys, SDPA's causal kernel (an explicit mask
        # costs a 2,048-token prefill ~2.4x the attention time: every masked block computed)
        causal = store.chunk_causal and self._window_limits() is None
        mask = None if causal else self.window_chunk_mask(store.chunk_mask())
        query_scale = None if log_n is None else store.chunk_log_n_scales(log_n)
        if (uses_scores and self.policy.prompt_rows is None and self.history is None and not dropout and _fusable(kwargs)
                and query.dtype in (torch.float32, torch.float64) and key.dtype == value.dtype == query.dtype):
            # every prompt row's attention wanted (H2O, BUZZ): the output and the received sums in
            # one blocked pass (SDPA and then a second pass over the logits cost 1.3-1.4x a plain
            # prefill at 2,048 tokens); 16-bit inputs keep SDPA (their softmax wants float32)
            out, received = prefill_attention(query, key, value, scale, query_scale=query_scale, mask=mask,
                                              query_valid=store.query_valid)
            self.finish_received(received)
            return (out if log_n is None else self._flag_nonfinite(out)), None
        sdpa_query = query if query_scale is None else query * query_scale[:, None, :, None].to(query.dtype)
        if causal:  # (the mask kvpolicy builds is causal whatever the module says)
            kwargs = {**kwargs, "is_causal": True}
        sdpa_mask = mask
        if mask is not None and mask.shape[1] not in (1, query.shape[1]):  # per KV head (AdaKV): each query head its group's
            sdpa_mask = mask.repeat_interleave(query.shape[1] // mask.shape[1], dim=1)
        out, _ = sdpa_attention_forward(module, sdpa_query, key, value, sdpa_mask, dropout=dropout, scaling=scale, **kwargs)
        received = None
        if uses_scores:
            received = received_attention(
                query, key, scale, query_scale=query_scale, mask=mask, query_valid=store.query_valid,
                rows=self.policy.prompt_rows, history=self.history,
            )
        self.finish_received(received)
        return (out if log_n is None else self._flag_nonfinite(out)), None

    def _flag_nonfinite(self, out: torch.Tensor) -> torch.Tensor:
        """BUZZ's log n: the logits times the scale may overflow (paper, section 3.5), which makes
        the probabilities NaN (their scores then rank lowest, the NaN rule): flagged on the device
        (no host read in the decode path), reported by EvictingCache.report_nonfinite."""
        if self.nonfinite is None:
            # (float32 for 16-bit outputs, whose sum would overflow; float64 for float64 ones)
            self.nonfinite = device_total(out.device, torch.float64 if out.dtype == torch.float64 else torch.float32)
        # (a sum: 2 small kernels a layer and step where isfinite-all-not-or took 4; an output is
        # a convex combination of the values, whose sum does not overflow where they are finite)
        self.nonfinite.add_(out.sum(dtype=self.nonfinite.dtype))
        return out

    def observe_queries(self, query: torch.Tensor, position_ids: torch.Tensor | None = None) -> None:
        """Expected Attention: hand the store this step's queries ``[batch, q_heads, q, head_dim]``
        rotated back to before RoPE (:meth:`LayerCache.observe_queries`). Each query is rotated
        by minus the position the model rotated it by (``position_ids`` when the attention is
        given them, else its position in the store), angles only (a scaled RoPE's magnitude factor
        stays, as it does in the cached keys); pads are not counted. The layer's RoPE layout goes
        with them, for the scores' rotation averaged over the next positions (none in a NoPE layer)."""
        store = self.store
        rope = self.rope_shift
        rotary = None if rope is None else Rotary(rope.inv_freq, rope.style, rope.rotary_dim)
        b, _, q, d = query.shape
        host = store.host_positions(q)  # (an eager decode step's, as ints: no tensor made)
        if host is not None and rotary is not None and position_ids is not None:
            # the rotation back goes with the query (one matrix a forward, shared by the layers)
            # and is applied when the sums take it: a step between two scorings holds it only
            inverse = self.pre_rope.inverse(position_ids, rotary.inv_freq, b, d, style=rotary.style,
                                            rotary_dim=rotary.rotary_dim, step=self.padding.serial)
            store.observe_queries(query, host, rotary, inverse=inverse)
            return
        positions = store.query_positions(q)  # [batch, q], -1 at pads
        rotated = positions if position_ids is None else position_ids.to(positions.device)
        pre_rope = query if rotary is None else self.pre_rope.unrotate(
            query, rotated, rotary.inv_freq, style=rotary.style, rotary_dim=rotary.rotary_dim, step=self.padding.serial)
        store.observe_queries(pre_rope, positions, rotary)

    def _make_step_options(self) -> StepOptions:
        kind, w = self.attention_kind.kind, self.attention_kind.window
        window = (kind, int(w)) if kind != "full" and w is not None else None
        rope = None
        rule = self.policy.decode_eviction
        if self.shifts and rule is not None and rule.victim == "oldest" and rule.sink > 0:
            assert self.rope_shift is not None  # (self.shifts says so)
            rope = (self.rope_shift.inv_freq, self.rope_shift.style, self.rope_shift.rotary_dim)
        return StepOptions(window=window, log_n=self.policy.log_n, shift_prefix=rule.sink if rope is not None else 0,
                           rope=rope)

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
        return x if self.rope_shift is None else self.rope_shift.rotate(x, delta)

    def _window_limits(self) -> list[int] | None:
        """Per row, the newest original position a query can no longer see in this sliding or
        chunked layer (:func:`~kvpolicy_torch.attention.window_limit`), or ``None`` when no kept
        token can be outside the window yet (host ints only)."""
        kind, w = self.attention_kind.kind, self.attention_kind.window
        if kind == "full" or w is None:
            return None
        newest = [s - 1 for s in self.store.seen]  # the query's original position in each row
        if max(newest) < w:
            return None  # every position so far is inside the window (or the first chunk)
        return [window_limit(p, kind, int(w)) for p in newest]

    def window_bias(self) -> torch.Tensor | None:
        """A decode step's additive bias ``[batch, kv_heads, n]`` for this sliding or chunked layer
        (:func:`~kvpolicy_torch.attention.window_bias`: ``-inf`` at kept tokens whose *original*
        position lies outside the window; the holes' ``-inf`` is the store's); ``None`` when no
        kept token can be outside it yet."""
        limits = self._window_limits()
        return None if limits is None else window_bias(self.store.slot_positions, limits)

    def window_chunk_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """A prompt chunk's boolean mask ``[batch | 1, 1 | kv_heads, q, n]`` restricted to this
        layer's sliding window or chunk (:func:`~kvpolicy_torch.attention.window_chunk_mask`)."""
        if self._window_limits() is None:
            return mask
        return window_chunk_mask(mask, self.store.slot_positions, self.attention_kind.kind, int(self.attention_kind.window))  # type: ignore[arg-type]

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

    def get_seq_length(self) -> int | torch.Tensor:  # type: ignore[override]
        """Columns seen so far, pads included (positions of new tokens start here), not the cached
        length; a ``[]`` device tensor inside a compiled static-shaped step
        (:attr:`LayerCache.sequence_length`)."""
        return self.store.sequence_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(columns + query_length, 0)``; no 4-D mask is built from it (the forwards of an
        :class:`EvictingCache` run under a mask function that builds none, :func:`scope_attention`).
        Static shapes: ``(slots + query_length, 0)``, the same at every step."""
        if self.store.static_shapes and self.store.is_initialized:
            return self.store.slots + query_length, 0
        return self.store.columns + query_length, 0

    def get_max_length(self) -> int:
        cap = self.policy.capacity
        return -1 if cap is None else cap

    def reset(self) -> None:
        self.store.reset()
        self.pending = self.device_step = False
        self.is_initialized = False
        self.nonfinite = None

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
