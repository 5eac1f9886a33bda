"""Drive a policy on NumPy arrays and on a torch ``LayerCache`` in lockstep, with identical scores.

Both sides receive the *same* float64 received-attention arrays (computed once, on the NumPy
side, with :func:`kvpolicy_numpy.replay`'s own operations), so their accumulated scores are
bit-equal and every difference in the kept positions comes from the policy's decision code on the
two array namespaces, not from two softmax implementations. Each eviction call is also checked
against the contract: the keep array's shape, dtype, order and range, that it evicts, and that
*whether* and *how many* do not depend on the score values (the policy is probed with other
scores and a copy of its state first).
"""

from __future__ import annotations

import zlib
from typing import Any, Callable, Sequence

import numpy as np

from kvpolicy.driver import evict_until_done, log_n_scales, read_only, softmax  # the reference's own, so the same bits
from kvpolicy.policy import KEY_STATISTICS, CacheView, EvictionPolicy
from kvpolicy.statistics import (
    cache_scores, history_record, low_attention, mark_unscored, query_moments, refresh_due, refresh_interval, refresh_sink,
    shift_history,
)

__all__ = ["ContractViolation", "NumpyCache", "TorchCache", "Lockstep", "check_candidate_sum", "example_inputs", "example_keys",
           "seeded_keys", "softmax"]

#: Width of the keys the kit draws for a policy whose scores come from keys.
KEY_DIM = 3


def seeded_keys(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    """Float64 keys ``[*shape, KEY_DIM]`` from ``seed``: small integer levels (-2..2: equal and
    parallel keys, so exact ties of a key statistic) for half the seeds, normal draws otherwise."""
    rng = np.random.default_rng(seed)
    if rng.integers(2):
        return rng.integers(-2, 3, size=(*shape, KEY_DIM)).astype(np.float64)
    return rng.normal(size=(*shape, KEY_DIM))


def example_keys(policy: EvictionPolicy, logits: np.ndarray, kv_heads: int | None = None) -> np.ndarray | None:
    """The keys the kit pairs with an example's ``logits`` for a policy whose scores come from
    keys (:data:`kvpolicy.KEY_STATISTICS`), ``None`` for any other: ``[steps, kv_heads, KEY_DIM]``
    for ``[steps, heads, steps]`` logits (``kv_heads`` default: ``heads``), ``[batch, steps,
    kv_heads, KEY_DIM]`` for ``[batch, steps, query_heads, steps]``. Each sequence's keys are a
    function of its own logits (:func:`seeded_keys`), so a row of a batch gets the keys it gets alone.

    Example:
        >>> from kvpolicy import Knorm
        >>> logits = np.zeros((5, 2, 5))
        >>> example_keys(Knorm(size=2), logits).shape, example_keys(Knorm(size=2), logits[None], 1).shape
        ((5, 2, 3), (1, 5, 1, 3))
    """
    if policy.score_statistic not in KEY_STATISTICS:
        return None
    logits = np.asarray(logits, dtype=np.float64)
    if logits.ndim == 4:
        return np.stack([example_keys(policy, row, kv_heads) for row in logits])  # type: ignore[misc]
    steps, heads = logits.shape[:2]
    seed = zlib.crc32(np.ascontiguousarray(logits).tobytes())
    return seeded_keys(seed, (steps, heads if kv_heads is None else kv_heads))


def example_inputs(policy: EvictionPolicy, logits: np.ndarray) -> dict[str, np.ndarray]:
    """The keyword arguments of :func:`kvpolicy_numpy.replay` beyond ``logits`` that the kit
    gives ``policy`` on an example: none for a policy scoring attention, ``keys``
    (:func:`example_keys`) for one scoring keys, and for Expected Attention the same vectors as
    ``values`` and ``queries`` too: in the kit each token has one vector, its key, value and query.

    Example:
        >>> from kvpolicy import ExpectedAttention, H2O
        >>> sorted(example_inputs(ExpectedAttention(size=2, sink=0), np.zeros((5, 2, 5)))), example_inputs(H2O(1, 1), np.zeros((5, 2, 5)))
        (['keys', 'queries', 'values'], {})
    """
    keys = example_keys(policy, logits)
    if keys is None:
        return {}
    if policy.score_statistic == "expected_attention":
        return {"keys": keys, "values": keys, "queries": keys}
    return {"keys": keys}

#: Eviction rounds after one append before a policy is declared to never stop.
MAX_ROUNDS = 1000


class ContractViolation(AssertionError):
    """A policy broke the eviction-policy contract. The message says what, where, and how to
    replay it."""


def _fmt(a: Any) -> str:
    return np.array2string(np.asarray(a), separator=", ", max_line_width=10**6, threshold=200)


def held_per_head(positions: np.ndarray) -> int:
    """Tokens a cache ``[batch, heads, n]`` (or ``[heads, n]``) holds per head: ``n``, or under
    head-wise budgets (holes, position ``-1``) the mean over a row's heads, rounded up, the most
    over rows.

    Example:
        >>> held_per_head(np.array([[[-1, 3, 4], [2, 3, 4]]]))
        3
    """
    positions = np.asarray(positions)
    if positions.size == 0 or positions.min() >= 0:
        return int(positions.shape[-1])
    rows = positions.reshape(-1, *positions.shape[-2:])
    held = (rows >= 0).sum(axis=(1, 2))
    return int(-(-held.max() // rows.shape[1]))


def trim_holes(kept: np.ndarray) -> np.ndarray:
    """``kept`` ``[heads, n]`` without its leading slots that are holes in every head (a row of a
    batch keeps as many slots as the batch's widest head; alone, as its own widest).

    Example:
        >>> trim_holes(np.array([[-1, -1, 4], [-1, 3, 4]])).tolist()
        [[-1, 4], [3, 4]]
    """
    kept = np.asarray(kept)
    empty = np.all(kept < 0, axis=0)
    lead = int(np.argmin(empty)) if not empty.all() else kept.shape[-1]
    return kept[:, lead:]


def check_positions(policy: EvictionPolicy, kept: np.ndarray, t: int, where: str) -> None:
    """Positions ``[heads, n]`` after token ``t``: per head sorted, unique, in ``[0, t]`` after
    leading holes (``-1``: head-wise budgets); at most ``capacity - 1`` tokens per head (on average
    over the heads, under head-wise budgets); equal heads under shared selection. Raises
    :class:`ContractViolation` naming ``where``."""
    kept = np.asarray(kept)
    if kept.dtype.kind not in "iu" or kept.ndim != 2:
        raise ContractViolation(f"{where}: kept positions must be a [heads, n] int array, got {kept.dtype} {kept.shape}")
    cap = policy.capacity
    size = held_per_head(kept)
    if cap is not None and size > cap - 1:
        raise ContractViolation(
            f"{policy!r} kept {size} tokens after token {t} ({where}); its capacity is {cap}, so at most "
            f"{cap - 1} may remain after an eviction (the next token must fit)"
        )
    for h, full in enumerate(kept.tolist()):
        row = [p for p in full if p != -1]
        if full[: len(full) - len(row)] != [-1] * (len(full) - len(row)):
            raise ContractViolation(f"{where}: positions after token {t} (head {h}) have holes (-1) after tokens: {full}")
        if row != sorted(set(row)):
            raise ContractViolation(f"{where}: positions after token {t} (head {h}) are not sorted and unique: {row}")
        if row and (row[0] < 0 or row[-1] > t):
            raise ContractViolation(f"{where}: positions after token {t} (head {h}) are outside [0, {t}]: {row}")
    if getattr(policy, "selection", "per_head") == "shared" and kept.shape[0] > 1 and not (kept == kept[:1]).all():
        raise ContractViolation(f"{where}: selection='shared' kept different tokens per head after token {t}: {kept.tolist()}")


def check_keep(policy: EvictionPolicy, view: CacheView, keep: Any) -> np.ndarray:
    """The keep array as int64 NumPy, after checking it against the contract (rows may start
    with holes, ``-1``: head-wise budgets)."""
    arr = np.asarray(keep)
    n = view.n_cached
    if arr.ndim != 3 or arr.shape[:2] != (view.batch, view.heads):
        raise ContractViolation(
            f"{policy!r} returned slots of shape {arr.shape}; expected [batch, heads, k] = "
            f"[{view.batch}, {view.heads}, k]"
        )
    if arr.dtype.kind not in "iu":
        raise ContractViolation(f"{policy!r} returned slots of dtype {arr.dtype}; expected integers (int64)")
    arr = arr.astype(np.int64, copy=False)
    k = arr.shape[-1]
    if k > n or (k == n and not (arr < 0).any()):
        raise ContractViolation(f"{policy!r} asked to evict but kept {k} of {n} tokens (return None to keep all)")
    if k and (arr.min() < (-1 if policy.ragged_heads else 0) or arr.max() >= n):  # holes: head-wise budgets only
        raise ContractViolation(f"{policy!r} returned slots outside [0, {n}): {_fmt(arr)}")
    later, earlier = arr[..., 1:], arr[..., :-1]
    if k > 1 and np.any((later < 0) & (earlier >= 0)):
        raise ContractViolation(f"{policy!r} returned holes (-1) after slots (holes lead a row): {_fmt(arr)}")
    if k > 1 and np.any((later <= earlier) & (later >= 0)):
        raise ContractViolation(f"{policy!r} returned slots that are not strictly ascending: {_fmt(arr)}")
    return arr


def check_decode_eviction(policy: EvictionPolicy, view: CacheView, keep: Any, state_before: dict[str, int]) -> None:
    """A declared :class:`~kvpolicy.DecodeEviction` must mean what ``select`` does after a decode
    step: nothing to evict up to ``limit`` tokens; at ``limit + 1`` exactly the rule's keep, state
    untouched (backends apply the rule instead of calling ``select``, in decode only: after a
    prompt they always call ``select``, e.g. a composition's prefill policy)."""
    check_headwise_eviction(policy, view, keep, state_before)
    rule = policy.decode_eviction
    if rule is None or view.phase != "decode":
        return
    n = view.n_cached
    if n <= rule.limit and keep is not None:
        raise ContractViolation(
            f"{policy!r} declares {rule!r} but evicted at {n} tokens (<= limit {rule.limit}); backends "
            "would not have asked it"
        )
    if n == rule.limit + 1:
        scores = view.scores if policy.selection == "per_head" else np.broadcast_to(
            np.sum(view.scores, axis=1, keepdims=True), view.scores.shape
        )
        want = np.asarray(rule.keep(CacheView(view.positions, scores, view.n_seen, dict(view.state), view.phase)))
        got = None if keep is None else np.asarray(keep)
        if got is None or got.shape != want.shape or not np.array_equal(got, want):
            raise ContractViolation(
                f"{policy!r} declares {rule!r}, but at {n} tokens select() kept {_fmt(got)} where the rule keeps "
                f"{_fmt(want)} (backends apply the rule in O(1) instead of calling select)"
            )
        if state_before != view.state:
            raise ContractViolation(f"{policy!r} declares {rule!r} but its state changed at a one-token eviction")



def check_headwise_eviction(policy: EvictionPolicy, view: CacheView, keep: Any, state_before: dict[str, int]) -> None:
    """A declared :class:`~kvpolicy.HeadwiseEviction` must mean what ``select`` does after a
    decode step: wherever it applies (the heads hold ``limit + 1`` tokens on average), exactly the
    rule's keep and the state it says (backends apply the rule instead of calling ``select``)."""
    rule = policy.headwise_eviction
    if rule is None or not rule.applies(view.n_cached, view.n_seen, state_before, view.phase):
        return
    want = np.asarray(rule.keep(CacheView(view.positions, view.scores, view.n_seen, dict(state_before), view.phase)))
    got = None if keep is None else np.asarray(keep)
    if got is None or got.shape != want.shape or not np.array_equal(got, want):
        raise ContractViolation(
            f"{policy!r} declares {rule!r}, but at {view.n_cached} tokens (state {state_before}) select() kept {_fmt(got)} "
            f"where the rule keeps {_fmt(want)} (backends apply the rule as a masked write instead of calling select)"
        )
    after = {**state_before, **rule.state_after(view.n_seen)}
    if view.state != after:
        raise ContractViolation(f"{policy!r} declares {rule!r}, whose eviction leaves state {after}, but select left {view.state}")


def check_candidate_sum(policy: EvictionPolicy, keys: np.ndarray, positions: np.ndarray, n_seen: Any,
                        scores: np.ndarray) -> None:
    """A declared :class:`~kvpolicy.CandidateSum` must mean the policy's ``cache_score``: given the
    candidates' summands summed (one matrix product over the held tokens, as KeyDiff's reference
    sums them), :meth:`~kvpolicy.CandidateSum.exact` gives ``scores`` (the reference's, from
    ``cache_scores``) at every held token, and :meth:`~kvpolicy.CandidateSum.estimate` is within
    :meth:`~kvpolicy.CandidateSum.error` of them (non-finite scores aside). A backend keeps the
    sum between decode steps and scores exactly only the tokens near the lowest estimate, so a
    wrong declaration would change what it keeps. ``keys`` ``[batch, heads, n, d]``; the kit
    calls it at every scoring.

    Example:
        >>> from kvpolicy import KeyDiff
        >>> from kvpolicy.statistics import cache_scores
        >>> keys, pos = np.array([[[[3.0, 4.0], [1.0, 0.0], [0.0, 2.0]]]]), np.arange(3)[None, None]
        >>> check_candidate_sum(KeyDiff(size=2), keys, pos, 3, cache_scores(KeyDiff(size=2), keys, None, pos, 3))
    """
    parts = policy.statistic_policy.candidate_sum
    if parts is None:
        return
    held = positions >= 0
    candidate = held & (positions < np.asarray(n_seen) - policy.key_recent)
    weight = candidate.astype(np.float64)
    summand = parts.summand(keys)
    total = np.matmul(weight[..., None, :], summand)[..., 0, :]
    count = np.maximum(weight.sum(-1, keepdims=True), 1.0)
    statistic = parts.statistic(total, count)
    exact = np.asarray(parts.exact(keys, summand, statistic), dtype=np.float64)
    estimate = np.asarray(parts.estimate(keys, statistic), dtype=np.float64)
    want = np.asarray(scores, dtype=np.float64)
    if not np.array_equal(np.where(held, exact, np.inf), np.where(held, want, np.inf), equal_nan=True):
        raise ContractViolation(
            f"{policy!r} declares {type(parts).__name__} as its score's sum over the candidates, but its exact() "
            f"gives {_fmt(np.where(held, exact, np.inf))} where cache_score gives {_fmt(want)}"
        )
    finite = held & np.isfinite(want) & np.isfinite(estimate)
    error = parts.error(keys.shape[-1])
    if np.any(np.abs(estimate - want)[finite] > error):
        raise ContractViolation(
            f"{policy!r}: {type(parts).__name__}.estimate() is {float(np.abs(estimate - want)[finite].max()):.3g} from "
            f"the exact scores, above its declared error {error:.3g}"
        )


def probe_host_decision(policy: EvictionPolicy, view: CacheView) -> tuple[int | None, dict[str, Any]]:
    """Ask ``policy`` on ``view`` with negated scores and a copy of its state: ``(kept count or
    None, state after)``. Whether to evict and how many to keep must come out the same as with
    the real scores (they are host decisions)."""
    probe = CacheView(view.positions, read_only(-view.scores), view.n_seen, dict(view.state), view.phase)
    keep = policy.evict(probe)
    return kept_count(keep), probe.state


def kept_count(keep: Any) -> int | None:
    """Tokens a keep array keeps, over every row and head (holes, ``-1``, not counted), or
    ``None`` for ``None``: the host decision (under head-wise budgets a head's share is not)."""
    return None if keep is None else int((np.asarray(keep) >= 0).sum())


class NumpyCache:
    """One layer's cache as NumPy ``[batch, heads, n]`` positions and float64 scores, evicted like
    :func:`kvpolicy_numpy.replay` (``phase`` is ``"prefill"`` after an append of more than one
    token, as in :class:`kvpolicy_torch.LayerCache`)."""

    def __init__(self, policy: EvictionPolicy, batch: int, heads: int, *, probe: bool = True) -> None:
        self.policy, self.batch, self.heads, self.probe = policy, batch, heads, probe
        self.state = policy.init_state()
        self.positions = np.zeros((batch, heads, 0), dtype=np.int64)
        self.scores = np.zeros((batch, heads, 0), dtype=np.float64)
        self.n_seen = 0
        self.rows = 1
        self.phase = "decode"
        self.scored_seen: int | None = None  # tokens seen at the last scoring from the cache
        self._evicting_rounds = 0  # in the current evict() call, against MAX_ROUNDS
        self.all_keys = np.zeros((batch, heads, 0, KEY_DIM))  # by position (a policy scoring keys)

    @property
    def length(self) -> int:
        return held_per_head(self.positions)

    def append(self, q: int, keys: np.ndarray | None = None) -> None:
        """``q`` tokens; ``keys`` ``[batch, heads, q, KEY_DIM]`` (default zeros) for a key statistic."""
        new_keys = np.zeros((self.batch, self.heads, q, KEY_DIM)) if keys is None else np.asarray(keys, dtype=np.float64)
        self.all_keys = np.concatenate([self.all_keys, new_keys], axis=2)
        new = np.broadcast_to(np.arange(self.n_seen, self.n_seen + q, dtype=np.int64), (self.batch, self.heads, q))
        self.positions = np.concatenate([self.positions, new], axis=-1)
        self.scores = np.concatenate([self.scores, np.zeros((self.batch, self.heads, q))], axis=-1)
        self.n_seen += q
        self.rows = q  # queries of the step (each a row of a "low_history" record)
        self.phase = "prefill" if q > 1 else "decode"

    def accumulate(self, received: np.ndarray) -> None:
        # the policy's score statistic: "latest" replaces the scores (TOVA), "low_history" shifts
        # the step's record in (Scissorhands, one bit per query of the last append), else they add up
        statistic = self.policy.score_statistic
        if statistic == "latest":
            self.scores = received.copy()
        elif statistic == "low_history":
            self.scores = shift_history(self.scores, received, self.rows, self.policy.score_history)  # type: ignore[arg-type]
        elif statistic not in KEY_STATISTICS:  # (a key statistic's scores come from the cache: evict())
            self.scores = self.scores + received

    def evict(self) -> list[tuple[int, int]]:
        self._evicting_rounds = 0
        refresh = refresh_interval(self.policy)
        if refresh > 1 and self.phase == "decode" and self.scored_seen is not None and not refresh_due(refresh, self.n_seen, self.scored_seen):
            # between two scorings (a refresh interval): the tokens appended since are unscored
            self.scores = mark_unscored(self.scores, self.positions, self.scored_seen, refresh_sink(self.policy))
        elif self.policy.score_statistic in KEY_STATISTICS:  # scores from the kept tokens' keys
            self.scored_seen = self.n_seen or None  # (an evict() before any token scores nothing: as torch's)
            cached = np.take_along_axis(self.all_keys, self.positions[..., None], axis=2)
            moments = None
            if self.policy.observes_queries:  # each token's vector is its query too
                counted = (np.arange(self.n_seen) >= self.policy.statistic_policy.sink).astype(np.float64)  # type: ignore[attr-defined]
                moments = query_moments(self.all_keys[:, :, None], np.broadcast_to(counted, (self.batch, self.n_seen)))
            self.scores = cache_scores(self.policy, cached, cached, self.positions, self.n_seen, moments)
            check_candidate_sum(self.policy, cached, self.positions, self.n_seen, self.scores)
        self.positions, self.scores, rounds = evict_until_done(
            self.policy, self.positions, self.scores, self.n_seen, self.state, self.phase, decide=self._decide
        )
        return rounds

    def _decide(self, view: CacheView) -> np.ndarray | None:
        """One round of :meth:`evict`: the policy's answer, checked against the contract."""
        state_before = dict(self.state)
        if self.probe:
            probed = probe_host_decision(self.policy, view)
        keep = self.policy.evict(view)
        if self.probe:
            got = kept_count(keep)
            if probed[0] != got:
                raise ContractViolation(
                    f"{self.policy!r}: whether to evict / how many to keep depends on the score values "
                    f"(n_cached={view.n_cached}, n_seen={view.n_seen}, state={view.state}): kept "
                    f"{'nothing evicted' if got is None else got} with the real scores, "
                    f"{'nothing evicted' if probed[0] is None else probed[0]} with other scores. Decide "
                    "*whether* and *how many* from host integers (n_cached, n_seen, state) only."
                )
            if keep is not None and probed[1] != self.state:
                raise ContractViolation(
                    f"{self.policy!r}: the state after an eviction depends on the score values "
                    f"({self.state} with the real scores, {probed[1]} with other scores); state holds host ints"
                )
        check_decode_eviction(self.policy, view, keep, state_before)
        if keep is None:
            return None
        self._evicting_rounds += 1
        if self._evicting_rounds > MAX_ROUNDS:
            raise ContractViolation(f"{self.policy!r} kept evicting for {MAX_ROUNDS} rounds after one append")
        return check_keep(self.policy, view, keep)


class TorchCache:
    """The same steps on :class:`kvpolicy_torch.LayerCache` (keys and values of width ``KEY_DIM``,
    float64; for Expected Attention a token's key is its value and its query too)."""

    def __init__(self, policy: EvictionPolicy, batch: int, heads: int) -> None:
        import torch  # optional: the kit compares with torch where it is installed

        from kvpolicy_torch import LayerCache  # optional: as torch

        self.torch = torch
        self.layer = LayerCache(policy)
        self.batch, self.heads = batch, heads

    @property
    def length(self) -> int:
        return self.layer.length

    @property
    def positions(self) -> np.ndarray:
        if not self.layer.is_initialized:
            return np.zeros((self.batch, self.heads, 0), dtype=np.int64)
        return self.layer.positions.cpu().numpy()

    def append(self, q: int, keys: np.ndarray | None = None) -> None:
        zeros = self.torch.zeros(self.batch, self.heads, q, KEY_DIM, dtype=self.torch.float64)
        k = zeros if keys is None else self.torch.from_numpy(np.ascontiguousarray(keys, dtype=np.float64))
        # one vector a token: its key and its value (as the NumPy side scores them), and its query
        # for a policy that observes queries (Expected Attention)
        self.layer.append(k, k)
        if self.layer.policy.observes_queries:
            self.layer.observe_queries(k)

    def accumulate(self, received: np.ndarray) -> None:
        # received is in position order (the NumPy side's layout); the layer's slots may have holes
        ordered = self.torch.from_numpy(np.ascontiguousarray(received))
        self.layer.accumulate(self.layer.to_slots(ordered))

    def evict(self) -> list[tuple[int, int]]:
        if not self.layer.is_initialized:  # nothing appended yet (LayerCache.evict needs storage)
            return []
        before = self._snapshot()  # copies: on the CPU a dense layer's positions are views of its storage
        rounds = self.layer.evict()
        check_untouched(self.layer.policy, before, self._snapshot())
        return rounds

    def _snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        return self.layer.positions.cpu().numpy().copy(), self.layer.scores.cpu().numpy().copy()


def check_untouched(policy: EvictionPolicy, before: tuple[np.ndarray, np.ndarray], after: tuple[np.ndarray, np.ndarray]) -> None:
    """The torch backend's views are not read-only (torch has none), so a policy that writes into
    ``view.positions`` or ``view.scores`` would change the cache: every token kept after an
    eviction must hold the position and the score (bit for bit, NaN included) it held before.
    ``before`` and ``after`` are ``(positions, scores)`` ``[batch, heads, n]`` in position order."""
    (pos0, sc0), (pos1, sc1) = before, after
    for b, h in np.ndindex(*pos1.shape[:2]):
        real = pos0[b, h] >= 0  # (a slot freed by a one-token eviction reads as position -1 until compacted)
        p0, s0 = pos0[b, h][real], sc0[b, h][real]
        held = pos1[b, h] >= 0  # (holes lead a head that keeps fewer, under head-wise budgets)
        p1, s1 = pos1[b, h][held], sc1[b, h][held]
        where = np.searchsorted(p0, p1)
        same = bool(np.all(where < p0.shape[-1]))
        if same:
            # (a key statistic's scores are the backend's own, recomputed from the keys at each
            # eviction: only the positions are the policy's to leave alone)
            scores_kept = policy.score_statistic in KEY_STATISTICS or np.array_equal(s0[where], s1, equal_nan=True)
            same = np.array_equal(p0[where], p1) and scores_kept
        if not same:
            raise ContractViolation(
                f"{policy!r} wrote into the view it was shown on the torch backend (row {b}, KV head {h}: the kept "
                "tokens' positions or scores changed in the eviction); view.positions and view.scores are read-only: "
                "copy them first (view.xp.asarray(view.scores, copy=True))"
            )


class Lockstep:
    """A :class:`NumpyCache` and (when ``torch``) a :class:`TorchCache` driven together; after
    every eviction their positions and eviction rounds must be equal."""

    def __init__(
        self,
        policy: EvictionPolicy,
        batch: int,
        heads: int,
        *,
        torch: bool = True,
        probe: bool = True,
        describe: Callable[[], str] = lambda: "",
    ) -> None:
        self.policy = policy
        self.np = NumpyCache(policy, batch, heads, probe=probe)
        self.tc = TorchCache(policy, batch, heads) if torch else None
        self.describe = describe

    @property
    def positions(self) -> np.ndarray:
        return self.np.positions

    @property
    def n_seen(self) -> int:
        return self.np.n_seen

    def append(self, q: int, received: np.ndarray, keys: np.ndarray | None = None) -> None:
        self.np.append(q, keys)
        self.np.accumulate(received)
        if self.tc is not None:
            self.tc.append(q, keys)
            self.tc.accumulate(received)

    def evict(self, check: Callable[[], None] | None = None) -> list[tuple[int, int]]:
        """Evict on both sides; ``check()`` runs after the NumPy side (its messages come first)."""
        rounds = self.np.evict()
        if check is not None:
            check()
        if self.tc is not None:
            try:
                t_rounds = self.tc.evict()
            except RuntimeError as e:  # LayerCache's own contract checks
                raise ContractViolation(f"the torch backend refused {self.policy!r}: {e}{self.describe()}") from None
            a, b = self.np.positions, self.tc.positions
            if a.shape != b.shape or not np.array_equal(a, b):
                raise ContractViolation(self._difference(a, b) + self.describe())
            if t_rounds != rounds:
                raise ContractViolation(
                    f"NumPy and torch evicted differently after token {self.n_seen - 1}: rounds "
                    f"(size before, after) {rounds} vs {t_rounds}{self.describe()}"
                )
        return rounds

    def _difference(self, a: np.ndarray, b: np.ndarray) -> str:
        t = self.n_seen - 1
        if a.shape != b.shape:
            return f"NumPy and torch keep different numbers of tokens after token {t}: {a.shape} vs {b.shape}"
        bad = np.argwhere((a != b).any(axis=-1))
        row, head = (int(x) for x in bad[0])
        return (
            f"NumPy and torch kept different positions after token {t} (row {row}, KV head {head}):\n"
            f"  numpy: {_fmt(a[row, head])}\n  torch: {_fmt(b[row, head])}\n"
            f"(equal scores on both sides, so the policy's decision differs between the array namespaces, "
            f"typically an unstable sort / top-k on ties)"
        )


# ---------------------------------------------------------------------------------- replay semantics
def group_sum(received_q: np.ndarray, group: int) -> np.ndarray:
    """``[batch, q_heads, n] -> [batch, kv_heads, n]``: query head ``g * group + r`` belongs to KV
    head ``g`` (transformers' ``repeat_kv`` order); the sum runs over ``r`` in order."""
    if group == 1:
        return received_q
    b, hq, n = received_q.shape
    grouped = received_q.reshape(b, hq // group, group, n)
    acc = grouped[:, :, 0]
    for r in range(1, group):
        acc = acc + grouped[:, :, r]
    return acc


def step_received(policy: EvictionPolicy, probs: np.ndarray, group: int, visible: np.ndarray, rows: int | None) -> np.ndarray:
    """What a step of ``q`` queries adds to the scores, ``[batch, kv_heads, n]``, from their
    probabilities ``probs`` ``[batch, q, q_heads, n]`` (``visible`` ``[q, n]``: which keys each
    query sees): the sum over the last ``rows`` queries (all when ``None``) and over each KV head's
    query heads; for a ``"low_history"`` policy (Scissorhands), the step's record of low-attention
    events instead (:mod:`kvpolicy.statistics`), each query a row of it."""
    if policy.score_statistic == "low_history":
        b, q, hq, n = probs.shape
        per_row = group_sum(probs.reshape(b * q, hq, n), group).reshape(b, q, hq // group, n)
        low = low_attention(per_row, group, kept=np.broadcast_to(visible[None, :, None, :], per_row.shape))
        return history_record(low.transpose(0, 2, 1, 3), policy.score_history)  # type: ignore[arg-type]
    q = probs.shape[1]
    return group_sum(probs[:, q - min(rows or q, q) :].sum(axis=1), group)


def prefill_received(policy: EvictionPolicy, logits: np.ndarray, p: int, group: int) -> np.ndarray:
    """Received attention of a ``p``-token prompt, ``[batch, kv_heads, p]`` (``logits`` is
    ``[batch, steps, q_heads, steps]``); the operations of :func:`kvpolicy_numpy.replay`."""
    rows = logits[:, :p, :, :p] * log_n_scales(policy, np.arange(1, p + 1))[None, :, None, None]
    causal = np.tril(np.ones((p, p), dtype=bool))
    probs = softmax(np.where(causal[None, :, None, :], rows, -np.inf))  # [batch, p, q_heads, p]
    return step_received(policy, probs, group, causal, policy.prompt_rows)  # the last prompt_rows rows


def decode_received(policy: EvictionPolicy, logits: np.ndarray, t: int, positions: np.ndarray, group: int) -> np.ndarray:
    """Received attention of query ``t`` over the cached ``positions`` ``[batch, kv_heads, n]``."""
    b, kv, n = positions.shape
    cached = np.repeat(positions, group, axis=1)  # [batch, q_heads, n]
    row = np.take_along_axis(logits[:, t], cached, axis=-1) * log_n_scales(policy, np.asarray([n]))[0]  # n = kept keys
    row = np.where(cached >= 0, row, -np.inf)  # holes (head-wise budgets) are not attended
    return step_received(policy, softmax(row)[:, None], group, np.ones((1, n), dtype=bool), None)


def run_replay(
    policy: EvictionPolicy,
    logits: np.ndarray,
    prompt_len: int = 0,
    *,
    group: int = 1,
    torch: bool = True,
    probe: bool = True,
    on_step: Callable[[int, np.ndarray, list[tuple[int, int]]], None] | None = None,
    describe: Callable[[], str] = lambda: "",
) -> list[np.ndarray | None]:
    """Replay ``policy`` on batched ``[batch, steps, q_heads, steps]`` logits with
    :func:`kvpolicy_numpy.replay`'s semantics, NumPy and (when ``torch``) torch in lockstep.

    Returns ``kept[t]``: ``[batch, kv_heads, n]`` positions after token ``t`` (``None`` before the
    prompt's last token). ``on_step(t, positions, rounds)`` is called after every NumPy eviction
    (before the torch side is compared; ``rounds`` is empty).
    """
    batch, steps, q_heads, _ = logits.shape
    if q_heads % group:
        raise ValueError(f"query heads ({q_heads}) must be a multiple of group ({group})")
    run = Lockstep(policy, batch, q_heads // group, torch=torch, probe=probe, describe=describe)
    kept: list[np.ndarray | None] = [None] * steps
    check = None if on_step is None else (lambda: on_step(run.n_seen - 1, run.np.positions, []))
    keys = example_keys(policy, logits, q_heads // group)  # [batch, steps, kv_heads, KEY_DIM] or None
    step_keys = (lambda a, b: None) if keys is None else (lambda a, b: keys[:, a:b].transpose(0, 2, 1, 3))
    if prompt_len:
        run.append(prompt_len, prefill_received(policy, logits, prompt_len, group), step_keys(0, prompt_len))
        rounds = run.evict(check)
        kept[prompt_len - 1] = run.positions.copy()
    for t in range(prompt_len, steps):
        run.np.append(1, step_keys(t, t + 1))
        received = decode_received(policy, logits, t, run.np.positions, group)
        run.np.accumulate(received)
        if run.tc is not None:
            run.tc.append(1, step_keys(t, t + 1))
            run.tc.accumulate(received)
        run.evict(check)
        kept[t] = run.positions.copy()
    return kept


def sequence_rows(kept: Sequence[np.ndarray | None], row: int) -> list[np.ndarray | None]:
    """``kept`` of one batch row: ``[kv_heads, n]`` per step."""
    return [None if k is None else k[row] for k in kept]
