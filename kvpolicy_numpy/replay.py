"""The exact reference backend: replay a policy on given attention logits, one token at a time.

Simple and literal on purpose; every faster backend is held to it by tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvpolicy.validation import check_choice, check_int
from kvpolicy.budget import realised_budget
from kvpolicy.driver import evict_until_done, log_n_scales, nonfinite_rows, softmax, warn_nonfinite
from kvpolicy.policy import KEY_STATISTICS, EvictionPolicy, check_eviction_policy
from kvpolicy.statistics import (
    Rotary, cache_scores, history_record, low_attention, mark_unscored, query_moments, refresh_due, refresh_interval, refresh_sink,
    shift_history,
)

__all__ = [
    "Trace", "replay", "require_finite", "softmax", "validate_keys", "validate_logits", "validate_queries",
    "validate_reconstruction", "validate_rope", "validate_values",
]


#: The reference's attention (logits times the log-n scale, then the softmax) reports an overflow
#: as the torch backend does: by one :class:`~kvpolicy.driver.NonFiniteWarning` naming the first
#: step and head (``Trace.nonfinite`` lists every row), not by NumPy's anonymous floating-point
#: warnings ("overflow encountered in multiply"); an overflow to ``-inf`` is only a probability of 0.
def _attention_errors() -> np.errstate:
    return np.errstate(over="ignore", invalid="ignore")


@dataclass
class Trace:
    """What a replay kept and computed.

    Attributes:
        kept: ``kept[t]`` is an int array ``[heads, n]`` of the sorted original positions kept
            per head after token ``t`` was processed (``None`` for ``t < prompt_len - 1``). Under
            head-wise budgets (:class:`~kvpolicy.AdaKV`) heads keep different numbers: ``n`` is
            the most a head keeps and a head keeping fewer starts with ``-1`` (holes).
        sizes: cache size (keys attended, the new one included) at every decode step: per head,
            on average over the heads under head-wise budgets.
        evictions: ``(t, size_before, size_after)`` for every eviction round; ``t`` is the last
            token processed (``prompt_len - 1`` for the prefill rounds).
        outputs: ``[steps, heads, d]`` attention outputs under the policy (when values given).
        full_outputs: the same with the full cache and no logit scaling (the paper's ``O_t``).
        prompt_len: tokens in the prefill.
        nonfinite: ``(step, head)`` of every attention row whose probabilities were not finite
            (the logits times the log-n scale overflowed; prompt rows are steps ``0..prompt_len-1``):
            their NaN scores ranked lowest (``CacheView.ranking_scores``). Empty on ordinary input;
            a replay that fills it also warns (:class:`kvpolicy.driver.NonFiniteWarning`).
    """

    kept: list[np.ndarray | None]
    sizes: np.ndarray
    evictions: list[tuple[int, int, int]]
    prompt_len: int
    outputs: np.ndarray | None = None
    full_outputs: np.ndarray | None = None
    _steps: int = field(default=0, repr=False)
    nonfinite: list[tuple[int, int]] = field(default_factory=list)

    @property
    def realised_budget(self) -> float:
        """Average decode-step size over the full cache's (see :mod:`kvpolicy.budget`).

        Defined over decode steps: a trace whose prompt is every token (``prompt_len ==
        steps``) has none, and raises ``ValueError``.
        """
        if self.prompt_len >= self._steps:
            raise ValueError(
                f"realised_budget needs at least one decode step: prompt_len must be < steps, "
                f"got prompt_len = steps = {self._steps} (replay with a shorter prompt_len)"
            )
        return realised_budget(self.sizes, self._steps, self.prompt_len)

    def output_error(self) -> np.ndarray:
        """Relative L2 error ``|O_hat - O| / |O|`` per step and head, ``[steps, heads]``."""
        if self.outputs is None or self.full_outputs is None:
            raise ValueError("values were not given to replay(), so there are no outputs to compare")
        num = np.linalg.norm(self.outputs - self.full_outputs, axis=-1)
        den = np.maximum(np.linalg.norm(self.full_outputs, axis=-1), 1e-300)
        return num / den


def _real_array(name: str, x: object) -> np.ndarray:
    x = np.asarray(x)
    if np.iscomplexobj(x):
        raise ValueError(f"{name} must be real numbers, got a complex array (dtype {x.dtype}); pass x.real if meant")
    if x.dtype == object or not (np.issubdtype(x.dtype, np.number) or np.issubdtype(x.dtype, np.bool_)):
        raise ValueError(f"{name} must be a real numeric array, got dtype {x.dtype}")
    return x.astype(np.float64, copy=False)


def validate_logits(logits: object) -> np.ndarray:
    """``logits`` as a float64 ``[steps, heads, steps]`` array, or ``ValueError``.

    Refused: another shape, complex or non-numeric values, and any NaN or infinite logit a query
    reads (``logits[t, h, j]`` with ``j <= t``; the error names the step ``t`` and head ``h``):
    a softmax over them is NaN, and a NaN score would decide an eviction arbitrarily. Entries
    above the diagonal are never read and may hold anything (e.g. ``-inf`` or NaN padding).

    Example:
        >>> import numpy as np
        >>> x = np.zeros((3, 1, 3)); x[2, 0, 1] = np.nan
        >>> validate_logits(x)
        Traceback (most recent call last):
        ...
        ValueError: logits must be finite where a query reads them (key j <= step t): logits[2, 0, 1] is nan (step 2, head 0)
    """
    logits = _real_array("logits", logits)
    if logits.ndim != 3 or logits.shape[0] != logits.shape[2] or logits.shape[0] == 0:
        raise ValueError(
            f"logits must have shape [steps, heads, steps] with steps >= 1, got {tuple(logits.shape)}"
        )
    steps = logits.shape[0]
    causal = np.tril(np.ones((steps, steps), dtype=bool))[:, None, :]
    bad = ~np.isfinite(logits) & causal
    if bad.any():
        t, h, j = (int(i) for i in np.argwhere(bad)[0])  # the first in step, head, key order
        raise ValueError(
            "logits must be finite where a query reads them (key j <= step t): "
            f"logits[{t}, {h}, {j}] is {logits[t, h, j]} (step {t}, head {h})"
        )
    return logits


def require_finite(name: str, array: np.ndarray, policy: EvictionPolicy, source: str,
                   shown: tuple[int, ...] | None = None) -> None:
    """``ValueError`` naming the first NaN or infinite entry of ``array`` (``[step, head, ...]``) that
    ``policy``'s scores come from (``source``); ``shown``: which axes of its index the message names.

    Example:
        >>> from kvpolicy import Knorm
        >>> require_finite("keys", np.array([[[1.0, np.nan]]]), Knorm(size=2), "the keys")
        Traceback (most recent call last):
        ...
        ValueError: keys must be finite for Knorm(size=2, recent=0), whose scores come from the keys: keys[0, 0, 1] is nan (step 0, head 0)
    """
    bad = ~np.isfinite(array)
    if bad.any():
        index = tuple(int(i) for i in np.argwhere(bad)[0])
        named = index if shown is None else tuple(index[a] for a in shown)
        raise ValueError(
            f"{name} must be finite for {policy!r}, whose scores come from {source}: {name}[{', '.join(map(str, named))}] "
            f"is {array[index]} (step {index[0]}, head {index[1]})"
        )


def validate_values(values: object, steps: int, heads: int, policy: EvictionPolicy | None = None) -> np.ndarray:
    """``values`` as a float64 ``[steps, heads, d]`` array, or ``ValueError`` (shape, complex; NaN or
    infinite for a ``policy`` whose scores come from the cache, which reads them)."""
    values = _real_array("values", values)
    if values.ndim != 3 or values.shape[:2] != (steps, heads):
        raise ValueError(
            f"values must have shape [steps, heads, d] = [{steps}, {heads}, d], got {tuple(values.shape)}"
        )
    if policy is not None and policy.score_statistic in KEY_STATISTICS:  # a NaN value would score silently
        require_finite("values", values, policy, "the cache")
    return values


def validate_keys(keys: object, steps: int, heads: int, policy: EvictionPolicy) -> np.ndarray | None:
    """``keys`` as a float64 ``[steps, heads, head_dim]`` array (``None`` stays ``None``), or
    ``ValueError`` (shape, complex; ``None``, NaN or infinite for a policy whose scores come from keys).

    Example:
        >>> from kvpolicy import Knorm
        >>> validate_keys(None, 4, 2, Knorm(size=2))
        Traceback (most recent call last):
        ...
        ValueError: keys are required for Knorm(size=2, recent=0): its scores come from the cached keys (score_statistic 'key_norm'); pass keys=[steps, heads, head_dim]
    """
    if keys is None:
        if policy.score_statistic in KEY_STATISTICS:
            raise ValueError(
                f"keys are required for {policy!r}: its scores come from the cached keys (score_statistic "
                f"{policy.score_statistic!r}); pass keys=[steps, heads, head_dim]"
            )
        return None
    keys = _real_array("keys", keys)
    if keys.ndim != 3 or keys.shape[:2] != (steps, heads) or keys.shape[2] == 0:
        raise ValueError(
            f"keys must have shape [steps, heads, head_dim] = [{steps}, {heads}, head_dim >= 1], got {tuple(keys.shape)}"
        )
    if policy.score_statistic in KEY_STATISTICS:  # (else ignored) scores from NaN keys would decide silently
        require_finite("keys", keys, policy, "the keys")
    return keys


def validate_queries(queries: object, steps: int, heads: int, head_dim: int, policy: EvictionPolicy) -> np.ndarray | None:
    """``queries`` as a float64 ``[steps, heads, group, head_dim]`` array (``[steps, heads,
    head_dim]`` is one query head per head: ``group = 1``), ``None`` for a policy that reads no
    queries, or ``ValueError`` (shape, complex; ``None``, NaN or infinite for Expected Attention,
    naming the first such entry's step and head, as :func:`validate_keys` does for keys).

    Example:
        >>> from kvpolicy import ExpectedAttention
        >>> validate_queries(np.zeros((4, 2, 3)), 4, 2, 3, ExpectedAttention(size=2, sink=0)).shape
        (4, 2, 1, 3)
    """
    if not policy.observes_queries:
        return None
    if queries is None:
        raise ValueError(
            f"queries are required for {policy!r}: its scores come from the moments of the queries seen; "
            "pass queries=[steps, heads, head_dim] (before RoPE) and values=[steps, heads, d]"
        )
    queries = _real_array("queries", queries)
    if queries.ndim == 3:
        queries = queries[:, :, None, :]
    if queries.ndim != 4 or queries.shape[:2] != (steps, heads) or queries.shape[2] == 0 or queries.shape[3] != head_dim:
        raise ValueError(
            f"queries must have shape [steps, heads, head_dim] or [steps, heads, group, head_dim] = "
            f"[{steps}, {heads}, (group >= 1,) {head_dim}] (head_dim as the keys'), got {tuple(queries.shape)}"
        )
    # a NaN query makes every score NaN: the policy would evict blind (one query head a head: its
    # index as the caller gave it, [step, head, dim])
    require_finite("queries", queries, policy, "the queries' moments", shown=(0, 1, 3) if queries.shape[2] == 1 else None)
    return queries


def validate_rope(rope: object, head_dim: int) -> Rotary | None:
    """``rope`` as a :class:`~kvpolicy.statistics.Rotary` with NumPy ``inv_freq``, for keys and
    queries of ``head_dim`` dimensions (``None`` stays ``None``), or ``TypeError`` (not a
    ``Rotary``) / ``ValueError`` naming the field: ``inv_freq`` a non-empty 1-D array of finite
    reals, ``style`` ``"half"`` or ``"interleaved"``, ``rotary_dim`` (default ``2 *
    len(inv_freq)``) equal to ``2 * len(inv_freq)`` (one frequency per pair of dimensions) and at
    most ``head_dim``.

    Example:
        >>> from kvpolicy.statistics import Rotary
        >>> validate_rope(Rotary(np.ones(4)), 6)
        Traceback (most recent call last):
        ...
        ValueError: rope rotates 8 dimensions (rotary_dim, default 2 * len(inv_freq) = 2 * 4), more than the head_dim 6 of the keys and queries; allowed: rotary_dim <= 6
    """
    if rope is None:
        return None
    if not isinstance(rope, Rotary):
        raise TypeError(f"rope must be a kvpolicy.statistics.Rotary(inv_freq, style, rotary_dim) or None, got {type(rope).__name__}")
    inv_freq = _real_array("rope.inv_freq", np.asarray(rope.inv_freq.tolist() if hasattr(rope.inv_freq, "tolist") else rope.inv_freq))
    if inv_freq.ndim != 1 or inv_freq.shape[0] == 0:
        raise ValueError(f"rope.inv_freq must have shape [rotary_dim / 2] (1-D, at least one frequency), got {tuple(inv_freq.shape)}")
    if not np.isfinite(inv_freq).all():
        i = int(np.argwhere(~np.isfinite(inv_freq))[0][0])
        raise ValueError(f"rope.inv_freq must be finite: rope.inv_freq[{i}] is {inv_freq[i]}")
    style = check_choice("rope.style", rope.style, ("half", "interleaved"))
    pairs = int(inv_freq.shape[0])
    if rope.rotary_dim is not None:
        rotary_dim = check_int("rope.rotary_dim", rope.rotary_dim, minimum=2)
        if rotary_dim != 2 * pairs:
            raise ValueError(
                f"rope.rotary_dim must be 2 * len(inv_freq) = {2 * pairs} (one frequency per pair of dimensions), got {rotary_dim}"
            )
    if 2 * pairs > head_dim:
        raise ValueError(
            f"rope rotates {2 * pairs} dimensions (rotary_dim, default 2 * len(inv_freq) = 2 * {pairs}), more than the head_dim "
            f"{head_dim} of the keys and queries; allowed: rotary_dim <= {head_dim}"
        )
    return Rotary(inv_freq, style, rope.rotary_dim)


def validate_reconstruction(reconstruction: object, heads: int, prompt_len: int, policy: EvictionPolicy) -> np.ndarray | None:
    """``reconstruction`` as a float64 ``[heads, prompt_len]`` array for a policy whose scores come
    from a context reconstruction (KVzip), ``None`` for any other, or ``ValueError``: missing,
    another shape, a prompt of fewer than 2 tokens (nothing to reconstruct: the policy decides
    after a prompt), or a NaN or infinite score (naming the first).

    Example:
        >>> from kvpolicy import KVzip
        >>> validate_reconstruction(np.array([[0.5, np.nan]]), 1, 2, KVzip(size=1, sink=0))
        Traceback (most recent call last):
        ...
        ValueError: reconstruction must be finite for KVzip(size=1, sink=0), whose scores come from the context reconstruction: reconstruction[0, 1] is nan (head 0, prompt token 1)
    """
    if not policy.needs_reconstruction:
        return None
    if reconstruction is None:
        raise ValueError(
            f"reconstruction is required for {policy!r}: its scores come from a context reconstruction after the prompt "
            f"(score_statistic 'reconstruction'); pass reconstruction=[heads, prompt_len]"
        )
    if prompt_len < 2:
        raise ValueError(f"{policy!r} decides once after a prompt (context) of at least 2 tokens; got prompt_len={prompt_len}")
    scores = _real_array("reconstruction", reconstruction)
    if scores.shape != (heads, prompt_len):
        raise ValueError(f"reconstruction must have shape [heads, prompt_len] = [{heads}, {prompt_len}], got {tuple(scores.shape)}")
    bad = ~np.isfinite(scores)
    if bad.any():
        h, j = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"reconstruction must be finite for {policy!r}, whose scores come from the context reconstruction: "
            f"reconstruction[{h}, {j}] is {scores[h, j]} (head {h}, prompt token {j})"
        )
    return scores


def replay(
    policy: EvictionPolicy,
    logits: np.ndarray,
    prompt_len: int = 0,
    values: np.ndarray | None = None,
    keys: np.ndarray | None = None,
    queries: np.ndarray | None = None,
    rope: Rotary | None = None,
    prompt_chunk: int | None = None,
    reconstruction: np.ndarray | None = None,
) -> Trace:
    """Replay ``policy`` on pre-softmax attention logits of one sequence.

    Args:
        policy: any :class:`~kvpolicy.EvictionPolicy`.
        logits: ``[steps, heads, steps]``; ``logits[t, h, j]`` is the logit of query ``t`` on key
            ``j`` in head ``h`` (only ``j <= t`` is read, and must be finite: a NaN or infinite
            logit raises ``ValueError`` naming its step and head, see :func:`validate_logits`).
        prompt_len: the first ``prompt_len`` tokens are one prefill (causal softmax per prompt
            row, scores summed over the rows), then one token per step.
        values: optional ``[steps, heads, d]`` value vectors, to compute attention outputs.
        keys: ``[steps, heads, head_dim]`` key vectors, required by a policy whose scores come from
            the cached keys (:data:`kvpolicy.KEY_STATISTICS`: Knorm, KeyDiff, Expected Attention);
            ignored otherwise. As the cache holds them: after RoPE in a model.
        queries: ``[steps, heads, head_dim]`` (or ``[steps, heads, group, head_dim]``: ``group``
            query heads per head, GQA) the query of each step, before RoPE; required by Expected
            Attention (with ``values``), ignored otherwise. Only its statistics read them: the
            attention itself comes from ``logits``.
        rope: the RoPE whose rotations Expected Attention averages over the next positions
            (:class:`kvpolicy.statistics.Rotary`, NumPy ``inv_freq``; checked by :func:`validate_rope`);
            ``None``: no rotation.
        prompt_chunk: the prompt is prefilled in chunks of this many tokens (the last one
            shorter), each evicted after it (``None``, default: the whole prompt at once). A
            chunk's row ``i`` attends to the tokens kept before the chunk and causally to the
            chunk's own (``n`` of its log-n scale: those kept plus ``i + 1``), and the chunk's
            rows score every token held (its last ``policy.prompt_rows`` rows when set), as a
            prompt's do; a chunk of one token is a decode step.
        reconstruction: ``[heads, prompt_len]`` the prompt tokens' scores from a context
            reconstruction (:func:`kvpolicy.statistics.reconstruction_scores`, what a model gives
            them while it repeats the prompt), required by a policy whose scores come from one
            (:data:`kvpolicy.policy.RECONSTRUCTION`: KVzip; checked by
            :func:`validate_reconstruction`), ignored otherwise. Such a policy is asked once,
            after the whole prompt (``phase="prefill"``, however it was chunked), on these scores,
            then at every decode step (new tokens score 0; no attention is folded in).

    Per step ``t``: key ``t`` is appended; query ``t`` attends with a softmax over the kept keys
    (logits times the policy's log-n scale, if any, with ``n`` the number of kept keys; prompt row
    ``i`` attends to ``i + 1`` keys); each kept token's score grows by the
    probability it received (or, when ``policy.score_statistic == "latest"``, its score becomes
    that probability; with ``"low_history"`` its record of low-attention events shifts in this
    query's bit, :mod:`kvpolicy.statistics`; a prompt's scores come from its last
    ``policy.prompt_rows`` rows when that is set, each row a query of a record); then the policy
    evicts, repeatedly until it returns ``None``. For a key statistic the scores are instead
    recomputed from the kept tokens' keys right before each eviction
    (:func:`kvpolicy.statistics.key_scores`, with ``n_seen = t + 1`` and the policy's
    ``key_recent``; Expected Attention: :func:`kvpolicy.statistics.expected_attention` with the
    moments of the queries of steps ``sink .. t``, every one seen, kept or not, summed afresh);
    with a ``refresh`` interval above 1 only after the prompt and at every ``refresh``-th decode
    step after the last scoring, the tokens appended in between scoring
    :data:`kvpolicy.statistics.UNSCORED` (:func:`kvpolicy.statistics.mark_unscored`).

    Example:
        >>> import numpy as np
        >>> from kvpolicy import StreamingLLM
        >>> trace = replay(StreamingLLM(sink=1, window=2), np.zeros((6, 1, 6)))
        >>> trace.kept[5].tolist()
        [[0, 4, 5]]
    """
    policy = check_eviction_policy("policy", policy)
    logits = validate_logits(logits)
    steps, heads, _ = logits.shape
    prompt_len = check_int("prompt_len", prompt_len, minimum=0, maximum=steps)
    chunk = prompt_len if prompt_chunk is None else check_int("prompt_chunk", prompt_chunk, minimum=1)
    if values is not None:
        values = validate_values(values, steps, heads, policy)
    keys = validate_keys(keys, steps, heads, policy)
    # (queries without keys: a policy that reads no keys reads no queries either, and ignores them)
    queries = None if keys is None else validate_queries(queries, steps, heads, keys.shape[2], policy)
    rope = None if queries is None else validate_rope(rope, keys.shape[2])  # (read by Expected Attention only)
    if queries is not None and values is None:
        raise ValueError(f"values are required for {policy!r}: its scores multiply by the value norm; pass values=[steps, heads, d]")
    reconstruction = validate_reconstruction(reconstruction, heads, prompt_len, policy)
    from_keys = policy.score_statistic in KEY_STATISTICS
    sink = refresh_sink(policy)  # (Expected Attention's, or its wrapper's scorer's; 0 for any other)

    state = policy.init_state()
    positions = np.zeros((1, heads, 0), dtype=np.int64)
    scores = np.zeros((1, heads, 0), dtype=np.float64)
    kept: list[np.ndarray | None] = [None] * steps
    sizes: list[int] = []
    evictions: list[tuple[int, int, int]] = []
    outputs = np.zeros((steps, heads, values.shape[2])) if values is not None else None
    nonfinite: list[tuple[int, int]] = []  # (step, head) rows whose probabilities overflowed

    refresh = refresh_interval(policy)
    scored_seen: int | None = None  # tokens seen at the last scoring (refresh > 1)

    def evict_until_stable(t: int, phase: str) -> None:
        nonlocal positions, scores, scored_seen
        if reconstruction is not None and t < prompt_len:  # asked once, after the prompt's reconstruction
            if t < prompt_len - 1:
                return
            scores = np.where(positions >= 0, reconstruction[np.arange(heads)[:, None], np.maximum(positions[0], 0)][None], np.inf)
            phase = "prefill"
        if from_keys and refresh > 1 and phase == "decode" and scored_seen is not None and not refresh_due(refresh, t + 1, scored_seen):
            scores = mark_unscored(scores, positions, scored_seen, sink)  # between two scorings
        elif from_keys:  # the scores of the kept tokens, from their keys [heads, n, d]
            cached = keys[positions[0], np.arange(heads)[:, None]]  # type: ignore[index]
            # the kept values (zeros of width 1 without values, as the torch backend holds them)
            source = values if values is not None else np.zeros((steps, heads, 1))
            held = source[positions[0], np.arange(heads)[:, None]][None]
            moments = None
            if queries is not None:  # Expected Attention: the moments of queries sink..t
                counted = (np.arange(t + 1) >= sink).astype(np.float64)[None]
                moments = query_moments(queries[: t + 1].transpose(1, 2, 0, 3)[None], counted)
            scores = cache_scores(policy, cached[None], held, positions, t + 1, moments, rope)
            scored_seen = t + 1
        positions, scores, rounds = evict_until_done(policy, positions, scores, t + 1, state, phase)
        evictions.extend((t, before, after) for before, after in rounds)

    def score_rows(probs: np.ndarray, visible: np.ndarray) -> None:
        """Fold a prompt chunk's probabilities ``[q, heads, n]`` (``visible``: the keys each row
        sees) into the scores of the ``n`` tokens held, as :func:`replay` says."""
        nonlocal scores
        q = probs.shape[0]
        # policy.prompt_rows: only the chunk's last rows score it (TOVA: 1, SnapKV: its window)
        # Rows added one at a time, in order, here and in kvpolicy_torch's replay: keys whose
        # probabilities are equal in every row then score the same bits on both backends, so the
        # policy's tie rule decides between them (a vectorised sum may add a few columns in
        # another order and part an exact tie by an ulp).
        window = probs[max(0, q - (policy.prompt_rows or q)) :]
        received = window[0].copy()
        for row in window[1:]:
            received = received + row
        if policy.score_statistic == "low_history":  # each row is a query of the record (Scissorhands)
            low = low_attention(probs, 1, kept=visible)  # [q, heads, n]
            record = history_record(low.transpose(1, 0, 2), policy.score_history)[None]
            scores = shift_history(scores, record, q, policy.score_history)  # type: ignore[arg-type]
        elif policy.score_statistic == "latest":
            scores = received[None]
        else:
            scores = scores + received[None]

    if prompt_len and chunk < prompt_len:
        for lo in range(0, prompt_len, chunk):
            hi = min(prompt_len, lo + chunk)
            q = hi - lo
            before = positions[0]  # [heads, n_before]; -1: a hole (head-wise budgets)
            held = np.concatenate([before, np.broadcast_to(np.arange(lo, hi, dtype=np.int64), (heads, q))], axis=-1)
            positions = held[None].copy()
            scores = np.concatenate([scores, np.zeros((1, heads, q))], axis=-1)
            t = np.arange(lo, hi)
            # row i sees the tokens kept before the chunk and the chunk's up to its own
            visible = (held[None] >= 0) & (held[None] <= t[:, None, None])  # [q, heads, n]
            rows = logits[lo:hi][:, np.arange(heads)[:, None], np.maximum(held, 0)]  # [q, heads, n]
            rows = rows * log_n_scales(policy, before.shape[-1] + np.arange(1, q + 1))[:, None, None]
            probs = softmax(np.where(visible, rows, -np.inf))
            nonfinite += nonfinite_rows(probs, lo)
            score_rows(probs, visible)
            if outputs is not None:
                outputs[lo:hi] = np.einsum("qhk,khd->qhd", probs, values[np.maximum(held, 0).T, np.arange(heads)[None, :]])
            evict_until_stable(hi - 1, "prefill" if q > 1 else "decode")
            kept[hi - 1] = positions[0].copy()
    elif prompt_len:
        p = prompt_len
        causal = np.tril(np.ones((p, p), dtype=bool))[:, None, :]
        with _attention_errors():
            rows = logits[:p, :, :p] * log_n_scales(policy, np.arange(1, p + 1))[:, None, None]
            probs = softmax(np.where(causal, rows, -np.inf))  # [p, heads, p]
        nonfinite += nonfinite_rows(probs, 0)
        positions = np.broadcast_to(np.arange(p, dtype=np.int64), (1, heads, p)).copy()
        # policy.prompt_rows: only the prompt's last rows score it (TOVA: 1, SnapKV: its window)
        # Rows added one at a time, in order, here and in kvpolicy_torch's replay: keys whose
        # probabilities are equal in every row then score the same bits on both backends, so the
        # policy's tie rule decides between them (a vectorised sum may add a few columns in
        # another order and part an exact tie by an ulp).
        window = probs[max(0, p - (policy.prompt_rows or p)) :]
        scores = window[0].copy()
        for row in window[1:]:
            scores = scores + row
        scores = scores[None]
        if policy.score_statistic == "low_history":  # each row is a query of the record (Scissorhands)
            low = low_attention(probs, 1, kept=np.broadcast_to(causal, probs.shape))  # [p, heads, p]
            scores = history_record(low.transpose(1, 0, 2), policy.score_history)[None]
        if outputs is not None:
            outputs[:p] = np.einsum("qhk,khd->qhd", probs, values[:p])
        # phase as kvpolicy_torch.LayerCache sets it: a one-token prompt is a decode step
        evict_until_stable(p - 1, "prefill" if p > 1 else "decode")
        kept[p - 1] = positions[0].copy()

    head_index = np.arange(heads)[:, None]
    for t in range(prompt_len, steps):
        positions = np.concatenate([positions, np.full((1, heads, 1), t, dtype=np.int64)], axis=-1)
        scores = np.concatenate([scores, np.zeros((1, heads, 1))], axis=-1)
        cached = positions[0]  # [heads, n]; -1: a hole (a head keeping fewer, head-wise budgets)
        held = cached >= 0
        sizes.append(int(held.sum()) // heads)
        # log n: n = the keys this query attends to, i.e. the kept ones (paper, section 3.5)
        with _attention_errors():
            row = logits[t][head_index, cached] * log_n_scales(policy, np.asarray([cached.shape[-1]]))[0]
            probs = softmax(row if held.all() else np.where(held, row, -np.inf))
        if not np.isfinite(probs).all():
            nonfinite += nonfinite_rows(probs[None], t)
        if policy.score_statistic == "latest":
            scores = probs[None]
        elif policy.score_statistic == "low_history":
            scores = shift_history(scores, low_attention(probs, 1)[None].astype(np.float64), 1, policy.score_history)
        elif not from_keys and reconstruction is None:  # (a key statistic's scores come from the cache, below)
            scores = scores + probs[None]
        if outputs is not None:
            outputs[t] = np.einsum("hk,khd->hd", probs, values[cached.T, np.arange(heads)[None, :]])
        evict_until_stable(t, "decode")
        kept[t] = positions[0].copy()

    full_outputs = None
    if values is not None:
        causal = np.tril(np.ones((steps, steps), dtype=bool))[:, None, :]
        full = softmax(np.where(causal, logits, -np.inf))
        full_outputs = np.einsum("qhk,khd->qhd", full, values)
    warn_nonfinite(policy, nonfinite)
    return Trace(kept, np.asarray(sizes, dtype=np.int64), evictions, prompt_len, outputs, full_outputs, steps, nonfinite)
