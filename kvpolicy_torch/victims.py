"""The victim search of a one-token eviction by lowest score (H2O, TOVA, Knorm, KeyDiff).

A row's victim is its lowest score outside the newest ``recent`` tokens, the earliest position of
a tie; a hole is never picked (it holds ``+inf``; accumulated scores, whose hole a NaN step can turn
NaN, are ranked by position: :func:`~kvpolicy_torch.ops.eviction_ranks`). :func:`lowest_victims` is
the plain scan; above a size (:class:`CandidateSearch`) a CPU layer finds it among a candidate set
instead, which reads ``O(candidates)`` scores a step rather than all of them
(``tests/torch/test_victims.py`` holds it to the plain scan, ``kvpolicy bench --what complexity``
measures it).
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from kvpolicy.policy import DecodeEviction

from .group import LayerGroup, mark_holes
from .ops import eviction_ranks, first_argmin
from .rows import Rows
from .storage import Storage

__all__ = ["CandidateSearch", "OneTokenEviction", "free_victims", "lowest_victims"]


def lowest_victims(
    scores: torch.Tensor,
    front: list[int],
    rule: DecodeEviction,
    shared: bool,
    reduce_scores: Callable[[torch.Tensor], torch.Tensor] | None = None,
    *,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Victim slot ``[rows, kv_heads]`` of each row of ``scores`` ``[rows, kv_heads, slots]``: the
    lowest score below the row's ``front`` outside its newest ``rule.recent`` slots, ties to the
    earliest slot (below a frontier, slot order is position order). ``shared``: one victim for
    all heads, by the scores summed over the heads (then ``reduce_scores``, e.g. over
    tensor-parallel ranks). ``positions``: given, a hole ranks ``+inf`` by its position and a NaN
    as ``-inf`` (:func:`~kvpolicy_torch.ops.eviction_ranks`), which accumulated scores need (a
    step whose attention is NaN throughout turns a hole's ``+inf`` into NaN); without, the scores
    are ranked as they are (a statistic that rewrites every score puts ``+inf`` at holes itself).

    Example:
        >>> from kvpolicy import DecodeEviction
        >>> scores, positions = torch.tensor([[[3.0, float("nan"), 1.0, 0.0]]]), torch.tensor([[[0, -1, 2, 3]]])
        >>> lowest_victims(scores, [4], DecodeEviction(limit=3, victim="lowest", recent=1), shared=False, positions=positions).tolist()
        [[2]]
    """
    hi = max(front) - rule.recent
    cand = scores[:, :, :hi] if positions is None else eviction_ranks(scores[:, :, :hi], positions[:, :, :hi])
    if any(f != front[0] for f in front):  # rows on other schedules: protect each row's own recent tokens
        if positions is None:
            cand = cand.clone()
        for i, f in enumerate(front):
            cand[i, :, f - rule.recent :] = math.inf
    if shared:
        summed = cand.sum(dim=1, keepdim=True)
        if reduce_scores is not None:
            summed = reduce_scores(summed)
        return first_argmin(summed).expand(cand.shape[0], cand.shape[1])
    return first_argmin(cand)


def free_victims(pos: torch.Tensor, scores: torch.Tensor, bias: torch.Tensor, victims: torch.Tensor,
                 rows: list[int]) -> None:
    """The slots ``victims`` ``[len(rows), kv_heads]`` of ``rows`` become holes (every row when
    ``rows`` covers the batch: one scatter per tensor)."""
    index = victims.unsqueeze(-1)
    if len(rows) == pos.shape[0]:
        mark_holes(pos, scores, bias, 2, index)
        return
    r_t = torch.tensor(rows, device=pos.device)
    for t, fill in ((pos, -1), (scores, math.inf), (bias, -math.inf)):
        part = t.index_select(0, r_t)
        part.scatter_(2, index, fill)
        t.index_copy_(0, r_t, part)


class CandidateSearch:
    """H2O's victim among candidates: :func:`lowest_victims` without reading every score.

    A full search (``topk``) keeps the ``candidates`` lowest-scored eligible slots per row and
    head, and the next lowest score as a ``bound`` every other eligible slot is at or above.
    Accumulated scores only grow (the layer calls :meth:`forget` when a received value is
    negative or NaN), so a slot at or above the bound then still is: while the lowest score among
    the candidates (and the slots that became eligible since) is strictly below the bound, it is
    the lowest eligible score, and every slot tied with it was searched, so "earliest of a tie" is
    the lowest such slot. A victim becomes a hole (``+inf``) and is never picked again. A full
    search runs again when the bound stops separating, when as many slots became eligible as there
    are candidates, or when slots moved: amortised over the steps between. ``O(batch x heads x
    candidates)`` a step.

    Example:
        >>> search = CandidateSearch()
        >>> search.applies(torch.zeros(1, 1, 10), hi=10, candidates=2, min_scores=1)
        True
    """

    #: eligible slots up to this many times ``candidates`` take the plain scan (small caches)
    PLAIN_SCAN_FACTOR = 4

    def __init__(self) -> None:
        self.searches = 0  # full searches so far (LayerCache.candidate_searches)
        self.pause = 0  # decode steps left on full scans (the candidates drained too fast)
        self.age = 0  # searches answered since the last full search
        self.forget()

    def forget(self) -> None:
        """Slots moved or a score may have gone down: the next search starts afresh."""
        self.slots: torch.Tensor | None = None  # [b, h, 2K] slots searched for the next victim
        self.bound: torch.Tensor | None = None  # [b, h, 1]: every other eligible slot's score is >= it
        self.hi = 0  # slots [0, hi) were eligible at the last full search; later ones are searched too
        self.top = -1  # eligible slots ended here at the last search (or plain scan)

    @property
    def active(self) -> bool:
        return self.slots is not None

    @staticmethod
    def applies(scores: torch.Tensor, hi: int, candidates: int, min_scores: int) -> bool:
        """Whether rows alike, with eligible slots ``[0, hi)``, are worth a candidate search (large
        CPU caches); the caller checks that the policy's scores only grow and are per head."""
        return (
            hi > CandidateSearch.PLAIN_SCAN_FACTOR * candidates  # small caches: the plain scan, decided first (every decode step)
            and scores.device.type == "cpu"
            and scores.shape[0] * scores.shape[1] * hi >= min_scores
        )

    def _rescan(self, scores: torch.Tensor, hi: int, candidates: int) -> bool:
        """The full search of ``[0, hi)``; False (nothing set) when a score is NaN (a full scan puts
        NaN first, ``topk`` last)."""
        searched = scores[:, :, :hi]
        if bool(torch.isnan(searched).any()):
            return False
        values, slots = torch.topk(searched, candidates + 1, dim=-1, largest=False, sorted=False)
        bound = values.amax(dim=-1, keepdim=True)
        # the largest of the k + 1 lowest is the bound; the others are the candidates (a tie with
        # the bound may leave a bound-valued slot out: the strict test below then rescans)
        last = values.argmax(dim=-1, keepdim=True)
        keep = torch.ones_like(slots, dtype=torch.bool).scatter_(2, last, False)
        # the candidates, then room for the slots that become eligible before the next search
        self.slots = torch.empty(*slots.shape[:2], 2 * candidates, dtype=slots.dtype, device=slots.device)
        self.slots[..., :candidates] = slots[keep].view(*slots.shape[:2], candidates)
        self.bound = bound
        self.hi = self.top = hi
        self.searches += 1
        return True

    def lowest(self, scores: torch.Tensor, hi: int, candidates: int) -> torch.Tensor | None:
        """Victim slot ``[batch, kv_heads]`` among slots ``[0, hi)``, or ``None`` when a plain scan
        must decide (the first step after slots moved, a bound that no longer separates)."""
        if self.slots is not None and (hi - self.top not in (0, 1) or hi - self.hi > candidates):
            # slots moved, more than one became eligible at once, or as many became eligible as
            # there are candidates: search again
            self.forget()
        if self.slots is None:
            if self.pause > 0:
                self.pause -= 1
                return None
            if self.top != hi - 1:
                # the first step after slots moved (or a cold start) takes the plain scan: the
                # candidates' topk pays off over a run of decode steps, not for one eviction
                self.top = hi
                return None
            if not self._rescan(scores, hi, candidates):
                self.pause = candidates
                return None
            self.age = 0
        k = candidates
        for attempt in range(2):
            cand, bound, lo = self.slots, self.bound, self.hi
            assert cand is not None and bound is not None
            if hi > lo:  # the slot that became eligible at this step (one per decode step)
                cand.select(2, k + hi - lo - 1).fill_(hi - 1)
            self.top = hi
            slots = cand[..., : k + hi - lo]
            searched = scores.gather(2, slots)
            low = searched.amin(dim=-1, keepdim=True)
            if bool((low < bound).all()):
                self.age += 1
                # the earliest (lowest) slot of those tied at the minimum
                return torch.where(searched == low, slots, torch.iinfo(torch.int64).max).amin(dim=-1)
            if attempt == 0:
                if self.age < candidates // 8 or not self._rescan(scores, hi, candidates):
                    break  # the bound fails soon after each search: full scans are cheaper for a while
                self.age = 0
        # more slots tie at the minimum than the candidates hold, or the candidates drain too fast
        self.forget()
        self.pause = candidates
        return None


class OneTokenEviction:
    """A layer's one-token decode eviction (:class:`~kvpolicy.DecodeEviction`) on the eager layout:
    which slot of each row that holds ``limit + 1`` tokens becomes a hole.

    ``"oldest"`` (StreamingLLM, the local window): the oldest token after the sinks, found from
    host integers (the rows' ring pointer); only its position is written, since the row's next
    append refills the slot before anything attends to it or searches it. ``"lowest"`` (H2O, TOVA,
    Knorm, KeyDiff): the lowest score outside the newest ``recent``, by the plain scan
    (:func:`lowest_victims`), among candidates (:class:`CandidateSearch`), or left to the layer's
    :class:`~kvpolicy_torch.LayerGroup` (:attr:`deferred`), which searches every layer's victims
    at once when the last layer of the step has evicted.

    Args:
        rule: the policy's decode eviction.
        shared: one victim for all heads of a row (the policy's ``selection == "shared"``).
        grows: whether the policy's scores only grow (``"accumulate"``: the candidates' bound holds).
        reduce_scores: applied to head-summed scores of a shared selection.
        group, index: the layer's group and its index there (``None``, ``-1``: alone).

    Example:
        >>> from kvpolicy import DecodeEviction
        >>> from kvpolicy_torch.rows import Rows
        >>> from kvpolicy_torch.storage import Storage
        >>> store = Storage.allocate(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2), 4, torch.float32)
        >>> _ = store.positions.copy_(torch.arange(4).view(1, 1, 4))
        >>> _ = store.scores.copy_(torch.tensor([[[5.0, 1.0, 3.0, 0.0]]]))
        >>> rows = Rows([4], [4], [4], [{}], [None], [[]])
        >>> OneTokenEviction(DecodeEviction(limit=3, victim="lowest", recent=1), shared=False, grows=True).evict(store, rows, [0], 1, 1)
        >>> store.positions[0, 0].tolist(), rows.count
        ([0, -1, 2, 3], [3])
    """

    def __init__(self, rule: DecodeEviction, *, shared: bool, grows: bool,
                 reduce_scores: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 group: LayerGroup | None = None, index: int = -1) -> None:
        self.rule = rule
        self.shared = shared
        self.grows = grows
        self.reduce_scores = reduce_scores
        self.group = group
        self.index = index
        self.search = CandidateSearch()
        #: this step's victims are left to the group (never visible: any read of the layer flushes it)
        self.deferred = False
        self._pending: tuple[Storage, Rows] | None = None

    def uses_candidates(self, scores: torch.Tensor, hi: int, candidates: int, min_scores: int) -> bool:
        """Whether rows alike, with eligible slots ``[0, hi)``, search among candidates."""
        return CandidateSearch.applies(scores, hi, candidates, min_scores) and not self.shared and self.grows

    def evict(self, store: Storage, rows: Rows, which: list[int], candidates: int, min_scores: int) -> None:
        """Free one slot in each row of ``which`` (all heads): ``O(batch x heads)`` writes, nothing moves."""
        rule = self.rule
        every = len(which) == len(rows.count)  # (rows.batch without the property's call)
        if rule.victim == "oldest":
            slots = []
            for r in which:
                # a dense row's oldest non-sink token is at slot `sink`; later ones follow it
                # around the ring [sink, front) (the next append refills the freed slot)
                fifo = rows.fifo[r]
                slot = rule.sink if fifo is None else fifo
                slots.append(slot)
                rows.free[r].append(slot)
                rows.fifo[r] = slot + 1 if slot + 1 < rows.front[r] else rule.sink
            # only the position says "hole": every other read goes by positions
            pos = store.positions
            if every and all(s == slots[0] for s in slots):
                pos.select(2, slots[0]).fill_(-1)
            else:
                dev = pos.device
                pos[torch.tensor(which, device=dev), :, torch.tensor(slots, device=dev)] = -1
        elif every and self._deferrable(store, rows, candidates, min_scores):
            self.deferred = True  # the group frees the victims: after the counts below
        else:
            free_victims(*store.bookkeeping(), self.lowest(store, rows, which, candidates, min_scores), which)
        for r in which:
            rows.count[r] -= 1
        if self.deferred and self.group is not None:
            self._pending = (store, rows)
            self.group.defer(self.index, rows.front[0] - rule.recent, self._free_alone, self._freed, self.shared,
                             holes_by_position=self.grows)

    def _deferrable(self, store: Storage, rows: Rows, candidates: int, min_scores: int) -> bool:
        """Whether this step's victims may wait for the group: every layer keeps its storage in it,
        the rows stand alike, and the plain scan would find them (not candidates; a shared selection
        only without ``reduce_scores``, which each layer applies to its own summed scores)."""
        group, front = self.group, rows.front
        if group is None or not group.complete or (self.shared and self.reduce_scores is not None):
            return False
        hi = front[0] - self.rule.recent
        # (small caches take the plain scan, CandidateSearch.applies' first test, asked here first:
        # every decode step of every layer asks)
        if front.count(front[0]) != len(front) or (
            hi > CandidateSearch.PLAIN_SCAN_FACTOR * candidates and self.uses_candidates(store.scores, hi, candidates, min_scores)
        ):
            return False
        if self.search.slots is not None:  # (search.active)
            self.search.forget()  # (as the plain scan would)
        return True

    def _freed(self) -> None:
        self.deferred, self._pending = False, None

    def _free_alone(self) -> None:
        """Free this step's victims here (the group could not search them with the others')."""
        assert self._pending is not None  # (set with deferred)
        store, rows = self._pending
        self._freed()
        every = list(range(rows.batch))
        free_victims(*store.bookkeeping(), lowest_victims(store.scores, rows.front, self.rule, self.shared,
                                                          self.reduce_scores, positions=self._holes(store)), every)

    def lowest(self, store: Storage, rows: Rows, which: list[int], candidates: int, min_scores: int) -> torch.Tensor:
        """Victim slot ``[len(which), heads]`` of each row of ``which``."""
        scores = store.scores
        front = [rows.front[r] for r in which]
        hi = max(front) - self.rule.recent
        if len(which) == rows.batch and all(f == front[0] for f in front) and self.uses_candidates(
            scores, hi, candidates, min_scores
        ):
            victims = self.search.lowest(scores, hi, candidates)
            if victims is not None:
                return victims
        elif self.search.active:
            self.search.forget()
        positions = self._holes(store)
        if len(which) < rows.batch:
            index = torch.tensor(which, device=scores.device)
            scores = scores.index_select(0, index)
            positions = None if positions is None else positions.index_select(0, index)
        return lowest_victims(scores, front, self.rule, self.shared, self.reduce_scores, positions=positions)

    def _holes(self, store: Storage) -> torch.Tensor | None:
        """The positions a search ranks holes by: accumulated scores only (see :func:`lowest_victims`)."""
        return store.positions if self.grows else None
