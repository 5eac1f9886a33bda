"""A literal, loop-by-loop oracle of the eviction policies, written apart from the policy code.

Used only by tests. It follows ``docs/policies.md`` (issue 3, section 2) and the BUZZ paper's
Algorithms 1 and 2 one token, one head and one segment at a time, with Python lists:

* decode step ``t``: key ``t`` is appended; query ``t`` attends with a softmax over the kept keys;
  every kept token's score grows by the probability it received; then the policy may evict;
* prefill of ``prompt_len`` tokens: causal softmax per prompt row, scores summed over the rows,
  then the eviction rule, repeated until it holds;
* TOVA: a token's score is only the latest query's probability (the prompt's last row after a
  prefill), not the sum.
* Scissorhands: a token's score is the list of its last ``history`` low-attention bits (a query
  gave it less than ``(1 - 1e-6) / n`` of its attention, ``n`` the keys the query saw; every prompt
  row a query); at ``size`` tokens or more, tokens outside the last ``recent`` go down to
  ``size - max(1, floor(drop * size))``: the most bits set first, the latest of a tie first.

What it shares with :mod:`kvpolicy_numpy.replay` is only the floating-point arithmetic of the
attention probabilities (the same NumPy operations in the same order, copied here rather than
imported, so equal inputs give bit-equal scores and ties are broken identically); the log-n
scale is computed with the same ``np.log`` call for the same reason. Every eviction decision is
plain Python on lists: no ``argsort``, no ``argmax``, no policy object method is called. The
policy object is read only for its parameters (attributes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

__all__ = ["OracleResult", "buzz_round", "keep_highest_oracle", "literal_replay", "oracle", "oracle_params", "same_kept"]


# --------------------------------------------------------------------------- arithmetic shared
# with kvpolicy_numpy.replay (same operations, same order: bit-equal floats)
def _softmax(logits: np.ndarray, axis: int = -1) -> np.ndarray:
    shifted = logits - np.max(logits, axis=axis, keepdims=True)
    e = np.exp(shifted)
    return e / np.sum(e, axis=axis, keepdims=True)


def _log_n_scale(n: int, base: float, floor: float) -> float:
    """``max(log(n) / log(base), floor)``; ``np.log`` as in ``LogNScaling.scales``."""
    value = float(np.log(np.asarray([n], dtype=np.float64))[0] / math.log(base))
    return value if value > floor else floor


# --------------------------------------------------------------------------- parameters
def oracle_params(policy: Any) -> dict[str, Any]:
    """The parameters the oracle needs, read from the policy's attributes (no methods)."""
    kind = type(policy).name
    p: dict[str, Any] = {"kind": kind, "selection": getattr(policy, "selection", "per_head")}
    if kind == "buzz":
        p.update(
            sink=policy.sink,
            window=policy.window,
            stride=policy.stride,
            threshold=policy.threshold,
            interval_keep=policy.interval_keep,
        )
        if policy.log_n is not None:
            p.update(log_base=policy.log_n.base, log_floor=policy.log_n.floor)
    elif kind == "h2o":
        p.update(heavy=policy.heavy, recent=policy.recent)
    elif kind == "streaming_llm":
        p.update(sink=policy.sink, window=policy.window)
    elif kind == "local":
        p.update(window=policy.window)
    elif kind == "tova":
        p.update(size=policy.size, recent=policy.recent)
    elif kind == "snapkv":
        p.update(size=policy.size, window=policy.window, kernel=policy.kernel, pooling=policy.pooling)
    elif kind == "scissorhands":
        p.update(size=policy.size, history=policy.history, drop=policy.drop, recent=policy.recent)
    elif kind == "full":
        pass
    elif kind == "compose":
        p.update(prefill=oracle_params(policy.prefill), decode=oracle_params(policy.decode))
        d = p["decode"]
        p["capacity"] = {  # the decode policy's capacity, from its parameters
            "buzz": lambda: d["sink"] + d["window"] + d["threshold"],
            "h2o": lambda: d["heavy"] + d["recent"] + 1,
            "tova": lambda: d["size"] + 1,
            "streaming_llm": lambda: d["sink"] + d["window"] + 1,
            "local": lambda: d["window"] + 1,
        }.get(d["kind"], lambda: None)()
        for key in ("log_base", "log_floor"):  # attention is scaled as the decode policy scales it
            if key in d:
                p[key] = d[key]
    else:
        raise ValueError(f"the oracle does not know policy {kind!r}")
    return p


# --------------------------------------------------------------------------- eviction rules
def _first_max(values: list[float]) -> int:
    """Index of the largest value, the earliest among equals (a plain loop, strict ``>``)."""
    best = 0
    for i in range(1, len(values)):
        if values[i] > values[best]:
            best = i
    return best


def _first_min(values: list[float]) -> int:
    """Index of the smallest value, the earliest among equals."""
    best = 0
    for i in range(1, len(values)):
        if values[i] < values[best]:
            best = i
    return best


def buzz_round(p: dict[str, Any], cache: list[int], scores: list[float], n_old: int) -> list[int] | None:
    """One BUZZ eviction (Algorithm 1 lines 13-15 with Algorithm 2) on one head's cache.

    Returns the kept *indices into the cache list*, or ``None`` when the middle is below the
    threshold.
    """
    sink, window, stride, threshold = p["sink"], p["window"], p["stride"], p["threshold"]
    n = len(cache)
    middle = n - sink - window
    if middle < threshold:
        return None
    s_hat = math.floor((stride + 1) / 2)
    old = list(range(sink, sink + n_old))
    new = list(range(sink + n_old, n - window))

    kept: list[int] = list(range(sink))
    # interval sampling of the old tokens: groups of s_hat, keep the first (or the last)
    g = 0
    while g < len(old):
        group = old[g : g + s_hat]
        kept.append(group[0] if p["interval_keep"] == "first" else group[-1])
        g += s_hat
    # local max sampling of the new tokens (Algorithm 2): segments of `stride` from their start
    idx = 0
    while idx < len(new):
        segment = new[idx : idx + stride]
        seg_scores = [scores[i] for i in segment]
        kept.append(segment[_first_max(seg_scores)])
        idx += stride
    kept.extend(range(n - window, n))
    return kept


def _h2o_round(p: dict[str, Any], cache: list[int], scores: list[float]) -> list[int] | None:
    """Evict one token at a time: the lowest score outside the last ``recent``, earliest first."""
    heavy, recent = p["heavy"], p["recent"]
    if len(cache) <= heavy + recent:
        return None
    alive = list(range(len(cache)))
    while len(alive) > heavy + recent:
        candidates = alive[: len(alive) - recent]
        victim = candidates[_first_min([scores[i] for i in candidates])]
        alive.remove(victim)
    return alive


def _tova_round(p: dict[str, Any], cache: list[int], scores: list[float]) -> list[int] | None:
    """TOVA: while more than ``size`` tokens, evict the lowest (latest-query) score outside the
    last ``recent``, the earliest of a tie; one token at a time."""
    size, recent = p["size"], p["recent"]
    if len(cache) <= size:
        return None
    alive = list(range(len(cache)))
    while len(alive) > size:
        candidates = alive[: len(alive) - recent]
        victim = candidates[_first_min([scores[i] for i in candidates])]
        alive.remove(victim)
    return alive


def _scissorhands_round(p: dict[str, Any], cache: list[int], bits: list[list[int]]) -> list[int] | None:
    """Scissorhands: at ``size`` tokens or more, drop tokens before the last ``recent`` down to
    ``size - max(1, floor(drop * size))``: the most low bits set first, the latest of a tie first."""
    size, recent = p["size"], p["recent"]
    m = max(1, min(size - 1, math.floor(p["drop"] * size)))
    if len(cache) < size:
        return None
    alive = list(range(len(cache)))
    while len(alive) > size - m:  # down to the target, one at a time (counts do not change meanwhile)
        candidates = alive[: len(alive) - recent]
        victim = candidates[0]
        for i in candidates:  # the most bits; among equals the latest (>=)
            if sum(bits[i]) >= sum(bits[victim]):
                victim = i
        alive.remove(victim)
    return alive


def _snapkv_round(p: dict[str, Any], cache: list[int], scores: list[float], phase: str) -> list[int] | None:
    """SnapKV, right after a prompt only: pool the scores of the tokens before the window (``kernel``
    positions centred on each: the largest of those that exist, or their sum over ``kernel``,
    zeros past the edges, added in ascending order), keep the ``size -
    window`` highest (picked one at a time; a tie goes to the higher own score, then the
    earliest), and the window."""
    size, window, kernel = p["size"], p["window"], p["kernel"]
    n = len(cache)
    if phase != "prefill" or n <= size:
        return None
    prefix = n - window
    half = kernel // 2
    pooled = []
    for j in range(prefix):
        if p.get("pooling", "avg") == "avg":
            values = sorted(scores[i] if 0 <= i < prefix else 0.0 for i in range(j - half, j + half + 1))
            total = values[0]
            for v in values[1:]:
                total = total + v
            pooled.append(total / kernel)
            continue
        best = scores[j]
        for i in range(max(0, j - half), min(prefix, j + half + 1)):
            if scores[i] > best:
                best = scores[i]
        pooled.append(best)
    chosen: list[int] = []
    remaining = list(range(prefix))
    while len(chosen) < size - window:
        best = remaining[0]
        for i in remaining:
            if pooled[i] > pooled[best] or (pooled[i] == pooled[best] and scores[i] > scores[best]):
                best = i
        chosen.append(best)
        remaining.remove(best)
    return sorted(chosen) + list(range(prefix, n))


def _streaming_round(p: dict[str, Any], cache: list[int]) -> list[int] | None:
    sink, window = p["sink"], p["window"]
    n = len(cache)
    if n <= sink + window:
        return None
    return list(range(sink)) + list(range(n - window, n))


def _local_round(p: dict[str, Any], cache: list[int]) -> list[int] | None:
    n = len(cache)
    if n <= p["window"]:
        return None
    return list(range(n - p["window"], n))


# --------------------------------------------------------------------------- the replay
@dataclass
class OracleResult:
    """``kept[t]``: per head, the sorted kept positions after token ``t`` (``None`` before the
    prompt's last token). ``sizes``: keys attended at every decode step. ``evictions``:
    ``(t, size_before, size_after)`` per eviction round (sizes of head 0; equal on all heads)."""

    kept: list[list[list[int]] | None]
    sizes: list[int]
    evictions: list[tuple[int, int, int]] = field(default_factory=list)
    #: ``outputs[t][h]``: query ``t``'s attention output (when values were given), a list of floats
    outputs: list[list[list[float]]] | None = None

    @property
    def n_evictions(self) -> int:
        return len(self.evictions)


def oracle(
    policy: Any, logits: np.ndarray, prompt_len: int = 0, values: np.ndarray | None = None
) -> OracleResult:
    """Replay ``policy`` (read for its parameters only) literally on ``logits[t, h, j]``; with
    ``values[t, h, :]`` also the attention outputs, summed in plain Python."""
    p = oracle_params(policy)
    logits = np.asarray(logits, dtype=np.float64)
    steps, heads, _ = logits.shape
    shared = p["selection"] == "shared"
    # TOVA's score is the latest query's attention, not a running sum (as the decode policy of a
    # composition); a prompt is scored by its last row (TOVA), its observation window (SnapKV),
    # as the prefill policy of a composition scores it, or by all its rows
    scoring = p["decode"] if p["kind"] == "compose" else p
    latest = scoring["kind"] == "tova"
    history = scoring.get("history") if scoring["kind"] == "scissorhands" else None

    def low_bits(probs_row: Any, n: int) -> list[int]:
        # a query's low-attention bits over the n keys it sees
        return [1 if float(probs_row[j]) < (1 - 1e-6) / n else 0 for j in range(n)]
    prompting = p["prefill"] if p["kind"] == "compose" else p
    prompt_rows = {"tova": 1, "snapkv": prompting.get("window")}.get(prompting["kind"])
    caches: list[list[int]] = [[] for _ in range(heads)]
    scores: list[list[float]] = [[] for _ in range(heads)]
    n_old = 0  # BUZZ: old tokens in the middle; the same count on every head
    result = OracleResult(kept=[None] * steps, sizes=[])
    if values is not None:
        result.outputs = [[[] for _ in range(heads)] for _ in range(steps)]

    def output(t: int, h: int, keys: list[int], probs: Any) -> None:
        if values is None:
            return
        d = values.shape[2]
        acc = [0.0] * d
        for j, pr in zip(keys, probs):
            for k in range(d):
                acc[k] += float(pr) * float(values[j, h, k])
        result.outputs[t][h] = acc

    def scale(n: int) -> float:
        if "log_base" not in p:
            return 1.0
        return _log_n_scale(n, p["log_base"], p["log_floor"])

    def decide(q: dict[str, Any], cache: list[int], sc: list[float], phase: str) -> list[int] | None:
        kind = q["kind"]
        if kind == "snapkv":
            return _snapkv_round(q, cache, sc, phase)
        if kind == "buzz":
            return buzz_round(q, cache, sc, n_old)
        if kind == "h2o":
            return _h2o_round(q, cache, sc)
        if kind == "tova":
            return _tova_round(q, cache, sc)
        if kind == "scissorhands":
            return _scissorhands_round(q, cache, sc)  # type: ignore[arg-type]
        if kind == "streaming_llm":
            return _streaming_round(q, cache)
        if kind == "local":
            return _local_round(q, cache)
        return None  # full cache

    deciders: list[dict[str, Any]] = []  # which parameters decided each round (for BUZZ's n_old)

    def one_round(cache: list[int], sc: list[float], phase: str) -> list[int] | None:
        if p["kind"] != "compose":
            deciders.append(p)
            return decide(p, cache, sc, phase)
        # composition: the prefill policy right after a prompt that leaves more than the decode
        # policy's capacity - 1 tokens, until it declines; then the decode policy
        cap = p["capacity"]
        if phase == "prefill" and (cap is None or len(cache) > cap - 1):
            keep = decide(p["prefill"], cache, sc, phase)
            if keep is not None:
                deciders.append(p["prefill"])
                return keep
        deciders.append(p["decode"])
        return decide(p["decode"], cache, sc, phase)

    def evict_until_stable(t: int, phase: str = "decode") -> None:
        nonlocal n_old
        while True:
            before = len(caches[0])
            if shared:
                summed = [0.0] * before
                for h in range(heads):  # the heads in order, as np.sum over the head axis
                    for j in range(before):
                        summed[j] = scores[h][j] if h == 0 else summed[j] + scores[h][j]
                keep = one_round(caches[0], summed, phase)
                keeps = None if keep is None else [keep] * heads
            else:
                keeps = [one_round(caches[h], scores[h], phase) for h in range(heads)]
                if any(k is None for k in keeps):
                    assert all(k is None for k in keeps), "heads disagree on whether to evict"
                    keeps = None
            if keeps is None:
                return
            for h in range(heads):
                caches[h] = [caches[h][i] for i in keeps[h]]
                scores[h] = [scores[h][i] for i in keeps[h]]
            after = len(caches[0])
            assert after < before, "an eviction round must evict"
            q = deciders[-1]
            if q["kind"] == "buzz":
                n_old = after - q["sink"] - q["window"]  # every survivor of the middle is old
            result.evictions.append((t, before, after))

    if prompt_len:
        n = prompt_len
        # causal softmax per prompt row, summed over the rows: replay's exact NumPy operations
        scale_rows = np.asarray([scale(i) for i in range(1, n + 1)], dtype=np.float64)
        rows = logits[:n, :, :n] * scale_rows[:, None, None]
        causal = np.tril(np.ones((n, n), dtype=bool))[:, None, :]
        probs = _softmax(np.where(causal, rows, -np.inf))
        summed = probs[max(0, n - (prompt_rows or n)) :].sum(axis=0)  # [heads, n]: the last prompt_rows rows
        for i in range(n):
            for h in range(heads):
                output(i, h, list(range(i + 1)), probs[i, h, : i + 1])
        for h in range(heads):
            caches[h] = list(range(n))
            scores[h] = [float(summed[h, j]) for j in range(n)]
            if history is not None:  # each prompt row is a query: token j's bits from rows j..n-1
                records: list[list[int]] = [[] for _ in range(n)]
                for i in range(n):
                    row_bits = low_bits(probs[i, h], i + 1)
                    for j in range(i + 1):
                        records[j] = (records[j] + [row_bits[j]])[-history:]
                scores[h] = records  # type: ignore[assignment]
        evict_until_stable(n - 1, "prefill" if n > 1 else "decode")  # a one-token prompt is a decode step
        result.kept[n - 1] = [list(c) for c in caches]

    for t in range(prompt_len, steps):
        for h in range(heads):
            caches[h].append(t)
            scores[h].append([] if history is not None else 0.0)  # type: ignore[arg-type]
        result.sizes.append(len(caches[0]))
        c = scale(len(caches[0]))  # log n: n = the keys query t attends to (paper, section 3.5)
        row = np.asarray(
            [[logits[t, h, j] for j in caches[h]] for h in range(heads)], dtype=np.float64
        ) * np.float64(c)
        probs = _softmax(row)
        for h in range(heads):
            if history is not None:
                row_bits = low_bits(probs[h], len(caches[h]))
                for j in range(len(caches[h])):
                    scores[h][j] = (scores[h][j] + [row_bits[j]])[-history:]  # type: ignore[operator]
                output(t, h, caches[h], probs[h])
                continue
            for j in range(len(caches[h])):
                scores[h][j] = float(probs[h, j]) if latest else scores[h][j] + float(probs[h, j])
            output(t, h, caches[h], probs[h])
        evict_until_stable(t)
        result.kept[t] = [list(c_) for c_ in caches]
    return result


def same_kept(got: list[Any], want: list[Any]) -> None:
    """Assert two replays' kept positions (``kept`` of a trace, or an oracle's nested lists) are
    the same at every step: both ``None`` (before the prompt's last token) or equal."""
    assert len(got) == len(want), (len(got), len(want))
    for t, (a, b) in enumerate(zip(got, want)):
        assert (a is None) == (b is None), f"step {t}"
        if a is not None:
            assert np.asarray(a).tolist() == np.asarray(b).tolist(), f"step {t}"


def literal_replay(steps: int, heads: int, prompt_len: int,
                   evict: Callable[[list[list[int]], int, bool], None]) -> list[list[list[int]] | None]:
    """The driver of the literal rules written out in the tests (kept per step and head, ``None``
    before the prompt's last token): every head holds the prompt's positions and
    ``evict(cached, t, prompt)`` is called once after it (``prompt``: it had more than one token),
    then each token is appended to every head and ``evict(cached, t, False)`` called. ``evict``
    replaces ``cached[h]`` with what head ``h`` keeps."""
    kept: list[list[list[int]] | None] = [None] * steps
    cached: list[list[int]] = [[] for _ in range(heads)]
    if prompt_len:
        cached = [list(range(prompt_len)) for _ in range(heads)]
        evict(cached, prompt_len - 1, prompt_len > 1)
        kept[prompt_len - 1] = [list(c) for c in cached]
    for t in range(prompt_len, steps):
        for c in cached:
            c.append(t)
        evict(cached, t, False)
        kept[t] = [list(c) for c in cached]
    return kept


def keep_highest_oracle(policy: Any, steps: int, heads: int, prompt_len: int, head_scores: Any) -> list[list[list[int]] | None]:
    """Kept positions per step and head of a policy that keeps the ``size`` highest scores
    computed from the cache (Knorm, KeyDiff, Expected Attention): append, then while more than
    ``size`` are held drop the lowest score outside the newest ``recent`` (the earliest of a tie),
    all surplus at once from one set of scores; ``selection="shared"`` sums the scores over heads.
    ``head_scores(h, held, t)``: head ``h``'s scores of its ``held`` positions after token ``t``."""

    def evict(cached: list[list[int]], t: int, prompt: bool) -> None:
        if len(cached[0]) > policy.size:
            drop_lowest(policy, cached, [head_scores(h, cached[h], t) for h in range(heads)])

    return literal_replay(steps, heads, prompt_len, evict)


def drop_lowest(policy: Any, cached: list[list[int]], scores: list[list[float]]) -> None:
    """While more than ``policy.size`` are held, drop the lowest of ``scores`` (per head, of its
    ``cached`` positions) outside the newest ``recent``, the earliest of a tie, all surplus at once;
    ``selection="shared"``: the scores summed over the heads."""
    n, heads = len(cached[0]), len(cached)
    if n <= policy.size:
        return
    if policy.selection == "shared":
        summed = [sum(s[i] for s in scores) for i in range(n)]
        scores = [summed] * heads
    for h in range(heads):
        drop = sorted(range(n - policy.recent), key=lambda i: (scores[h][i], i))[: n - policy.size]
        cached[h] = [p for i, p in enumerate(cached[h]) if i not in drop]


def refresh_oracle(policy: Any, steps: int, heads: int, prompt_len: int, head_scores: Any,
                   unscored: Any) -> list[list[list[int]] | None]:
    """:func:`keep_highest_oracle` under a refresh interval (``policy.refresh``), literally: the
    held tokens are scored after the prompt and at every ``refresh``-th decode step since the last
    scoring, kept per position in between; a token appended since scores ``unscored(position)``
    (``UNSCORED``; Expected Attention's sinks ``+inf``)."""
    stored: list[dict[int, float]] = [{} for _ in range(heads)]
    scored_at: int | None = None

    def scores(h: int, held: list[int]) -> list[float]:
        return [stored[h].get(p, unscored(p)) for p in held]

    def evict(cached: list[list[int]], t: int, prompt: bool) -> None:
        nonlocal scored_at
        if prompt or scored_at is None or t + 1 - scored_at >= policy.refresh:
            for h in range(heads):
                stored[h] = dict(zip(cached[h], head_scores(h, cached[h], t)))
            scored_at = t + 1
        drop_lowest(policy, cached, [scores(h, cached[h]) for h in range(heads)])

    return literal_replay(steps, heads, prompt_len, evict)
