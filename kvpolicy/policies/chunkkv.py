"""ChunkKV (Liu et al., 2025, "ChunkKV: Semantic-Preserving KV Cache Compression for Efficient
Long-Context LLM Inference"): a scorer's selection in whole chunks of consecutive tokens."""

from __future__ import annotations

from typing import Any

from ..validation import check_int
from ..policy import Array, CacheView, DecodeEviction, EvictionPolicy, Selection, WrappingPolicy
from ..registry import get_policy, register_policy
from .adakv import keep_best

__all__ = ["ChunkKV", "chunk_scores"]


def chunk_scores(view: CacheView, scorer: EvictionPolicy, chunk_length: int) -> Array:
    """``[batch, heads, n // chunk_length]`` float: the score of each complete chunk of the view
    (slots ``[c L, (c + 1) L)``, ``L = chunk_length``): the sum of the ``scorer``'s ranking scores
    (the first key of its :meth:`~kvpolicy.EvictionPolicy.ranking`: Knorm's minus norm, SnapKV's
    pooled attention) over the chunk, added one slot after the other (the same bits on every
    backend); ``+inf`` for a chunk holding a token the scorer protects (its recent or observation
    window); a NaN (``+inf`` beside ``-inf``) counts as ``-inf``.

    Example:
        >>> import numpy as np
        >>> from kvpolicy import CacheView, TOVA
        >>> view = CacheView(np.arange(7)[None, None], np.array([[[1.0, 2, 0, 0, 5, 1, 9]]]), 7)
        >>> chunk_scores(view, TOVA(size=4, recent=2, selection="per_head"), 3).tolist()  # slot 6 (recent) is no full chunk
        [[[3.0, inf]]]
    """
    xp = view.xp
    ranking = scorer.ranking(view)
    primary = ranking.keys[0]
    chunks = view.n_cached // chunk_length
    width = chunks * chunk_length
    shape = (*primary.shape[:-1], chunks, chunk_length)
    grouped = xp.reshape(xp.astype(primary[..., :width], xp.float64), shape)
    guarded = xp.reshape(ranking.protected[..., :width], shape)
    finite = xp.isfinite(grouped)
    values = xp.where(finite, grouped, xp.zeros_like(grouped))  # (infinities apart: no NaN from +inf - inf)
    total = values[..., 0]
    for j in range(1, chunk_length):
        total = total + values[..., j]
    high, low = xp.any(grouped == xp.inf, axis=-1), xp.any(~finite & (grouped != xp.inf), axis=-1)  # (NaN counts as -inf)
    total = xp.where(low, -xp.inf, xp.where(high, xp.inf, total))
    return xp.where(xp.any(guarded, axis=-1), xp.inf, total)


@register_policy
class ChunkKV(WrappingPolicy):
    """A scorer's selection in whole chunks: keep the chunks of ``chunk_length`` consecutive
    tokens that the scorer's scores rank highest.

    When the ``scorer`` (any policy that ranks tokens: Knorm, KeyDiff, Expected Attention, TOVA,
    H2O, SnapKV) evicts, keeping ``b`` tokens of the ``n`` a head holds (its
    :meth:`~kvpolicy.EvictionPolicy.head_budget`: after a prompt, or at a decode step once full),
    ChunkKV splits the held tokens, in slot order, into ``n // L`` complete chunks of ``L =
    chunk_length`` slots and the newest ``r = n % L`` (a chunk still filling, always kept), scores
    each complete chunk by the sum of the scorer's scores over it (:func:`chunk_scores`: ``+inf``
    for a chunk holding a token the scorer protects) and keeps the ``(b - r) // L`` best chunks
    (a tie: the later chunk stays). The kept tokens are ``r + L x ((b - r) // L) <= b``, from host
    integers only. A budget below one chunk (``b < L``), or a cache of no complete chunk, keeps
    the scorer's own ``b`` tokens. Chunks stay whole over decode steps: a kept chunk fills slots
    ``[c L, (c + 1) L)`` again, and the partial chunk is completed by the next tokens, so a
    decode step evicts nothing until the scorer's budget is exceeded, then a whole chunk (or more).

    With ``selection="shared"`` (default: the paper's and kvpress's ``ChunkKVPress``) the scores
    are summed over a layer's KV heads and every head keeps the same chunks; ``"per_head"``: each
    head its own. Scores come from the scorer's statistic (:class:`~kvpolicy.WrappingPolicy`:
    Knorm's key norms, SnapKV's observation window, ...).

    Under kvpress's protocol (:func:`kvpolicy.prefill_only`) the context keeps ``r + L x ((k - r)
    // L)`` of its ``n`` tokens, ``k = int(n (1 - compression_ratio))``. kvpress's ``ChunkKVPress``
    instead keeps ``max(1, int(ceil(n / L) (1 - ratio)))`` chunks chosen among all of them, the
    partial one (scored by its mean) included, so its count depends on whether the partial chunk
    wins; both agree when ``n`` is a multiple of ``L`` (and then keep the same chunks up to ties,
    which kvpress's ``topk`` breaks its own way). It uses only the first row's chunks for a whole
    batch; here every row chooses its own.

    Parameters:
        scorer: a policy that ranks tokens (``selection="per_head"``), e.g. ``SnapKV(size=64)``.
        chunk_length: ``L``, tokens per chunk (>= 1; kvpress's default 20; 1 is the scorer).
        selection: ``"shared"`` (default) or ``"per_head"``.

    Registered as ``chunkkv`` (planned over SnapKV, kvpress's leaderboard entry; ``scorer="<registry
    name>"`` picks another).

    Example:
        >>> from kvpolicy import ChunkKV, Knorm
        >>> p = ChunkKV(Knorm(size=50), chunk_length=20)
        >>> p.capacity, p.score_statistic, p.kept_tokens(51, 50)
        (51, 'key_norm', 31)
    """

    name = "chunkkv"
    default_selection = "shared"

    def __init__(self, scorer: EvictionPolicy, chunk_length: int = 20, *, selection: Selection = "shared") -> None:
        if not isinstance(scorer, EvictionPolicy):
            raise ValueError(
                f"scorer must be an EvictionPolicy instance (e.g. SnapKV(size=64)), got {scorer!r}; to plan one from a "
                "budget use make_policy('chunkkv', budget, ..., scorer='snapkv')"
            )
        if not scorer.ranks_tokens or scorer.ragged_heads:
            raise ValueError(
                f"scorer must rank tokens by a score (declare ranking() and head_budget(): H2O, TOVA, Knorm, KeyDiff, "
                f"Expected Attention, SnapKV; not AdaKV), got {scorer!r}"
            )
        if scorer.selection != "per_head":
            raise ValueError(
                f"scorer must select per head (selection='per_head'): ChunkKV's own selection says whether heads share "
                f"chunks; got {scorer!r}"
            )
        self.chunk_length = check_int("chunk_length", chunk_length, minimum=1)
        super().__init__(selection=selection)
        self.scorer = self.wrapped = scorer
        self.log_n = scorer.log_n

    # (what backends read is the scorer's: WrappingPolicy; its capacity bounds ChunkKV's too, which keeps fewer)
    @property
    def decode_eviction(self) -> DecodeEviction | None:
        return None  # a step evicts whole chunks, not one token

    def kept_tokens(self, n_cached: int, budget: int) -> int:
        """Tokens a head keeps when the scorer keeps ``budget`` of ``n_cached``: ``r + L x ((budget
        - r) // L)`` with ``r = n_cached % L``; ``budget`` when no whole chunk fits (the scorer's own
        choice)."""
        rest = n_cached % self.chunk_length
        if budget < self.chunk_length or n_cached < self.chunk_length:
            return budget
        return rest + self.chunk_length * ((budget - rest) // self.chunk_length)

    def keep_chunks(self, view: CacheView, budget: int) -> Array:
        """The keep array when the scorer keeps ``budget`` (``< n_cached``) tokens a head: the
        partial chunk and the best ``(budget - r) // L`` complete chunks (see the class), or the
        scorer's own ``budget`` tokens when no whole chunk fits. Used by :meth:`select` and by
        :class:`~kvpolicy.PrefillOnly` (kvpress's protocol, ``budget = int(n (1 - ratio))``)."""
        n, length = view.n_cached, self.chunk_length
        if budget < length or n < length:
            return keep_best(view, self.scorer.ranking(view), budget)
        xp = view.xp
        chunks = n // length
        kept = (budget - n % length) // length
        scores = chunk_scores(view, self.scorer, length)
        # the lowest go first, the earliest of a tie: the kept chunks are the last of a stable ascending sort
        best = xp.sort(xp.argsort(scores, axis=-1, stable=True)[..., chunks - kept :], axis=-1)  # [batch, heads, kept]
        offsets = view.arange(length)
        slots = xp.reshape(best[..., None] * length + offsets, (*best.shape[:-1], kept * length))
        return view.keep(slots, view.arange(chunks * length, n))

    def select(self, view: CacheView) -> Array | None:
        budget = self.scorer.head_budget(view.n_cached, view.phase)
        if budget is None:
            return None
        return self.keep_chunks(view, budget)

    def for_layer(self, layer: int, layers: int) -> EvictionPolicy:
        """Over the scorer's policy for ``layer`` (e.g. a :class:`~kvpolicy.CriticalKV` bound to
        the layer's output projection); itself when that is the scorer."""
        inner = self.scorer.for_layer(layer, layers)
        return self if inner is self.scorer else ChunkKV(inner, self.chunk_length, selection=self.selection)

    def params(self) -> dict[str, Any]:
        """The scorer as plain data (registry name and parameters) and ``chunk_length``."""
        return {
            "scorer": {"policy": self.scorer.name, **self.scorer.params(), "selection": self.scorer.selection},
            "chunk_length": self.chunk_length,
        }

    def __repr__(self) -> str:
        shown = "" if self.selection == "shared" else f", selection={self.selection!r}"
        return f"ChunkKV(scorer={self.scorer!r}, chunk_length={self.chunk_length!r}{shown})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ChunkKV) and (self.scorer, self.chunk_length, self.selection) == (
            other.scorer, other.chunk_length, other.selection)

    def __hash__(self) -> int:
        return hash(("ChunkKV", self.scorer, self.chunk_length, self.selection))

    min_size = 2

    @classmethod
    def from_size(cls, size: int, **overrides: Any) -> "ChunkKV":
        """``scorer`` (a registry name; default ``"snapkv"``, kvpress's leaderboard entry) planned
        with ``from_size(size)`` and ``selection="per_head"``; ``chunk_length`` and ``selection``
        are ChunkKV's; the other overrides are the scorer's."""
        scorer = overrides.pop("scorer", "snapkv")
        if not isinstance(scorer, str):
            raise ValueError(f"ChunkKV plans from a scorer's registry name (scorer='snapkv', 'knorm', ...), got {scorer!r}")
        chunk_length = overrides.pop("chunk_length", 20)
        selection = overrides.pop("selection", "shared")
        entry = get_policy(scorer)
        return cls(entry.from_size(max(size, entry.min_size), selection="per_head", **overrides), chunk_length,
                   selection=selection)
