"""What a torch layer keeps between decode steps for a score from the cache: Expected Attention's
running query statistics (below) and a sum over the candidates a score is declared as
(:class:`CandidateSums`: KeyDiff's anchor).

A layer whose policy scores with ``"expected_attention"`` keeps, per row and query head, the
running sums of the queries it has seen (:class:`kvpolicy.statistics.QueryMoments`: their count,
sum and sum of outer products, float64): each prompt chunk and each decode step adds its queries
at positions ``>= sink`` (pads never), so at every eviction the mean and covariance are those of
every query seen since the sinks, exactly as the NumPy reference computes them afresh. The sums
are updated in place (no host read), so a static-shaped decode step stays one graph.

With a refresh interval (Expected Attention's ``refresh > 1``) :func:`held_scores` computes the
scores after a prompt and at every ``refresh``-th decode step only, and marks the tokens appended
in between :data:`~kvpolicy.statistics.UNSCORED` (the NumPy reference's rule,
:func:`kvpolicy.statistics.refresh_due`); :attr:`RunningMoments.scored_seen` remembers when, on
the device. Eager, the step's choice reads one flag from the device; a compiled step takes both
branches into its one graph (``torch.cond``).
"""

from __future__ import annotations

from typing import Any

import torch

from kvpolicy.policy import EvictionPolicy
from kvpolicy.statistics import (
    UNSCORED, CachedTokens, QueryMoments, Rotary, cache_scores, mark_unscored, query_moments, refresh_due, refresh_interval,
    refresh_sink,
)

from .posshift import rope_matrix, rope_rotate
from .storage import Storage

__all__ = ["CandidateSums", "PreRope", "RunningMoments", "held_scores", "token_scores", "unrotated"]


class PreRope:
    """Queries rotated back to before RoPE (what Expected Attention's moments are of), one
    rotation a step shared by a model's layers.

    A decode step hands every layer a query rotated by the same positions (the forward's
    ``position_ids``): the first layer to ask builds the inverse rotation as a matrix in float64
    (:func:`~kvpolicy_torch.rope_matrix`), and every layer then turns its query back with one
    product (a rotation per layer was ~20 element-wise kernels of a decode step). The matrix is
    reused only inside one forward (``step``: a counter the caller advances at every forward) and
    for the same ``positions`` tensor and frequencies, so a tensor changed in place between
    forwards is never served a stale rotation; inside ``torch.compile`` nothing is kept (the
    product is traced with the rest of the step). A prompt's queries (``q > 1``) are rotated
    element-wise (:func:`~kvpolicy_torch.rope_rotate`), once per chunk.

    Example:
        >>> pre = PreRope()
        >>> freq, q = torch.tensor([1.0, 0.1]), torch.randn(1, 2, 1, 4)
        >>> rotated = rope_rotate(q, torch.tensor([[[7]]]), freq)
        >>> back = pre.unrotate(rotated, torch.tensor([[7]]), freq, step=1)
        >>> back.dtype, bool(torch.allclose(back, q.double(), atol=1e-6))
        (torch.float64, True)
    """

    def __init__(self) -> None:
        self._key: tuple[Any, ...] | None = None
        self._held: tuple[torch.Tensor, torch.Tensor] | None = None  # (positions, frequencies): kept alive, ids stay theirs
        self._matrix: torch.Tensor | None = None

    def unrotate(self, queries: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, *, style: str = "half",
                 rotary_dim: int | None = None, step: int = 0) -> torch.Tensor:
        """``queries`` ``[batch, q_heads, q, head_dim]``, rotated by ``positions`` ``[batch or 1, q]``,
        rotated back: float64 for a decode step (``q == 1``), the queries' dtype for a prompt chunk."""
        b, _, q, d = queries.shape
        if q != 1:
            return rope_rotate(queries, -positions.expand(b, -1)[:, None, :], inv_freq, style=style, rotary_dim=rotary_dim)
        return unrotated(queries, self.inverse(positions, inv_freq, b, d, style=style, rotary_dim=rotary_dim, step=step))

    def inverse(self, positions: torch.Tensor, inv_freq: torch.Tensor, batch: int, head_dim: int, *, style: str = "half",
                rotary_dim: int | None = None, step: int = 0) -> torch.Tensor:
        """``[batch, head_dim, head_dim]`` float64: the rotation back of a decode step's queries
        rotated by ``positions`` ``[batch or 1, 1]`` (:func:`unrotated` applies it), built by the
        first layer of a forward that asks and shared by the others (see the class docstring).

        Example:
            >>> pre, freq = PreRope(), torch.tensor([1.0, 0.1])
            >>> at = torch.tensor([[7]])
            >>> pre.inverse(at, freq, 1, 4, step=3) is pre.inverse(at, freq, 1, 4, step=3)
            True
        """
        if torch.compiler.is_compiling():
            return self.matrix(positions, inv_freq, batch, head_dim, style, rotary_dim).view(batch, head_dim, head_dim)
        key = (step, id(positions), id(inv_freq), batch, head_dim, style, rotary_dim, inv_freq.device)
        held = self._held
        if key != self._key or held is None or held[0] is not positions or held[1] is not inv_freq:
            self._matrix = self.matrix(positions, inv_freq, batch, head_dim, style, rotary_dim).view(batch, head_dim, head_dim)
            self._key, self._held = key, (positions, inv_freq)
        return self._matrix  # type: ignore[return-value]

    @staticmethod
    def matrix(positions: torch.Tensor, inv_freq: torch.Tensor, batch: int, head_dim: int, style: str,
               rotary_dim: int | None) -> torch.Tensor:
        """``[batch, 1, head_dim, head_dim]`` float64: the rotation by minus each row's position."""
        delta = -positions.expand(batch, -1)[:, 0].to(inv_freq.device)
        return rope_matrix(delta, inv_freq, head_dim, style=style, rotary_dim=rotary_dim, dtype=torch.float64)


def unrotated(queries: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """Float64 ``queries`` ``[batch, q_heads, 1, head_dim]`` turned back by ``inverse``
    ``[batch, head_dim, head_dim]`` (:meth:`PreRope.inverse`): one product per row, its query heads
    the rows of one matrix (a broadcast matmul over the heads expanded the rotation per head).

    Example:
        >>> freq, q = torch.tensor([1.0, 0.1]), torch.randn(1, 2, 1, 4)
        >>> at = torch.tensor([[7]])
        >>> back = unrotated(rope_rotate(q, at.view(1, 1, 1), freq), PreRope().inverse(at, freq, 1, 4))
        >>> bool(torch.allclose(back, q.double(), atol=1e-6))
        True
    """
    b, d = queries.shape[0], queries.shape[-1]
    return torch.bmm(queries.reshape(b, -1, d).to(torch.float64), inverse).view(queries.shape)


class RunningMoments:
    """The running :class:`~kvpolicy.statistics.QueryMoments` of one layer's queries (Expected
    Attention), and the bookkeeping of a refresh interval (:func:`held_scores`) for any score from
    the cache that declares one (KeyDiff's ``refresh``: then no query is observed, ``moments``
    stays ``None``).

    Args:
        sink: queries at positions below this are not counted (the policy's ``sink``).
        buffered: hold each decode query until the sums are read (:data:`PENDING`): for a layer
            whose scores are computed every ``refresh > 1`` steps, eager. A float64 query is held
            as given, not copied: do not change it in place before the next scoring.

    Attributes:
        moments: the sums so far (``None`` before the first query; reading them takes the held
            queries in).
        rotary: the RoPE the queries were rotated back from (:class:`~kvpolicy.statistics.Rotary`,
            ``None``: no rotation), as the last :meth:`observe` gave it.
        scored_seen: int64 ``[batch]`` tokens each row had seen when the scores were last
            computed (``None`` before; kept by :func:`held_scores` under a refresh interval).

    Example:
        >>> running = RunningMoments(sink=1)
        >>> q = torch.tensor([[[[1.0, 0.0], [3.0, 2.0]]]])  # [batch 1, query heads 1, q 2, d 2]
        >>> running.observe(q, torch.tensor([[0, 1]]), kv_heads=1)
        >>> running.observe(torch.tensor([[[[1.0, 2.0]]]]), torch.tensor([[2]]), kv_heads=1)
        >>> running.moments.count.tolist(), running.moments.total.tolist()
        ([2.0], [[[[4.0, 4.0]]]])
    """

    #: decode queries held before the sums take them (eager, ``buffered``): the sums are read only
    #: when the scores are computed (every ``refresh``-th step under a refresh interval), so a step
    #: appends its query to a list and the sums take the held ones in one product when read, or
    #: when this many are held (``[batch, q_heads, PENDING, head_dim]`` float64 a layer at most)
    PENDING = 64

    def __init__(self, sink: int, *, buffered: bool = False) -> None:
        self.sink = sink
        #: hold decode queries until the sums are read (:data:`PENDING`); not for a compiled step,
        #: whose graph takes each query into the sums in place
        self.buffered = buffered
        self._moments: QueryMoments | None = None
        # decode queries held: ([b, hq, 1, d] float64, positions [b, 1] or one int per row, the
        # rotation back still to apply [b, d, d] or None)
        self._pending: list[tuple[torch.Tensor, torch.Tensor | list[int], torch.Tensor | None]] = []
        self._kv_heads = 0
        self.rotary: Rotary | None = None
        self.scored_seen: torch.Tensor | None = None
        #: the most tokens a row had seen at the last scoring, when decided on the host (eager),
        #: and at the last step that marked the tokens appended since (:func:`held_scores`)
        self.scored_host: int | None = None
        self.marked_host: int | None = None

    def observe(self, queries: torch.Tensor, positions: torch.Tensor | list[int], kv_heads: int, rotary: Rotary | None = None,
                *, inverse: torch.Tensor | None = None) -> None:
        """Add ``queries`` ``[batch, q_heads, q, head_dim]`` (before RoPE) at ``positions``
        ``[batch, q]`` (``-1``: a pad, not counted; a decode step's, ``q == 1``, may be one int per
        row, which spares a tensor); ``q_heads`` is a multiple of ``kv_heads`` (GQA: query head
        ``j`` belongs to KV head ``j // (q_heads / kv_heads)``). ``inverse``: a decode step's
        queries are still rotated by RoPE, and this ``[batch, head_dim, head_dim]`` float64 matrix
        turns them back (:meth:`PreRope.inverse`), applied when the sums take them: a held query
        costs no product at its step, the held ones one product together."""
        if queries.ndim != 4:
            raise ValueError(f"queries must be [batch, q_heads, q, head_dim], got shape {tuple(queries.shape)}")
        b, hq, q, d = queries.shape
        if hq % kv_heads:
            raise ValueError(f"query heads ({hq}) must be a multiple of kv_heads ({kv_heads})")
        if isinstance(positions, list):
            if q != 1 or len(positions) != b:
                raise ValueError(f"positions as ints are a decode step's, one per row: {b} for queries of shape {tuple(queries.shape)}, got {len(positions)}")
        elif tuple(positions.shape) != (b, q):
            raise ValueError(f"positions must have shape [batch, q] = [{b}, {q}], got {tuple(positions.shape)}")
        if inverse is not None and (q != 1 or tuple(inverse.shape) != (b, d, d)):
            raise ValueError(f"inverse must be a decode step's [batch, head_dim, head_dim] = [{b}, {d}, {d}], got {tuple(inverse.shape)} for q = {q}")
        self.rotary = rotary
        decode = q == 1 and self._moments is not None and self._moments.total.shape == (b, kv_heads, hq // kv_heads, d)
        if decode and self.buffered and not torch.compiler.is_compiling():
            # held until the sums are read (the query as float64: a copy unless it is one already)
            self._pending.append((queries.to(torch.float64), positions, inverse))
            if len(self._pending) >= self.PENDING:
                self._take_pending()
            return
        self._take_pending()
        if inverse is not None:
            queries = unrotated(queries, inverse)
        if isinstance(positions, list):
            positions = torch.tensor(positions, device=queries.device).view(b, 1)
        moments = self._moments
        if decode and moments is not None:
            self._add_one(moments, queries, positions)
            return
        counted = positions.to(queries.device) >= self.sink
        step = query_moments(queries.reshape(b, kv_heads, hq // kv_heads, q, d), counted)
        self._kv_heads = kv_heads
        if moments is None:
            self._moments = step
        elif moments.total.shape != step.total.shape:
            raise ValueError(
                f"queries of shape {tuple(queries.shape)} do not match the earlier ones' statistics "
                f"{tuple(moments.total.shape)} ([batch, kv_heads, group, head_dim]); reset() first"
            )
        else:  # in place: a compiled step mutates the sums it was given
            for mine, new in zip(moments, step):
                mine.add_(new)

    @property
    def moments(self) -> QueryMoments | None:
        """The sums of every query observed so far (``None`` before the first); reading them makes
        the sums take the decode queries held since the last read (``buffered``)."""
        self._take_pending()
        return self._moments

    @property
    def held_queries(self) -> int:
        """Decode queries held that the sums have not taken yet (0 unless ``buffered``).

        Example:
            >>> running = RunningMoments(sink=0, buffered=True)
            >>> running.observe(torch.randn(1, 2, 3, 4), torch.arange(3).view(1, 3), kv_heads=1)  # a prompt: taken
            >>> for t in (3, 4):
            ...     running.observe(torch.randn(1, 2, 1, 4), torch.tensor([[t]]), kv_heads=1)
            >>> running.held_queries, running.moments.count.tolist(), running.held_queries
            (2, [5.0], 0)
        """
        return len(self._pending)

    @property
    def observed(self) -> bool:
        """Whether a query was observed (without making the sums take the held ones)."""
        return self._moments is not None

    def _take_pending(self) -> None:
        """The held decode queries added to the sums, in one product (their order within it is a
        matrix product's, as the NumPy reference sums a prompt's queries: the sums differ from
        adding them one by one by float64 rounding, far below the scores' rounding); the ones
        still rotated turned back first, together (one product)."""
        pending, moments = self._pending, self._moments
        if not pending or moments is None:
            return
        self._pending = []
        b, hq, _, d = pending[0][0].shape
        if all(inverse is not None for _, _, inverse in pending):
            # [N * b, hq, d] by [N * b, d, d]: each query by its own step's rotation back
            held = torch.stack([q for q, _, _ in pending]).view(-1, hq, d)
            back = torch.bmm(held, torch.stack([inv for _, _, inv in pending]).view(-1, d, d))
            queries = back.view(len(pending), b, hq, d).permute(1, 2, 0, 3)  # [b, hq, N, d]
        else:
            queries = torch.cat([q if inv is None else unrotated(q, inv) for q, _, inv in pending], dim=2)  # [b, hq, N, d]
        device = queries.device
        if all(isinstance(p, list) for _, p, _ in pending):
            positions = torch.tensor([p for _, p, _ in pending], device=device).T  # [b, N]
        else:
            positions = torch.cat([torch.tensor(p, device=device).view(b, 1) if isinstance(p, list) else p.to(device)
                                   for _, p, _ in pending], dim=1)
        if len(pending) == 1:
            self._add_one(moments, queries, positions)
            return
        step = query_moments(queries.reshape(b, self._kv_heads, hq // self._kv_heads, len(pending), d), positions >= self.sink)
        for mine, new in zip(moments, step):
            mine.add_(new)

    def _add_one(self, moments: QueryMoments, queries: torch.Tensor, positions: torch.Tensor) -> None:
        """A decode step's one query per row ``[batch, q_heads, 1, d]`` added in place (three
        kernels, no temporary ``[.., d, d]``; a compiled step mutates the sums it was given)."""
        b, hq, _, d = queries.shape
        w = (positions.to(queries.device) >= self.sink).reshape(b).to(torch.float64)
        q64 = queries.reshape(b * hq, d).to(torch.float64)
        weighted = q64 * w.repeat_interleave(hq)[:, None]
        moments.count.add_(w)
        moments.total.view(b * hq, d).add_(weighted)
        outer = moments.outer.view(b * hq, d, d)
        if torch.compiler.is_compiling():
            # a broadcast product added in place: inductor fuses it into one pass over the sums; a
            # baddbmm_ there is an extern kernel writing a new buffer, then copied back into the
            # mutated input (2.1 + 0.6 ms a step over SmolLM2's 30 layers). The same numbers: each
            # element is one product added (an inner dimension of 1)
            outer.add_(weighted[:, :, None] * q64[:, None, :])
        else:
            outer.baddbmm_(weighted[:, :, None], q64[:, None, :])  # (eager: one kernel, no temporary)

    def mark_newest(self, scores: torch.Tensor, positions: torch.Tensor, refresh: int, seen: int, sink: int,
                    written: bool = False) -> bool:
        """Eager, under a refresh interval: if this decode step, every row having seen ``seen``
        tokens, falls between two scorings decided on the host and the step before it marked the
        tokens appended since the last scoring, only the newest (position ``seen - 1``, not a sink)
        is left to mark: it scores :data:`~kvpolicy.statistics.UNSCORED` in ``scores`` (in place,
        two kernels; ``positions`` alongside, any slots; none where ``written``: the token was
        cached with that score, :attr:`SlotLayout.fresh_score <kvpolicy_torch.layout.SlotLayout>`)
        and ``True``. ``False``: nothing written, :func:`held_scores` decides the step.

        Example:
            >>> running = RunningMoments(sink=0)
            >>> running.scored_host = running.marked_host = 10  # scored, then marked, at 10 seen
            >>> scores, positions = torch.zeros(1, 1, 3, dtype=torch.float64), torch.tensor([[[8, 9, 10]]])
            >>> running.mark_newest(scores, positions, 4, 11, 0), scores[0, 0].tolist() == [0.0, 0.0, UNSCORED]
            (True, True)
            >>> running.mark_newest(scores, positions, 4, 14, 0)  # due: a scoring
            False
        """
        scored = self.scored_host
        if scored is None or self.marked_host not in (seen - 1, seen) or refresh_due(refresh, seen, scored) or seen - 1 < max(sink, scored):
            return False
        self.marked_host = seen
        if not written:
            scores.masked_fill_(positions == seen - 1, UNSCORED)
        return True

    def select(self, index: torch.Tensor) -> None:
        """Keep (or repeat) rows by ``index`` (beam search)."""
        moments = self.moments  # (the held queries taken first: they are the old rows')
        if moments is not None:
            self._moments = QueryMoments(*(t.index_select(0, index.to(t.device)) for t in moments))
        if self.scored_seen is not None:
            self.scored_seen = self.scored_seen.index_select(0, index.to(self.scored_seen.device))
            self.scored_host = self.marked_host = None  # (the rows' most may change: read back once, at the next step)

    def reset(self) -> None:
        """Forget every query."""
        self._moments = None
        self._pending = []
        self.scored_seen = self.scored_host = self.marked_host = None


def token_scores(policy: EvictionPolicy, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor | list[int],
                 dtype: torch.dtype) -> torch.Tensor:
    """``[batch, kv_heads, q]`` in ``dtype``: the scores of ``q`` tokens about to be cached
    (``keys`` ``[batch, kv_heads, q, head_dim]``), for a policy that scores each token once
    (:func:`kvpolicy.statistics.scored_once`); ``positions``: their original positions, a tensor
    broadcastable to ``[batch, kv_heads, q]`` or one int per row (decode).

    Example:
        >>> from kvpolicy import Knorm
        >>> token_scores(Knorm(size=4), torch.tensor([[[[3.0, 4.0]]]]), torch.zeros(1, 1, 1, 2), [7], torch.float32).tolist()
        [[[-5.0]]]
    """
    b, h, q, _ = keys.shape
    n_seen: Any
    if isinstance(positions, list) and positions.count(positions[0]) == len(positions):  # (no generator: a decode step)
        positions, n_seen = torch.full((b, h, q), positions[0], device=keys.device), positions[0] + 1
    else:
        if isinstance(positions, list):
            positions = torch.tensor(positions, device=keys.device).view(-1, 1, 1)
        positions = positions.expand(b, h, q)
        n_seen = positions + 1
    # (the policy's own score, called directly: a token being cached is no hole, so cache_scores'
    # masking is not needed, and a decode step pays for every kernel; the shape check stays)
    scorer = policy.statistic_policy
    score = scorer.cache_score(CachedTokens(keys, values, positions, n_seen, policy.key_recent))
    if score.shape != positions.shape:
        raise ValueError(
            f"{scorer!r}.cache_score must return one score per cached token, shape {tuple(positions.shape)}; "
            f"got {tuple(score.shape)}"
        )
    return score if score.dtype == dtype else score.to(dtype)


def held_scores(policy: EvictionPolicy, running: RunningMoments | None, slots: Storage, seen: Any,
                phase: str = "decode", seen_max: int | None = None) -> torch.Tensor:
    """The scores of a statistic from the cache (Knorm, KeyDiff, Expected Attention) for every
    token ``slots`` hold (:func:`kvpolicy.statistics.cache_scores`; holes and pads ``+inf``), from
    the keys, values and, for Expected Attention, the ``running`` moments of the queries seen.
    ``seen``: tokens seen, an int or a per-row tensor ``[batch, 1, 1]``; ``phase``: the layer's
    (``"prefill"`` after a prompt chunk). Under a refresh interval, at a decode step between two
    scorings: the held scores, with the tokens appended since the last scoring
    :data:`~kvpolicy.statistics.UNSCORED` (see the module docstring; eager, the held scores
    themselves, updated in place); ``seen_max``: the most tokens a row has seen, when the host
    knows it (eager: the step is chosen without a read). Under a refresh interval every decode
    step must come here (the layer's eviction calls it at each)."""
    if running is None:
        return cache_scores(policy, slots.keys, slots.values, slots.positions, seen)
    if not running.observed and policy.observes_queries:
        raise RuntimeError(
            f"{policy!r} scores from the queries' moments, and no query was observed: call observe_queries() "
            f"with each step's queries before evict() (the transformers cache does)"
        )

    # (held decode queries: the moments are read by a scoring only, so a step between two scorings
    # leaves them held; otherwise read here, outside a compiled step's branches)
    now = None if running.buffered else (running.moments, running.rotary)

    def fresh() -> torch.Tensor:
        moments, rotary = now if now is not None else (running.moments, running.rotary)
        return cache_scores(policy, slots.keys, slots.values, slots.positions, seen, moments, rotary)

    refresh = refresh_interval(policy)
    if refresh == 1:
        return fresh()
    positions = slots.positions

    def per_row() -> torch.Tensor:
        rows = seen.reshape(-1) if isinstance(seen, torch.Tensor) else torch.full((1,), seen, device=positions.device)
        return rows.to(positions.device, torch.int64).expand(positions.shape[0])

    last, compiling = running.scored_seen, torch.compiler.is_compiling()
    if phase != "decode" or last is None or last.shape != (positions.shape[0],):  # after a prompt, or the first time
        running.scored_seen = per_row().clone(memory_format=torch.contiguous_format)
        running.scored_host = running.marked_host = seen_max
        return fresh()
    sink = refresh_sink(policy)

    def stale() -> torch.Tensor:
        return mark_unscored(slots.scores, positions, last.view(-1, 1, 1), sink)

    if not compiling and seen_max is not None and running.scored_host is not None:  # eager: host ints decide
        if isinstance(seen, int) and running.mark_newest(slots.scores, positions, refresh, seen, sink):
            # The last step came here too, so the tokens appended since the last scoring were
            # marked at their own steps: only the newest is new (in place, not O(n) several kernels)
            return slots.scores
        if not refresh_due(refresh, seen_max, running.scored_host):
            running.marked_host = seen_max
            return stale()
        last.copy_(per_row())
        running.scored_host = running.marked_host = seen_max
        return fresh()
    rows = per_row()
    due = refresh_due(refresh, rows, last).any()
    if compiling:  # both branches in the one graph of a compiled step
        scores = torch.cond(due, lambda: fresh().to(slots.scores.dtype), lambda: stale().clone(), ())
    else:  # one read of the flag: the step computes one branch
        scores = fresh() if bool(due) else stale()
    last.copy_(torch.where(due, rows, last))  # (in place: a compiled step mutates the tensor it was given)
    # decided on the device: the host knows when only by reading it (eager, once; then host ints decide)
    running.scored_host = int(last.max()) if not compiling and seen_max is not None else None
    running.marked_host = seen_max if not compiling else None
    return scores


class CandidateSums:
    """A score from the cache declared as a sum over the candidates
    (:class:`kvpolicy.CandidateSum`: KeyDiff's anchor), kept from one decode step to the next,
    and the scores of a step whose eviction reads only each head's lowest.

    The sum follows the tokens by position, so compaction (slots moving) leaves it as it is:
    between two calls, a token that became a candidate (a new one, or one leaving the recent
    window: its position is at or past the last call's ``seen - recent``) adds its summand, and
    each of the last call's exactly scored tokens (the lowest, whatever the eviction took among
    them) that is no longer held subtracts the summand kept for it. When the candidates a head
    holds are not then what that accounts for (another token left: a general eviction), at the
    first call, after :meth:`forget` (rows reordered or restored) or every :data:`RESUM`
    updates (rounding drift), the sum is taken afresh, as the reference computes it (the
    difference is float rounding in the sum, far below the scores' own rounding, as between any
    two backends' summation orders).

    The scores: the policy's cheap estimate for every held token, then the exact score for the
    :data:`RESCORED` lowest estimates per head (at least the layer's heads + 1). Every token left
    at its estimate scores above the next estimate minus the declared error; when each head has as
    many exact scores below that as the eviction reads (its lowest; under head-wise budgets the
    layer's H lowest over its heads, up to H from one head), those are below every score left, so
    the victims (ties to the earliest) are the ones the exact rule picks; otherwise (a tie at the
    cut, NaN, a head of few tokens) :meth:`scores` returns ``None`` and the caller rescores
    everything. Only for an eviction that reads each head's lowest scores (the
    one-token rule, head-wise budgets): the other scores are estimates.

    Example:
        >>> from kvpolicy import KeyDiff
        >>> sums = CandidateSums(KeyDiff(size=4).candidate_sum, min_slots=0)  # (screen even 12 slots)
        >>> keys = torch.randn(1, 2, 12, 8)
        >>> positions = torch.arange(12).expand(1, 2, 12)
        >>> scores = sums.scores(keys, positions, 12, 0)
        >>> exact = KeyDiff(size=4).cache_score(CachedTokens(keys, None, positions, 12))
        >>> bool((scores.argmin(-1) == exact.argmin(-1)).all())
        True
    """

    #: incremental updates between two full sums (bounds the rounding drift of the kept sum)
    RESUM = 64
    #: tokens per head scored exactly at a step
    RESCORED = 4
    #: slots below which a full rescoring is cheaper than the ~80 small kernels of the screen (one
    #: CPU thread, 64-dimensional heads: 136 slots 0.6x, 530 slots 3.5x, 2,070 slots 8.8x faster
    #: than the full rescoring; ``min_slots`` per instance)
    MIN_SLOTS = 256

    def __init__(self, parts: Any, min_slots: int | None = None) -> None:
        self.parts = parts
        self.min_slots = self.MIN_SLOTS if min_slots is None else min_slots
        self.full_sums = 0  # (a diagnostic: how often the sum was taken afresh)
        self.forget()

    def forget(self) -> None:
        """Rows were reordered or restored: the next call sums afresh."""
        self.total: torch.Tensor | None = None
        self.count: torch.Tensor | None = None  # [b, h] candidates held at the last call
        self.edge: Any = None  # the last call's seen - recent: a candidate from there on is new
        self.rescored: torch.Tensor | None = None  # [b, h, k] positions scored exactly (-1: none)
        self.rescored_sum: torch.Tensor | None = None  # [b, h, k, e] their summands
        self.updates = 0

    def _sum(self, keys: torch.Tensor, positions: torch.Tensor, candidate: torch.Tensor, edge: Any) -> torch.Tensor:
        """``[batch, kv_heads, e]`` float64: the candidates' summands summed."""
        count = candidate.sum(-1)
        total, rescored, summands = self.total, self.rescored, self.rescored_sum
        if (total is not None and rescored is not None and summands is not None and self.count is not None
                and self.updates < self.RESUM and total.shape[:2] == positions.shape[:2]):
            entering = candidate & (positions >= self.edge)
            gone = (rescored >= 0) & ~(positions[..., None, :] == rescored[..., None]).any(-1)
            if bool((self.count + entering.sum(-1) - gone.sum(-1) == count).all()):
                total = total - (summands * gone[..., None]).sum(-2)
                b, h, s = entering.nonzero(as_tuple=True)
                if b.numel():
                    total.index_put_((b, h), self.parts.summand(keys[b, h, s]), accumulate=True)
                self.total, self.count, self.edge = total, count, edge
                self.updates += 1
                return total
        weight = candidate.to(torch.float64)
        self.total = torch.matmul(weight[..., None, :], self.parts.summand(keys))[..., 0, :]
        self.count, self.edge, self.updates = count, edge, 0
        self.full_sums += 1
        return self.total

    def scores(self, keys: torch.Tensor, positions: torch.Tensor, seen: Any, recent: int, need: int = 1) -> torch.Tensor | None:
        """Float64 ``[batch, kv_heads, n]``: exact at each head's lowest, estimates elsewhere, ``+inf``
        at holes and pads; ``None`` where the estimates cannot tell the lowest (score every token).
        ``keys`` ``[batch, kv_heads, n, d]``, ``positions`` ``[batch, kv_heads, n]`` (``-1``: hole
        or pad), ``seen`` an int or ``[batch, 1, 1]``, ``recent`` the policy's ``key_recent``;
        ``need``: how many of each head's lowest the eviction reads (1 for a one-token rule; the
        layer's heads under head-wise budgets, whose ``H`` lowest over the layer may all come from
        one head)."""
        # (head-wise budgets take the layer's H lowest over all its heads, so up to H from one head:
        # each head's H + 1 lowest are scored exactly, enough to place the cut)
        k = max(self.RESCORED, positions.shape[1] + 1)
        if positions.shape[-1] < max(k + 1, self.min_slots) or (
            keys.is_cuda and torch.get_float32_matmul_precision() != "highest"
        ):
            self.forget()  # (too few tokens to screen; or float32 products may run in TF32, beyond the error)
            return None
        held = positions >= 0
        edge = seen - recent
        candidate = held & (positions < edge)
        total = self._sum(keys, positions, candidate, edge)
        count = self.count.to(torch.float64).clamp(min=1.0)[..., None]  # type: ignore[union-attr]
        statistic = self.parts.statistic(total, count)
        estimate = self.parts.estimate(keys, statistic)
        search = torch.where(candidate, estimate, torch.inf)
        low, slot = torch.topk(search, k + 1, dim=-1, largest=False, sorted=True)
        slot = slot[..., :k]
        chosen = keys.gather(2, slot[..., None].expand(*slot.shape, keys.shape[-1]))
        picked = candidate.gather(2, slot)
        # (the tokens scored exactly, and their summands: what the next call subtracts if they go)
        self.rescored = torch.where(picked, positions.gather(2, slot), -1)
        self.rescored_sum = summand = self.parts.summand(chosen)
        exact = self.parts.exact(chosen, summand, statistic)
        # every token left at its estimate scores above low[k] - error: a head whose `need` lowest
        # exact scores lie below that (or that has no candidate left at its estimate: low[k] is
        # +inf) has its lowest, ties included, among the exact ones; NaN anywhere fails the test
        below = (picked & (exact < low[..., k:] - self.parts.error(keys.shape[-1]))).sum(-1)
        if not bool(((below >= need) | (low[..., k] == torch.inf)).all()):
            return None
        scores = torch.where(held, estimate.to(torch.float64), torch.inf)
        return scores.scatter_(2, slot, torch.where(picked, exact, scores.gather(2, slot)))
