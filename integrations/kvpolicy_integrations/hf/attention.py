"""The ``"kvpolicy_sdpa"`` attention function and its registration in transformers (a part of
:mod:`kvpolicy_integrations.hf`, whose docstring describes the whole).

* :func:`kvpolicy_sdpa_attention`: what a model loaded with ``attn_implementation="kvpolicy_sdpa"``
  runs: the cache layer's attention when an :class:`~kvpolicy_integrations.hf.EvictingLayer` handed
  itself over (:data:`LAYER_KWARG`), else transformers' SDPA;
* the scoped implementation (:data:`SCOPED_ATTENTION_NAME`), which a model runs only during the
  forwards given an :class:`~kvpolicy_integrations.hf.EvictingCache`, and its mask function, which
  builds no mask (the cache's hooks switch to it: :func:`kvpolicy_integrations.hf.scope_attention`);
* :func:`register_attention` (run at import), :func:`use_kvpolicy_attention` and
  :func:`set_attention_implementation`: registering the names and switching a model for good.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

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
#: not pass its kwargs to ``cache.update`` (see ``_scoped_attention``): the scoped attention reads the
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
        set_attention_implementation(model, ATTENTION_NAME)


def set_attention_implementation(model: torch.nn.Module, name: str) -> None:
    """``model.set_attn_implementation(name)``, transformers' public switch, which also checks that the
    model's class can run ``name``; its refusal (transformers refuses SDPA for a few classes, e.g. Git,
    VaultGemma) becomes a ``ValueError`` naming the model type and why kvpolicy cannot serve it."""
    try:
        model.set_attn_implementation(name)
    except ValueError as exc:  # transformers refuses SDPA for this class (e.g. Git, VaultGemma)
        raise ValueError(
            f"model_type {getattr(model.config, 'model_type', None)!r} cannot use EvictingCache: its attention "
            f"cannot run through SDPA, which kvpolicy's attention is built on (transformers: {exc})"
        ) from exc
