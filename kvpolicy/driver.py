"""The one eviction driver (NumPy or torch arrays), and the softmax and log-n scale the replays share.

Every place that runs a policy on dense NumPy ``[batch, heads, n]`` positions and scores — the
reference (:func:`kvpolicy_numpy.replay`), the budget planner (:func:`kvpolicy.simulate_sizes`),
eval's chunked-prefill sizes, the steady-state finder and eviction workloads of
:mod:`kvpolicy.perf.eviction`, and the conformance kit — asks the policy through
:func:`evict_until_done`: ask ``policy.evict``, gather what it keeps, ask again, until it returns
``None``. The torch backend (``kvpolicy_torch.LayerCache``) runs the same loop (:func:`kept_slots`) on
torch views of its dense rows and applies all rounds in one compaction.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from array_api_compat import device

from .policy import CacheView, EvictionPolicy, array_namespace

__all__ = ["evict_until_done", "kept_slots", "log_n_scales", "softmax"]


def softmax(logits: np.ndarray, axis: int = -1) -> np.ndarray:
    """Numerically stable softmax; ``-inf`` entries get probability 0.

    Example:
        >>> softmax(np.asarray([0.0, 0.0, -np.inf])).tolist()
        [0.5, 0.5, 0.0]
    """
    # C order first: NumPy's sum adds in an order that follows the memory layout (pairwise along
    # a contiguous axis, one by one across a strided one), so the same logits gathered into a
    # Fortran-ordered array would round differently; the reference must not depend on it
    shifted = np.ascontiguousarray(logits) - np.max(logits, axis=axis, keepdims=True)
    e = np.exp(shifted)
    return e / np.sum(e, axis=axis, keepdims=True)


def log_n_scales(policy: EvictionPolicy, n_keys: np.ndarray) -> np.ndarray:
    """The logit scale (float64) of queries attending to ``n_keys`` keys each: the policy's
    :class:`~kvpolicy.LogNScaling`, or 1 for a policy without log n.

    Example:
        >>> from kvpolicy import H2O
        >>> log_n_scales(H2O(heavy=2, recent=2), np.asarray([1, 8])).tolist()
        [1.0, 1.0]
    """
    if policy.log_n is None:
        return np.ones(np.shape(n_keys), dtype=np.float64)
    return np.asarray(policy.log_n.scales(n_keys), dtype=np.float64)


def evict_until_done(
    policy: EvictionPolicy,
    positions: Any,
    scores: Any | None,
    n_seen: int,
    state: dict[str, Any],
    phase: str = "decode",
    *,
    decide: Callable[[CacheView], Any] | None = None,
) -> tuple[Any, Any | None, list[tuple[int, int]]]:
    """Evict until the policy is done: ``(positions, scores, rounds)`` after it.

    Each round shows the policy a :class:`~kvpolicy.CacheView` of ``positions`` and ``scores``
    (``[batch, heads, n]``, NumPy or torch; ``scores=None`` shows zeros, enough where only sizes
    matter since a policy decides *whether* and *how many* from host integers) and gathers the
    slots it keeps; ``state`` is updated in place by the policy. ``rounds`` holds ``(size before,
    size after)`` per eviction. ``decide(view)`` replaces ``policy.evict(view)`` (the kit checks
    each answer there; the torch backend passes its score reduction). A round that asks to evict
    but keeps every token raises ``RuntimeError`` (it would never end).

    Example:
        >>> from kvpolicy import StreamingLLM
        >>> p = StreamingLLM(sink=1, window=2)
        >>> pos, _, rounds = evict_until_done(p, np.arange(6)[None, None], None, 6, p.init_state())
        >>> pos.tolist(), rounds
        ([[[0, 4, 5]]], [(6, 3)])
    """
    positions, scores, _, rounds = _rounds(policy, positions, scores, n_seen, state, phase, decide)
    return positions, scores, rounds


def kept_slots(
    policy: EvictionPolicy,
    positions: Any,
    scores: Any | None,
    n_seen: int,
    state: dict[str, Any],
    phase: str = "decode",
    *,
    decide: Callable[[CacheView], Any] | None = None,
) -> tuple[Any | None, list[tuple[int, int]]]:
    """The loop of :func:`evict_until_done`: ``(keep, rounds)``, ``keep`` ``[batch, heads, k]``
    the slots of the input that survive every round (``None`` when nothing was evicted), for a
    backend that applies all rounds at once (the torch backend's one compaction).

    Example:
        >>> from kvpolicy import H2O
        >>> p = H2O(heavy=1, recent=1)
        >>> keep, rounds = kept_slots(p, np.arange(4)[None, None], np.array([[[5.0, 1.0, 2.0, 0.0]]]), 4, {})
        >>> keep.tolist(), rounds
        ([[[0, 3]]], [(4, 2)])
    """
    _, _, keep, rounds = _rounds(policy, positions, scores, n_seen, state, phase, decide)
    return keep, rounds


def _rounds(
    policy: EvictionPolicy,
    positions: Any,
    scores: Any | None,
    n_seen: int,
    state: dict[str, Any],
    phase: str,
    decide: Callable[[CacheView], Any] | None,
) -> tuple[Any, Any | None, Any | None, list[tuple[int, int]]]:
    """The loop itself: positions and scores after it, the composite keep and the rounds."""
    ask = policy.evict if decide is None else decide
    xp = array_namespace(positions)
    rounds: list[tuple[int, int]] = []
    total = None  # composite keep: slots of the input
    while True:
        shown = xp.zeros(positions.shape, dtype=xp.float64, device=device(positions)) if scores is None else scores
        keep = ask(CacheView(positions, shown, n_seen, state, phase))  # type: ignore[arg-type]
        if keep is None:
            return positions, scores, total, rounds
        keep = xp.astype(xp.asarray(keep, device=device(positions)), xp.int64)
        before = positions.shape[-1]
        positions = xp.take_along_axis(positions, keep, axis=-1)
        if scores is not None:
            scores = xp.take_along_axis(scores, keep, axis=-1)
        if positions.shape[-1] >= before:
            raise RuntimeError(f"{policy!r} asked to evict but kept {positions.shape[-1]} of {before} tokens")
        if total is None:
            total = keep
        else:
            total = xp.take_along_axis(xp.broadcast_to(total, (*keep.shape[:-1], total.shape[-1])), keep, axis=-1)
        rounds.append((before, positions.shape[-1]))
