"""The one eviction driver (NumPy or torch arrays), and the softmax and log-n scale the replays share.

Every place that runs a policy on dense NumPy ``[batch, heads, n]`` positions and scores — the
reference (:func:`kvpolicy_numpy.replay`), the budget planner (:func:`kvpolicy.simulate_sizes`),
eval's chunked-prefill sizes, the steady-state finder and eviction workloads of
:mod:`kvpolicy_tools.perf.eviction`, and the conformance kit — asks the policy through
:func:`evict_until_done`: ask ``policy.evict``, gather what it keeps, ask again, until it returns
``None``. The torch backend (``kvpolicy_torch.LayerCache``) runs the same loop (:func:`kept_slots`) on
torch views of its dense rows and applies all rounds in one compaction.

The loop holds every policy to the contract on every backend (:func:`check_keep`,
:func:`check_capacity_kept`: a :class:`PolicyError` names the policy) and shows it read-only views
(:func:`read_only`).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import numpy as np
from array_api_compat import device

from .policy import CacheView, EvictionPolicy, array_namespace
from .registry import is_builtin_policy

__all__ = [
    "NonFiniteWarning",
    "PolicyError",
    "check_capacity_kept",
    "check_keep",
    "evict_until_done",
    "kept_slots",
    "log_n_scales",
    "nonfinite_rows",
    "read_only",
    "softmax",
    "take_slots",
    "warn_nonfinite",
]


class PolicyError(RuntimeError):
    """A policy broke the eviction contract at run time (what its ``select`` returned, or what it
    left in the cache); the message names the policy and what to fix. Every backend raises it:
    the NumPy reference, ``kvpolicy_torch.LayerCache`` and the planners all run :func:`kept_slots`.

    ``n_cached`` is set when the policy stopped evicting above its capacity (the tokens it left)."""

    def __init__(self, message: str, *, n_cached: int | None = None) -> None:
        super().__init__(message)
        self.n_cached = n_cached


class NonFiniteWarning(RuntimeWarning):
    """Attention probabilities became NaN inside a replay (the logits times the log-n scale
    overflowed, e.g. BUZZ with log n on logits near the float limit). The scores they feed follow
    the NaN rule of :attr:`kvpolicy.CacheView.ranking_scores` (a NaN score ranks lowest); the
    warning names the first step and head, and the trace lists every one (``Trace.nonfinite``)."""


def nonfinite_rows(probs: Any, first_step: int) -> list[tuple[int, int]]:
    """``(step, head)`` of every row of ``probs`` ``[steps, heads, n]`` (NumPy or torch; rows are
    steps ``first_step, first_step + 1, ...``) holding a NaN or infinite probability.

    Example:
        >>> nonfinite_rows(np.array([[[0.5, 0.5]], [[np.nan, np.nan]]]), 10)
        [(11, 0)]
    """
    xp = array_namespace(probs)
    bad = xp.any(~xp.isfinite(probs), axis=-1)  # [steps, heads]
    rows = np.argwhere(np.asarray(bad.tolist(), dtype=bool).reshape(bad.shape))
    return [(first_step + int(t), int(h)) for t, h in rows]


def warn_nonfinite(policy: EvictionPolicy, where: list[tuple[int, int]]) -> None:
    """One :class:`NonFiniteWarning` for a replay of ``policy`` whose attention rows ``where``
    (``(step, head)``, see :func:`nonfinite_rows`) were not finite; nothing when ``where`` is empty.

    Example:
        >>> import warnings
        >>> from kvpolicy import H2O
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warn_nonfinite(H2O(heavy=1, recent=1), [(3, 0)])
        >>> caught[0].category.__name__
        'NonFiniteWarning'
    """
    if not where:
        return

    step, head = where[0]
    scaled = " times the log-n scale" if policy.log_n is not None else ""
    warnings.warn(
        f"{policy!r}: attention probabilities became NaN at step {step} (head {head}) and {len(where) - 1} more "
        f"(step, head) rows: the logits{scaled} overflowed float64. Their scores are NaN, which rank lowest "
        "(kvpolicy.CacheView.ranking_scores): such tokens go first. Trace.nonfinite lists every row; scale the "
        "logits down to avoid it.",
        NonFiniteWarning,
        stacklevel=3,
    )


def read_only(x: Any) -> Any:
    """``x`` as the policy may see it: for a NumPy array a view whose writes raise ``ValueError``
    (``flags.writeable`` is ``False``; ``x`` itself stays writable); a torch tensor as it is (torch
    has no read-only tensors: the conformance kit, :func:`kvpolicy.testing.check_policy`, detects
    a policy that writes into its view instead).

    Example:
        >>> x = np.arange(3)
        >>> read_only(x).flags.writeable, x.flags.writeable
        (False, True)
    """
    if isinstance(x, np.ndarray):
        x = x.view()
        x.flags.writeable = False
    return x


def take_slots(x: Any, keep: Any, fill: Any) -> Any:
    """``x`` ``[batch, heads, n]`` gathered at the slots ``keep`` ``[batch, heads, k]``, with
    ``fill`` where ``keep`` is ``-1`` (a hole: a head keeping fewer tokens than the widest, under
    head-wise budgets, see :func:`check_keep`).

    Example:
        >>> take_slots(np.array([[[10, 11, 12]]]), np.array([[[-1, 0, 2]]]), -1).tolist()
        [[[-1, 10, 12]]]
    """
    xp = array_namespace(x)
    keep = xp.broadcast_to(keep, (*x.shape[:-1], keep.shape[-1])) if keep.ndim == x.ndim else keep
    taken = xp.take_along_axis(x, xp.clip(keep, min=0), axis=-1)
    if isinstance(keep, np.ndarray) and keep.size and keep.min() >= 0:
        return taken  # no holes (every policy but head-wise budgets): nothing to fill
    return xp.where(keep >= 0, taken, xp.asarray(fill, dtype=x.dtype, device=device(x)))


def _first_bad_row(policy: EvictionPolicy, keep: Any, n: int) -> str:
    """Where and how a keep array breaks the rules (the error path only: reads it on the host)."""
    rows = np.asarray(keep.tolist(), dtype=np.int64).reshape(-1, keep.shape[-1])
    heads = keep.shape[1]
    for i, row in enumerate(rows):
        held = row[np.argmax(row >= 0) if (row >= 0).any() else row.size :]  # after the leading holes
        low = -1 if policy.ragged_heads else 0
        if row.size and (row.min() < low or row.max() >= n):
            why = f"slot {int(row[(row < low) | (row >= n)][0])} is outside [0, {n})"
        elif (held < 0).any():
            why = "a hole (-1) follows a slot (holes, head-wise budgets' only, lead a row)"
        elif held.size == row.size == n and held.tolist() == list(range(n)):
            why = f"it keeps all {n} slots while asking to evict"
        elif row.size > 1 and np.any(np.diff(row) == 0):
            why = f"slot {int(row[1:][np.diff(row) == 0][0])} appears twice"
        elif row.size > 1 and np.any(np.diff(row) < 0):
            why = "the slots are not in ascending order"
        else:
            continue
        shown = row.tolist() if row.size <= 32 else row[:32].tolist() + ["..."]
        return f"row {i // heads}, head {i % heads}: {why} (got {shown})"
    return "a slot is out of range, repeated or out of order"  # pragma: no cover - found above


def check_keep(policy: EvictionPolicy, keep: Any, positions: Any, *, values: bool = True) -> Any:
    """``keep`` (what ``policy`` returned for a view of ``positions`` ``[batch, heads, n]``) as int64
    on the positions' device, or :class:`PolicyError` naming the policy and the rule it broke:
    shape ``[batch, heads, k]``, integer slots, fewer than ``n`` (return ``None`` to keep every
    token; ``n`` itself for head-wise budgets when a hole is made, and for one process's share of a
    sharded layer, :attr:`~kvpolicy.EvictionPolicy.sharded_heads`, whose heads may evict nothing in a
    round that evicts elsewhere) and, with ``values``, strictly ascending (so unique) in ``[0, n)``. The value checks read
    the answer on the host: one read per eviction round (a sync on an accelerator), so the loop
    (:func:`kept_slots`) leaves them out only at a torch decode step of a built-in policy
    (:func:`kvpolicy.registry.is_builtin_policy`: held to the contract by the conformance kit), to
    keep the decode path free of syncs; the one-token decode path
    (:class:`~kvpolicy.DecodeEviction`) never asks ``select`` at all.

    Example:
        >>> from kvpolicy import H2O
        >>> check_keep(H2O(heavy=1, recent=1), np.array([[[0, 2]]]), np.arange(3)[None, None]).tolist()
        [[[0, 2]]]
        >>> check_keep(H2O(heavy=1, recent=1), np.array([[[2, 0]]]), np.arange(3)[None, None])
        Traceback (most recent call last):
        ...
        kvpolicy.driver.PolicyError: H2O(heavy=1, recent=1).select() must return slots in ascending order, each once, in [0, 3): row 0, head 0: the slots are not in ascending order (got [2, 0])
    """
    xp = array_namespace(positions)
    keep = xp.asarray(keep, device=device(positions))
    batch, heads, n = positions.shape
    if keep.ndim != 3 or tuple(keep.shape[:2]) != (batch, heads):
        raise PolicyError(
            f"{policy!r}.select() returned slots of shape {tuple(keep.shape)}; expected [batch, heads, k] = "
            f"[{batch}, {heads}, k]"
        )
    if not xp.isdtype(keep.dtype, "integral"):
        raise PolicyError(f"{policy!r}.select() returned slots of dtype {keep.dtype}; expected integers (int64)")
    keep = xp.astype(keep, xp.int64)
    k = keep.shape[-1]
    # (a ragged keep may make holes only; one process's share of a sharded layer may keep it all
    # while another process's heads evict: it still answers, so that every process records the round)
    if k > n or (k == n and not values and not policy.ragged_heads):
        raise PolicyError(f"{policy!r} asked to evict but kept {k} of {n} tokens (select() returns None to keep every token)")
    if k and values:
        # holes (-1) may lead a row of a head-wise policy (ragged_heads); what follows ascends
        # strictly in [0, n)
        bad = xp.any(keep < (-1 if policy.ragged_heads else 0)) | xp.any(keep[..., -1] >= n)
        if k > 1:
            later, earlier = keep[..., 1:], keep[..., :-1]
            bad = bad | xp.any(((later <= earlier) & (later >= 0)) | ((later < 0) & (earlier >= 0)))
        if k == n and not policy.sharded_heads:  # as many slots as the view: only a row that turns a token into a hole evicts
            bad = bad | ~xp.any(keep < 0)
        if bool(bad):
            if k == n and not policy.sharded_heads and not bool(xp.any(keep < 0)):
                raise PolicyError(
                    f"{policy!r} asked to evict but kept {k} of {n} tokens (select() returns None to keep every token)"
                )
            raise PolicyError(
                f"{policy!r}.select() must return slots in ascending order, each once, in [0, {n}): "
                + _first_bad_row(policy, keep, n)
            )
    return keep


def check_capacity_kept(policy: EvictionPolicy, n_cached: int, positions: Any = None) -> None:
    """:class:`PolicyError` when ``policy`` stopped evicting (``select`` returned ``None``) with
    more than ``capacity - 1`` tokens cached (:attr:`~kvpolicy.EvictionPolicy.capacity` counts the
    next token, which must fit: the torch backend has no slot for it): per head, or, when
    ``positions`` ``[batch, heads, n]`` are given and hold holes (head-wise budgets, whose capacity
    is per head on average), on average over a row's heads. Not for one process's share of a
    layer split over processes (:attr:`~kvpolicy.EvictionPolicy.sharded_heads`): its heads may
    hold more than the layer's mean.

    Example:
        >>> from kvpolicy import StreamingLLM
        >>> check_capacity_kept(StreamingLLM(sink=1, window=2), 3)
        >>> check_capacity_kept(StreamingLLM(sink=1, window=2), 4)
        Traceback (most recent call last):
        ...
        kvpolicy.driver.PolicyError: StreamingLLM(sink=1, window=2) stopped evicting with 4 tokens cached, more than its capacity 4 allows between steps (3: the next token must fit): select() must keep evicting (it is asked again after every round) until at most capacity - 1 tokens remain
    """
    cap = policy.capacity
    if policy.sharded_heads:
        return  # the capacity bounds the mean over all of a layer's heads, of which this process holds a share
    if cap is not None and n_cached >= cap and positions is not None:
        xp = array_namespace(positions)
        held = xp.sum(xp.astype(positions >= 0, xp.int64), axis=(1, 2))  # [batch] (a host read: rare)
        n_cached = -(-int(xp.max(held)) // int(positions.shape[1]))
    if cap is not None and n_cached >= cap:
        raise PolicyError(
            f"{policy!r} stopped evicting with {n_cached} tokens cached, more than its capacity {cap} allows between "
            f"steps ({cap - 1}: the next token must fit): select() must "
            "keep evicting (it is asked again after every round) until at most capacity - 1 tokens remain",
            n_cached=n_cached,
        )


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
    # the answers' values are read on the host except at a torch decode step of a built-in (no sync
    # there) and on torch's meta device (no values at all)
    values = isinstance(positions, np.ndarray) or (
        getattr(device(positions), "type", None) != "meta" and (phase != "decode" or not is_builtin_policy(policy))
    )
    rounds: list[tuple[int, int]] = []
    total = None  # composite keep: slots of the input
    while True:
        shown = xp.zeros(positions.shape, dtype=xp.float64, device=device(positions)) if scores is None else scores
        view = CacheView(read_only(positions), read_only(shown), n_seen, state, phase)  # type: ignore[arg-type]
        try:
            keep = ask(view)
        except ValueError as e:
            if "read-only" not in str(e):
                raise
            raise PolicyError(
                f"{policy!r} wrote into the view it was shown: view.positions and view.scores are read-only "
                "(copy them first, e.g. view.xp.asarray(view.scores, copy=True), or keep your own data in view.state)"
            ) from e
        if keep is None:
            check_capacity_kept(policy, positions.shape[-1], positions)
            return positions, scores, total, rounds
        keep = check_keep(policy, keep, positions, values=values)
        before = positions.shape[-1]
        positions = take_slots(positions, keep, -1)
        if scores is not None:
            scores = take_slots(scores, keep, 0)
        if total is None:
            total = keep
        else:
            total = take_slots(xp.broadcast_to(total, (*keep.shape[:-1], total.shape[-1])), keep, -1)
        rounds.append((before, positions.shape[-1]))
