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
* :func:`scope_attention`: the model runs kvpolicy's attention only during the forwards given an
  :class:`EvictingCache` (forward hooks), and its own everywhere else; each layer hands itself to
  its attention through the kwargs transformers passes to ``cache.update`` (no global state).
* ``static_shapes=True``: a decode step is one graph (``torch.compile(fullgraph=True)``, CUDA
  graphs): :func:`compile_decode_step`, :func:`greedy_decode`, :meth:`EvictingCache.settle`.
* :func:`generate`: the one-line helper.

Positions: ``get_seq_length`` is the number of tokens *seen* (like transformers' own
sliding-window layer), so positions built from it stay right after eviction, and
``get_mask_sizes`` reports the cached length plus the query, which is what ``update`` returns.
Two position modes: ``"original"`` (a key keeps the RoPE position it was computed at; default for
H2O and BUZZ) and ``"cache"`` (StreamingLLM's pos-shift: keys are re-rotated so that the
distances between query and keys are distances between cache slots).
"""

from __future__ import annotations

import inspect
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Sequence

import torch
from transformers import AttentionInterface, PretrainedConfig
from transformers.cache_utils import Cache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvpolicy.validation import check_bool, check_float, check_int
from kvpolicy.budget import make_policy
from kvpolicy.driver import NonFiniteWarning
from kvpolicy.policy import EvictionPolicy, check_eviction_policy
from kvpolicy.statistics import Rotary
from kvpolicy_torch import LayerCache, LayerGroup, PrefixShift, prefill_attention, received_attention, rope_matrix, rope_rotate
from kvpolicy_torch.queries import PreRope
from kvpolicy_torch.static import StepOptions, device_flag

from .capabilities import (
    LayerAttention, ModelCapabilities, RopeLayout, cache_kwargs, detect, last_logits_kwargs, model_layers, query_rotations,
    rope_layouts, text_config,
)
from .reconstruction import reconstruct, repeat_prompts

__all__ = [
    "ATTENTION_NAME",
    "LAYER_KWARG",
    "PREFILL_CHUNK",
    "SCOPED_ATTENTION_NAME",
    "EvictingCache",
    "EvictingLayer",
    "GenerationResult",
    "ShiftMatrices",
    "cache_kwargs",
    "compile_decode_step",
    "generate",
    "greedy_decode",
    "model_layers",
    "output_projections",
    "register_attention",
    "scope_attention",
    "use_kvpolicy_attention",
]

ATTENTION_NAME = "kvpolicy_sdpa"
#: The attention implementation a model runs under while (and only while) a forward is given an
#: :class:`EvictingCache`: see :func:`scope_attention`.
SCOPED_ATTENTION_NAME = "kvpolicy_evicting"
#: The keyword :meth:`EvictingLayer.update` adds to the attention call's kwargs: the layer itself.
#: transformers hands the attention module's kwargs to ``cache.update(..., kwargs=kwargs)`` and
#: then unpacks the same dict into the attention function, so the attention finds its layer
#: without any global state (and a compiled step traces it as a plain argument).
LAYER_KWARG = "kvpolicy_layer"
PositionsMode = Literal["original", "cache"]
#: Tokens per forward when :func:`generate` and :func:`greedy_decode` prefill a longer prompt
#: (their ``prefill_chunk``; ``None`` or ``0``: the whole prompt in one forward). An
#: :class:`EvictingCache` given the same ``prefill_chunk`` (its default) then holds at most the
#: policy's capacity plus one chunk during the prefill, whatever the prompt's length; a one-shot
#: prefill holds the whole prompt for a moment, and is faster (each later chunk attends through a
#: mask over the tokens kept before it): docs/performance.md, "Prefill (time to first token)".
PREFILL_CHUNK = 512


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


def _scoped_attention(
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
        scope = _ATTENTION_SCOPE.get(module)
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


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """The mask function of a forward given an :class:`EvictingCache`: no 4-D mask is built (each
    layer masks from its own slots; the padding reaches the cache from the forward's arguments)."""
    return None


def register_attention() -> str:
    """Register ``"kvpolicy_sdpa"`` (and the scoped implementation an :class:`EvictingCache`'s
    forwards run under) in transformers' attention and mask interfaces (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, kvpolicy_sdpa_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    AttentionInterface.register(SCOPED_ATTENTION_NAME, _scoped_attention)
    AttentionMaskInterface.register(SCOPED_ATTENTION_NAME, _no_mask)
    return ATTENTION_NAME


register_attention()


def use_kvpolicy_attention(model: torch.nn.Module) -> None:
    """Switch ``model`` to ``"kvpolicy_sdpa"`` for good (what ``attn_implementation="kvpolicy_sdpa"``
    at load time does): it serves an :class:`EvictingCache` given only the model's config, and
    any other cache as SDPA. Not needed when :class:`EvictingCache` is given the model itself,
    which scopes the switch to its own forwards (:func:`scope_attention`)."""
    register_attention()
    if getattr(model.config, "_attn_implementation", None) != ATTENTION_NAME:
        _set_implementation(model, ATTENTION_NAME)


def _switch_attention(config: PretrainedConfig, name: str) -> None:
    """Set ``config``'s attention implementation for the forward in flight: the one place kvpolicy
    writes transformers' ``config._attn_implementation`` (docs/design.md, "The attention switch").
    The public ``model.set_attn_implementation`` validates the name and walks every submodule at
    each call (about a millisecond on a 30-layer model) and cannot run inside a compiled step, so
    the scope's hooks, which run at every forward (compiled ones included), write the config's
    own setter directly; :func:`scope_attention` has validated both names once, through
    ``set_attn_implementation``."""
    config._attn_implementation = name


def _set_implementation(model: torch.nn.Module, name: str) -> None:
    try:
        model.set_attn_implementation(name)
    except ValueError as exc:  # transformers refuses SDPA for this class (e.g. Git, VaultGemma)
        raise ValueError(
            f"model_type {getattr(model.config, 'model_type', None)!r} cannot use EvictingCache: its attention "
            f"cannot run through SDPA, which kvpolicy's attention is built on (transformers: {exc})"
        ) from exc


class _Scope:
    """The forward hooks of one model (see :func:`scope_attention`).

    The switch is the model config's attention implementation, which every thread running the
    model reads: while one thread's forward holds it, a forward of the same model in another
    thread (with any cache) is refused with a clear error, never served by the wrong attention or
    the wrong cache."""

    def __init__(self) -> None:
        self.owner: torch.nn.Module | None = None  # the module whose forward switched the model
        self.saved: Any = None  # the implementation to put back
        self.cache: EvictingCache | None = None  # the cache of the forward in flight
        self.thread: int | None = None  # the thread of that forward (None inside torch.compile)

    def check_thread(self) -> None:
        """``RuntimeError`` when another thread's forward has switched the model."""
        if self.owner is not None and self.thread is not None and self.thread != threading.get_ident():
            raise RuntimeError(
                "this model is running a forward with an EvictingCache in another thread, which switched the "
                "model's attention implementation (a setting of the model's config, shared by every thread) for that "
                "forward: one model serves one forward with an EvictingCache at a time. Give each thread its own "
                "model (e.g. copy.deepcopy(model)) and cache, or run the forwards one after another (a lock)"
            )

    def before(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.owner is not None:  # (a nested forward of the same model, or another thread's)
            self.check_thread()
            return
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if not isinstance(cache, EvictingCache):
            return
        if kwargs.get("output_attentions", getattr(module.config, "output_attentions", False)):
            # (before anything is appended: the cache is left as it was)
            raise ValueError(
                "output_attentions=True with an EvictingCache: its attention runs over the kept slots (in slot order, "
                "evicted tokens gone), so it has no per-position attention maps to return. Leave output_attentions "
                "off, or read the maps with a transformers cache (DynamicCache); what each kept token received is in "
                "the cache's scores"
            )
        ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        q = (ids if ids is not None else embeds).shape[1]
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        mask = mask if isinstance(mask, torch.Tensor) else None
        compiling = torch.compiler.is_compiling()
        if not compiling:  # (a weak reference is not traced: the eager prompt forward checks it)
            cache.check_model(module)
        positions = kwargs.get("position_ids")
        cache.check_forward(mask, q, kwargs.get("use_cache"), positions if isinstance(positions, torch.Tensor) else None)
        cache.note_padding(mask, q)
        if not compiling:
            cache.enter()  # (last: the post-hook leaves what this hook entered)
        config = module.config
        self.owner, self.saved, self.cache = module, config._attn_implementation, cache
        self.thread = None if compiling else threading.get_ident()
        _switch_attention(config, SCOPED_ATTENTION_NAME)

    def after(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        if self.owner is module and (self.thread is None or self.thread == threading.get_ident()):
            _switch_attention(module.config, self.saved)
            if self.cache is not None and not torch.compiler.is_compiling():
                self.cache.leave()
            self.owner, self.saved, self.cache, self.thread = None, None, None, None

    def interrupted(self, module: torch.nn.Module, error: BaseException) -> None:
        """``module``'s forward ended by ``error`` that torch's ``always_call`` hooks do not see
        (a ``KeyboardInterrupt``, a ``SystemExit``: not an ``Exception``): the model is put back as
        :meth:`after` does, and the cache in flight, which holds part of that forward's step, is
        marked so (:meth:`EvictingCache.interrupted`)."""
        cache = self.cache if self.owner is module else None
        self.after(module, (), {}, None)
        if cache is not None:
            cache.interrupted(error)


class ScopedForward:
    """The ``forward`` of a model under :func:`scope_attention`: the model's own, inside a
    ``try`` whose handler puts the model back when the forward ends by an exception that is not an
    ``Exception`` (``KeyboardInterrupt`` from Ctrl-C, ``SystemExit``). torch runs a module's
    ``always_call`` forward hooks only for an ``Exception``; every other path goes through the
    hooks (:func:`scope_attention`). ``inspect.signature`` sees the model's own forward
    (``__wrapped__``), and a deep copy or a pickle of the model carries it (bound to the copy).

    Example:
        >>> import inspect
        >>> from kvpolicy import H2O
        >>> from kvpolicy_tools.models import tiny_llama
        >>> model = tiny_llama()
        >>> _ = EvictingCache(H2O(4, 4), model)
        >>> isinstance(model.forward, ScopedForward), "attention_mask" in inspect.signature(model.forward).parameters
        (True, True)
    """

    def __init__(self, module: torch.nn.Module, scope: _Scope) -> None:
        self.module = module
        self.scope = scope
        #: a forward another library set on the instance before (accelerate's hooks), else ``None``
        self.inner: Callable[..., Any] | None = module.__dict__.get("forward")

    @property
    def __wrapped__(self) -> Callable[..., Any]:
        return self.inner if self.inner is not None else type(self.module).forward.__get__(self.module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        if torch.compiler.is_compiling():  # (traced: a compiled forward's switch is a side effect applied at its end)
            return self.__wrapped__(*args, **kwargs)
        try:
            return self.__wrapped__(*args, **kwargs)
        except Exception:
            raise  # (torch's always_call hook puts the model back)
        except BaseException as error:
            self.scope.interrupted(module, error)
            raise


_SCOPED: "weakref.WeakKeyDictionary[torch.nn.Module, _Scope]" = weakref.WeakKeyDictionary()
#: the attribute of a scoped model holding its scope, so that a deep copy of the model (which
#: copies its hooks, bound to a copy of the scope) is known as scoped and not hooked twice
SCOPE_ATTRIBUTE = "kvpolicy_attention_scope"
#: attention modules (those with a ``layer_idx``) -> their model's scope, for models whose
#: attention does not pass its kwargs to ``cache.update`` (see ``_scoped_attention``)
_ATTENTION_SCOPE: "weakref.WeakKeyDictionary[torch.nn.Module, _Scope]" = weakref.WeakKeyDictionary()


def scope_attention(model: torch.nn.Module) -> None:
    """Let ``model`` run kvpolicy's attention during the forwards given an :class:`EvictingCache`
    (``cache=`` or ``past_key_values=``), and its own everywhere else (idempotent; the
    :class:`EvictingCache` constructor calls it).

    Two forward hooks on the model (and on its base model, for callers of ``model.model``) switch
    the config's attention implementation when such a forward starts and put the model's own back
    when it ends (even when it raises), and hand the cache the forward's 2-D padding mask. They
    do nothing for any other cache, so the model keeps running transformers' caches eager and
    compiled (``fullgraph=True``), and ``output_attentions=True`` on an eager model. Hooks are
    traced by ``torch.compile`` like the rest of the forward: no global or context state.

    Example:
        >>> from kvpolicy import H2O
        >>> from kvpolicy_tools.models import tiny_llama
        >>> model = tiny_llama()
        >>> cache = EvictingCache(H2O(4, 4), model)
        >>> _ = model(torch.arange(1, 9)[None], **cache_kwargs(model, cache))
        >>> model.config._attn_implementation  # as loaded
        'sdpa'
    """
    register_attention()
    if model in _SCOPED:
        return
    scope = getattr(model, SCOPE_ATTRIBUTE, None)
    if not isinstance(scope, _Scope):  # (a deep copy of a scoped model carries its hooks and their scope)
        saved = model.config._attn_implementation
        # transformers' own checks, which it runs for an SDPA-named implementation: can this class run it?
        _set_implementation(model, ATTENTION_NAME)
        _set_implementation(model, saved)
        scope = _Scope()
        modules = [model]
        base = getattr(model, "base_model", model)
        if isinstance(base, torch.nn.Module) and base is not model:
            modules.append(base)
        for module in modules:
            module.register_forward_pre_hook(scope.before, with_kwargs=True)
            module.register_forward_hook(scope.after, with_kwargs=True, always_call=True)
            module.forward = ScopedForward(module, scope)  # (the paths the always_call hook does not see)
        setattr(model, SCOPE_ATTRIBUTE, scope)
    _SCOPED[model] = scope
    for sub in model.modules():
        if isinstance(getattr(sub, "layer_idx", None), int):
            _ATTENTION_SCOPE[sub] = scope


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
        self._batch: tuple[torch.Tensor, ...] | None = None  # per layer of the batch, its sinks rotated [b, h, s, d]
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
                # unbound once: each layer then takes a view made here (no op a layer)
                self._batch = rope_rotate(torch.stack([self._sinks[l] for l in like]), shifts, inv_freq, style=style,
                                          rotary_dim=rotary_dim).unbind(0)
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
        pre_rope: PreRope | None = None,
        group: LayerGroup | None = None,
        prefill_chunk: int | None = None,
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
            key_shift=self._shift_keys if self.shifts else None, group=group, prompt_chunk=prefill_chunk,
        )
        self.shift_matrices = shift_matrices if shift_matrices is not None else ShiftMatrices()
        #: Expected Attention's queries rotated back to before RoPE (one rotation a step for all layers)
        self.pre_rope = pre_rope if pre_rope is not None else PreRope()
        #: this layer's attention pattern (full, or a sliding or chunked window)
        self.attention_kind = attention if attention is not None else LayerAttention("full")

        self.fused_decode = fused_decode
        # what the policy needs of each attention call, fixed for the layer's life (read per step)
        self.observes, self.captures = policy.observes_queries, policy.captures_attention
        self.padding = padding if padding is not None else Padding()
        self.pending = False
        self._seen_serial = -1
        self._prefix: PrefixShift | None = None
        self._step_options = self._make_step_options()
        #: a ``[]`` bool device flag: some attention output of a log-n policy was not finite since
        #: the last reset (see :meth:`EvictingCache.report_nonfinite`); ``None`` before the first
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

        ``kwargs``: the attention module's keyword arguments, which transformers then unpacks into
        the attention function: this layer adds itself there (:data:`LAYER_KWARG`), so that
        :meth:`attention` serves the call that follows. A call without them is one made by hand,
        outside a model's forward, and is refused (``RuntimeError``, nothing appended): the layer
        evicts only after the step's attention, so such an append would hold the keys past the
        policy's capacity. (:meth:`EvictingCache.update` hands them, an empty dict for a model
        whose attention passes none; a caller that runs the attention itself passes
        ``kwargs={}``, then calls :meth:`attention` or :meth:`finish_received`.)"""
        if kwargs is None:
            raise RuntimeError(
                f"layer {self.layer_idx}: EvictingLayer.update() was called by hand, outside a model's forward, which is "
                f"not supported: an evicting layer appends a step's keys and values and evicts by that step's attention, "
                f"which only the model's forward computes (an append without it holds the keys past the policy's "
                f"capacity). Run the model with the cache (model(ids, cache=cache) or model.generate(..., cache=cache)); to "
                f"append keys and values by hand, use transformers' DynamicCache. (To drive a layer by hand: "
                f"update(keys, values, kwargs={{}}), then attention(module, query, keys, values) or finish_received(scores).)"
            )
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
        if q == 1 and self.store.static_shapes and self.store.is_initialized:
            # a static-shaped decode step: device bookkeeping only (kvpolicy_torch.static)
            keys, values = self.store.append(key_states, value_states)
            if self.store.on_device:
                self.pending = True
                return keys, values
            self._prefix = None  # (a first step without a prompt: the host path below)
            return self._finish_update(keys, values)
        pad = self.padding
        valid = real = None
        if q > 1 and pad.serial != self._seen_serial:  # the padding noted for this forward (once per layer)
            self._seen_serial = pad.serial
            if pad.valid is not None and pad.q == q and q > 1:
                valid, real = pad.valid, pad.real
        keys, values = self.store.append(key_states, value_states, valid=valid, real=real)
        self._prefix = None
        return self._finish_update(keys, values)

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
        out = self._attention(module, query, key, value, dropout=dropout, scaling=scaling, **kwargs)
        if self.policy.log_n is not None:
            # the logits times the log-n scale may overflow (paper, section 3.5), which makes the
            # probabilities NaN (their scores then rank lowest, the NaN rule): flagged on the device
            # (no host read in the decode path), reported by EvictingCache.report_nonfinite
            if self.nonfinite is None:
                self.nonfinite = device_flag(out.device)
            self.nonfinite.logical_or_(~torch.isfinite(out).all())
        return out, None

    def _attention(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                   dropout: float, scaling: float | None, **kwargs: Any) -> torch.Tensor:
        """The body of :meth:`attention`: its output."""
        if not self.pending:
            raise ValueError(
                f"layer {self.layer_idx}: the model's attention ran more than once for one cache update (e.g. DiffLlama's "
                f"differential attention): not softmax attention over a KV cache as kvpolicy serves it"
            )
        self.pending = False
        store = self.store
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        if self.observes:  # Expected Attention: the queries' running moments, before evict()
            self.observe_queries(query, kwargs.get("position_ids"))
        if store.on_device:  # a static-shaped decode step: one graph (kvpolicy_torch.static)
            if dropout or not _fusable(kwargs):
                raise ValueError(_unfusable_message(module, dropout, kwargs))
            out = store.attend(query, scale, options=self.step_options)
            store.evict()
            return out
        q_len = query.shape[2]
        log_n = self.policy.log_n
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
            # (the fused path never needs `plain`: store.bias, a slice, is read only when SDPA may serve)
            sdpa = not (uses_scores and self.fused_decode) and window is None and prefix is None
            if sdpa and store.bias is None and scales is None:
                # SDPA: nothing to mask or shift, and no scores wanted (or the unfused path asked for)
                out, _ = sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scale, **kwargs)
                if uses_scores:
                    store.accumulate_query(received_attention(query, key, scale), query.shape[1] // key.shape[1])
                self.finish_received(None)
                return out
            if dropout or not _fusable(kwargs):
                raise ValueError(_unfusable_message(module, dropout, kwargs))
            row_scale = torch.tensor(scales, device=query.device) if scales is not None else None
            out = store.attend(query, scale, extra_bias=window, row_scale=row_scale, prefix=prefix)
            self.finish_received(None)
            return out
        # the first chunk of a prompt (no pads, nothing held before it, every key inside this
        # layer's window): plain causal over its own keys, SDPA's causal kernel (an explicit mask
        # costs a 2,048-token prefill ~2.4x the attention time: every masked block computed)
        causal = store.chunk_causal and self._window_limits() is None
        mask = None if causal else self.window_chunk_mask(store.chunk_mask())
        query_scale = None if log_n is None else _chunk_log_n_scales(log_n, store, q_len, query.device)
        if (uses_scores and self.policy.prompt_rows is None and self.history is None and not dropout and _fusable(kwargs)
                and query.dtype in (torch.float32, torch.float64) and key.dtype == value.dtype == query.dtype):
            # every prompt row's attention wanted (H2O, BUZZ): the output and the received sums in
            # one blocked pass (SDPA and then a second pass over the logits cost 1.3-1.4x a plain
            # prefill at 2,048 tokens); 16-bit inputs keep SDPA (their softmax wants float32)
            out, received = prefill_attention(query, key, value, scale, query_scale=query_scale, mask=mask,
                                              query_valid=store.query_valid)
            self.finish_received(received)
            return out
        sdpa_query = query if query_scale is None else query * query_scale[:, None, :, None].to(query.dtype)
        if causal:  # (the mask kvpolicy builds is causal whatever the module says)
            kwargs = {**kwargs, "is_causal": True}
        out, _ = sdpa_attention_forward(module, sdpa_query, key, value, mask, dropout=dropout, scaling=scale, **kwargs)
        received = None
        if uses_scores:
            received = received_attention(
                query, key, scale, query_scale=query_scale, mask=mask, query_valid=store.query_valid,
                rows=self.policy.prompt_rows, history=self.history,
            )
        self.finish_received(received)
        return out

    def observe_queries(self, query: torch.Tensor, position_ids: torch.Tensor | None = None) -> None:
        """Expected Attention: hand the store this step's queries ``[batch, q_heads, q, head_dim]``
        rotated back to before RoPE (:meth:`LayerCache.observe_queries`). Each query is rotated
        by minus the position the model rotated it by (``position_ids`` when the attention is
        given them, else its position in the store), angles only (a scaled RoPE's magnitude factor
        stays, as it does in the cached keys); pads are not counted. The layer's RoPE layout goes
        with them, for the scores' rotation averaged over the next positions (none in a NoPE layer)."""
        store = self.store
        positions = store.query_positions(query.shape[2])  # [batch, q], -1 at pads
        rotated = positions if position_ids is None else position_ids.to(positions.device)
        rotary = None
        if self.rope is not None:
            rotary = Rotary(self.rope.inv_freq, self.rope.style, self.rope.rotary_dim)
        elif self.inv_freq is not None:
            rotary = Rotary(self.inv_freq, "half", None)
        pre_rope = query if rotary is None else self.pre_rope.unrotate(
            query, rotated, rotary.inv_freq, style=rotary.style, rotary_dim=rotary.rotary_dim, step=self.padding.serial)
        store.observe_queries(pre_rope, positions, rotary)

    @property
    def step_options(self) -> StepOptions:
        """What a static-shaped decode step of this layer adds to plain attention (fixed for the
        layer's life, so a compiled step traces it as constants)."""
        return self._step_options

    def _make_step_options(self) -> StepOptions:
        kind, w = self.attention_kind.kind, self.attention_kind.window
        window = (kind, int(w)) if kind != "full" and w is not None else None
        rope = None
        rule = self.policy.decode_eviction
        if self.shifts and rule is not None and rule.victim == "oldest" and rule.sink > 0:
            if self.rope is not None:
                rope = (self.rope.inv_freq, self.rope.style, self.rope.rotary_dim)
            else:
                rope = (self.inv_freq, "half", None)
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
        kind, w = self.attention_kind.kind, self.attention_kind.window
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
        kind, w = self.attention_kind.kind, int(self.attention_kind.window)  # type: ignore[arg-type]
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
        self.pending = False
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
        prefill_chunk: the chunk size of a chunked prefill (default :data:`PREFILL_CHUNK`, what
            :func:`generate` and :func:`greedy_decode` feed a long prompt in): when the first
            forward brings exactly this many tokens, a bounded policy's layers allocate room for
            one chunk beyond the capacity, so the cache never holds more than the capacity and one
            chunk during the prefill (:class:`kvpolicy_torch.LayerCache`'s ``prompt_chunk``), and
            gives the room back at the first decode step;
            ``None``: no room (a chunk that does not fit is held beside the storage until evicted).

    Left-padded batches work for every policy: pads are never attended, scored or kept, and each
    row evicts on its own schedule (the 2-D ``attention_mask`` says which tokens are pads).

    Example:
        >>> from kvpolicy import make_policy
        >>> from kvpolicy_tools.models import tiny_llama
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
        prefill_chunk: int | None = PREFILL_CHUNK,
    ) -> None:
        if not isinstance(policy, EvictionPolicy):
            raise ValueError(f"policy must be an EvictionPolicy, got {policy!r}")
        if not isinstance(model, (torch.nn.Module, PretrainedConfig)):
            raise TypeError(f"model must be a transformers model (or its config), got {type(model).__name__} {model!r:.80}")
        caps = detect(model)
        positions = positions or policy.default_positions
        if positions not in ("original", "cache"):
            raise ValueError(f"positions must be 'original' or 'cache', got {positions!r}")
        ropes: list[RopeLayout | None] = [None] * len(caps.layers)
        if positions == "cache" or policy.observes_queries:
            # (Expected Attention rotates each query back to before RoPE and averages RoPE over the next positions)
            if not isinstance(model, torch.nn.Module):
                raise ValueError(
                    f"positions='cache' (pos-shift) and {type(policy).__name__}'s query statistics need the model itself, not "
                    f"only its config: its RoPE layout is measured with one forward"
                    + ("; positions='original' works with a config" if positions == "cache" else "")
                )
            # (a model without RoPE serves Expected Attention with its queries as they are)
            ropes = rope_layouts(model) if positions == "cache" else query_rotations(model)
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1 or None, got {max_tokens!r}")
        fused_decode = check_bool("fused_decode", fused_decode)
        static_shapes = check_bool("static_shapes", static_shapes)
        if static_shapes and positions == "cache":
            rule = policy.decode_eviction
            if rule is None or rule.victim != "oldest":
                raise ValueError(
                    f"static_shapes=True with positions='cache' (pos-shift) serves policies whose decode eviction is "
                    f"'oldest' (StreamingLLM); {policy!r} would re-rotate keys per slot on the host: use "
                    f"positions='original' or static_shapes=False"
                )
        if isinstance(model, torch.nn.Module):
            scope_attention(model)
        #: the model this cache serves (a weak reference; ``None`` when built from a config, or in a
        #: copy: pickle and deepcopy drop it, so a restored cache serves a model of the same shape)
        self.built_for: weakref.ref[torch.nn.Module] | None = weakref.ref(model) if isinstance(model, torch.nn.Module) else None
        self.policy = policy
        #: whether a decode step keeps its shapes (the cache :func:`compile_decode_step` serves)
        self.static_shapes = static_shapes
        self.positions_mode = positions
        self.capabilities: ModelCapabilities = caps
        self.padding = Padding()  # shared by the layers: the padding of the forward in flight
        self._busy = threading.Lock()  # one forward at a time (enter / leave)
        self._reported: set[int] = set()  # layers report_nonfinite has warned about since the last reset
        self._interrupted: str | None = None  # what ended a forward mid-step (interrupted), until reset()
        shift_matrices = ShiftMatrices()  # shared by the layers: pos-shift rotations, built once a step
        pre_rope = PreRope()  # (and the rotation of a step's queries back to before RoPE)
        n_layers = len(caps.layers)
        # shared by the layers: one victim search a decode step for all (static shapes search on the
        # device, each layer in its own graph nodes)
        group = None if static_shapes else LayerGroup(n_layers)
        layers = [
            EvictingLayer(
                policy.for_layer(i, n_layers), i, positions=positions, rope=ropes[i], attention=caps.layers[i], reduce_scores=reduce_scores,
                fused_decode=fused_decode, static_shapes=static_shapes, reserve=max_tokens, padding=self.padding,
                shift_matrices=shift_matrices, pre_rope=pre_rope, group=group,
                prefill_chunk=None if prefill_chunk is None else check_int("prefill_chunk", prefill_chunk, minimum=1),
            )
            for i in range(len(caps.layers))
        ]
        super().__init__(layers=layers)

    @property
    def needs_settle(self) -> bool:
        """Whether compiled decode steps leave work to :meth:`settle` (static shapes, and a bounded
        policy without a one-token decode eviction, BUZZ, Scissorhands; or a storage that may
        still grow: an unbounded policy, or one given a ``max_tokens`` below its capacity)."""
        return any(layer.store.needs_settle for layer in self.layers)

    def settle(self) -> list[list[tuple[int, int]]]:
        """Between compiled decode steps: run the general evictions those steps left to the host,
        and grow a storage the next step would find full (see :attr:`needs_settle`;
        :func:`decode_steps` and :func:`generate` call it). Eager code needs no call: each step
        evicts itself. Returns each layer's rounds."""
        return [layer.store.settle() for layer in self.layers]

    def check_model(self, model: torch.nn.Module) -> None:
        """Refuse a forward of ``model`` (a model or its base model, whose hooks call this) when it
        is not the model this cache was built for (its keys, values and layers are that model's):
        ``ValueError`` naming both."""
        if self.built_for is None:
            return  # built from a config, or a copy
        mine = self.built_for()  # (None: that model is gone, so this one is another)
        if model is not mine and getattr(mine, "base_model", None) is not model \
                and getattr(model, "base_model", None) is not mine:
            raise ValueError(
                f"this EvictingCache was built for another model ({type(mine).__name__ if mine is not None else 'gone'}, "
                f"{len(self.layers)} layers) than "
                f"the one running this forward ({type(model).__name__}): a cache holds one model's keys and values; "
                "make one per model (EvictingCache(policy, model))"
            )

    def check_forward(self, attention_mask: torch.Tensor | None, q_length: int, use_cache: Any,
                      position_ids: torch.Tensor | None = None) -> None:
        """Refuse a forward this cache cannot serve exactly (its hooks call this first): a 4-D mask,
        ``use_cache=False`` (transformers then feeds the whole sequence at every step), or a new
        prompt without :meth:`reset`: a 2-D mask that does not cover the columns this cache has
        seen plus the new ones, or a prompt chunk (``q_length > 1``) without pads whose first
        position lies before a row's tokens seen (``generate()`` passes positions and drops an
        all-ones mask). A one-token decode step reads nothing here (no host sync); a chunk
        without positions or mask whose tokens follow what the cache has seen is a continuation
        for the cache as for the model (transformers' caches cannot tell either)."""
        if self._interrupted is not None:
            raise RuntimeError(
                f"this EvictingCache's last forward was interrupted mid-step ({self._interrupted}): its layers hold part "
                "of that step (some appended, some not, scores half accumulated), so it cannot continue the sequence "
                "exactly; call cache.reset() and run the prompt again (or make a new cache). The model was put back "
                "as it was"
            )
        if use_cache is False:
            raise ValueError(
                "use_cache=False with an EvictingCache: transformers would feed the whole sequence to the cache at every "
                "step (a fine-tuned checkpoint's generation config may say use_cache=False): pass use_cache=True"
            )
        if q_length < 1:
            seen = self.layers[0].store.seen if self.layers[0].store.is_initialized else [0]
            raise ValueError(
                f"this forward brings no new tokens, and this EvictingCache has seen {max(seen)}: generate() given a used "
                "cache feeds the model only the prompt's tokens beyond what the cache has seen, none here. A cache "
                "serves one sequence from its first token: for a new prompt call cache.reset() (or make a new cache)"
            )
        if q_length > 1 and position_ids is not None and self.layers[0].store.is_initialized:
            self._check_positions(attention_mask, q_length, position_ids)
        if attention_mask is None:
            return
        if attention_mask.ndim != 2:
            raise ValueError(
                "EvictingCache builds the attention mask from the kept tokens' positions; this forward got a "
                f"{attention_mask.ndim}-D attention_mask, which cannot be applied to an evicting cache: pass the usual 2-D "
                "padding mask (or none)"
            )
        seen = self.layers[0].store.sequence_length if self.layers[0].store.is_initialized else 0
        if isinstance(seen, int) and attention_mask.shape[1] != seen + q_length:
            raise ValueError(
                f"this EvictingCache has seen {seen} columns, but the forward's attention_mask covers "
                f"{attention_mask.shape[1]} for {q_length} new tokens: a cache serves one sequence (batch) from its first "
                f"token; for a new prompt call cache.reset() (or make a new cache)"
            )

    def _check_positions(self, attention_mask: torch.Tensor | None, q_length: int, position_ids: torch.Tensor) -> None:
        """A prompt chunk's first positions against each row's tokens seen (one host read a chunk)."""
        if attention_mask is not None and attention_mask.ndim == 2 and not bool(attention_mask[:, -q_length:].all()):
            return  # pads in the chunk: the mask check below speaks for it
        seen = self.layers[0].store.seen
        first = position_ids.reshape(-1, position_ids.shape[-1])[:, 0].tolist()
        if len(first) == 1:
            first = first * len(seen)
        for row, (p, s) in enumerate(zip(first, seen)):
            if p < s:
                raise ValueError(
                    f"this EvictingCache has seen {s} tokens in row {row}, but the forward's {q_length}-token chunk starts at "
                    f"position {p}: that is a new prompt, not a continuation (a cache serves one sequence from its first "
                    f"token; generate() given a used cache would feed it only the prompt's tail): call cache.reset() "
                    f"(or make a new cache) for a new prompt"
                )

    def interrupted(self, error: BaseException) -> None:
        """A forward using this cache ended by ``error`` that is not an ``Exception`` (Ctrl-C's
        ``KeyboardInterrupt``), maybe mid-step (:class:`ScopedForward` calls this): the cache is
        released, and its next forward is refused until :meth:`reset`."""
        self._interrupted = type(error).__name__
        self.leave()

    def enter(self) -> None:
        """A forward starts using this cache (its hooks call this): one at a time."""
        if not self._busy.acquire(blocking=False):
            raise RuntimeError(
                "this EvictingCache is already in use by another forward (another thread?): a cache holds one "
                "sequence's state; give each thread its own cache"
            )

    def leave(self) -> None:
        """The forward that :meth:`enter`-ed has ended."""
        if self._busy.locked():
            self._busy.release()

    def report_nonfinite(self) -> list[int]:
        """The layers whose attention output was not finite (NaN or infinite) since the last
        :meth:`reset`, for a policy with log n (BUZZ, paper section 3.5): the logits times the
        log-n scale overflowed the model's dtype. Such a step's probabilities are NaN, so its
        scores follow the NaN rule (they rank lowest: :attr:`kvpolicy.CacheView.ranking_scores`),
        and the model's output from there on means little. A layer flags it on the device (no
        host read in the decode path); this reads the flags (one host read) and warns
        :class:`kvpolicy.driver.NonFiniteWarning` once per layer. :func:`generate`,
        :func:`greedy_decode`, :meth:`lengths`, :meth:`row_lengths` and :meth:`reset` call it.

        Example:
            >>> from kvpolicy import BUZZ
            >>> from kvpolicy_tools.models import tiny_llama
            >>> model = tiny_llama()
            >>> cache = EvictingCache(BUZZ(sink=2, window=8, stride=3, log_n=True), model)
            >>> _ = greedy_decode(model, torch.arange(1, 17)[None], cache, 4)
            >>> cache.report_nonfinite()
            []
        """
        flags = [layer.nonfinite for layer in self.layers]
        present = [i for i, f in enumerate(flags) if f is not None and f.device.type != "meta"]  # (meta: no values)
        if not present:
            return []
        values = torch.stack([flags[i].to("cpu", non_blocking=False) for i in present]).tolist()
        bad = [i for i, v in zip(present, values) if v]
        new = [i for i in bad if i not in self._reported]
        if new:
            self._reported.update(new)
            warnings.warn(
                f"{self.policy!r}: the attention output of layer(s) {new} of this EvictingCache was not finite: the "
                f"logits times the log-n scale overflowed {self.layers[new[0]].store.keys.dtype}. Those steps' "
                "probabilities are NaN; their scores rank lowest (kvpolicy.CacheView.ranking_scores), so such tokens go "
                "first, and the model's outputs from there on are not meaningful: use a larger log_base or "
                "log_floor=0, or run the model in float32",
                NonFiniteWarning,
                stacklevel=2,
            )
        return bad

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["_busy"]  # a lock: a copy gets its own
        state["built_for"] = None  # a weak reference (pickle cannot hold one)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._busy = threading.Lock()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' entry point: layer ``layer_idx`` appends (see :meth:`EvictingLayer.update`)."""
        if not 0 <= layer_idx < len(self.layers):
            raise ValueError(f"layer_idx {layer_idx} is out of range: this EvictingCache was built for {len(self.layers)} layers")
        outside = not torch.compiler.is_compiling() and not self._busy.locked()  # (no hooked forward holds it)
        if outside and kwargs.get("kwargs") is None:
            # transformers' attention passes its kwargs (the attention function finds its layer there): a call
            # without them, outside a forward the hooks saw, is a direct one
            raise RuntimeError(
                f"layer {layer_idx}: EvictingCache.update() was called outside a model's forward, which is not "
                "supported: an evicting cache appends a step's keys and values and then evicts by that step's "
                "attention, which only the model's forward computes (update() is transformers' entry point for a "
                "model's attention). Run the model with the cache (model(ids, cache=cache) or model.generate(..., "
                "cache=cache)); to append keys and values by hand, use transformers' DynamicCache. (A model whose "
                "attention calls cache.update() without kwargs=, as GPT-NeoX's does, is served when the cache is given "
                "the model itself: EvictingCache(policy, model))"
            )
        if outside and self.built_for is not None:
            mine = self.built_for()
            raise RuntimeError(
                f"layer {layer_idx}: a forward that did not go through the hooks of the model this EvictingCache was "
                f"built for ({type(mine).__name__ if mine is not None else 'a model that is gone'}) updates it: a cache "
                "serves the model it was built for (make one per model: EvictingCache(policy, model)), given as "
                "cache= or past_key_values= (a cache passed positionally is not seen by the hooks)"
            )
        if kwargs.get("kwargs") is None:  # a model whose attention passes none (GPT-NeoX): the layer is found by index
            kwargs = {**kwargs, "kwargs": {}}
        return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)

    def note_padding(self, attention_mask: torch.Tensor | None, q_length: int) -> None:
        """Record the padding of the forward about to run (``attention_mask``: the 2-D mask of all
        columns so far, or ``None``). Read once per prompt chunk (one host sync); decode tokens
        (``q_length == 1``) are taken as real, as ``generate()`` makes them."""
        if q_length == 1:
            return  # a decode step: nothing to note (and nothing a compiled step would have to guard on)
        pad = self.padding
        pad.serial += 1
        pad.valid, pad.real, pad.q = None, None, q_length
        if attention_mask is None or attention_mask.ndim != 2:
            return
        valid = attention_mask[:, -q_length:].to(torch.bool)
        real = valid.sum(dim=-1).tolist()
        if any(r != q_length for r in real):
            pad.valid, pad.real = valid, real

    def reset(self) -> None:
        """Forget the sequence (every layer), so that the cache serves a new prompt; a non-finite
        attention not yet reported is reported first (:meth:`report_nonfinite`)."""
        self.report_nonfinite()
        self._reported = set()
        self._interrupted = None
        super().reset()

    def lengths(self) -> list[int]:
        """Kept tokens per layer (the most any row keeps; see :meth:`row_lengths`)."""
        self.report_nonfinite()
        return [max(layer.store.lengths, default=0) for layer in self.layers]

    def row_lengths(self) -> list[list[int]]:
        """Kept tokens per layer and row (rows of a left-padded batch differ)."""
        self.report_nonfinite()
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
            if layer.store.is_initialized:
                total += layer.store.token_bytes * sum(layer.store.seen)
        return total


def output_projections(model: torch.nn.Module) -> list[torch.Tensor]:
    """Each decoder layer's output projection ``W_o`` as :class:`~kvpolicy.CriticalKV` reads it
    (its ``projections``): ``[kv_heads, group, head_dim, hidden]``, the rows of ``o_proj.weight``
    transposed that query head ``g`` of KV head ``h`` multiplies (transformers' GQA layout: query
    head ``h x group + g``), in layer order, detached, on the model's device and dtype.
    ``ValueError`` for a model whose attention modules have no ``o_proj`` (or whose count is not
    the config's layer count).

    Example:
        >>> from kvpolicy_tools.models import tiny_llama
        >>> w = output_projections(tiny_llama(num_layers=2, heads=4, kv_heads=2, head_dim=8, vocab=32))
        >>> len(w), tuple(w[0].shape)
        (2, (2, 2, 8, 32))
    """
    config = text_config(model)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if not isinstance(heads, int) or not isinstance(kv_heads, int) or heads < 1 or kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"output_projections needs the config's num_attention_heads and num_key_value_heads, got {heads!r}, {kv_heads!r}")
    found = {}
    for module in model.modules():
        o_proj, layer = getattr(module, "o_proj", None), getattr(module, "layer_idx", None)
        if isinstance(o_proj, torch.nn.Linear) and isinstance(layer, int):
            found[layer] = o_proj.weight
    layers = model_layers(model)
    if not found or (layers is not None and sorted(found) != list(range(layers))):
        raise ValueError(
            f"output_projections reads each attention layer's o_proj (a Linear, with layer_idx); found "
            f"{len(found)} of {layers} layers in {type(model).__name__}"
        )
    out = []
    for i in sorted(found):
        w = found[i].detach().transpose(0, 1)  # [heads x head_dim, hidden]
        out.append(w.reshape(kv_heads, heads // kv_heads, w.shape[0] // heads, w.shape[1]))
    return out


def compile_decode_step(model: torch.nn.Module, *, mode: str | None = None, backend: str | None = None,
                        dynamic: bool | None = None) -> Callable[..., Any]:
    """``model`` compiled for decode steps: ``torch.compile(model, fullgraph=True)`` (``mode=
    "reduce-overhead"`` adds CUDA graphs on a GPU; ``backend`` ``None``: torch's default backend,
    inductor unless ``torch.compiler.set_default_backend`` says otherwise). With an
    ``EvictingCache(..., static_shapes=True)`` a decode step is one graph for every policy whose
    decode eviction is a :class:`~kvpolicy.DecodeEviction` (and for the others too, whose general
    evictions run between steps: :meth:`EvictingCache.settle`).

    Compile once per model and reuse it across caches and prompts: the first cache's step compiles
    a graph for its exact shapes; the first cache whose storage size, capacity or batch differs
    compiles one more, with those sizes dynamic (torch's automatic dynamic shapes), which then
    serves every other size. So a serving loop over prompts of any length, with capacities
    planned per prompt (:func:`generate` with ``compile=True``), runs on two graphs per policy
    kind. Policies of other kinds (their decode step is other code) compile graphs of their own,
    up to torch's recompile limit for the model's forward (``torch._dynamo.config.recompile_limit``,
    8, shared by every compiled caller of the model): compile a copy of the model for more kinds.
    ``dynamic=False`` specialises every graph to its cache (what a benchmark of one cache wants; at
    most 8 caches of different sizes); ``dynamic`` is ``torch.compile``'s. A step past the limit
    raises a ``ValueError`` saying which (``dynamic=False``'s sizes, or the policy kinds) and what
    to do, from torch's ``FailOnRecompileLimitHit``.

    A cache built without ``static_shapes=True`` is refused (``ValueError``) before anything is
    compiled: its decode step reads host bookkeeping that changes every step, so each step would
    compile a graph of its own.

    Example:
        >>> from kvpolicy import H2O
        >>> from kvpolicy_tools.models import tiny_llama
        >>> model = tiny_llama()
        >>> step = compile_decode_step(model, backend="eager")
        >>> callable(step)
        True
        >>> step(input_ids=torch.tensor([[5]]), cache=EvictingCache(H2O(4, 4), model))
        Traceback (most recent call last):
        ...
        ValueError: cache: compile_decode_step serves an EvictingCache built with static_shapes=True ...
    """
    if dynamic is not None:
        dynamic = check_bool("dynamic", dynamic)
    compiled = torch.compile(model, fullgraph=True, dynamic=dynamic, mode=mode, backend=backend)

    def step(*args: Any, **kwargs: Any) -> Any:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if isinstance(cache, EvictingCache) and not cache.static_shapes:
            raise ValueError(
                "cache: compile_decode_step serves an EvictingCache built with static_shapes=True (one graph a "
                "decode step); this one has static_shapes=False, whose decode step reads host bookkeeping that changes "
                "every step (each step would compile a graph of its own, up to torch's recompile limit): build it with "
                "EvictingCache(..., static_shapes=True), or run the decode steps eagerly (step=model)"
            )
        try:
            return compiled(*args, **kwargs)
        except Exception as error:
            # torch._dynamo.exc.FailOnRecompileLimitHit (torch names it nowhere public): said by name
            if type(error).__name__ != "FailOnRecompileLimitHit":
                raise
            raise ValueError(_recompile_limit_message(dynamic)) from error

    step.__doc__ = f"{type(model).__name__} compiled for decode steps (kvpolicy_integrations.hf.compile_decode_step)."
    return step


def _recompile_limit_message(dynamic: bool | None) -> str:
    """Why a :func:`compile_decode_step` step stopped at torch's recompile limit, and what to do."""
    limit = torch.compiler.config.recompile_limit
    where = f"torch's recompile limit (torch.compiler.config.recompile_limit = {limit})"
    if dynamic is False:
        return (
            f"dynamic=False: compile_decode_step compiles a graph per cache size, and this cache would be graph {limit + 1}, "
            f"past {where}: leave dynamic=None (the default: the sizes become dynamic at the second size, and two graphs "
            f"serve every size), compile a new step for each {limit} sizes, or raise the limit"
        )
    return (
        f"compile_decode_step: {where} is reached for this model's forward (shared by every compiled caller of the model): "
        f"each policy kind's decode step is other code, so a graph of its own; compile a copy of the model per policy kind "
        f"(compile_decode_step(copy.deepcopy(model))), or raise the limit"
    )


def greedy_decode(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    cache: Any,
    max_new_tokens: int,
    *,
    attention_mask: torch.Tensor | None = None,
    step: Callable[..., Any] | None = None,
    prefill_chunk: int | None = PREFILL_CHUNK,
    after_prompt: Callable[[], Any] | None = None,
) -> torch.Tensor:
    """Greedy decoding with ``cache``: the prompt through ``model`` (eager, in forwards of
    ``prefill_chunk`` tokens), then one token a step
    through ``step`` (default ``model``; e.g. :func:`compile_decode_step`), with
    :meth:`EvictingCache.settle` between steps when the cache asks for it.

    Decode steps pass positions (each row's next real position) and no attention mask: an
    :class:`EvictingCache` knows each row's pads from the prompt's mask, so the step's inputs keep
    their shapes and a compiled step never recompiles. Any other cache is given the growing 2-D mask.

    Args:
        input_ids: ``[batch, prompt]``; ``attention_mask`` ``[batch, prompt]`` (0: a left pad).
        step: the callable that runs a decode step (a compiled model).
        prefill_chunk: tokens per prompt forward (default :data:`PREFILL_CHUNK`): a longer
            prompt is fed in chunks, so an :class:`EvictingCache` holds at most its policy's
            capacity plus one chunk during the prefill; ``None`` or ``0``: the whole prompt in
            one forward.
        after_prompt: called once the prompt is in the cache, before the first decode step:
            required for a policy scored by a context reconstruction (KVzip: e.g. ``lambda:
            reconstruct(model, cache, input_ids, repeat_prompts(tokenizer))``,
            :mod:`kvpolicy_integrations.reconstruction`), which :func:`generate` passes.

    Returns:
        ``[batch, max_new_tokens]``: the new tokens.

    Example:
        >>> from kvpolicy import H2O
        >>> from kvpolicy_tools.models import tiny_llama
        >>> model = tiny_llama()
        >>> ids = torch.arange(1, 33)[None]
        >>> new = greedy_decode(model, ids, EvictingCache(H2O(8, 8), model, static_shapes=True), 8)
        >>> torch.equal(new, greedy_decode(model, ids, EvictingCache(H2O(8, 8), model), 8))
        True
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if input_ids.ndim != 2 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids must be [batch, prompt] with a prompt of at least one token, got {tuple(input_ids.shape)}")
    chunk = input_ids.shape[1] if not prefill_chunk else check_int("prefill_chunk", prefill_chunk, minimum=1)
    ours = isinstance(cache, EvictingCache)
    if ours and after_prompt is None and cache.policy.needs_reconstruction:
        raise ValueError(
            f"{cache.policy!r} scores the prompt by a context reconstruction: pass after_prompt=lambda: "
            "kvpolicy_integrations.reconstruction.reconstruct(model, cache, input_ids, repeat_prompts(tokenizer)) "
            "(kvpolicy_integrations.hf.generate does)"
        )
    step = step if step is not None else model
    if attention_mask is None:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    else:
        positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
    settle = ours and cache.needs_settle
    out = []
    last = last_logits_kwargs(model)
    with torch.no_grad():
        for lo in range(0, input_ids.shape[1], chunk):  # (the mask covers every column so far)
            hi = min(input_ids.shape[1], lo + chunk)
            logits = model(input_ids=input_ids[:, lo:hi], attention_mask=None if attention_mask is None else attention_mask[:, :hi],
                           position_ids=positions[:, lo:hi], use_cache=True, **last, **cache_kwargs(model, cache)).logits[:, -1]
        if after_prompt is not None:
            after_prompt()
        pos = positions[:, -1:] + 1
        mask = attention_mask
        for k in range(max_new_tokens):
            token = logits.argmax(-1, keepdim=True)
            out.append(token)
            if k + 1 == max_new_tokens:
                break
            extra: dict[str, Any] = {}
            if not ours and mask is not None:
                mask = torch.cat([mask, torch.ones_like(token)], dim=1)
                extra["attention_mask"] = mask
            logits = step(input_ids=token, position_ids=pos, use_cache=True, **extra, **cache_kwargs(model, cache)).logits[:, -1]
            if settle:
                cache.settle()
            pos = pos + 1
    if ours:
        cache.report_nonfinite()
    return torch.cat(out, dim=1)


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
    budget: float | None = None,
    max_new_tokens: int = 64,
    chat: bool | None = None,
    positions: PositionsMode | None = None,
    compile: bool = False,
    prefill_chunk: int | None = PREFILL_CHUNK,
    **overrides: Any,
) -> GenerationResult:
    """Greedy generation of ``prompt`` with an evicting cache, in one call.

    ``policy`` is a policy or a registered name resolved with :func:`kvpolicy.make_policy` for
    ``budget`` (in ``(0, 1]``; default 0.3) on this prompt's length plus ``max_new_tokens``, with
    ``overrides`` (its fixed parameters, e.g. ``heavy=2``). A policy object is used as it is:
    ``budget`` and ``overrides`` plan a name, so with an object they raise ``ValueError`` naming
    them rather than being ignored. ``chat`` applies the tokenizer's
    chat template (default: when it has one). ``compile=True`` runs the decode steps compiled
    (:func:`compile_decode_step`, one graph a step, on a static-shaped cache; compiling takes a
    while, so it pays for long generations) with :func:`greedy_decode`. A prompt longer than
    ``prefill_chunk`` tokens (default :data:`PREFILL_CHUNK`) is prefilled in chunks of that many,
    so the cache holds at most the policy's capacity plus one chunk however long the prompt is
    (``None`` or ``0``: one forward of the whole prompt, faster and holding all of it for a moment).
    A policy scored by a context reconstruction (KVzip) gets it after the prompt
    (:func:`kvpolicy_integrations.reconstruction.reconstruct`, with the tokenizer's repeat prompts;
    a chat template's prefix is not repeated) and decodes with :func:`greedy_decode`, which does not
    stop at an end-of-sequence token.

    Example:
        >>> from kvpolicy_tools.models import tiny_llama
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
    # every argument checked before the tokenizer or the model is touched
    if not isinstance(prompt, str):
        raise ValueError(f"prompt must be a string, got {type(prompt).__name__} {prompt!r:.80}")
    if not prompt.strip():
        raise ValueError(f"prompt is empty ({prompt!r}): give generate() some text to continue")
    max_new_tokens = check_int("max_new_tokens", max_new_tokens, minimum=1)
    if budget is not None:
        budget = check_float("budget", budget, low=0.0, high=1.0, low_open=True)
    if not isinstance(policy, str):
        policy = check_eviction_policy("policy", policy)
        # budget= and the overrides plan a registered name: with a policy object they would do nothing
        given = ([f"budget={budget!r}"] if budget is not None else []) + [f"{k}={v!r}" for k, v in overrides.items()]
        if given:
            raise ValueError(
                f"{', '.join(given)}: budget and parameter overrides plan a registered policy name, and policy "
                f"{policy!r} is an object, used as it is: set its parameters on it, or pass its name "
                f"({policy.name!r}) with them"
            )
    elif budget is None:
        budget = 0.3
    chunk = None if not prefill_chunk else check_int("prefill_chunk", prefill_chunk, minimum=1)
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
    if n_prompt == 0:
        raise ValueError(f"prompt {prompt!r:.80} is empty after tokenization (0 tokens): give generate() some text")
    if isinstance(policy, str):
        policy = make_policy(
            policy, budget, context_length=n_prompt + max_new_tokens, prompt_length=n_prompt, layers=model_layers(model),
            **overrides,
        )
    compile = check_bool("compile", compile)
    cache = EvictingCache(policy, model, positions=positions, max_tokens=n_prompt + max_new_tokens, static_shapes=compile,
                          prefill_chunk=chunk)
    after_prompt = None
    if policy.needs_reconstruction:
        prompts = repeat_prompts(tokenizer)
        start = prompts.start(input_ids)
        after_prompt = lambda: reconstruct(model, cache, input_ids, prompts, start=start)  # noqa: E731
    if compile or after_prompt is not None:
        new = greedy_decode(model, input_ids, cache, max_new_tokens, attention_mask=torch.ones_like(input_ids),
                            step=compile_decode_step(model) if compile else None, prefill_chunk=chunk,
                            after_prompt=after_prompt)
        out = torch.cat([input_ids, new], dim=1)
    else:
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            prefill_chunk_size=chunk if chunk is not None and n_prompt > chunk else None,
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



