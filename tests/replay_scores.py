"""The accumulated scores behind a NumPy replay's evictions, recomputed from the trace alone (the BUZZ and
H2O rule tests in tests/core/policies/ hold each eviction to them)."""

from __future__ import annotations

import numpy as np

from kvpolicy_numpy import softmax


def reconstruct_scores(trace, logits: np.ndarray, policy, t: int) -> list[dict[int, float]]:
    """Accumulated score of every token in the pre-eviction cache of decode step ``t``, per head,
    recomputed from the trace alone: at each decode step ``u`` query ``u`` attended to
    ``kept[u-1] + [u]``. With shared selection, one entry: the sum over heads, as the policy
    sees it. (Prompt-free traces only; the same float operations as the replay, so ties are
    exact ties.)"""
    assert trace.prompt_len == 0
    heads = logits.shape[1]
    scores: list[dict[int, float]] = [dict() for _ in range(heads)]
    for u in range(t + 1):
        n_keys = 1 if u == 0 else trace.kept[u - 1].shape[-1] + 1  # log n: n = keys attended
        scale = np.float64(1.0) if policy.log_n is None else policy.log_n.scales(np.asarray([n_keys]))[0]
        for h in range(heads):
            attended = ([] if u == 0 else trace.kept[u - 1][h].tolist()) + [u]
            probs = softmax(logits[u, h, attended] * scale)
            scores[h] = {j: scores[h].get(j, 0.0) + float(pr) for j, pr in zip(attended, probs)}
    if policy.selection == "shared":
        summed = dict(scores[0])
        for h in range(1, heads):
            summed = {j: summed[j] + scores[h][j] for j in summed}
        return [summed] * heads
    return scores
