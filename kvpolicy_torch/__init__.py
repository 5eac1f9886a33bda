"""kvpolicy_torch: the fast backend. Batched, per KV head, GQA aware, CPU and CUDA.

* :class:`LayerCache`: one layer's evicting KV store, preallocated to the policy's capacity.
* :func:`received_attention`: the attention each cached token receives, summed per KV head.
* :func:`replay`: the reference contract of :func:`kvpolicy_numpy.replay`, through LayerCache.
"""

from .layer import LayerCache
from .replay import replay
from .scores import group_query_heads, received_attention

__all__ = ["LayerCache", "group_query_heads", "received_attention", "replay"]
