"""A general eviction: the policy's own ``select`` asked on the host, applied by compaction.

A policy without a one-token decode eviction (BUZZ, Scissorhands, any prefill) decides by its
:meth:`~kvpolicy.EvictionPolicy.select` on dense views of each row, in position order. Rows in the
same host state (kept tokens, tokens seen, policy state) decide together; the core's loop
(:func:`kvpolicy.driver.kept_slots`) asks until the policy keeps everything, and a group's rounds
are applied in one compaction (:meth:`~kvpolicy_torch.layout.SlotLayout.keep`).
"""

from __future__ import annotations

from typing import Callable

import torch

from kvpolicy.driver import kept_slots
from kvpolicy.policy import EvictionPolicy

from .layout import SlotLayout

__all__ = ["declines", "select_rounds"]


def select_rounds(
    layout: SlotLayout,
    policy: EvictionPolicy,
    reduce_scores: Callable[[torch.Tensor], torch.Tensor] | None,
    *,
    sink: int,
    chunk_bytes: int,
) -> list[tuple[int, int]]:
    """Ask ``policy`` on ``layout``'s rows, group by group, and compact what it keeps; return the
    ``(size_before, size_after)`` rounds. The transient working set (an overflowing chunk) is
    left for the caller to put back once it fits.

    Example:
        >>> from kvpolicy import BUZZ
        >>> from kvpolicy_torch import LayerCache
        >>> layer = LayerCache(BUZZ(sink=1, window=2, stride=3))
        >>> K, V = layer.append(torch.randn(1, 1, 9, 4), torch.randn(1, 1, 9, 4))
        >>> layer.accumulate(torch.arange(9.0).view(1, 1, 9))
        >>> layer.evict(), layer.positions.tolist()  # (select_rounds, through the layer)
        ([(9, 5)], [[[0, 3, 6, 7, 8]]])
    """
    layout.unshift()
    rows = layout.rows
    layout.densify(sink=sink, chunk_bytes=chunk_bytes)
    rounds: list[tuple[int, int]] = []
    for group in rows.groups():
        r0 = group[0]
        n = rows.count[r0]
        full = layout.full()
        pos, scores = full.positions, full.scores
        if len(group) < rows.batch:
            index = torch.tensor(group, device=pos.device)
            pos, scores = pos.index_select(0, index), scores.index_select(0, index)
        state = dict(rows.states[r0])
        keep, done = kept_slots(policy, pos[:, :, :n], scores[:, :, :n], rows.seen[r0], state, layout.phase,
                                decide=lambda view: policy.evict(view, reduce_scores))
        if keep is None:
            continue
        layout.keep(group, keep, chunk_bytes=chunk_bytes)
        for r in group:
            rows.states[r] = dict(state)
        rounds += done
    return rounds


def declines(layout: SlotLayout, size_rule: Callable[[int, dict[str, int]], int] | None) -> bool:
    """Whether this decode step's ``size_rule`` keeps every row's tokens, so the policy (whose rule
    the tests hold to its ``select``) would decline and is not asked (host integers only)."""
    if size_rule is None or layout.phase != "decode" or layout.extra is not None:
        return False
    rows = layout.rows
    return all(size_rule(c, dict(s)) == c for c, s in zip(rows.count, rows.states))
