"""A layer's eviction on the host (the eager layout): which rule decides after a step.

After each step (:meth:`~kvpolicy_torch.LayerCache.evict`), :meth:`HostEviction.evict` decides,
from host integers only, which of three things runs:

1. **A one-token eviction** (:class:`~kvpolicy.DecodeEviction`: H2O, TOVA, StreamingLLM, the local
   window): after a decode step, each row holding ``limit + 1`` tokens frees one slot per head
   (:class:`~kvpolicy_torch.victims.OneTokenEviction`); nothing moves.
   Head-wise budgets' decode step (:class:`~kvpolicy.HeadwiseEviction`, AdaKV over H2O, TOVA,
   Knorm, KeyDiff or Expected Attention) likewise: each row whose heads hold ``limit + 1`` tokens
   on average frees the layer's ``H`` lowest outside the floors where they stand
   (:meth:`HostEviction.evict_headwise`).
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

import math
from typing import Any, Callable

import torch

from kvpolicy.policy import KEY_STATISTICS, EvictionPolicy
from kvpolicy.statistics import UNSCORED, refresh_interval, refresh_sink, scored_once

from .allocation import SlotAllocator
from .general import declines, select_rounds
from .headwise import fitted_slots, free_slots, headwise_victims, likely_victims
from .layout import SlotLayout
from .queries import CandidateSums, RunningMoments, held_scores
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
        sums: CandidateSums | None = None,
    ) -> None:
        self.policy, self.victims, self.slots = policy, victims, slots
        self.reduce_scores = reduce_scores
        #: a score declared as a sum over the candidates (KeyDiff), kept between decode steps
        self.sums = sums
        self.rule = policy.decode_eviction
        self.refresh = refresh_interval(policy)  # decode steps between two scorings from the cache
        self.refresh_sink = refresh_sink(policy)  # (the positions a refresh interval leaves +inf)
        self.once = scored_once(policy)  # decode tokens scored when cached, never rescored
        # a policy without one-token evictions (BUZZ, SnapKV and its compositions) that declares
        # its decode steps' size rule: a decode step at which the rule keeps every token skips the
        # policy's call (host integers only)
        self.size_rule = policy.decode_size_rule() if self.rule is None else None
        #: head-wise budgets' decode eviction (AdaKV over H2O, TOVA, ...): victims freed in place
        self.headwise = policy.headwise_eviction
        #: whether a decode step scores the held keys first (a statistic from the cache, not given
        #: once to each token when cached): Knorm, KeyDiff, Expected Attention
        self.rescores = policy.score_statistic in KEY_STATISTICS and not self.once
        #: the one-token eviction when it decides a decode step alone (no head-wise budgets, no
        #: score from the cache to compute first: H2O, TOVA, StreamingLLM, the local window, Knorm),
        #: else ``None``: the layer hands such a step to it directly
        #: (:meth:`~kvpolicy_torch.victims.OneTokenEviction.evict_due`), as :meth:`evict` does
        self.one_token_alone = victims if victims is not None and self.headwise is None and not self.rescores else None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["size_rule"] = None  # a closure: rebuilt from the policy
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.size_rule = self.policy.decode_size_rule() if self.rule is None else None

    def forget_sums(self) -> None:
        """Rows were reordered or restored: a sum over the candidates is taken afresh at the next step."""
        if self.sums is not None:
            self.sums.forget()

    def declines(self, layout: SlotLayout) -> bool:
        """Whether the policy's size rule keeps every row at this decode step (it is not asked)."""
        return declines(layout, self.size_rule)

    def evict(self, layout: SlotLayout, running: RunningMoments | None, *, candidates: int, min_scores: int,
              chunk_bytes: int) -> list[tuple[int, int]]:
        """Evict after a step; ``(size_before, size_after)`` per round (per group of rows that
        evicted together). ``running``: Expected Attention's query moments; ``candidates`` and
        ``min_scores``: the candidate search's (:class:`~kvpolicy_torch.victims.CandidateSearch`)."""
        if self.headwise is not None and layout.phase == "decode" and layout.extra is None:
            rounds = self.evict_headwise(layout, running)
            if rounds is not None:
                return rounds
        rule, count = self.rule, layout.rows.count
        one_token = layout.phase == "decode" and rule is not None and layout.extra is None
        if self.policy.score_statistic in KEY_STATISTICS and (not one_token or (not self.once and (max(count) > rule.limit or self.refresh > 1))):  # type: ignore[union-attr]
            # (a decode step under the rule's limit evicts nothing: no scores needed, unless a
            # refresh interval counts the steps between two scorings; a token-local score was
            # given to the decode token when it was cached: LayerCache.append)
            self.score_keys(layout, running, lowest_only=one_token)
        if not one_token:
            return [] if self.declines(layout) else self.general(layout, chunk_bytes=chunk_bytes)
        if self.victims is None:
            over = rule.limit + 1  # type: ignore[union-attr]
            return self.general(layout, chunk_bytes=chunk_bytes) if any(c > over for c in count) else []
        rounds = self.victims.evict_due(layout.store, layout.rows, candidates, min_scores)  # type: ignore[arg-type]
        # (None: a padded row above the limit after its prompt)
        return self.general(layout, chunk_bytes=chunk_bytes) if rounds is None else rounds

    def evict_headwise(self, layout: SlotLayout, running: RunningMoments | None) -> list[tuple[int, int]] | None:
        """A decode step's head-wise eviction (:class:`~kvpolicy.HeadwiseEviction`), from host
        integers: each row whose heads hold ``limit + 1`` tokens on average frees the layer's ``H``
        lowest where they stand (:func:`~kvpolicy_torch.headwise.likely_victims`, or
        :func:`~kvpolicy_torch.headwise.headwise_victims` where it is not sure; one masked write per
        bookkeeping tensor; compaction comes when a row reaches the end of its slots); a row below
        that keeps everything. ``None`` when a row stands above it (a padded row after its prompt): the
        policy's ``select`` decides, as for any other step."""
        rule, rows = self.headwise, layout.rows
        assert rule is not None  # (the caller checks)
        count, seen_rows, states = rows.count, rows.seen, rows.states
        due = []
        for r in range(rows.batch):
            mean = rule.mean_tokens(count[r], seen_rows[r], states[r])
            if mean == rule.limit + 1:
                due.append(r)
            elif mean > rule.limit:
                return None
        if self.rescores and (due or self.refresh > 1):
            self.score_keys(layout, running, lowest_only=True)  # (as a one-token rule: no scores read below the limit)
        if not due:
            return []
        store = layout.storage()
        front = [rows.front[r] for r in due]
        seen: int | torch.Tensor = seen_rows[due[0]]
        if any(seen_rows[r] != seen for r in due):
            seen = torch.tensor([seen_rows[r] for r in due], device=store.positions.device).view(-1, 1, 1)
        if len(due) == rows.batch and front.count(front[0]) == len(front):
            # every head holds its newest `recent` tokens at the slots just below the frontier
            # (never victims, always appended there): the candidates are the slots before them
            # (the common case, every step of every layer: no position read, one slice)
            below = front[0] - rule.recent
            candidates, candidate_positions = store.scores[:, :, :below], store.positions
            pos = scores = None
        else:
            pos, scores = layout.returned_positions(), layout.returned_scores()  # (the slots up to the furthest frontier)
            if len(due) < rows.batch:
                index = torch.tensor(due, device=pos.device)
                pos, scores = pos.index_select(0, index), scores.index_select(0, index)
            candidates, candidate_positions = torch.where(pos < seen - rule.recent, scores, math.inf), pos
        counts = layout.head_counts
        if counts is None:  # (after slots moved: counted again, one host read)
            counts = layout.head_counts = (layout.returned_positions() >= 0).sum(-1).tolist()
        found = likely_victims(candidates, [counts[r] for r in due], rule, positions=candidate_positions)
        if found is None:  # a NaN, or a read too short: the exact search
            if pos is None:
                pos, scores = layout.returned_positions(), layout.returned_scores()
            head, slot = headwise_victims(pos, scores, seen, rule)
            victims = [list(zip(h, j)) for h, j in zip(head.tolist(), slot.tolist())]
            for r, row in zip(due, victims):
                for h, _ in row:
                    counts[r][h] -= 1
        else:
            victims = [v for v, _ in found]
            for r, (_, count) in zip(due, found):
                counts[r] = count
        free_slots(store, due, victims)
        widest = [max(counts[r]) for r in due]
        layout.scattered = True
        if rows.batch == 1:  # (the common case, every step of every layer)
            before, rows.count[0] = rows.count[0], widest[0]
            rows.states[0] = {**rows.states[0], **rule.state_after(rows.seen[0])}
            return [(before, widest[0])]
        # a round per group of rows in the same host state, as a general eviction's (its widest head after)
        groups = [(rows.count[r], rows.seen[r], tuple(sorted(rows.states[r].items()))) for r in due]
        rounds: dict[tuple[Any, ...], tuple[int, int]] = {}
        for w, g in zip(widest, groups):
            rounds[g] = (g[0], max(w, rounds[g][1] if g in rounds else 0))
        for r, g in zip(due, groups):
            rows.count[r] = rounds[g][1]  # (a group's rows keep one count, its widest head's: as a compaction leaves them)
            rows.states[r] = {**rows.states[r], **rule.state_after(rows.seen[r])}
        return list(rounds.values())

    def score_keys(self, layout: SlotLayout, running: RunningMoments | None, lowest_only: bool = False) -> None:
        """A statistic from the cache (Knorm, KeyDiff, Expected Attention): every held token's
        score, recomputed from what the layer holds before the policy decides. ``lowest_only``:
        the eviction reads only each head's lowest score (a decode step's one-token or head-wise
        rule), so a score declared as a sum over the candidates is exact there only
        (:class:`~kvpolicy_torch.queries.CandidateSums`)."""
        seen_rows = layout.rows.seen
        seen: Any = seen_rows[0]
        if running is not None and self.refresh > 1 and layout.extra is None and layout.phase == "decode" \
                and seen_rows.count(seen) == len(seen_rows):
            # between two scorings, the step before marked the tokens since: the newest alone is
            # marked, on the storage itself (its slots past the frontier hold no such position), or
            # was cached unscored (the layout's fresh score)
            store = layout.storage()
            if running.mark_newest(store.scores, store.positions, self.refresh, seen, self.refresh_sink,
                                   written=layout.fresh_score == UNSCORED):
                return
        working = layout.working()
        if any(s != seen for s in seen_rows):
            seen = torch.tensor(seen_rows, device=working.positions.device).view(-1, 1, 1)
        if lowest_only and self.sums is not None and layout.phase == "decode" and layout.extra is None:
            # (a one-token rule reads each head's lowest; head-wise budgets the layer's H lowest)
            need = 1 if self.headwise is None else int(working.positions.shape[1])
            found = self.sums.scores(working.keys, working.positions, seen, self.policy.key_recent, need=need)
            if found is not None:
                working.scores.copy_(found)
                return
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
