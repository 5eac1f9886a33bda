"""The registration of kvpolicy's attention functions in transformers (a part of
:mod:`kvpolicy_integrations.hf`, whose docstring describes the whole).

* the functions themselves live in :mod:`.layer`, beside the layer whose attention they run
  (re-exported here): :func:`kvpolicy_sdpa_attention`, what a model loaded with
  ``attn_implementation="kvpolicy_sdpa"`` runs, and :func:`scoped_attention`
  (:data:`SCOPED_ATTENTION_NAME`), which a model runs only during the forwards given an
  :class:`~kvpolicy_integrations.hf.EvictingCache` (the cache's hooks switch to it:
  :func:`kvpolicy_integrations.hf.scope_attention`);
* the scoped implementation's mask function, which builds no mask;
* :func:`register_attention` (run at import), :func:`use_kvpolicy_attention` and
  :func:`set_attention_implementation`: registering the names and switching a model for good.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

# (the functions live beside the layer they run, so that a decode step's attention call stays in
# one module: benchmarks/decode_calls.py; re-exported here, where they are registered)
from .layer import (  # noqa: F401
    ATTENTION_NAME, ATTENTION_SCOPES, LAYER_KWARG, SCOPED_ATTENTION_NAME, kvpolicy_sdpa_attention, scoped_attention,
)

def _no_mask(*args: Any, **kwargs: Any) -> None:
    """The mask function of a forward given an :class:`EvictingCache`: no 4-D mask is built (each
    layer masks from its own slots; the padding reaches the cache from the forward's arguments)."""
    return None


def register_attention() -> str:
    """Register ``"kvpolicy_sdpa"`` (and the scoped implementation an :class:`EvictingCache`'s
    forwards run under) in transformers' attention and mask interfaces (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, kvpolicy_sdpa_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    AttentionInterface.register(SCOPED_ATTENTION_NAME, scoped_attention)
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
