"""What a transformers decoder does, detected from the model (or its config), not from its name.

:func:`detect` answers the questions kvpolicy's cache needs answered before it can serve a model:

* does its attention go through transformers' attention interface and call
  ``past_key_values.update()`` (otherwise no scores can be captured), with plain scaled
  dot-product logits (no soft-capping, no attention sinks, no latent (MLA) keys)?
* is every layer an attention layer (hybrid state-space / linear-attention models are not)?
* which layers are full, sliding-window or chunked, and with which window
  (transformers' own ``get_layer_types_and_kwargs``, the same answer ``DynamicCache`` uses)?
* for StreamingLLM's pos-shift (``positions="cache"``): how each layer rotates its keys with the
  position. This is *measured*: one forward of a few copies of one token at different positions,
  whose keys must be a RoPE rotation (half-split or interleaved, of the first ``rotary_dim``
  dimensions, with one of the model's ``inv_freq`` buffers) of the position-0 key, or equal to it
  (a NoPE layer). Anything else (absolute position embeddings, ALiBi, a norm after RoPE) means
  pos-shift cannot be done, and the error says so and that ``positions="original"`` works.

Every refusal is a ``ValueError`` naming the missing capability and what does work.
"""

from __future__ import annotations

import functools
import inspect
import sys
import weakref
from dataclasses import dataclass
from typing import Any, Literal

import torch
from transformers import DynamicCache
from transformers.cache_utils import get_layer_types_and_kwargs
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from kvpolicy_torch import rope_rotate

__all__ = ["Geometry", "LayerAttention", "ModelCapabilities", "RopeLayout", "cache_kwargs", "detect", "geometry",
           "last_logits_kwargs",
           "model_layers", "query_rotations", "rope_layouts", "text_config"]

def cache_kwargs(model: Any, cache: Any) -> dict[str, Any]:
    """The keyword that hands ``cache`` to ``model``'s forward and ``generate``: ``cache`` where the
    model takes it (transformers >= 5.24, which deprecates ``past_key_values``), else
    ``past_key_values``.

    Example:
        >>> from kvpolicy_tools.models import tiny_llama
        >>> list(cache_kwargs(tiny_llama(num_layers=1), None)) in (["cache"], ["past_key_values"])
        True
    """
    return {"cache": cache} if _takes_cache(type(model)) else {"past_key_values": cache}


def last_logits_kwargs(model: Any) -> dict[str, Any]:
    """``{"logits_to_keep": 1}`` for a model whose forward takes it (a prompt forward then
    projects only its last position onto the vocabulary, as ``generate`` asks), else ``{}``.

    Example:
        >>> from kvpolicy_tools.models import tiny_llama
        >>> last_logits_kwargs(tiny_llama(num_layers=1))
        {'logits_to_keep': 1}
    """
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}
    return {"logits_to_keep": 1} if "logits_to_keep" in parameters else {}


@functools.lru_cache(maxsize=None)
def _takes_cache(model_class: type) -> bool:
    """Whether ``model_class.forward`` has a ``cache`` parameter (once per class: decode loops ask
    at every step)."""
    try:
        return "cache" in inspect.signature(model_class.forward).parameters
    except (AttributeError, TypeError, ValueError):  # no inspectable forward: the name every version takes
        return False


LayerKind = Literal["full", "sliding", "chunked"]
_KINDS: dict[str, LayerKind] = {"full_attention": "full", "sliding_attention": "sliding", "chunked_attention": "chunked"}


@dataclass(frozen=True)
class RopeLayout:
    """How a layer rotates keys (and queries) by position.

    ``style``: ``"half"`` (Llama's ``rotate_half``: pairs ``(i, i + rotary_dim / 2)``) or
    ``"interleaved"`` (pairs ``(2i, 2i + 1)``: Cohere, GLM, GPT-J style); ``rotary_dim``: the
    leading dimensions rotated (``head_dim`` unless partial rotary); ``module`` and ``buffer``:
    where the frequencies live, read at each use (dynamic scaling updates them in place).
    """

    style: Literal["half", "interleaved"]
    rotary_dim: int
    module: torch.nn.Module
    buffer: str

    @property
    def inv_freq(self) -> torch.Tensor:
        """The layer's current rotary frequencies ``[rotary_dim / 2]``."""
        return getattr(self.module, self.buffer)


@dataclass(frozen=True)
class LayerAttention:
    """One layer: ``kind``, ``window`` (the sliding window or chunk size; ``None`` when full)."""

    kind: LayerKind
    window: int | None = None


@dataclass(frozen=True)
class Geometry:
    """A decoder's shape, read from its text config by :func:`geometry` (the one reader of it:
    the cache through :func:`detect`, the DeepSpeed engine, the model loaders' ``describe``).
    ``vocab_size``, ``intermediate_size`` and ``max_positions`` are ``None`` where the config has
    none."""

    model_type: str
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int | None
    intermediate_size: int | None
    max_positions: int | None
    tie_word_embeddings: bool

    @property
    def groups(self) -> int:
        """Query heads per KV head."""
        return self.heads // self.kv_heads


@dataclass(frozen=True)
class ModelCapabilities:
    """What :func:`detect` found. ``layers``: one :class:`LayerAttention` per decoder layer;
    ``geometry``: the decoder's shape (:func:`geometry`)."""

    model_type: str
    layers: tuple[LayerAttention, ...]
    geometry: Geometry

    @property
    def has_local_layers(self) -> bool:
        """Whether some layer is sliding-window or chunked."""
        return any(layer.kind != "full" for layer in self.layers)


def text_config(model_or_config: Any) -> Any:
    """The decoder's config of a model or config (a multimodal wrapper's text config)."""
    config = getattr(model_or_config, "config", model_or_config)
    get = getattr(config, "get_text_config", None)
    if get is None:
        return config
    try:
        return get(decoder=True)
    except TypeError:
        return get()


def model_layers(model_or_config: Any) -> int | None:
    """The decoder's layer count (``num_hidden_layers`` of :func:`text_config`), or ``None`` where
    the config does not say: what a per-layer budget is planned over
    (:func:`kvpolicy.plan_policy`'s ``layers``).

    Example:
        >>> from transformers import LlamaConfig
        >>> model_layers(LlamaConfig(num_hidden_layers=3))
        3
    """
    layers = getattr(text_config(model_or_config), "num_hidden_layers", None)
    return layers if isinstance(layers, int) and not isinstance(layers, bool) and layers > 0 else None


def _positive(name: str, value: Any) -> int:
    if value is None:
        raise ValueError(f"model config has no {name!r}")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"model config: {name} must be a positive integer, got {value!r}")
    return value


def _global(config: Any, name: str) -> Any:
    """``config.name`` (``None`` when absent); a ``ValueError`` naming it when the config holds it
    per layer and refuses a global read (transformers' heterogeneous configs, e.g. Gemma 4's
    ``head_dim``): kvpolicy reads one shape for every layer."""
    try:
        return getattr(config, name, None)
    except Exception as exc:  # noqa: BLE001 - transformers' error class lives in a private-looking module
        raise ValueError(
            f"model config: per-layer (heterogeneous) attention geometry is not supported: {name} "
            f"({type(exc).__name__}: {exc})"
        ) from exc


def geometry(
    model_or_config: Any,
    *,
    heads_attr: str = "num_attention_heads",
    kv_heads_attr: str = "num_key_value_heads",
    head_dim_attr: str = "head_dim",
) -> Geometry:
    """The shape of a decoder (a model or its config; a multimodal wrapper's text config), read
    under the config's attribute names (a family that names its head counts otherwise passes its
    own); ``ValueError`` naming the attribute when a count is missing, not positive, or the heads
    are not a multiple of the KV heads.

    Example:
        >>> from kvpolicy_tools.models import tiny_llama
        >>> g = geometry(tiny_llama(num_layers=2, heads=4, kv_heads=2, head_dim=16))
        >>> g.layers, g.heads, g.kv_heads, g.head_dim, g.groups
        (2, 4, 2, 16, 2)
    """
    config = text_config(model_or_config)
    heads = _positive(heads_attr, _global(config, heads_attr))
    kv_heads = _positive(kv_heads_attr, _global(config, kv_heads_attr) or heads)
    hidden = _positive("hidden_size", _global(config, "hidden_size"))
    head_dim = _positive(head_dim_attr, _global(config, head_dim_attr) or hidden // heads)
    if heads % kv_heads:
        raise ValueError(f"model config: {heads_attr}={heads} is not a multiple of {kv_heads_attr}={kv_heads}")

    def optional(name: str) -> int | None:
        value = getattr(config, name, None)
        return None if value is None else int(value)

    return Geometry(
        model_type=str(getattr(config, "model_type", None)),
        layers=_positive("num_hidden_layers", getattr(config, "num_hidden_layers", None)),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=int(head_dim),
        hidden_size=hidden,
        vocab_size=optional("vocab_size"),
        intermediate_size=optional("intermediate_size"),
        max_positions=optional("max_position_embeddings"),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
    )


def _what_works(model_type: str) -> str:
    return (
        f"model_type {model_type!r} cannot use EvictingCache; families that work are decoders whose attention goes "
        f"through transformers' attention interface (Llama, Mistral, Qwen, Gemma/Gemma 3, Phi-3, OLMo, Granite, "
        f"Cohere, GPT-NeoX, ...: see the README's model table)"
    )


def _model_class(model_or_config: Any) -> type | None:
    if isinstance(model_or_config, torch.nn.Module):
        return type(model_or_config)

    config = getattr(model_or_config, "config", model_or_config)
    for cfg in (config, text_config(config)):
        try:
            return MODEL_FOR_CAUSAL_LM_MAPPING[type(cfg)]
        except (KeyError, ValueError):
            continue
    return None


def _uses_attention_interface(cls: type) -> bool:
    """Whether the model class's attention dispatches through ``ALL_ATTENTION_FUNCTIONS`` (what
    ``set_attn_implementation`` switches): declared by ``is_backend_compatible()``, or its
    modeling module dispatches through it (StableLM does without declaring it)."""
    if getattr(cls, "is_backend_compatible", lambda: False)():
        return True
    module = sys.modules.get(cls.__module__)
    return module is not None and getattr(module, "ALL_ATTENTION_FUNCTIONS", None) is not None


def detect(model_or_config: Any) -> ModelCapabilities:
    """Detect the capabilities of a transformers causal LM (or its config); ``ValueError`` with the
    missing capability and what works when kvpolicy cannot serve it at all.

    Example:
        >>> from kvpolicy_tools.models import tiny_llama
        >>> caps = detect(tiny_llama())
        >>> caps.model_type, caps.layers[0], caps.has_local_layers
        ('llama', LayerAttention(kind='full', window=None), False)
    """
    config = text_config(model_or_config)
    model_type = str(getattr(config, "model_type", None))
    for attr in ("num_hidden_layers", "num_attention_heads"):
        try:
            value = getattr(config, attr, None)
        except Exception as exc:  # noqa: BLE001 - e.g. heterogeneous configs refuse a global head count
            raise ValueError(
                f"{_what_works(model_type)}: per-layer (heterogeneous) attention geometry is not supported "
                f"({type(exc).__name__}: {exc})"
            ) from exc
        if not isinstance(value, int):
            raise ValueError(f"{_what_works(model_type)}; its config has no integer {attr!r}")
    # BERT-style encoders double as decoders only with is_decoder=True (they also carry add_cross_attention)
    encoder = getattr(config, "is_decoder", None) is False and hasattr(config, "add_cross_attention")
    if getattr(config, "is_encoder_decoder", False) or encoder:
        raise ValueError(f"{_what_works(model_type)}: it is not a causal decoder (an encoder or encoder-decoder config)")
    cls = _model_class(model_or_config)
    if cls is None or not _uses_attention_interface(cls):
        raise ValueError(
            f"{_what_works(model_type)}: its attention does not go through transformers' attention interface "
            f"(AttentionInterface), so kvpolicy cannot capture scores or mask evicted tokens"
        )
    if getattr(config, "kv_lora_rank", None) or getattr(config, "q_lora_rank", None):
        raise ValueError(
            f"{_what_works(model_type)}: multi-head latent attention (MLA, compressed KV) is not supported: "
            f"the cached keys are not per-head keys that a policy can score and evict"
        )
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise ValueError(
            f"{_what_works(model_type)}: soft-capped attention logits (attn_logit_softcapping) are not supported: "
            f"SDPA cannot apply them and kvpolicy's score path has no soft-capping"
        )
    if isinstance(model_or_config, torch.nn.Module) and any(
        isinstance(getattr(m, "sinks", None), torch.Tensor) for m in model_or_config.modules()
    ):
        raise ValueError(f"{_what_works(model_type)}: attention sinks (a learned per-head logit) are not supported")
    try:
        kinds, kwargs = get_layer_types_and_kwargs(config)
    except Exception as exc:  # noqa: BLE001 - transformers' own per-layer description failed
        raise ValueError(f"{_what_works(model_type)}: its layer types cannot be read ({exc})") from exc
    unknown = sorted({k for k in kinds if k not in _KINDS})
    if unknown:
        raise ValueError(
            f"{_what_works(model_type)}: it has layers that are not softmax attention over a KV cache "
            f"({', '.join(map(repr, unknown))}: hybrid state-space / linear-attention / KV-sharing layers)"
        )
    layers = tuple(
        LayerAttention(_KINDS[k], int(kw["sliding_window"]) if _KINDS[k] != "full" else None)
        for k, kw in zip(kinds, kwargs)
    )
    if len(layers) != config.num_hidden_layers:
        raise ValueError(f"{_what_works(model_type)}: {len(layers)} layer types for {config.num_hidden_layers} layers")
    try:
        shape = geometry(model_or_config)
    except ValueError as exc:
        raise ValueError(f"{_what_works(model_type)}: {exc}") from exc
    return ModelCapabilities(model_type=model_type, layers=layers, geometry=shape)


# ------------------------------------------------------------------------------------------------
# RoPE layout, measured
# ------------------------------------------------------------------------------------------------

_PROBE_POSITIONS = (0, 1, 7, 29)


_LAYOUTS: "weakref.WeakKeyDictionary[torch.nn.Module, list[RopeLayout | None]]" = weakref.WeakKeyDictionary()


def rope_layouts(model: torch.nn.Module) -> list[RopeLayout | None]:
    """Each layer's :class:`RopeLayout` (``None``: a NoPE layer, keys independent of position),
    measured with one forward; ``ValueError`` when the keys move with the position in a way no
    RoPE layout explains (then pos-shift cannot be done; ``positions="original"`` works).

    Example:
        >>> from kvpolicy_tools.models import tiny_llama
        >>> [(r.style, r.rotary_dim) for r in rope_layouts(tiny_llama())][:1]
        [('half', 16)]
    """
    if model in _LAYOUTS:  # measured once per model (a layout does not change with dtype or device)
        return _LAYOUTS[model]
    _LAYOUTS[model] = layouts = _measure_rope(model)
    return layouts


def query_rotations(model: torch.nn.Module) -> list[RopeLayout | None]:
    """What rotation each layer's queries carry, for a statistic of the queries before RoPE
    (Expected Attention): the measured :func:`rope_layouts`, or ``None`` for every layer of a model
    with no rotary frequencies at all (absolute position embeddings, ALiBi: nothing rotates its
    queries). ``ValueError`` when a model with rotary frequencies moves its keys in a way no RoPE
    layout explains (e.g. a norm after RoPE): its queries cannot be rotated back.

    Example:
        >>> from kvpolicy_tools.models import tiny_llama
        >>> [(r.style, r.rotary_dim) for r in query_rotations(tiny_llama())][:1]
        [('half', 16)]
    """
    try:
        return rope_layouts(model)
    except ValueError as exc:
        if any(name.endswith("inv_freq") for name, _ in model.named_buffers()):
            raise ValueError(
                f"a statistic of the queries before RoPE (Expected Attention) cannot be kept for this model: {exc}. "
                "Its queries cannot be rotated back; choose a policy scored from attention or keys"
            ) from None
        return [None] * int(text_config(model).num_hidden_layers)


def _measure_rope(model: torch.nn.Module) -> list[RopeLayout | None]:
    config = text_config(model)
    model_type = getattr(config, "model_type", None)
    freqs = [
        (module, name.rsplit(".", 1)[-1], buf)
        for module_name, module in model.named_modules()
        for name, buf in module.named_buffers(recurse=False)
        if name.endswith("inv_freq") and buf.ndim == 1
    ]
    device = next(model.parameters()).device
    if device.type == "meta":
        # nothing can be measured on the meta device (no values; used to trace ops and shapes):
        # assume Llama's layout, full-head half-split with the first frequencies found
        if not freqs:
            raise ValueError(f"pos-shift (positions='cache') needs RoPE; {model_type!r} has no inv_freq buffer")
        module, buffer, inv = freqs[0]
        return [RopeLayout("half", 2 * inv.shape[0], module, buffer)] * int(config.num_hidden_layers)
    n = len(_PROBE_POSITIONS)
    token = min(5, int(getattr(config, "vocab_size", 6)) - 1)
    ids = torch.full((n, 1), token, device=device)
    pos = torch.tensor(_PROBE_POSITIONS, device=device)[:, None]
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, position_ids=pos, attention_mask=torch.ones_like(ids), **cache_kwargs(model, cache), use_cache=True)
    out: list[RopeLayout | None] = []
    for i, layer in enumerate(cache.layers):
        keys = getattr(layer, "keys", None)
        if not isinstance(keys, torch.Tensor) or keys.ndim != 4:
            raise ValueError(f"pos-shift (positions='cache'): layer {i} of {model_type!r} caches no per-head keys; "
                             f"positions='original' works for this model")
        k = keys[:, :, -1].to(torch.float64)  # [n, kv_heads, head_dim]
        base = k[:1].expand_as(k)
        # float32 keys agree to ~1e-6 relative; half-precision ones to their rounding
        tol = max(1e-4, 16 * torch.finfo(keys.dtype).eps) * float(k.abs().max()) + 1e-6
        if float((k - base).abs().max()) <= tol:
            out.append(None)
            continue
        found = None
        delta = pos[:, 0].view(n, 1).to(torch.float64)
        for module, buffer, inv in freqs:
            for style in ("half", "interleaved"):
                rot = rope_rotate(base, delta, inv.to(torch.float64), style=style, rotary_dim=2 * inv.shape[0])
                if rot.shape == k.shape and float((rot - k).abs().max()) <= tol:
                    found = RopeLayout(style, 2 * inv.shape[0], module, buffer)
                    break
            if found:
                break
        if found is None:
            raise ValueError(
                f"pos-shift (positions='cache') needs RoPE keys; layer {i} of {model_type!r} moves its keys with the "
                f"position in another way (absolute position embeddings, ALiBi or an unrecognised rotary layout). "
                f"positions='original' works for this model"
            )
        out.append(found)
    if all(r is None for r in out):
        raise ValueError(
            f"pos-shift (positions='cache') needs RoPE; {model_type!r} has no rotary position embedding in any layer. "
            f"positions='original' works for this model"
        )
    return out
