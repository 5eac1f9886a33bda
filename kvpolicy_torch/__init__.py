"""kvpolicy_torch: the fast backend. Batched, per KV head, GQA aware, CPU and CUDA.

* :class:`LayerCache`: one layer's evicting KV store, preallocated to the policy's capacity.
* :class:`LayerGroup`: the layers of one cache, whose one-token evictions are searched together.
* :func:`received_attention`: the attention each cached token receives, summed per KV head.
* :func:`decode_attention`: a decode step's attention over a cache's slots and its scores in one pass.
* :func:`replay`: the reference contract of :func:`kvpolicy_numpy.replay`, through LayerCache.
"""

from .attention import decode_attention, grouped_decode, rope_matrix, rope_rotate
from .layer import LayerCache, LayerGroup, LayerSnapshot, PrefixShift
from .ops import first_argmin
from .replay import replay
from .scores import group_query_heads, received_attention

__all__ = [
    "LayerCache",
    "LayerGroup",
    "LayerSnapshot",
    "PrefixShift",
    "decode_attention",
    "first_argmin",
    "grouped_decode",
    "group_query_heads",
    "received_attention",
    "replay",
    "rope_matrix",
    "rope_rotate",
]
