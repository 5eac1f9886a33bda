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

Modules, one per role (import from this package, or ``kvpolicy.hf``; the modules are where the code
lives):

* :mod:`.attention`: the registration of kvpolicy's attention functions in transformers
  (:func:`register_attention`, run at import) and :func:`use_kvpolicy_attention`;
* :mod:`.layer`: one cache layer, :class:`EvictingLayer` (append, attention, eviction, pos-shift,
  sliding windows), the attention functions that hand a step to it (``"kvpolicy_sdpa"`` and the
  scoped implementation an :class:`EvictingCache`'s forwards run under), and what the layers of one
  cache share (:class:`Padding`, :class:`ShiftMatrices`);
* :mod:`.cache`: the whole cache, :class:`EvictingCache` (its checks of each forward, reset, sizes,
  non-finite reports), the forward hooks of :func:`scope_attention`, and :func:`output_projections`;
* :mod:`.generation`: :func:`generate`, :func:`greedy_decode` and :func:`compile_decode_step`.
"""

from __future__ import annotations

# (also importable, as from hf.py before the split, though not in __all__: kvpolicy_sdpa_attention, PositionsMode,
# Padding, ScopedForward, SCOPE_ATTRIBUTE)
from ..capabilities import cache_kwargs, model_layers
from .attention import ATTENTION_NAME, LAYER_KWARG, SCOPED_ATTENTION_NAME, kvpolicy_sdpa_attention, register_attention, use_kvpolicy_attention  # noqa: F401
from .cache import PREFILL_CHUNK, SCOPE_ATTRIBUTE, EvictingCache, ScopedForward, output_projections, scope_attention  # noqa: F401
from .generation import GenerationResult, compile_decode_step, generate, greedy_decode
from .layer import EvictingLayer, Padding, PositionsMode, ShiftMatrices  # noqa: F401

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
