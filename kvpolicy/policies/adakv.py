"""Head-wise budgets: AdaKV (Feng et al., 2024, "Ada-KV: Optimizing KV Cache Eviction by Adaptive
Budget Allocation for Efficient LLM Inference")."""

from __future__ import annotations

import math
import sys
from typing import Any, Protocol, runtime_checkable

from ..validation import check_float
from ..policy import Array, CacheView, DecodeEviction, EvictionPolicy, HeadwiseEviction, Ranking, SizeRule, WrappingPolicy
from .lowest import KeepAtMost
from ..registry import get_policy, register_policy

__all__ = ["AdaKV", "HeadExchange", "ShardedAdaKV", "headwise_keep", "keep_best"]


def _lexsort(keys: list[Array], xp: Any) -> Array:
    """Slots ``[..., m]`` in ascending lexicographic order of ``keys`` (the first key first; equal
    in every key: slot order), by stable sorts from the last key to the first."""
    order = None
    for key in reversed(keys):
        if xp.isdtype(key.dtype, "real floating"):
            key = xp.where(xp.isnan(key), -xp.inf, key)  # a NaN counts as -inf
        if order is not None:
            key = xp.take_along_axis(key, order, axis=-1)
        step = xp.argsort(key, axis=-1, stable=True)
        order = step if order is None else xp.take_along_axis(order, step, axis=-1)
    return order


def headwise_keep(view: CacheView, ranking: Ranking, budget: int, floor: int) -> Array:
    """The keep array of one head-wise eviction: of each row's tokens (every head of the layer),
    keep ``budget``, the tokens ``ranking`` evicts last over all heads, after each head's
    ``floor`` best and every protected token.

    In order: holes go first (they hold nothing), then the unprotected tokens outside their head's
    ``floor`` best by ``ranking``'s keys (over all heads at once; a tie in every key goes to the
    lower head), until ``budget`` remain. The result is ``[batch, heads, k]`` with ``k`` the most
    tokens a head keeps; a head keeping fewer starts with holes (``-1``). Reads ``k`` on the host.

    Args:
        view: the layer (``held``: which slots hold a token).
        ranking: the scorer's order (:meth:`~kvpolicy.EvictionPolicy.ranking`).
        budget: tokens kept per row, over all heads (at most the tokens held).
        floor: tokens each head keeps at least (its best by ``ranking``; fewer if it holds fewer).

    Example (head 0 attends sharply, head 1 broadly: head 1 keeps more):
        >>> import numpy as np
        >>> from kvpolicy import CacheView, Ranking
        >>> s = np.array([[[0.9, 0.0, 0.1, 0.0], [0.3, 0.2, 0.25, 0.15]]])
        >>> view = CacheView(np.broadcast_to(np.arange(4), (1, 2, 4)), s, 4)
        >>> ranking = Ranking(np.zeros((1, 2, 4), dtype=bool), (s, view.positions))
        >>> headwise_keep(view, ranking, budget=4, floor=1).tolist()
        [[[-1, -1, 0], [0, 1, 2]]]
        >>> headwise_keep(view, ranking, budget=4, floor=2).tolist()  # floors of 2: 2 tokens each
        [[[0, 2], [0, 2]]]
    """
    xp = view.xp
    batch, heads, n = view.positions.shape
    held = view.held
    protected = ranking.protected & held
    # each head's eviction order: holes first, protected tokens last
    order = _lexsort([xp.astype(held, xp.int8), xp.astype(protected, xp.int8), *ranking.keys], xp)
    place = xp.argsort(order, axis=-1)  # a slot's place in its head's order (the inverse permutation)
    must = protected | (held & (place >= n - floor))  # the head's `floor` best, and what is protected
    # one order over the row's heads (flattened head by head: a full tie goes to the lower head)
    flat = [xp.reshape(k, (batch, heads * n)) for k in (xp.astype(held, xp.int8), xp.astype(must, xp.int8), *ranking.keys)]
    rank = xp.argsort(_lexsort(flat, xp), axis=-1)
    return view.keep_where(xp.reshape(rank >= heads * n - budget, (batch, heads, n)))


def keep_best(view: CacheView, ranking: Ranking, k: int) -> Array:
    """The keep array ``[batch, heads, k]`` in which every head keeps its ``k`` tokens that
    ``ranking`` evicts last (protected tokens last of all; holes first): a scorer's own choice at a
    per-head budget of ``k`` (``1 <= k <= n_cached``), e.g. :class:`~kvpolicy.PrefillOnly`'s.

    Example:
        >>> import numpy as np
        >>> from kvpolicy import CacheView, Ranking
        >>> s = np.array([[[0.9, 0.0, 0.1, 0.0], [0.3, 0.2, 0.25, 0.15]]])
        >>> view = CacheView(np.broadcast_to(np.arange(4), (1, 2, 4)), s, 4)
        >>> protect_last = np.broadcast_to(np.arange(4) == 3, (1, 2, 4))
        >>> keep_best(view, Ranking(protect_last, (s, view.positions)), 2).tolist()
        [[[0, 3], [0, 3]]]
    """
    xp = view.xp
    held = view.held
    order = _lexsort([xp.astype(held, xp.int8), xp.astype(ranking.protected & held, xp.int8), *ranking.keys], xp)
    return xp.sort(order[..., view.n_cached - k :], axis=-1)


@register_policy
class AdaKV(WrappingPolicy):
    """Head-wise budgets (AdaKV) over a scorer: one top-k over a layer's KV heads, a floor per head.

    A layer's budget is shared among its KV heads by one top-k over all heads' scores.

    Where the ``scorer`` (H2O, TOVA, Knorm, KeyDiff, SnapKV, any policy that declares
    :meth:`~kvpolicy.EvictionPolicy.ranking`) would keep ``b`` tokens in every one of a layer's
    ``H`` KV heads, AdaKV keeps ``H x b`` tokens in the layer: first each head's
    ``floor = int(alpha_safeguard x b)`` best by the scorer's ranking and every token the scorer
    protects (its recent or observation window), then the best of the rest over all heads at once
    (:func:`headwise_keep`). Heads whose attention is spread keep more, heads that attend sharply
    fewer. The scorer decides when (its :meth:`~kvpolicy.EvictionPolicy.head_budget` on the
    layer's mean tokens per head): after a prompt (SnapKV), or at every decode step once full
    (H2O, TOVA, KeyDiff, Knorm), where a step adds one token to each head and so evicts ``H``
    tokens of the layer, the lowest over all heads outside the floors: which heads lose a token
    is decided by their scores. ``alpha_safeguard = 1`` is the scorer itself (every head keeps
    its own ``b``); ``0`` is one top-k with no floor.

    Kept tokens are freed, not masked (kvpress's ``AdaKVPress`` masks them and keeps the memory):
    a head keeping fewer tokens than the layer's widest holds holes in its first slots (position
    ``-1``), so a layer's storage is its widest head's tokens times its heads (docs/design.md,
    "Head-wise budgets"). :attr:`capacity` is per head *on average* (the layer holds at most
    ``H x (capacity - 1)`` tokens between steps); one head may hold up to
    :meth:`head_capacity` ``(H)``.

    Parameters:
        scorer: a policy that ranks tokens (``selection="per_head"``), e.g. ``SnapKV(size=64)``.
        alpha_safeguard: the fraction of its share ``b`` each head keeps at least (``[0, 1]``;
            kvpress's default 0.2).

    Registered presets (planned like any policy: ``make_policy("adakv_snapkv", 0.3, ...)``):
    ``adakv_snapkv``, ``adakv_h2o``, ``adakv_keydiff``, ``adakv_tova``, ``adakv_expected_attention``
    (kvpress's leaderboard leader); ``adakv`` plans with
    ``scorer="<registry name>"``.

    Example:
        >>> from kvpolicy import AdaKV, H2O
        >>> p = AdaKV(H2O(heavy=6, recent=2), alpha_safeguard=0.25)
        >>> p.capacity, p.floor, p.head_capacity(4)
        (9, 2, 27)
    """

    name = "adakv"

    def __init__(self, scorer: EvictionPolicy, alpha_safeguard: float = 0.2) -> None:
        if not isinstance(scorer, EvictionPolicy):
            raise ValueError(
                f"scorer must be an EvictionPolicy instance (e.g. SnapKV(size=64)), got {scorer!r}; to plan one from a "
                "budget use make_policy('adakv', budget, ..., scorer='snapkv')"
            )
        if not scorer.ranks_tokens:
            raise ValueError(
                f"scorer must rank tokens by a score (declare ranking() and head_budget(): H2O, TOVA, Knorm, KeyDiff, "
                f"SnapKV), got {scorer!r}"
            )
        if scorer.selection != "per_head":
            raise ValueError(
                f"scorer must select per head (selection='per_head'): AdaKV shares the layer's budget among its heads; "
                f"got {scorer!r}"
            )
        self.alpha_safeguard = check_float("alpha_safeguard", alpha_safeguard, low=0.0, high=1.0)
        super().__init__(selection="per_head")
        self.scorer = self.wrapped = scorer
        self.log_n = scorer.log_n

    # ---------------------------------------------------------------- what backends read
    # (the scorer's: WrappingPolicy; its capacity is per head on average here)
    ragged_heads = True  # (a class attribute over WrappingPolicy's property: AdaKV makes heads differ)

    @property
    def capacity(self) -> int | None:
        """Most tokens a layer holds per head *on average* (the scorer's capacity)."""
        return self.scorer.capacity

    @property
    def share(self) -> int:
        """``b``: the tokens per head the scorer keeps when it evicts (its ``head_budget``)."""
        b = self.scorer.head_budget(sys.maxsize, "prefill")
        assert b is not None  # a scorer evicts from any number of tokens after a prompt
        return b

    @property
    def floor(self) -> int:
        """Tokens each head keeps at least: ``int(alpha_safeguard x share)``."""
        return self.floor_of(self.share)

    def floor_of(self, share: int) -> int:
        """``int(alpha_safeguard x share)`` (kvpress's rounding), computed without float error
        at ``alpha_safeguard = 1``."""
        return share if self.alpha_safeguard == 1.0 else int(math.floor(self.alpha_safeguard * share))

    def head_capacity(self, heads: int) -> int | None:
        """Most tokens one of ``heads`` heads ever holds: the layer's ``heads x share`` less the
        others' floors, plus the token a decode step appends (``None`` when the scorer is
        unbounded)."""
        if self.capacity is None:
            return None
        return heads * self.share - (heads - 1) * self.floor + 1

    @property
    def decode_eviction(self) -> DecodeEviction | None:
        return None  # a step evicts one token per head of the layer, from whichever heads score lowest

    @property
    def headwise_eviction(self) -> HeadwiseEviction | None:
        """The decode step's eviction as a declared rule (:class:`~kvpolicy.HeadwiseEviction`:
        the layer's ``H`` lowest outside the floors and the recent window, applied by backends as
        a masked write) over a scorer that evicts its lowest score one token a step and ranks by
        it (:class:`~kvpolicy.policies.lowest.KeepAtMost` with ``victim="lowest"``: H2O, TOVA,
        Knorm, KeyDiff, Expected Attention, and CriticalKV over one of them, whose rule is its
        scorer's: :attr:`~kvpolicy.EvictionPolicy.rule_policy`); ``None`` over any other (SnapKV:
        no decode eviction).

        Example:
            >>> from kvpolicy import H2O, SnapKV
            >>> AdaKV(H2O(heavy=6, recent=2), alpha_safeguard=0.25).headwise_eviction
            HeadwiseEviction(limit=8, recent=2, floor=2)
            >>> AdaKV(SnapKV(size=40)).headwise_eviction is None
            True
        """
        scorer = self.scorer.rule_policy  # (CriticalKV: its scorer's rule on CriticalKV's scores)
        rule = self.scorer.decode_eviction
        cls = type(scorer)
        if (
            not isinstance(scorer, KeepAtMost) or rule is None or rule.victim != "lowest"
            or cls.ranking is not KeepAtMost.ranking or cls.head_budget is not KeepAtMost.head_budget
            or cls.select is not KeepAtMost.select
        ):
            return None  # (its decode steps mean something else: select decides)
        return HeadwiseEviction(limit=rule.limit, recent=rule.recent, floor=self.floor_of(rule.limit))

    # ---------------------------------------------------------------- the rule
    def init_state(self) -> dict[str, int]:
        # every head gains one token a step, so with `kept` per head (on average) after the last
        # eviction, at `seen` tokens, a layer now holds kept + n_seen - seen per head on average
        # (host integers: the widest head, n_cached, depends on the scores)
        return {"seen": 0, "kept": 0}

    def mean_tokens(self, view: CacheView) -> int:
        """Tokens the layer holds per head on average (host integers only): ``n_cached`` until
        AdaKV first evicts (only it makes heads differ; another policy, e.g. a composition's
        prefill, may have evicted before), then what it kept plus the tokens seen since."""
        return HeadwiseEviction.mean_tokens(view.n_cached, view.n_seen, view.state)

    def head_share(self, view: CacheView) -> int | None:
        """``b``, the tokens per head this view's eviction keeps on average (the scorer's
        :meth:`~kvpolicy.EvictionPolicy.head_budget` on :meth:`mean_tokens`), or ``None`` when
        it keeps every token: host integers only, so every process of a sharded layer
        (:class:`ShardedAdaKV`) decides alike without exchanging a thing."""
        return self.scorer.head_budget(self.mean_tokens(view), view.phase)

    def select(self, view: CacheView) -> Array | None:
        b = self.head_share(view)
        if b is None:
            return None
        xp = view.xp
        # the scorer ranks a view whose holes score 0 (backends differ there: 0 or +inf), so
        # pooling (SnapKV) next to them is pooling at the edge
        scores = xp.where(view.held, view.scores, xp.zeros_like(view.scores))
        ranking = self.scorer.ranking(CacheView(view.positions, scores, view.n_seen, {}, view.phase))
        view.state.update(seen=view.n_seen, kept=b)
        return headwise_keep(view, ranking, view.heads * b, self.floor_of(b))

    def for_layer(self, layer: int, layers: int) -> EvictionPolicy:
        """Over the scorer's policy for ``layer`` (e.g. a :class:`~kvpolicy.CriticalKV` bound to
        the layer's output projection); itself when that is the scorer."""
        inner = self.scorer.for_layer(layer, layers)
        return self if inner is self.scorer else AdaKV(inner, self.alpha_safeguard)

    def size_rule(self) -> SizeRule | None:
        """The scorer's rule: exact with one head (the planners'); with more, ``n`` is the widest
        head's, so the rule may say "evict" where :meth:`select` declines (backends then ask it)."""
        return self.scorer.size_rule()

    def params(self) -> dict[str, Any]:
        """The scorer as plain data (registry name and parameters) and ``alpha_safeguard``."""
        return {
            "scorer": {"policy": self.scorer.name, **self.scorer.params(), "selection": self.scorer.selection},
            "alpha_safeguard": self.alpha_safeguard,
        }

    def __repr__(self) -> str:
        return f"AdaKV(scorer={self.scorer!r}, alpha_safeguard={self.alpha_safeguard!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AdaKV) and (self.scorer, self.alpha_safeguard) == (other.scorer, other.alpha_safeguard)

    def __hash__(self) -> int:
        return hash(("AdaKV", self.scorer, self.alpha_safeguard))

    min_size = 2

    @classmethod
    def from_size(cls, size: int, **overrides: Any) -> "AdaKV":
        """``scorer`` (required: a registry name) planned with ``from_size(size)`` and
        ``selection="per_head"``; ``alpha_safeguard`` is AdaKV's; the other overrides are the
        scorer's."""
        scorer = overrides.pop("scorer", None)
        if not isinstance(scorer, str):
            raise ValueError(
                "AdaKV plans from a scorer's registry name: scorer='snapkv' (or h2o, tova, knorm, keydiff; or use a "
                f"preset such as adakv_snapkv), got {scorer!r}"
            )
        alpha = overrides.pop("alpha_safeguard", 0.2)
        entry = get_policy(scorer)
        overrides.setdefault("selection", "per_head")
        return cls(entry.from_size(max(size, entry.min_size), **overrides), alpha)


for _scorer in ("snapkv", "h2o", "keydiff", "tova", "expected_attention"):
    register_policy(
        AdaKV,
        name=f"adakv_{_scorer}",
        preset={"scorer": _scorer},
        doc=f"AdaKV head-wise budgets over {_scorer} (per head), alpha_safeguard 0.2",
    )


@runtime_checkable
class HeadExchange(Protocol):
    """How one process reaches the rest of a layer whose KV heads are split over processes
    (tensor parallelism: each rank holds a contiguous block of them), for :class:`ShardedAdaKV`.

    Attributes:
        heads: the layer's KV heads, over all processes.
        start: this process's first head among them (its heads are ``start, start + 1, ...``).

    :meth:`gather` is a collective: every process calls it, in the same order, with arrays of
    its own heads. ``kvpolicy.deepspeed.TensorParallelHeads`` is the one over a
    ``torch.distributed`` group.
    """

    heads: int
    start: int

    def gather(self, x: Array, fill: Any) -> Array:
        """``x`` ``[batch, local heads, n]`` of every process, in head order: ``[batch, heads, m]``,
        each process's rows left-padded with ``fill`` to the widest process's ``m`` (a head-wise
        layout's holes lead its rows, so a left-padded row is the same row)."""
        ...


class ShardedAdaKV(WrappingPolicy):
    """:class:`AdaKV` for one process's share of a layer whose KV heads are split over processes
    (tensor parallelism): the same tokens per head as AdaKV on the whole layer.

    AdaKV ranks all of a layer's heads at once (one top-k), so when it evicts, each process
    gathers every process's positions and scores (two calls of ``exchange.gather``, each
    ``[batch, heads, n]``, padded), runs AdaKV on the whole layer, identically everywhere, and
    keeps its own heads' share, in its own slots. Whether to evict is decided on host integers
    (:meth:`AdaKV.head_share`), alike on every process, so a step that evicts nothing exchanges
    nothing. A process whose heads lose no token in a round that evicts elsewhere still answers
    (with all its slots: :attr:`~kvpolicy.EvictionPolicy.sharded_heads`), so that every process
    records the round in the policy's state.

    What a process allocates: its heads' widest, as a single process would (AdaKV's
    :attr:`capacity` per head, grown up to :meth:`head_capacity` of the *whole* layer's heads: one
    process's heads may take more than their share of the layer's budget). A size rule would see
    one process's widest head only, so there is none: backends ask :meth:`select` at every step.

    One sequence at a time (batch 1): the torch backend groups a batch's rows by their widest
    head, which differs between processes (``kvpolicy.deepspeed`` refuses a larger batch).

    Parameters:
        adakv: the :class:`AdaKV` policy of the whole layer.
        exchange: the :class:`HeadExchange` of this process.

    Example (rank 1 of 2, holding head 2 of a layer's 3; its exchange here knows rank 0's rows):
        >>> import numpy as np
        >>> from kvpolicy import CacheView, H2O
        >>> positions = np.broadcast_to(np.arange(5), (1, 3, 5))
        >>> scores = np.array([[[9.0, 0, 0, 0, 1], [5, 4, 3, 2, 1], [4, 4, 0, 1, 1]]])
        >>> class Rank1:
        ...     heads, start = 3, 2
        ...     def gather(self, x, fill):  # (a collective in real use: kvpolicy.deepspeed.TensorParallelHeads)
        ...         return np.concatenate([(positions if fill == -1 else scores)[:, :2], x], axis=1)
        >>> adakv = AdaKV(H2O(heavy=2, recent=1), alpha_safeguard=0.5)
        >>> adakv.select(CacheView(positions, scores, 5, adakv.init_state())).tolist()  # one process, 3 heads
        [[[-1, -1, 0, 4], [0, 1, 2, 4], [-1, 0, 1, 4]]]
        >>> ShardedAdaKV(adakv, Rank1()).select(CacheView(positions[:, 2:], scores[:, 2:], 5, adakv.init_state())).tolist()
        [[[0, 1, 4]]]
    """

    name = "adakv"  # the policy it runs (not registered itself: it holds a process's exchange)
    ragged_heads = True
    sharded_heads = True
    size_rule = None  # a process's count is its widest head's, which says nothing of the layer's

    def __init__(self, adakv: AdaKV, exchange: HeadExchange) -> None:
        if not isinstance(adakv, AdaKV):
            raise ValueError(f"adakv must be an AdaKV policy (head-wise budgets over a scorer), got {adakv!r}")
        if not isinstance(exchange, HeadExchange):
            raise ValueError(f"exchange must be a HeadExchange (heads, start, gather(x, fill)), got {exchange!r}")
        heads, start = exchange.heads, exchange.start
        if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
            raise ValueError(f"exchange.heads must be a positive integer, got {heads!r}")
        if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start < heads:
            raise ValueError(f"exchange.start must be an integer in [0, {heads}), got {start!r}")
        super().__init__(selection="per_head")
        self.wrapped = adakv
        self.exchange = exchange
        self.log_n = adakv.log_n

    def head_capacity(self, heads: int) -> int | None:
        """Most tokens one head ever holds: AdaKV's for the *layer's* heads (``exchange.heads``),
        whatever ``heads`` this process holds."""
        return self.wrapped.head_capacity(self.exchange.heads)

    def init_state(self) -> dict[str, int]:
        return self.wrapped.init_state()

    def for_layer(self, layer: int, layers: int) -> EvictionPolicy:
        inner = self.wrapped.for_layer(layer, layers)
        return self if inner is self.wrapped else ShardedAdaKV(inner, self.exchange)  # type: ignore[arg-type]

    def select(self, view: CacheView) -> Array | None:
        if self.wrapped.head_share(view) is None:  # host integers, alike on every process: no exchange
            return None
        xp = view.xp
        local, n = view.heads, view.n_cached
        positions = self.exchange.gather(view.positions, -1)
        scores = self.exchange.gather(view.scores, 0)
        m = int(positions.shape[-1])
        whole = CacheView(positions, scores, view.n_seen, view.state, view.phase)  # (AdaKV records the round in state)
        keep = self.wrapped.select(whole)
        if keep is None:  # pragma: no cover - budget() said it evicts, on the same integers
            raise RuntimeError(f"{self.wrapped!r} declined on the whole layer after deciding to evict")
        start = self.exchange.start
        mine = keep[:, start : start + local, :]
        mine = xp.where(mine >= 0, mine - (m - n), xp.full_like(mine, -1))  # the whole layer's slots -> this process's
        # as wide as this process's widest head; one slot (a hole) if its heads keep nothing (floor 0)
        widest = max(int(xp.max(xp.sum(xp.astype(mine >= 0, xp.int64), axis=-1))), 1)
        return mine[..., mine.shape[-1] - widest :]

    def params(self) -> dict[str, Any]:
        return {"adakv": self.wrapped, "heads": self.exchange.heads, "start": self.exchange.start}

    def __repr__(self) -> str:
        return f"ShardedAdaKV({self.wrapped!r}, heads={self.exchange.heads}, start={self.exchange.start})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ShardedAdaKV) and self.wrapped == other.wrapped and self.exchange is other.exchange

    def __hash__(self) -> int:
        return hash(("ShardedAdaKV", self.wrapped, self.exchange.heads, self.exchange.start))
