"""Input checks of :class:`~kvpolicy_torch.LayerCache`: what it is given is checked before anything
is allocated or written, and each error names the argument and what to do.

Shapes and dtypes only (host metadata): no check reads a tensor's values, so none costs a
host-device sync. :func:`check_capacity` runs when a layer is built, :func:`check_append` at every
:meth:`~kvpolicy_torch.LayerCache.append` (its memory bound only before the first allocation),
:func:`check_query` at every :meth:`~kvpolicy_torch.LayerCache.attend`.
"""

from __future__ import annotations

import numbers
import os
from typing import Any, Sequence

import torch

from kvpolicy.validation import check_bool, check_int
from kvpolicy.policy import DecodeEviction, EvictionPolicy

from .victims import LayerGroup

__all__ = [
    "available_bytes", "check_append", "check_batch_index", "check_capacity", "check_kv", "check_layer", "check_like", "check_memory",
    "check_step_kv", "checked_valid",
    "check_query", "check_received",
]


def check_capacity(policy: EvictionPolicy) -> int | None:
    """``policy.capacity`` if it is ``None`` (unbounded) or an integer ``>= 1``, else ``ValueError``
    naming the policy: a cache cannot hold 0 or 4.5 tokens.

    Example:
        >>> from kvpolicy import H2O
        >>> check_capacity(H2O(heavy=2, recent=2))
        5
    """
    cap = policy.capacity
    if cap is None:
        return None
    if isinstance(cap, bool) or not isinstance(cap, numbers.Integral) or cap < 1:
        raise ValueError(
            f"{policy!r}.capacity must be None (unbounded) or an integer >= 1 (the most tokens one layer holds "
            f"per head), got {cap!r}: fix the policy's capacity property"
        )
    return int(cap)


def check_kv(keys: Any, values: Any) -> None:
    """``keys`` and ``values`` as :meth:`~kvpolicy_torch.LayerCache.append` takes them:
    floating-point tensors ``[batch, kv_heads, q, head_dim]`` of one dtype, on one device, with
    equal first three dimensions and ``q >= 1``; else ``TypeError``/``ValueError`` saying what to
    change.

    Example:
        >>> check_kv(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4, dtype=torch.float16))
        Traceback (most recent call last):
        ...
        ValueError: keys and values must share a dtype, got torch.float32 keys and torch.float16 values: cast one to the other's (e.g. values.to(keys.dtype))
    """
    for name, x in (("keys", keys), ("values", values)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor [batch, kv_heads, q, head_dim], got {type(x).__name__}")
        if x.ndim != 4:
            raise ValueError(f"{name} must be [batch, kv_heads, q, head_dim] (4 dimensions), got shape {tuple(x.shape)}")
        if not x.is_floating_point():
            raise TypeError(f"{name} must be floating point (float16, bfloat16, float32 or float64), got {x.dtype}")
    if keys.shape[:3] != values.shape[:3]:
        raise ValueError(
            "keys and values must be [batch, kv_heads, q, head_dim] with equal first three dims, "
            f"got {tuple(keys.shape)} and {tuple(values.shape)}"
        )
    if keys.shape[2] == 0:
        raise ValueError("keys must hold at least one token (q >= 1)")
    if keys.dtype != values.dtype:
        raise ValueError(
            f"keys and values must share a dtype, got {keys.dtype} keys and {values.dtype} values: cast one to the "
            "other's (e.g. values.to(keys.dtype))"
        )
    if keys.device != values.device:
        raise ValueError(f"keys and values must be on one device, got keys on {keys.device} and values on {values.device}")


def available_bytes(device: torch.device) -> int:
    """Memory an allocation on ``device`` can hope for: free memory of a CUDA device, the machine's
    physical memory for the CPU (what the operating system may lend; the free part changes by the
    second), or ``-1`` where it is not known (no bound then).

    Example:
        >>> available_bytes(torch.device("cpu")) > 0
        True
    """
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "cpu":
        try:
            return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        except (AttributeError, ValueError, OSError):  # not a POSIX system
            return -1
    return -1


def check_memory(policy: EvictionPolicy, tokens: int, keys: torch.Tensor, values: torch.Tensor, what: str = "capacity") -> None:
    """``ValueError`` before a layer allocates ``tokens`` slots for keys and values shaped like
    ``keys``/``values`` when their bytes (keys, values, positions and scores) exceed
    :func:`available_bytes` of their device: a clear message instead of the allocator's, naming
    the policy and what sets the size (``what``: its ``capacity``, or the layer's ``reserve``).

    Example:
        >>> from kvpolicy import LocalWindow
        >>> kv = torch.zeros(1, 8, 1, 128)
        >>> check_memory(LocalWindow(window=10**12), 10**12, kv, kv)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: LocalWindow(window=1000000000000) needs ... for its capacity of 1000000000000 tokens ...
    """
    b, h, _, d = keys.shape
    per_slot = b * h * (d * keys.element_size() + values.shape[3] * values.element_size() + 8 + 4)
    need = tokens * per_slot
    have = available_bytes(keys.device)
    if have >= 0 and need > have:
        raise ValueError(
            f"{policy!r} needs {need / 2**30:,.1f} GiB for its {what} of {tokens} tokens (batch {b}, {h} KV heads, "
            f"head_dim {d}, {keys.dtype}) per layer, more than the {have / 2**30:,.1f} GiB {keys.device} has: "
            "choose a smaller policy (e.g. kvpolicy.make_policy(name, budget, context_length=...) sizes it for the run)"
        )


def check_layer(policy: Any, *, static_shapes: Any, key_shift: Any, group: Any) -> None:
    """What :class:`~kvpolicy_torch.LayerCache` checks when it is built: a policy with a valid
    capacity (:func:`check_capacity`) whose ``decode_eviction`` is a
    :class:`~kvpolicy.DecodeEviction` (or ``None``) that fits in it, ``static_shapes`` a bool
    (with head-wise budgets only where their decode eviction is declared, a
    :class:`~kvpolicy.HeadwiseEviction`, which a static step applies on the device), ``key_shift``
    callable or ``None``, ``group`` a :class:`~kvpolicy_torch.LayerGroup` or ``None``.

    Example:
        >>> from kvpolicy import AdaKV, H2O, SnapKV
        >>> check_layer(AdaKV(H2O(heavy=2, recent=2)), static_shapes=True, key_shift=None, group=None)
        >>> check_layer(AdaKV(SnapKV(size=40)), static_shapes=True, key_shift=None, group=None)
        Traceback (most recent call last):
        ...
        ValueError: AdaKV(scorer=SnapKV(size=40, window=32, kernel=5, pooling='avg'), alpha_safeguard=0.2) (head-wise budgets without a declared decode eviction, HeadwiseEviction) runs with static_shapes=False only (the eager layout)
    """
    if not isinstance(policy, EvictionPolicy):
        raise ValueError(f"policy must be an EvictionPolicy, got {policy!r}")
    check_capacity(policy)
    check_bool("static_shapes", static_shapes)
    rule = policy.decode_eviction
    if rule is not None and not isinstance(rule, DecodeEviction):
        raise ValueError(f"{policy!r}.decode_eviction must be a DecodeEviction or None, got {rule!r}")
    if rule is not None and policy.capacity is not None and policy.capacity < rule.limit + 1:
        raise ValueError(f"{policy!r} declares capacity {policy.capacity} below its decode eviction's limit + 1")
    if policy.ragged_heads and static_shapes and policy.headwise_eviction is None:
        raise ValueError(
            f"{policy!r} (head-wise budgets without a declared decode eviction, HeadwiseEviction) runs with "
            "static_shapes=False only (the eager layout)"
        )
    if key_shift is not None and not callable(key_shift):
        raise ValueError(f"key_shift must be callable (keys, delta) -> keys, got {key_shift!r}")
    if group is not None and not isinstance(group, LayerGroup):
        raise ValueError(f"group must be a LayerGroup or None, got {group!r}")


def check_append(layer: Any, keys: Any, values: Any) -> None:
    """What :meth:`~kvpolicy_torch.LayerCache.append` checks first, before the layer's first
    allocation: :func:`check_kv`, and :func:`check_memory` for its policy's capacity (or, for an
    unbounded policy, its ``reserve``, an integer >= 0). Later appends cost nothing here: the layer holds every one
    to the first one's shapes, dtypes and device itself.

    Example:
        >>> from kvpolicy import H2O
        >>> from kvpolicy_torch import LayerCache
        >>> check_append(LayerCache(H2O(heavy=2, recent=2)), torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))
    """
    if layer.is_initialized:
        return  # later appends must match the first one, which the layer compares in one tuple
    check_kv(keys, values)
    reserve = None if layer.reserve is None else check_int("reserve", layer.reserve, minimum=0)
    cap = layer.policy.capacity
    tokens, what = (cap, "capacity") if cap is not None else (max(keys.shape[2], reserve or 0), "reserve")
    if cap is not None and reserve is not None and max(keys.shape[2], reserve) + 1 < cap:
        tokens, what = max(keys.shape[2], reserve) + 1, "reserve"  # what the layer allocates for a run of `reserve` tokens
    check_memory(layer.policy, tokens, keys, values, what)


def check_step_kv(keys: torch.Tensor, values: torch.Tensor) -> None:
    """What every :meth:`~kvpolicy_torch.LayerCache.append` checks (cheap: shapes only): keys and
    values ``[batch, kv_heads, q, head_dim]`` with equal first three dimensions.

    Example:
        >>> check_step_kv(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 8))
    """
    ks, vs = keys.shape, values.shape
    if len(ks) != 4 or len(vs) != 4 or ks[0] != vs[0] or ks[1] != vs[1] or ks[2] != vs[2]:
        raise ValueError(
            "keys and values must be [batch, kv_heads, q, head_dim] with equal first three dims, "
            f"got {tuple(keys.shape)} and {tuple(values.shape)}"
        )
    if ks[2] == 0:
        raise ValueError("keys must hold at least one token (q >= 1)")


def checked_valid(valid: Any, real: Sequence[int] | None, keys: torch.Tensor) -> tuple[torch.Tensor | None, list[int] | None]:
    """An append's pad mask ``valid`` ``[batch, q]`` for ``keys`` ``[batch, kv_heads, q, head_dim]``,
    as bool on the keys' device, with ``real`` (its True per row; read once per chunk when not
    given); ``(None, real)`` when every token is real. A pad in a decode token (``q == 1``) is a
    ``ValueError``: pads belong to prompts.

    Example:
        >>> checked_valid(torch.tensor([[0, 1, 1]]), None, torch.zeros(1, 2, 3, 4))
        (tensor([[False,  True,  True]]), [2])
    """
    b, _, q, _ = keys.shape
    if not isinstance(valid, torch.Tensor) or tuple(valid.shape) != (b, q):
        raise ValueError(f"valid must have shape [batch, q] = [{b}, {q}], got {tuple(getattr(valid, 'shape', ()))}")
    valid = valid.to(device=keys.device, dtype=torch.bool)
    real = valid.sum(dim=-1).tolist() if real is None else list(real)
    if real == [q] * b:
        return None, real
    if q == 1:
        raise ValueError("a padded decode token: pads are supported in prompts (chunks of q > 1) only")
    return valid, real


def check_query(query: Any, keys: torch.Tensor | None) -> None:
    """A decode query for :meth:`~kvpolicy_torch.LayerCache.attend` over a layer whose storage is
    shaped like ``keys`` ``[batch, kv_heads, slots, head_dim]`` (``None``: nothing appended yet, so
    there is nothing to compare): a tensor ``[batch, q_heads, 1, head_dim]``, same batch, dtype and
    head size, ``q_heads`` a multiple of ``kv_heads`` (GQA); else ``ValueError`` saying what differs.

    Example:
        >>> check_query(torch.zeros(1, 6, 1, 8), torch.zeros(1, 4, 16, 8))
        Traceback (most recent call last):
        ...
        ValueError: query heads (6) must be a multiple of the cache's KV heads (4) (grouped-query attention): check the model's num_attention_heads and num_key_value_heads
    """
    shape = getattr(query, "shape", None)
    if keys is not None and shape is not None and len(shape) == 4:  # the common case first: one tuple test
        b, h, _, d = keys.shape
        if (shape[0] == b and shape[2] == 1 and shape[3] == d and shape[1] % h == 0 and isinstance(query, torch.Tensor)
                and query.dtype == keys.dtype):
            return
    if not isinstance(query, torch.Tensor):
        raise TypeError(f"query must be a torch.Tensor [batch, q_heads, 1, head_dim], got {type(query).__name__}")
    if query.ndim != 4 or query.shape[2] != 1:
        raise ValueError(f"query must be [batch, q_heads, 1, head_dim] (one decode token), got shape {tuple(query.shape)}")
    if keys is None:
        return
    b, h, _, d = keys.shape
    if query.shape[0] != b:
        raise ValueError(f"query batch ({query.shape[0]}) differs from the cache's ({b})")
    if query.shape[1] % h:
        raise ValueError(
            f"query heads ({query.shape[1]}) must be a multiple of the cache's KV heads ({h}) (grouped-query "
            "attention): check the model's num_attention_heads and num_key_value_heads"
        )
    if query.shape[3] != d:
        raise ValueError(f"query head size ({query.shape[3]}) differs from the keys' ({d}): queries and keys must share head_dim")
    if query.dtype != keys.dtype:
        raise ValueError(
            f"query dtype {query.dtype} differs from the cache's keys' ({keys.dtype}): cast the query (query.to({keys.dtype}))"
        )


def check_received(received: Any, shape: Any) -> None:
    """What :meth:`~kvpolicy_torch.LayerCache.accumulate` is given: a real tensor of ``shape``
    (``[batch, kv_heads, n]``, the slots the last append returned); else ``TypeError``/``ValueError``.

    Example:
        >>> check_received([[0.5]], (1, 1, 1))
        Traceback (most recent call last):
        ...
        TypeError: received must be a torch.Tensor [batch, kv_heads, n], got list
    """
    if not isinstance(received, torch.Tensor):
        raise TypeError(f"received must be a torch.Tensor [batch, kv_heads, n], got {type(received).__name__}")
    if received.shape != shape:
        raise ValueError(f"received must have shape {tuple(shape)}, got {tuple(received.shape)}")
    if received.is_complex():
        raise ValueError("received must be real, got a complex tensor")


def check_batch_index(index: Any, batch: int) -> None:
    """What :meth:`~kvpolicy_torch.LayerCache.select_batch` is given: a 1-D integer tensor of at
    least one row index in ``[0, batch)`` (beam search's reorder; not a bool mask); else
    ``TypeError``/``ValueError``, before the layer changes. The range is read on the CPU only (on an accelerator it would cost a
    host-device sync; index_select checks it there).

    Example:
        >>> check_batch_index(torch.tensor([0, 2]), 2)
        Traceback (most recent call last):
        ...
        ValueError: index holds row 2, outside the 2 rows held ([0, 2)): select_batch keeps or repeats rows the layer holds
    """
    if (not isinstance(index, torch.Tensor) or index.ndim != 1 or index.is_floating_point() or index.is_complex()
            or index.dtype == torch.bool):
        # (a bool mask is not row indices: index_select would refuse it deep inside)
        raise TypeError(f"index must be a 1-D integer tensor of rows, got {index!r:.80}")
    if not index.numel():
        raise ValueError("index must hold at least one row (select_batch keeps or repeats rows; reset() forgets them all)")
    if index.device.type == "cpu":
        low, high = int(index.min()), int(index.max())
        if low < 0 or high >= batch:
            bad = low if low < 0 else high
            raise ValueError(
                f"index holds row {bad}, outside the {batch} rows held ([0, {batch})): select_batch keeps or repeats "
                "rows the layer holds"
            )


def check_like(storage: Any, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Keys and values appended after the first must match the storage's batch, KV heads, head
    sizes, dtypes and device (``storage``: a :class:`~kvpolicy_torch.storage.Storage`); else
    ``ValueError`` saying what changed.

    Example:
        >>> from kvpolicy_torch.storage import Storage
        >>> s = Storage.allocate(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4), 3, torch.float32)
        >>> check_like(s, torch.zeros(1, 3, 1, 4), torch.zeros(1, 3, 1, 4))
        Traceback (most recent call last):
        ...
        ValueError: batch and kv_heads changed from (1, 2) to (1, 3)
    """
    k, v = storage.keys, storage.values
    if (keys.shape[0], keys.shape[1]) != (k.shape[0], k.shape[1]):
        raise ValueError(f"batch and kv_heads changed from {tuple(k.shape[:2])} to {tuple(keys.shape[:2])}")
    if keys.shape[3] != k.shape[3] or values.shape[3] != v.shape[3]:
        raise ValueError(
            f"head_dim changed from {k.shape[3]}/{v.shape[3]} (keys/values) to {keys.shape[3]}/{values.shape[3]}"
        )
    if keys.dtype != k.dtype or values.dtype != v.dtype:
        raise ValueError(f"keys/values dtype changed from {k.dtype}/{v.dtype} to {keys.dtype}/{values.dtype}")
    if keys.device != k.device:
        raise ValueError(f"keys moved from {k.device} to {keys.device}")

