"""kvpolicy_torch: the fast backend. Batched, per KV head, GQA aware, CPU and CUDA.

A layer's decode step is one protocol everywhere: **update -> attend -> accumulate -> evict**.
:meth:`LayerCache.append` writes the new token's key and value and returns what the query
attends; :meth:`LayerCache.attend` computes the attention and adds what each slot received to
its score (:meth:`LayerCache.accumulate` when the caller computes attention itself);
:meth:`LayerCache.evict` lets the policy free what it must. Two layouts serve it: the eager one
(``kvpolicy_torch.layer``: host integers decide, the fastest on a CPU) and the static one
(``static_shapes=True``, :mod:`kvpolicy_torch.static`: device tensors decide, one compiled graph a
step); a prompt chunk and a policy's general ``select`` run on the host in both.

* :class:`LayerCache`: one layer's evicting KV store, preallocated to the policy's capacity; its
  parts are modules of their own: ``reads`` (every read of its state), ``layout`` (the eager
  layout: storage, rows, where new tokens go, compaction), ``storage`` (the slots, and how
  many), ``allocation`` (allocation, growth, room for an append), ``rows`` (per-row bookkeeping),
  ``eviction`` (which rule decides after a step), ``attention`` (the decode attention kernels and
  the eager step's attention over the slots), ``scores`` (received attention and how it becomes a
  score), ``victims`` (the one-token victim search, in one layer or every layer of a cache),
  ``general`` (a policy's own ``select``), ``compaction``, ``posshift`` (and RoPE's rotations),
  ``static`` (the device layout), ``queries``, ``headwise`` and ``checks`` (docs/design.md, "The
  parts of LayerCache").
* :class:`LayerGroup`: the layers of one cache, whose one-token evictions are searched together.
* :func:`received_attention`: the attention each cached token receives, summed per KV head.
* :func:`prefill_attention`: a prompt chunk's attention and what each key received, in one blocked pass.
* :func:`decode_attention`: a decode step's attention over a cache's slots and its scores in one pass.
* :func:`replay`: the reference contract of :func:`kvpolicy_numpy.replay`, through LayerCache.
"""

import array_api_compat.torch as _xp
import torch as _torch

from kvpolicy.policy import register_namespace as _register_namespace

from .attention import decode_attention, grouped_decode
from .posshift import ShiftMatrices, rope_matrix, rope_rotate
from .layer import LayerCache, LayerSnapshot, PrefixShift
from .replay import replay
from .scores import group_query_heads, prefill_attention, received_attention
from .victims import LayerGroup, first_argmin

__all__ = [
    "LayerCache",
    "LayerGroup",
    "LayerSnapshot",
    "PrefixShift",
    "ShiftMatrices",
    "decode_attention",
    "first_argmin",
    "grouped_decode",
    "group_query_heads",
    "prefill_attention",
    "received_attention",
    "replay",
    "rope_matrix",
    "rope_rotate",
]

# a declared score asks array_namespace once a layer or more at every decode step: one dict read
_register_namespace(_torch.Tensor, _xp)
