"""A layer's eviction on the host (the eager layout): which rule decides after a step.

After each step (:meth:`~kvpolicy_torch.LayerCache.evict`), :meth:`HostEviction.evict` decides,
from host integers only, which of three things runs:

1. **A one-token eviction** (:class:`~kvpolicy.DecodeEviction`: H2O, TOVA, StreamingLLM, the local
   window): after a decode step, each row holding ``limit + 1`` tokens frees one slot per head
   (:class:`~kvpolicy_torch.victims.OneTokenEviction`); nothing moves.
2. **Nothing**: a decode step at which the policy's declared size rule keeps every row's tokens
   (BUZZ between strides, :func:`~kvpolicy_torch.general.declines`), or a one-token rule's rows
   under the limit.
3. **A general eviction**: the policy's ``select`` on dense rows, applied by compaction
   (:func:`~kvpolicy_torch.general.select_rounds`), for a prompt chunk, a policy without a one-token
   rule, or rows of a left-padded batch that hold more than ``limit + 1`` after their prompt.
   The transient working set of an overflowing chunk is then put back, and under head-wise
   budgets the storage follows the widest head.

A statistic computed from the keys (KeyDiff, Expected Attention) is recomputed over the held tokens
first, unless the step evicts nothing by rule; one the policy declares token-local (Knorm:
:func:`kvpolicy.statistics.scored_once`) only for a prompt chunk or a general eviction, a decode
token having been scored when it was cached.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from kvpolicy.policy import KEY_STATISTICS, EvictionPolicy
from kvpolicy.statistics import refresh_interval, scored_once

from .allocation import SlotAllocator
from .general import declines, select_rounds
from .headwise import fitted_slots
from .layout import SlotLayout
from .queries import RunningMoments, held_scores
from .victims import OneTokenEviction

__all__ = ["HostEviction"]


class HostEviction:
    """One layer's eviction decided and applied on the host (the eager layout).

    Args:
        policy: the layer's policy.
        victims: its one-token eviction, or ``None`` (a policy without one).
        slots: the layer's allocator (head-wise budgets resize the storage after an eviction).
        reduce_scores: applied to head-summed scores of a shared selection (tensor parallelism).

    Example:
        >>> from kvpolicy import BUZZ, H2O
        >>> from kvpolicy_torch import LayerCache
        >>> h2o = LayerCache(H2O(heavy=1, recent=1))
        >>> for t in range(4):
        ...     K, V = h2o.append(torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4))
        ...     h2o.accumulate(torch.ones(1, 1, K.shape[2]))
        ...     rounds = h2o.evict()
        >>> rounds, h2o.length  # a decode step at the limit: one token freed, nothing moved
        ([(3, 2)], 2)
        >>> buzz = LayerCache(BUZZ(sink=1, window=2, stride=3))
        >>> K, V = buzz.append(torch.randn(1, 1, 9, 4), torch.randn(1, 1, 9, 4))
        >>> buzz.accumulate(torch.rand(1, 1, 9)); buzz.evict()  # a prompt chunk: BUZZ's select
        [(9, 5)]
        >>> K, V = buzz.append(torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4))
        >>> buzz.accumulate(torch.ones(1, 1, 6)); buzz.evict()  # its size rule keeps all 6: not asked
        []
    """

    def __init__(
        self,
        policy: EvictionPolicy,
        victims: OneTokenEviction | None,
        slots: SlotAllocator,
        reduce_scores: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.policy, self.victims, self.slots = policy, victims, slots
        self.reduce_scores = reduce_scores
        self.rule = policy.decode_eviction
        self.refresh = refresh_interval(policy)  # decode steps between two scorings from the cache
        self.once = scored_once(policy)  # decode tokens scored when cached, never rescored
        # a policy without one-token evictions (BUZZ, SnapKV and its compositions) that declares
        # its decode steps' size rule: a decode step at which the rule keeps every token skips the
        # policy's call (host integers only)
        self.size_rule = policy.decode_size_rule() if self.rule is None else None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["size_rule"] = None  # a closure: rebuilt from the policy
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.size_rule = self.policy.decode_size_rule() if self.rule is None else None

    def declines(self, layout: SlotLayout) -> bool:
        """Whether the policy's size rule keeps every row at this decode step (it is not asked)."""
        return declines(layout, self.size_rule)

    def evict(self, layout: SlotLayout, running: RunningMoments | None, *, candidates: int, min_scores: int,
              chunk_bytes: int) -> list[tuple[int, int]]:
        """Evict after a step; ``(size_before, size_after)`` per round (per group of rows that
        evicted together). ``running``: Expected Attention's query moments; ``candidates`` and
        ``min_scores``: the candidate search's (:class:`~kvpolicy_torch.victims.CandidateSearch`)."""
        rule, count = self.rule, layout.rows.count
        one_token = layout.phase == "decode" and rule is not None and layout.extra is None
        if self.policy.score_statistic in KEY_STATISTICS and (not one_token or (not self.once and (max(count) > rule.limit or self.refresh > 1))):  # type: ignore[union-attr]
            # (a decode step under the rule's limit evicts nothing: no scores needed, unless a
            # refresh interval counts the steps between two scorings; a token-local score was
            # given to the decode token when it was cached: LayerCache.append)
            self.score_keys(layout, running)
        if not one_token:
            return [] if self.declines(layout) else self.general(layout, chunk_bytes=chunk_bytes)
        over = rule.limit + 1  # type: ignore[union-attr]
        batch = layout.rows.batch
        # (list.count: every decode step of every layer asks, and most batches have rows alike)
        rows = list(range(batch)) if count.count(over) == batch else [r for r, c in enumerate(count) if c == over]
        if len(rows) < batch and any(c > over for c in count):
            return self.general(layout, chunk_bytes=chunk_bytes)  # (a padded row above the limit after its prompt)
        if not rows or self.victims is None:
            return []
        self.victims.evict(layout.storage(), layout.rows, rows, candidates, min_scores)
        return [(over, over - 1)]

    def score_keys(self, layout: SlotLayout, running: RunningMoments | None) -> None:
        """A statistic from the cache (Knorm, KeyDiff, Expected Attention): every held token's
        score, recomputed from what the layer holds before the policy decides."""
        working, seen_rows = layout.working(), layout.rows.seen
        seen: Any = seen_rows[0]
        if any(s != seen for s in seen_rows):
            seen = torch.tensor(seen_rows, device=working.positions.device).view(-1, 1, 1)
        scores = held_scores(self.policy, running, working, seen, layout.phase, max(seen_rows))
        if scores is not working.scores:  # (between two scorings of a refresh interval: updated in place)
            working.scores.copy_(scores)

    def general(self, layout: SlotLayout, *, chunk_bytes: int) -> list[tuple[int, int]]:
        """The policy's ``select`` (:func:`~kvpolicy_torch.general.select_rounds`), then the
        transient working set put back and, under head-wise budgets, the storage fitted to the
        widest head."""
        slots, plan = self.slots, self.slots.plan
        rounds = select_rounds(layout, self.policy, self.reduce_scores, sink=slots.sink, chunk_bytes=chunk_bytes)
        if layout.extra is not None:
            widest, held = max(layout.rows.count), layout.storage().slots
            if slots.ragged and held < widest <= plan.planned:
                # the widest head holds more than the mean's slots: grow the storage to fit it
                slots.fit_widest(layout, plan.grown(held, widest + 1))
            if widest > layout.storage().slots:
                raise RuntimeError(f"{self.policy!r} left {widest} tokens but declared capacity {self.policy.capacity}")
            layout.put_back()
        fit = fitted_slots(layout.storage().slots, max(layout.rows.front)) if slots.ragged and rounds else None
        if fit is not None:  # the storage follows the widest head (kvpolicy_torch.headwise)
            slots.fit_widest(layout, fit)
        return rounds
