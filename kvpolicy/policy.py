"""The abstract eviction policy and the read-only cache view it decides on.

A policy never touches keys or values. A backend (``kvpolicy_numpy``, ``kvpolicy_torch``, the
transformers cache) keeps, per layer, the cached tokens' original positions and accumulated
attention scores, shows them to the policy as a :class:`CacheView`, and applies the slots the
policy returns with one gather. The decision is written once against the array namespace of
the view (``view.xp``, from ``array-api-compat``), so the same code runs on NumPy and Torch.

Shapes follow the backends: ``[batch, kv_heads, n]`` for positions and scores, where ``n`` is
the number of cached tokens of that layer (equal for every row and head), except under head-wise
budgets (:class:`~kvpolicy.AdaKV`), where heads hold different numbers of tokens: ``n`` is then the
most any head holds, and a head holding fewer has *holes* in its first slots (position ``-1``).

Two rules keep decisions cheap and free of host-device syncs on accelerators:

* *whether* to evict depends only on host integers (``view.n_cached``, ``view.n_seen``,
  ``view.state``), never on tensor values;
* *which* slots to keep is computed with array operations, never with ``.item()``.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, ClassVar, Literal, NamedTuple

from array_api_compat import array_namespace as _ns, device

from .validation import check_choice, check_float, check_int
from .params import Param, Selection, declared_params, make_init

__all__ = [
    "KEY_STATISTICS",
    "RECONSTRUCTION",
    "CachedTokens",
    "CacheView",
    "CandidateSum",
    "DecodeEviction",
    "DeferredScoresView",
    "HeadwiseEviction",
    "EvictionPolicy",
    "LogNScaling",
    "Ranking",
    "ScoreStatistic",
    "Selection",
    "WrappingPolicy",
    "array_namespace",
    "check_eviction_policy",
    "check_inherited_rules",
    "keep_at_most",
    "register_namespace",
]

Array = Any  # a NumPy ndarray or a torch.Tensor; anything array-api-compat understands
#: How a token's score is computed (:attr:`EvictionPolicy.score_statistic`): from the attention it
#: received (``"accumulate"``, ``"latest"``, ``"low_history"``) or from the cached keys
#: (``"key_norm"``, ``"key_diff"``, ``"expected_attention"``, see :data:`KEY_STATISTICS`), or from a
#: context-reconstruction pass after the prompt (``"reconstruction"``: KVzip, :data:`RECONSTRUCTION`).
ScoreStatistic = Literal[
    "accumulate", "latest", "low_history", "key_norm", "key_diff", "expected_attention", "cache", "reconstruction",
]
#: The score statistics that backends compute from the cache (:func:`kvpolicy.statistics.cache_scores`),
#: not from attention: a policy with one needs no score capture inside attention, and declares its
#: score as one method, :meth:`EvictionPolicy.cache_score`, which every backend calls (the NumPy
#: reference, the torch backend eager and compiled, the transformers and DeepSpeed caches, the
#: conformance kit). ``"key_norm"`` (Knorm) and ``"key_diff"`` (KeyDiff) read the cached keys;
#: ``"expected_attention"`` also the cached values and the moments of the queries the layer has
#: seen (:class:`kvpolicy.statistics.QueryMoments`); ``"cache"`` is any other score a policy
#: computes from the cached keys and values (docs/extending.md).
KEY_STATISTICS: tuple[str, ...] = ("key_norm", "key_diff", "expected_attention", "cache")
#: The score statistic of a policy that decides once, after the prompt, on what each prompt token
#: receives while the model is fed a repeat prompt and the prompt again (KVzip's context
#: reconstruction): the maximum, over the reconstruction's queries and the query heads of a KV
#: head, of the attention probability (:func:`kvpolicy.statistics.reconstruction_scores`). No
#: attention is captured while the prompt and the decode steps run; a backend runs the pass (the
#: transformers integration: ``kvpolicy_integrations.reconstruction.reconstruct``) or is given its scores (the
#: NumPy reference: ``replay(reconstruction=...)``), then asks the policy once, and refuses a
#: decode step before that.
RECONSTRUCTION = "reconstruction"


class CachedTokens(NamedTuple):
    """What a score from the cache is computed from: the argument of
    :meth:`kvpolicy.EvictionPolicy.cache_score` (arrays of one backend, NumPy or torch).

    Attributes:
        keys: ``[..., n, d]`` the cached keys, as cached (after RoPE in a model's cache).
        values: ``[..., n, dv]`` the cached values (``None`` where a NumPy replay was given none).
        positions: ``[..., n]`` their original positions, ``-1`` at a hole or pad.
        n_seen: tokens seen so far: an int, or an array broadcastable to ``positions[..., :1]``
            (one per row of a left-padded batch).
        recent: the policy's :attr:`~kvpolicy.EvictionPolicy.key_recent` (tokens always kept,
            which a statistic over the candidates may leave out, as KeyDiff's anchor does).
        moments: the queries' running moments (:class:`kvpolicy.statistics.QueryMoments`), for a
            policy that observes queries (``None`` else).
        rotary: the layer's RoPE (:class:`kvpolicy.statistics.Rotary`), where a policy averages
            over future rotations (``None`` else).
    """

    keys: Array
    values: Array | None
    positions: Array
    n_seen: Any
    recent: int = 0
    moments: Any = None  #: a :class:`kvpolicy.statistics.QueryMoments`, or ``None``
    rotary: Any = None  #: a :class:`kvpolicy.statistics.Rotary`, or ``None``


#: Array types whose namespace a backend declared (:func:`register_namespace`): only read at a
#: call (a compiled step may call :func:`array_namespace` inside ``torch.cond``, which may not
#: mutate a dict), written when a backend is imported.
_NAMESPACES: dict[type, Any] = {}


def register_namespace(array_type: type, namespace: Any) -> None:
    """Declare ``namespace`` the array-API namespace of arrays whose type is exactly
    ``array_type``, so that :func:`array_namespace` answers by one dict read instead of
    array-api-compat's search (~1.7 us a call, and a decode step's declared scores ask once a
    layer or more). A backend calls it when it is imported (``kvpolicy_torch``: ``torch.Tensor``;
    ``kvpolicy_numpy``: ``numpy.ndarray``); ``namespace`` must be what array-api-compat gives
    for such an array.

    Example:
        >>> import numpy as np
        >>> import array_api_compat.numpy
        >>> register_namespace(np.ndarray, array_api_compat.numpy)
        >>> array_namespace(np.zeros(2)) is array_api_compat.numpy
        True
    """
    if not isinstance(array_type, type):
        raise ValueError(f"array_type must be a type (e.g. torch.Tensor), got {array_type!r}")
    _NAMESPACES[array_type] = namespace


def array_namespace(x: Array) -> Any:
    """The array-api-compat namespace of ``x`` (NumPy or Torch): a registered type's
    (:func:`register_namespace`), else array-api-compat's answer.

    Example:
        >>> import numpy as np
        >>> array_namespace(np.zeros(2)).__name__
        'array_api_compat.numpy'
    """
    ns = _NAMESPACES.get(type(x))
    return _ns(x) if ns is None else ns


@dataclass
class CacheView:
    """What a policy sees of one layer's cache, at one eviction opportunity.

    Attributes:
        positions: ``[batch, kv_heads, n]`` integer original positions of the cached tokens,
            ascending along the last axis (slot order is position order). Only under head-wise
            budgets (:class:`~kvpolicy.AdaKV`) does a head hold fewer than ``n`` tokens: its first
            slots are then holes, position ``-1`` (score 0 in the NumPy reference, ``+inf`` in
            the torch backend: read :attr:`held`, never a hole's score).
        scores: ``[batch, kv_heads, n]`` accumulated attention each cached token has received
            (summed over the query heads of its KV head, over all queries so far; only the latest
            query's for a policy whose :attr:`EvictionPolicy.score_statistic` is ``"latest"``). Policies rank
            :attr:`ranking_scores`, in which a NaN score counts as ``-inf`` (see there).
        n_seen: tokens processed so far in this sequence, the ones just appended included.
        state: the policy's own per-layer state: a small dict of host ints the policy may update
            when it evicts (e.g. BUZZ's count of "old" middle tokens).
        phase: ``"prefill"`` right after a prompt (or chunk) was appended, else ``"decode"``.

    The view is read-only for the policy except ``state``.
    """

    positions: Array
    scores: Array
    n_seen: int
    state: dict[str, int] = field(default_factory=dict)
    phase: Literal["prefill", "decode"] = "decode"

    @cached_property
    def ranking_scores(self) -> Array:
        """:attr:`scores` with every NaN replaced by ``-inf``: what score-reading policies rank.

        The rule for a NaN score (an overflow upstream, e.g. in half precision): it counts as the
        lowest possible score, so H2O evicts such a token first and it never wins a BUZZ segment
        unless every token of the segment is NaN (then the earliest wins, as on any tie). Without
        it, sort and argmax would each place NaN wherever their library does, differently for
        ``argmin`` and ``argsort``. ``+inf`` and ``-inf`` scores rank as themselves. One
        element-wise pass on the device, no host sync.

        Example:
            >>> import numpy as np
            >>> view = CacheView(np.arange(3)[None, None], np.array([[[0.5, np.nan, 1.0]]]), 3)
            >>> view.ranking_scores.tolist()
            [[[0.5, -inf, 1.0]]]
        """
        xp = self.xp
        return xp.where(xp.isnan(self.scores), -xp.inf, self.scores)

    @property
    def n_cached(self) -> int:
        """Number of cached tokens (slots) per head (the most any head holds, see :attr:`positions`)."""
        return int(self.positions.shape[-1])

    @property
    def held(self) -> Array:
        """``[batch, kv_heads, n]`` bool: which slots hold a token (not a hole, position ``-1``).

        Example:
            >>> import numpy as np
            >>> CacheView(np.array([[[-1, 4, 7], [2, 4, 7]]]), np.zeros((1, 2, 3)), 8).held.tolist()
            [[[False, True, True], [True, True, True]]]
        """
        return self.positions >= 0

    @property
    def batch(self) -> int:
        return int(self.positions.shape[0])

    @property
    def heads(self) -> int:
        return int(self.positions.shape[1])

    @cached_property
    def xp(self) -> Any:
        """Array namespace of the view's arrays (``array_api_compat.numpy`` or ``.torch``).

        Read from ``positions``, so asking for it never computes deferred scores."""
        return array_namespace(self.positions)

    def arange(self, start: int, stop: int | None = None, step: int = 1) -> Array:
        """A 1-D int64 slot range on the view's device."""
        xp = self.xp
        if stop is None:
            start, stop = 0, start
        return xp.arange(start, stop, step, dtype=xp.int64, device=device(self.positions))

    def drop_lowest(self, count: int, recent: int = 0) -> Array:
        """The keep array without the ``count`` lowest :attr:`ranking_scores` among the tokens
        before the newest ``recent`` (which are all kept); of equal scores the earliest goes first.

        H2O's and TOVA's rule. ``count == 1`` (a decode step) is one ``argmin`` (the first minimum:
        the earliest of a tie), O(n); more (after a prompt) a stable ascending sort.

        Example:
            >>> import numpy as np
            >>> v = CacheView(np.arange(5)[None, None], np.array([[[3.0, 1.0, 1.0, 2.0, 0.0]]]), 5)
            >>> v.drop_lowest(1, recent=1).tolist(), v.drop_lowest(2, recent=1).tolist()
            ([[[0, 2, 3, 4]]], [[[0, 3, 4]]])
        """
        xp = self.xp
        n = self.n_cached
        candidates = n - recent
        scores = self.ranking_scores[..., :candidates]
        if count == 1:
            lowest = xp.argmin(scores, axis=-1)  # [batch, heads]
            rest = self.arange(candidates - 1)
            kept = rest + xp.astype(rest >= lowest[..., None], xp.int64)
        else:
            order = xp.argsort(scores, axis=-1, stable=True)
            kept = xp.sort(order[..., count:], axis=-1)
        return self.keep(kept, self.arange(candidates, n))

    def lowest_first(self, recent: int = 0) -> "Ranking":
        """The :class:`Ranking` of :meth:`drop_lowest`: the lowest :attr:`ranking_scores` go
        first, the earliest position of a tie first; the newest ``recent`` slots are protected.

        Example:
            >>> import numpy as np
            >>> v = CacheView(np.arange(3)[None, None], np.array([[[2.0, np.nan, 1.0]]]), 3)
            >>> r = v.lowest_first(recent=1)
            >>> r.protected.tolist(), r.keys[0].tolist()
            ([[[False, False, True]]], [[[2.0, -inf, 1.0]]])
        """
        xp = self.xp
        protected = xp.broadcast_to(self.arange(self.n_cached) >= self.n_cached - recent, self.positions.shape)
        return Ranking(protected, (self.ranking_scores, self.positions))

    def keep_where(self, kept: Array) -> Array:
        """The keep array ``[batch, heads, k]`` of the slots where ``kept`` (``[batch, heads, n]``
        bool) holds: ``k`` the most any head keeps, a head keeping fewer starting with holes
        (``-1``: head-wise budgets). Reads ``k`` on the host.

        Example:
            >>> import numpy as np
            >>> v = CacheView(np.arange(3)[None, None].repeat(2, 1), np.zeros((1, 2, 3)), 3)
            >>> v.keep_where(np.array([[[True, False, True], [False, False, True]]])).tolist()
            [[[0, 2], [-1, 2]]]
        """
        xp = self.xp
        n = self.n_cached
        widest = int(xp.max(xp.sum(xp.astype(kept, xp.int64), axis=-1)))
        slots = xp.where(kept, self.arange(n), -1)
        return xp.sort(slots, axis=-1)[..., n - widest :]

    def keep(self, *parts: Array) -> Array:
        """Concatenate slot indices into a ``[batch, heads, k]`` keep array.

        Each part is either 1-D (the same slots for every row and head) or ``[batch, heads, m]``.
        Parts must already be in ascending slot order and disjoint, in order.
        """
        xp = self.xp
        if all(part.ndim == 1 for part in parts):
            # The same slots everywhere: one 1-D concat, broadcast (a view) to [batch, heads, k],
            # so backends can see that every row and head keeps the same slots.
            flat = xp.concat([xp.astype(part, xp.int64) for part in parts], axis=-1)
            return xp.broadcast_to(flat[None, None, :], (self.batch, self.heads, flat.shape[0]))
        shaped = []
        for part in parts:
            if part.ndim == 1:
                part = xp.broadcast_to(part[None, None, :], (self.batch, self.heads, part.shape[0]))
            shaped.append(xp.astype(part, xp.int64))
        return xp.concat(shaped, axis=-1)


class DeferredScoresView(CacheView):
    """A :class:`CacheView` whose ``scores`` are computed on first read, at most once.

    :meth:`EvictionPolicy.evict` shows a shared selection this view: summing the scores over
    heads and reducing them across tensor-parallel ranks (an all-reduce) then happens only if the
    policy reads ``view.scores``, which the built-in policies do only once they have decided, from
    host integers, to evict. A policy that reads scores before deciding still gets the right
    answer; it only pays the reduction at every call.

    Args:
        positions, n_seen, state, phase: as for :class:`CacheView`.
        compute_scores: called with no arguments on the first read of ``scores``; returns the
            ``[batch, heads, n]`` scores.

    Example:
        >>> import numpy as np
        >>> calls = []
        >>> view = DeferredScoresView(np.arange(4)[None, None], lambda: calls.append(1) or np.ones((1, 1, 4)), 4)
        >>> view.n_cached, view.scores_computed
        (4, False)
        >>> float(view.scores.sum()), float(view.scores.sum()), len(calls)
        (4.0, 4.0, 1)
    """

    def __init__(
        self,
        positions: Array,
        compute_scores: Callable[[], Array],
        n_seen: int,
        state: dict[str, int] | None = None,
        phase: Literal["prefill", "decode"] = "decode",
    ) -> None:
        self._compute_scores = compute_scores
        self._scores: Array | None = None
        super().__init__(positions, None, n_seen, {} if state is None else state, phase)

    @property  # type: ignore[override]
    def scores(self) -> Array:
        if self._scores is None:
            self._scores = self._compute_scores()
        return self._scores

    @scores.setter
    def scores(self, value: Array | None) -> None:
        self._scores = value

    @property
    def scores_computed(self) -> bool:
        """Whether ``scores`` has been read (and so computed) yet."""
        return self._scores is not None

    def __repr__(self) -> str:
        return (
            f"DeferredScoresView(n_cached={self.n_cached}, n_seen={self.n_seen}, state={self.state!r}, "
            f"phase={self.phase!r}, scores_computed={self.scores_computed})"
        )


@dataclass(frozen=True)
class DecodeEviction:
    """A policy's one-token decode eviction, declared so a backend can apply it in O(1).

    Most decode-time policies evict exactly one token per decode step once their cache is full.
    Described this way, a backend needs neither an ordered view nor a keep list of the whole
    cache: it frees one slot (``kvpolicy_torch.LayerCache`` leaves every other token where it is).
    Whenever a layer holds exactly ``limit + 1`` tokens the declared eviction must keep exactly
    what :meth:`EvictionPolicy.select` keeps (and leave ``state`` alone); the conformance kit
    checks this on every policy that declares one.

    Attributes:
        limit: tokens kept after the eviction; the rule applies when a layer holds ``limit + 1``.
        victim: ``"oldest"``: the token with the smallest position among positions ``>= sink``
            (StreamingLLM, local window); ``"lowest"``: the token with the lowest accumulated
            score among all but the last ``recent`` positions, ties to the earliest position (H2O).
        sink: with ``"oldest"``, positions below ``sink`` are never the victim.
        recent: with ``"lowest"``, the ``recent`` newest tokens are never the victim.

    Example:
        >>> import numpy as np
        >>> rule = DecodeEviction(limit=3, victim="lowest", recent=1)
        >>> view = CacheView(np.array([[[0, 1, 2, 3]]]), np.array([[[5.0, 1.0, 1.0, 0.0]]]), n_seen=4)
        >>> rule.keep(view).tolist()  # ties (1.0) go to the earliest position; the newest is protected
        [[[0, 2, 3]]]
    """

    limit: int
    victim: Literal["oldest", "lowest"]
    sink: int = 0
    recent: int = 0

    def __post_init__(self) -> None:
        check_int("limit", self.limit, minimum=1)
        check_choice("victim", self.victim, ("oldest", "lowest"))
        check_int("sink", self.sink, minimum=0, maximum=self.limit - 1)
        check_int("recent", self.recent, minimum=0, maximum=self.limit - 1)
        if self.victim == "oldest" and self.recent:
            raise ValueError("recent applies to victim='lowest' only; got recent with victim='oldest'")
        if self.victim == "lowest" and self.sink:
            raise ValueError("sink applies to victim='oldest' only; got sink with victim='lowest'")

    def keep(self, view: CacheView) -> Array:
        """The keep array ``[batch, heads, limit]`` this rule implies on an ordered ``view`` of
        ``limit + 1`` tokens: the reference meaning of the rule, in the array namespace of the view."""
        n = view.n_cached
        if n != self.limit + 1:
            raise ValueError(f"the rule applies to views of limit + 1 = {self.limit + 1} tokens, got {n}")
        if self.victim == "lowest":
            return view.drop_lowest(1, self.recent)  # the first minimum: the earliest; NaN as -inf
        xp = view.xp
        # positions ascend, so the victim is the first slot at or above `sink`
        victim = xp.sum(xp.astype(view.positions < self.sink, xp.int64), axis=-1)  # [batch, heads]
        rest = view.arange(n - 1)
        return rest + xp.astype(rest >= victim[..., None], xp.int64)


class CandidateSum:
    """How a score from the cache depends on the other tokens, when it does only through a sum,
    over the candidates (the held tokens outside the newest :attr:`EvictionPolicy.key_recent`),
    of one vector per token (KeyDiff: the candidates' unit keys, whose mean is its anchor).

    A policy declares it (:attr:`EvictionPolicy.candidate_sum`) beside its
    :meth:`~EvictionPolicy.cache_score`, so a backend may keep the sum as tokens come and go and,
    at a decode step whose eviction reads only each head's lowest score, compute the score
    exactly for the few tokens whose estimate is near the lowest instead of for every held token.
    The NumPy reference never uses it (it calls ``cache_score``), so the kept tokens are the
    reference's whenever the declaration is true; ``kvpolicy.testing.check_candidate_sum`` checks
    it. Five methods on array-API arrays (``keys`` ``[..., n, d]`` of any real dtype):

    * :meth:`summand`: float64 ``[..., n, e]``, each token's vector;
    * :meth:`statistic`: what the scores read of the others, from ``total`` ``[..., e]`` (the
      candidates' summands summed) and ``count`` ``[..., 1]`` (the candidates, at least 1):
      KeyDiff's anchor, computed once a step;
    * :meth:`exact`: float64 ``[..., n]``, the tokens' scores given their ``summand`` (as
      :meth:`summand` gives it) and the ``statistic``: ``cache_score`` at every held token;
    * :meth:`estimate`: ``[..., n]``, cheaper (float32), given the ``statistic``;
    * :meth:`error`: a bound on ``|estimate - exact|`` for keys of ``head_dim``, in IEEE float32
      arithmetic (a backend rescores every token exactly wherever the estimates cannot separate
      the lowest by more than it, and does not estimate where float32 products may run in lower
      precision: a GPU's TF32).

    Example:
        >>> from kvpolicy import KeyDiff
        >>> type(KeyDiff(size=4).candidate_sum).__name__
        'UnitKeySum'
    """

    def summand(self, keys: Array) -> Array:
        raise NotImplementedError

    def statistic(self, total: Array, count: Array) -> Array:
        raise NotImplementedError

    def exact(self, keys: Array, summand: Array, statistic: Array) -> Array:
        raise NotImplementedError

    def estimate(self, keys: Array, statistic: Array) -> Array:
        raise NotImplementedError

    def error(self, head_dim: int) -> float:
        raise NotImplementedError


@dataclass(frozen=True)
class HeadwiseEviction:
    """Head-wise budgets' decode eviction (:class:`~kvpolicy.AdaKV` over a scorer that evicts its
    lowest score one token a step: H2O, TOVA, Knorm, KeyDiff, Expected Attention), declared so a
    backend can apply it as a masked write (the victims become holes where they stand) instead of
    asking :meth:`EvictionPolicy.select` and compacting the layer at every step.

    The rule: once a layer's heads keep ``limit`` tokens on average, each decode step adds one
    token to every head, and the layer sheds ``H`` (its KV heads): the ``H`` lowest over all its
    heads by (score, position, head), a NaN score counting as ``-inf``, among the held tokens
    outside the newest ``recent`` slots and outside each head's ``floor`` best by the same order.
    It applies (:meth:`applies`, host integers only) at a decode step where the heads hold
    ``limit + 1`` tokens on average, and leaves the policy's state as :meth:`state_after` says.
    There are always ``H`` such tokens (``floor <= limit`` and ``recent < limit``: each head holds
    more than ``max(floor, recent)`` tokens on average), so the rule never reaches into a floor.
    Whenever it applies it keeps exactly what ``select`` keeps; the conformance kit checks this on
    every policy that declares one.

    The state it keeps (AdaKV's): ``kept``, the tokens per head on average after the last eviction
    (``0``: none yet), and ``seen``, the tokens seen then (:meth:`mean_tokens`).

    Attributes:
        limit: tokens per head kept on average after the eviction (the scorer's ``b``).
        recent: the newest slots of a head that are never a victim (the scorer's recent window).
        floor: tokens each head keeps at least, its best by the order above.

    Example (2 heads of 4 tokens, 3 each on average before the step: head 0's two lowest go, unless its floor keeps one):
        >>> import numpy as np
        >>> rule = HeadwiseEviction(limit=3, recent=1, floor=2)
        >>> view = CacheView(np.arange(4)[None, None].repeat(2, 1), np.array([[[0.1, 0.2, 0.3, 9], [5, 6, 7, 0]]]), 4,
        ...                  {"seen": 3, "kept": 3})
        >>> rule.applies(view.n_cached, view.n_seen, view.state, "decode"), rule.keep(view).tolist()
        (True, [[[-1, -1, 2, 3], [0, 1, 2, 3]]])
        >>> HeadwiseEviction(limit=3, recent=1, floor=3).keep(view).tolist()  # head 0 keeps 3: head 1 loses its lowest
        [[[1, 2, 3], [1, 2, 3]]]
        >>> rule.state_after(view.n_seen)
        {'seen': 4, 'kept': 3}
    """

    limit: int
    recent: int = 0
    floor: int = 0

    def __post_init__(self) -> None:
        check_int("limit", self.limit, minimum=1)
        check_int("recent", self.recent, minimum=0, maximum=self.limit - 1)
        check_int("floor", self.floor, minimum=0, maximum=self.limit)

    @staticmethod
    def mean_tokens(n_cached: int, n_seen: int, state: dict[str, int]) -> int:
        """Tokens a layer holds per head on average (host integers only): ``n_cached`` until the
        first head-wise eviction (before it every head holds as many), then what it kept plus the
        tokens seen since (each decode step adds one to every head).

        Example:
            >>> HeadwiseEviction.mean_tokens(9, 12, {"seen": 0, "kept": 0}), HeadwiseEviction.mean_tokens(9, 12, {"seen": 10, "kept": 5})
            (9, 7)
        """
        if state["kept"] == 0:
            return n_cached
        return state["kept"] + n_seen - state["seen"]

    def applies(self, n_cached: int, n_seen: int, state: dict[str, int], phase: str) -> bool:
        """Whether the rule applies to a layer (host integers): a decode step at which its heads
        hold ``limit + 1`` tokens on average."""
        return phase == "decode" and self.mean_tokens(n_cached, n_seen, state) == self.limit + 1

    def state_after(self, n_seen: int) -> dict[str, int]:
        """The policy's state after the eviction, at ``n_seen`` tokens seen."""
        return {"seen": n_seen, "kept": self.limit}

    def keep(self, view: CacheView) -> Array:
        """The keep array ``[batch, heads, k]`` this rule implies on an ordered ``view`` (holes
        lead a head; ``k`` the widest head's tokens after it, a narrower head's row starting with
        ``-1``): the reference meaning of the rule, in the array namespace of the view."""
        xp = view.xp
        batch, heads, n = view.positions.shape
        held = view.held
        key = view.ranking_scores
        protected = held & xp.broadcast_to(view.arange(n) >= n - self.recent, held.shape)
        candidate = held & ~protected
        # each head's candidates in its eviction order (lowest key first, the earliest slot of a
        # tie; the other slots after them), and each slot's place in it
        order = xp.argsort(key, axis=-1, stable=True)
        order = xp.take_along_axis(order, xp.argsort(xp.astype(~xp.take_along_axis(candidate, order, axis=-1), xp.int8), axis=-1, stable=True), axis=-1)
        place = xp.argsort(order, axis=-1)
        # a head may lose its lowest `eligible` candidates: those outside its floor best
        count = xp.sum(xp.astype(held, xp.int64), axis=-1, keepdims=True)
        kept_protected = xp.sum(xp.astype(protected, xp.int64), axis=-1, keepdims=True)
        eligible = candidate & (place < count - xp.maximum(kept_protected, xp.full_like(count, self.floor)))
        # the H lowest eligible over the row's heads: by key, then position, then head (flattened head by head)
        flat = lambda x: xp.reshape(x, (batch, heads * n))  # noqa: E731
        order = xp.argsort(flat(view.positions), axis=-1, stable=True)
        for k in (flat(key), flat(xp.astype(~eligible, xp.int8))):
            order = xp.take_along_axis(order, xp.argsort(xp.take_along_axis(k, order, axis=-1), axis=-1, stable=True), axis=-1)
        victim = xp.reshape(xp.argsort(order, axis=-1) < heads, (batch, heads, n))
        return view.keep_where(held & ~victim)


class Ranking(NamedTuple):
    """The order in which a policy that ranks tokens by a score evicts one head's tokens
    (:meth:`EvictionPolicy.ranking`), so head-wise budgets (:class:`~kvpolicy.AdaKV`) can merge the
    heads of a layer into one order.

    Attributes:
        protected: ``[batch, kv_heads, n]`` bool, the tokens the policy always keeps (a recent
            window, SnapKV's observation window): they are never evicted.
        keys: ``[batch, kv_heads, n]`` arrays, compared in turn: among unprotected tokens the one
            with the smallest first key is evicted first, a tie goes to the second key, and so on.
            The last key breaks every tie within a head (e.g. the position); tokens of different
            heads equal in every key go in head order (the lower head first). A NaN counts as
            ``-inf`` (:attr:`CacheView.ranking_scores`).

    Example:
        >>> import numpy as np
        >>> from kvpolicy import H2O
        >>> view = CacheView(np.arange(4)[None, None], np.array([[[3.0, 1.0, 1.0, 2.0]]]), 4)
        >>> r = H2O(heavy=2, recent=1).ranking(view)
        >>> r.protected.tolist(), [k.tolist() for k in r.keys]
        ([[[False, False, False, True]]], [[[[3.0, 1.0, 1.0, 2.0]]], [[[0, 1, 2, 3]]]])
    """

    protected: Array
    keys: tuple[Array, ...]


@dataclass(frozen=True)
class LogNScaling:
    """BUZZ's "log n" attention (paper, section 3.5): the logits of a query that attends to ``n``
    keys are multiplied by ``max(log_base(n), floor)``.

    ``n`` is the number of entries of the query's softmax, i.e. the keys it attends to: at a
    decode step the cached keys (the new one included), for prompt row ``i`` of a one-shot
    prefill ``i + 1`` (causal). ``base`` (512) is the length at which the scale is 1.

    ``floor`` (default ``0.0``): the paper's formula as written, no floor, so a query attending to
    fewer than ``base`` keys gets *softer* attention (scale below 1; ``log_512 50 = 0.63``).
    ``floor=1.0`` is the earlier kvpolicy variant: contexts shorter than ``base`` keep ordinary
    attention (the paper's "n = 512 degrades to the traditional formula" applied below 512 too).

    Example:
        >>> round(LogNScaling().scale(64), 4)
        0.6667
        >>> LogNScaling(floor=1.0).scale(64), LogNScaling().scale(512)
        (1.0, 1.0)
    """

    base: float = 512.0
    floor: float = 0.0

    def __post_init__(self) -> None:
        check_float("log_base", self.base, low=1.0, high=math.inf, low_open=True, high_open=True)
        check_float("log_floor", self.floor, low=0.0, high=math.inf, high_open=True)

    def scale(self, n: int) -> float:
        """Scale for one query that attends to ``n >= 1`` keys (itself included)."""
        return max(math.log(max(n, 1)) / math.log(self.base), self.floor)

    def scales(self, n: Array) -> Array:
        """Vectorised :meth:`scale` for an array of key counts (NumPy or Torch)."""
        xp = array_namespace(n)
        s = xp.log(xp.astype(n, xp.float64)) / math.log(self.base)
        return xp.clip(s, min=self.floor)


#: ``rule(n_cached, state) -> n_after``: see :meth:`EvictionPolicy.size_rule`.
SizeRule = Callable[[int, dict[str, int]], int]


def keep_at_most(limit: int) -> SizeRule:
    """The size rule of a policy that cuts the cache back to ``limit`` tokens whenever it holds
    more (StreamingLLM, the local window, H2O).

    Example:
        >>> rule = keep_at_most(4)
        >>> [rule(n, {}) for n in (3, 4, 5, 9)]
        [3, 4, 4, 4]
    """
    return lambda n, state: limit if n > limit else n


#: The rules a policy declares beside :meth:`EvictionPolicy.select`, which describe what it keeps.
DECLARED_RULES = ("decode_eviction", "headwise_eviction", "size_rule", "decode_size_rule")


def check_inherited_rules(cls: type) -> None:
    """Refuse a policy class that redefines ``select`` (or ``evict``) while it inherits a
    :attr:`~EvictionPolicy.decode_eviction` or :meth:`~EvictionPolicy.size_rule` without saying so.

    Those rules describe the parent's ``select``: kept silently, backends would apply the parent's
    eviction instead of the new ``select`` (and the planner its sizes); dropped silently, the
    subclass would lose its O(1) decode eviction and exact planning without a word. So the class
    says which: its own rule, the parent's (``decode_eviction = H2O.decode_eviction``), or none
    (``decode_eviction = None``, ``size_rule = None``: backends call ``select`` at every step and
    the planner replays it, which is exact for any policy, only slower). A ``TypeError`` at class
    creation otherwise. :class:`EvictionPolicy` runs it on every subclass.

    Example:
        >>> from kvpolicy import H2O
        >>> class Mine(H2O):
        ...     def select(self, view):
        ...         return super().select(view)
        Traceback (most recent call last):
        ...
        TypeError: Mine redefines select, so the decode_eviction and size_rule it inherits from H2O may no longer describe what it keeps: declare its own, keep H2O's (decode_eviction = H2O.decode_eviction) or go without (decode_eviction = None, size_rule = None: backends then call select at every step and the planner replays it)
        >>> class Mine(H2O):
        ...     decode_eviction = size_rule = None
        ...     def select(self, view):
        ...         return super().select(view)
        >>> Mine(2, 2).decode_eviction, Mine(2, 2).size_rule(), H2O(2, 2).decode_eviction.limit
        (None, None, 4)
    """
    redefined = [m for m in ("select", "evict") if m in cls.__dict__]
    if not redefined:
        return
    missing = []
    for attr in DECLARED_RULES:
        if attr in cls.__dict__:
            continue
        inherited = getattr(cls, attr)  # the property or method object, from the nearest base
        if inherited is not None and inherited is not EvictionPolicy.__dict__[attr]:
            missing.append(attr)
    if missing:
        owner = cls.__mro__[1].__name__
        raise TypeError(
            f"{cls.__name__} redefines {' and '.join(redefined)}, so the {' and '.join(missing)} it inherits from {owner} "
            f"may no longer describe what it keeps: declare its own, keep {owner}'s ({missing[0]} = {owner}.{missing[0]}) "
            f"or go without ({', '.join(f'{a} = None' for a in missing)}: backends then call select at every step and "
            "the planner replays it)"
        )


def _no_decode_size_rule(self: "EvictionPolicy") -> None:
    """What ``decode_size_rule = None`` in a class body declares: no decode size rule."""
    return None


class EvictionPolicy(ABC):
    """Base class of every KV-cache eviction policy.

    Subclasses set :attr:`name`, implement :attr:`capacity` and :meth:`select`, and may override
    :meth:`init_state`, :meth:`params` and :meth:`from_size`. Backends call :meth:`evict`, which
    handles the per-head / shared selection choice, after every append, repeatedly until it
    returns ``None``.

    Args:
        selection: ``"per_head"`` (default) lets every KV head keep its own tokens;
            ``"shared"`` sums the scores over heads and keeps the same tokens on all of them.

    Example:
        >>> from kvpolicy import StreamingLLM
        >>> p = StreamingLLM(sink=4, window=60)
        >>> p.capacity
        65
    """

    #: Registry name, e.g. ``"buzz"``; also the CLI name.
    name: ClassVar[str] = ""
    #: Whether the policy reads scores at all (lets backends skip score capture for e.g. local).
    uses_scores: ClassVar[bool] = True
    #: Positions mode the HF integration uses unless told otherwise: ``"original"`` keeps the
    #: RoPE position a key was computed at, ``"cache"`` re-rotates keys to their slot index.
    default_positions: ClassVar[Literal["original", "cache"]] = "original"

    #: How the attention a token receives updates its score (what ``view.scores`` holds).
    #: ``"accumulate"`` (default; H2O, BUZZ): it is added, so a score is the sum over every query
    #: so far. ``"latest"`` (TOVA): it replaces the score, so a score is the latest query's
    #: (or prompt chunk's, see :attr:`prompt_rows`). Either way summed over the query heads of a
    #: KV head. Every backend applies it (the NumPy reference, the conformance kit,
    #: ``kvpolicy_torch.LayerCache.accumulate``). ``"key_norm"`` (Knorm) and ``"key_diff"``
    #: (KeyDiff) come from the cached keys instead, ``"expected_attention"`` from the cached keys
    #: and values and the queries' moments, recomputed by the backend before every eviction
    #: decision (:func:`kvpolicy.statistics.cache_scores`); received attention is ignored.
    score_statistic: ClassVar[ScoreStatistic] = "accumulate"
    #: For ``score_statistic = "low_history"`` (Scissorhands): the queries a token's record of
    #: low-attention events covers (:mod:`kvpolicy.statistics`); ``None`` otherwise.
    score_history: ClassVar[int | None] = None

    #: Optional log-n logit scaling (BUZZ with log n); ``None`` means plain attention.
    log_n: LogNScaling | None = None

    #: The parameters the class declares (:class:`~kvpolicy.Param`), bases first: the constructor,
    #: :meth:`params` (so ``repr``, ``==`` and ``hash``) and validation are derived from them.
    parameters: ClassVar[tuple[Param, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.parameters = declared_params(cls)
        if cls.parameters and "__init__" not in cls.__dict__:
            cls.__init__ = make_init(cls, cls.parameters, EvictionPolicy.__init__)  # type: ignore[method-assign]
        if cls.__dict__.get("size_rule", EvictionPolicy.size_rule) is None:  # `size_rule = None`: none, explicitly
            cls.size_rule = EvictionPolicy.size_rule  # type: ignore[method-assign]
        if "decode_size_rule" in cls.__dict__ and cls.__dict__["decode_size_rule"] is None:  # (likewise)
            cls.decode_size_rule = _no_decode_size_rule  # type: ignore[method-assign]
        check_inherited_rules(cls)
        # a score from the cache is declared by the policy itself, or no backend could compute it
        statistic = cls.__dict__.get("score_statistic", None)
        if statistic in KEY_STATISTICS and cls.cache_score is EvictionPolicy.cache_score:
            raise TypeError(
                f"{cls.__name__} declares score_statistic = {statistic!r} (a score from the cache): define "
                "cache_score(self, tokens) returning each cached token's score (docs/extending.md)"
            )
        # And its ranking (head-wise budgets): the parent's order describes the parent's select().
        if "select" in cls.__dict__ and not {"ranking", "head_budget"} & set(cls.__dict__):
            cls.ranking = EvictionPolicy.ranking  # type: ignore[method-assign]
            cls.head_budget = EvictionPolicy.head_budget  # type: ignore[method-assign]

    def cache_score(self, tokens: CachedTokens) -> Array:
        """Each cached token's score, for a policy whose :attr:`score_statistic` comes from the
        cache (:data:`KEY_STATISTICS`): the one method a new scorer defines, on array-API arrays
        (``array_namespace(tokens.keys)``), so it runs on every backend, eager and compiled.

        ``tokens`` (:class:`kvpolicy.statistics.CachedTokens`) holds the cached keys
        ``[..., n, d]`` and values, their positions ``[..., n]`` (``-1`` at a hole or pad), the
        tokens seen and the queries' moments where the policy observes queries. Return a real
        array ``[..., n]``: higher is kept (:class:`~kvpolicy.policies.lowest.KeepHighest` keeps the
        highest); holes become ``+inf`` whatever it returns. Called before every eviction decision.

        Example:
            >>> import numpy as np
            >>> from kvpolicy import Knorm
            >>> from kvpolicy.statistics import CachedTokens
            >>> keys = np.array([[[3.0, 4.0], [1.0, 0.0]]])  # [heads, n, d]
            >>> Knorm(size=1).cache_score(CachedTokens(keys, None, np.arange(2)[None], 2)).tolist()
            [[-5.0, -1.0]]
        """
        raise NotImplementedError(
            f"{type(self).__name__} has score_statistic {self.score_statistic!r}, computed from the cache: "
            "define cache_score(self, tokens) returning each cached token's score"
        )

    @property
    def captures_attention(self) -> bool:
        """Whether backends must capture the attention each cached token receives for this
        policy: it reads scores (:attr:`uses_scores`) and they come from attention, not from the
        cached keys (:data:`KEY_STATISTICS`). ``False``: decode can take plain SDPA (or flash
        attention) with no score capture.

        Example:
            >>> from kvpolicy import H2O, StreamingLLM
            >>> H2O(heavy=2, recent=2).captures_attention, StreamingLLM(sink=1, window=2).captures_attention
            (True, False)
        """
        return self.uses_scores and self.score_statistic not in KEY_STATISTICS and not self.needs_reconstruction

    @property
    def needs_reconstruction(self) -> bool:
        """Whether the policy's scores come from a context-reconstruction pass after the prompt
        (:data:`RECONSTRUCTION`, KVzip): a backend asks it once, after that pass, and never while
        the prompt is appended.

        Example:
            >>> from kvpolicy import KVzip, SnapKV, prefill_only
            >>> KVzip(size=8).needs_reconstruction, prefill_only(KVzip(size=8), 0.5).needs_reconstruction
            (True, True)
            >>> SnapKV(size=64).needs_reconstruction, KVzip(size=8).captures_attention
            (False, False)
        """
        return self.uses_scores and self.score_statistic == RECONSTRUCTION

    @property
    def observes_queries(self) -> bool:
        """Whether the policy's scores come from the queries a layer has seen as well as from its
        cache (Expected Attention's moments of the queries): a backend hands it every query
        (``LayerCache.observe_queries``), so a cache built from recorded keys and scores alone
        cannot serve it.

        Example:
            >>> from kvpolicy import ExpectedAttention, Knorm
            >>> ExpectedAttention(size=8).observes_queries, Knorm(size=8).observes_queries
            (True, False)
        """
        return self.uses_scores and self.score_statistic == "expected_attention"

    @property
    def statistic_policy(self) -> "EvictionPolicy":
        """The policy whose parameters configure the score statistic the backends compute (e.g.
        Expected Attention's ``sink`` and ``future``): itself, or the policy a
        :class:`WrappingPolicy` wraps (an :class:`~kvpolicy.AdaKV` scorer)."""
        return self

    @property
    def rule_policy(self) -> "EvictionPolicy":
        """The policy whose rule this one applies to its scores (``select``, ``ranking``,
        ``head_budget``, ``decode_eviction``): itself, or for a policy that changes only the scores
        and hands the rest to a scorer (:class:`~kvpolicy.CriticalKV`) that scorer's. AdaKV reads
        it to know whether its head-wise decode rule holds over a scorer.

        Example:
            >>> from kvpolicy import CriticalKV, Knorm
            >>> Knorm(size=8).rule_policy, CriticalKV(Knorm(size=8)).rule_policy
            (Knorm(size=8, recent=0), Knorm(size=8, recent=0))
        """
        return self

    #: For a key statistic (:data:`KEY_STATISTICS`): the newest tokens that are no candidates of
    #: the statistic (KeyDiff's anchor is the mean over the candidates' keys only). ``0``: all.
    key_recent: int = 0
    #: For a score from the cache (:meth:`cache_score`): ``True`` declares that a token's score
    #: depends on that token alone (its key, value and position: Knorm's key norm), never on the
    #: other tokens, the tokens seen or the queries. A backend then scores each decode token
    #: once, when it is cached, and keeps the score, as it keeps accumulated attention, instead
    #: of rescoring every held token before each decision
    #: (:func:`kvpolicy.statistics.scored_once`). ``False`` (default): rescored every time
    #: (KeyDiff's anchor, Expected Attention's moments change at every step). The NumPy reference
    #: rescores every time either way, so the conformance kit fails a wrong declaration.
    score_once: ClassVar[bool] = False
    #: For a score from the cache that depends on the other tokens only through a sum over the
    #: candidates (KeyDiff's anchor): the declared decomposition (:class:`CandidateSum`), which lets
    #: a backend keep the sum from step to step and rescore exactly only the tokens near the lowest
    #: at a decode step. ``None`` (default): rescored in full. The reference ignores it.
    candidate_sum: ClassVar[CandidateSum | None] = None

    @property
    def prompt_rows(self) -> int | None:
        """Which rows of a prompt (chunk) score it: ``None`` (default): every row, summed; ``k``:
        only its last ``k`` rows (TOVA: 1, the latest query; SnapKV: its observation window).
        Applied by every backend (``kvpolicy_torch.received_attention(rows=)`` for prompts)."""
        return 1 if self.score_statistic == "latest" else None

    @property
    def decode_eviction(self) -> DecodeEviction | None:
        """The policy's one-token decode eviction, if it has one (see :class:`DecodeEviction`):
        backends may then apply it in O(1) instead of calling :meth:`select`. ``None``
        (default): backends always call :meth:`select`. Every built-in that evicts one token a
        decode step declares one (:class:`~kvpolicy.policies.lowest.KeepAtMost` derives it from
        the policy's rule); a subclass that redefines ``select`` says whether it keeps its
        parent's (:func:`check_inherited_rules`)."""
        return None

    @property
    def headwise_eviction(self) -> HeadwiseEviction | None:
        """Head-wise budgets' decode eviction, if the policy has one (see :class:`HeadwiseEviction`):
        backends may then apply it as a masked write instead of calling :meth:`select` (and
        compacting) at every decode step. ``None`` (default): backends call :meth:`select`.
        :class:`~kvpolicy.AdaKV` declares one over a scorer that evicts its lowest score one token
        a step; a subclass that redefines ``select`` says whether it keeps its parent's
        (:func:`check_inherited_rules`)."""
        return None

    # ----------------------------------------------------------------- ranking (head-wise budgets)
    def head_budget(self, n_cached: int, phase: Literal["prefill", "decode"]) -> int | None:
        """For head-wise budgets (:class:`~kvpolicy.AdaKV`): the tokens each head keeps if the
        policy evicts when every head holds ``n_cached`` tokens in ``phase``, or ``None`` when it
        declines (host integers only). Declared with :meth:`ranking` by the policies that keep a
        head's highest-ranked tokens (H2O, TOVA, Knorm, KeyDiff, SnapKV); ``select`` then keeps
        the ``head_budget`` tokens of each head that :meth:`ranking` evicts last. Default: ``None``
        (the policy is no scorer; AdaKV refuses it).

        Example:
            >>> from kvpolicy import H2O
            >>> H2O(heavy=2, recent=2).head_budget(5, "decode"), H2O(heavy=2, recent=2).head_budget(4, "decode")
            (4, None)
        """
        return None

    def ranking(self, view: CacheView) -> Ranking:
        """For head-wise budgets: the order in which this policy evicts each head's tokens
        (:class:`Ranking`), on ``view`` (holes, position ``-1``, may lead a head: their keys are
        ignored; a score-reading policy sees them with score 0). Declared with :meth:`head_budget`.

        ``NotImplementedError`` for a policy that does not rank tokens by a score."""
        raise NotImplementedError(f"{self!r} does not rank tokens by a score (it declares no ranking())")

    @property
    def ranks_tokens(self) -> bool:
        """Whether the policy declares :meth:`ranking` and :meth:`head_budget` (it can be an
        :class:`~kvpolicy.AdaKV` scorer).

        Example:
            >>> from kvpolicy import BUZZ, H2O
            >>> H2O(heavy=2, recent=2).ranks_tokens, BUZZ(sink=1, window=4, stride=3).ranks_tokens
            (True, False)
        """
        cls = type(self)
        return cls.ranking is not EvictionPolicy.ranking and cls.head_budget is not EvictionPolicy.head_budget

    #: ``True`` for head-wise budgets (:class:`~kvpolicy.AdaKV`): a layer's heads may hold different
    #: numbers of tokens, so ``select`` may return rows that start with holes (``-1``) and views
    #: may show them; backends then count a row's slots as its widest head's.
    ragged_heads: ClassVar[bool] = False

    #: ``True`` for a head-wise policy deciding for one process's share of a layer whose KV heads
    #: are split over processes (:class:`~kvpolicy.policies.ShardedAdaKV`, tensor parallelism): its heads
    #: may keep every token in a round that evicts on another process's heads, and hold more than
    #: the layer's capacity per head on average (the capacity bounds the mean over *all* the
    #: layer's heads, which no one process holds). The eviction loop's checks allow both.
    sharded_heads: ClassVar[bool] = False

    #: ``False`` for a policy that never evicts (the full cache): the planners give it budget 1
    #: and refuse a capacity, and eval runs it once, as the reference line, not per budget.
    evicts: ClassVar[bool] = True

    def size_rule(self) -> SizeRule | None:
        """The policy's size rule, if it declares one: ``rule(n_cached, state) -> n_after``, the
        cache size after evicting until done from ``n_cached`` tokens, on host integers, updating
        ``state`` as :meth:`select` would. The budget planner (:func:`kvpolicy.simulate_sizes`)
        uses it instead of replaying :meth:`evict` on placeholder arrays, and the torch backend
        skips asking :meth:`evict` at a decode step where the rule keeps every token (a policy
        without a :class:`DecodeEviction`, such as BUZZ, is asked at every step otherwise); ``None``
        (default) means the planner replays, which is exact for any policy, only slower. A policy whose sizes
        depend on more than the count and its state leaves it ``None`` (or writes ``size_rule =
        None``); a subclass that redefines ``select`` or ``evict`` says whether it keeps its
        parent's rule (:func:`check_inherited_rules`). Tests hold each rule to the replay.

        Example:
            >>> from kvpolicy import StreamingLLM
            >>> rule = StreamingLLM(sink=1, window=2).size_rule()
            >>> rule(3, {}), rule(4, {})
            (3, 3)
        """
        return None

    def decode_size_rule(self) -> SizeRule | None:
        """The size rule of a decode step: ``rule(n_cached, state) -> n_after`` after a decode
        step brought the cache to ``n_cached`` tokens, on host integers, updating ``state`` as
        :meth:`select` would; by default :meth:`size_rule` (a rule of both phases). A policy that
        evicts a prompt otherwise than its decode steps, and so declares no :meth:`size_rule`,
        may declare this one alone: SnapKV never evicts at a decode step, a composition's decode
        steps are its decode policy's. The torch backend skips asking :meth:`evict` at a decode
        step where it keeps every token (asking took snapkv_buzz ~35 us a layer and step more, on
        SmolLM2-135M's shapes); the conformance kit holds it to
        ``select`` (:func:`kvpolicy.testing.check_sizes`). ``decode_size_rule = None``: none.

        Example:
            >>> from kvpolicy import BUZZ, SnapKV, compose
            >>> SnapKV(size=8, window=2).size_rule() is None, SnapKV(size=8, window=2).decode_size_rule()(50, {})
            (True, 50)
            >>> rule = compose(prefill=SnapKV(size=8, window=2), decode=BUZZ(sink=1, window=2, stride=3, threshold=6)).decode_size_rule()
            >>> rule(8, {"decode.n_old": 0}), rule(9, {"decode.n_old": 0})  # (BUZZ's middle reaches 6 at 9 tokens)
            (8, 5)
        """
        return self.size_rule()

    #: The ``selection`` a policy declaring :class:`~kvpolicy.Param` s gets when none is given (its
    #: derived constructor's default): ``"per_head"`` for every built-in but TOVA, whose paper
    #: averages the attention over a layer's heads (``"shared"``).
    default_selection: ClassVar[Selection] = "per_head"

    def __init__(self, *, selection: Selection = "per_head") -> None:
        self.selection: Selection = check_choice("selection", selection, ("per_head", "shared"))  # type: ignore[assignment]

    # ----------------------------------------------------------------- the contract
    @property
    @abstractmethod
    def capacity(self) -> int | None:
        """Most tokens one layer's cache ever holds per head, during a decode step's attention
        included (``None``: unbounded). A prefill chunk adds its own length transiently."""

    @abstractmethod
    def select(self, view: CacheView) -> Array | None:
        """Slots to keep, ``[batch, heads, k]`` int64 ascending, or ``None`` to keep everything.

        Must return ``None`` once the cache satisfies the policy, since backends call it
        repeatedly after each append until it does. Must decide *whether* to evict from host
        integers only (``view.n_cached``, ``view.n_seen``, ``view.state``).
        """

    def init_state(self) -> dict[str, int]:
        """Fresh per-layer state (host ints). Default: none."""
        return {}

    def for_layer(self, layer: int, layers: int) -> "EvictionPolicy":
        """The policy layer ``layer`` (of ``layers``) of a model runs; caches ask once per layer.
        ``self`` unless the policy gives layers their own budgets (:class:`~kvpolicy.PyramidKV`).

        Example:
            >>> from kvpolicy import H2O
            >>> p = H2O(heavy=8, recent=8)
            >>> p.for_layer(3, 30) is p
            True
        """
        return self

    def params(self) -> dict[str, Any]:
        """The policy's parameters, as passed to its constructor (``selection`` apart): by default
        the declared ones (:attr:`parameters`) that are shown."""
        out = {}
        for p in self.parameters:
            value = self.__dict__[p.attribute]
            if p.is_shown(self, value):
                out[p.keyword] = value
        return out

    @classmethod
    def from_size(cls, size: int, **overrides: Any) -> "EvictionPolicy":
        """Build the policy whose steady cache size grows with ``size`` (used by budgets).

        Subclasses that support budgets override this; ``size`` is about the number of tokens kept.
        """
        raise ValueError(f"policy {cls.name!r} has no size knob, so budgets cannot be planned for it")

    #: Smallest ``size`` :meth:`from_size` accepts.
    min_size: ClassVar[int] = 1

    # ----------------------------------------------------------------- backend entry point
    def evict(
        self,
        view: CacheView,
        reduce_scores: Callable[[Array], Array] | None = None,
    ) -> Array | None:
        """Run one eviction decision; backends call this, not :meth:`select`.

        With ``selection="shared"`` the policy decides on a :class:`DeferredScoresView` of one
        head: its scores, summed over heads and passed through ``reduce_scores`` (e.g. an
        all-reduce across tensor-parallel ranks), are computed only if :meth:`select` reads
        them, i.e. only in a round that evicts. The chosen slots are broadcast to every head. A
        policy that reads no scores (``uses_scores = False``) keeps the same slots on every head
        either way, so its shared selection *is* its per-head selection.

        Example (the all-reduce stand-in runs only in the round that evicts):
            >>> import numpy as np
            >>> from kvpolicy import H2O
            >>> p, calls = H2O(heavy=2, recent=2, selection="shared"), []
            >>> def reduce(s):
            ...     calls.append(s.shape)
            ...     return s
            >>> view = lambda n: CacheView(np.arange(n)[None, None].repeat(2, 1), np.ones((1, 2, n)), n)
            >>> p.evict(view(4), reduce) is None, calls
            (True, [])
            >>> p.evict(view(5), reduce).shape, calls
            ((1, 2, 4), [(1, 1, 5)])
        """
        if self.selection == "per_head" or not self.uses_scores:
            return self.select(view)
        xp = view.xp

        def shared_scores() -> Array:
            summed = xp.sum(view.scores, axis=1, keepdims=True)
            return reduce_scores(summed) if reduce_scores is not None else summed

        shared = DeferredScoresView(view.positions[:, :1, :], shared_scores, view.n_seen, view.state, view.phase)
        keep = self.select(shared)
        if keep is None:
            return None
        return xp.broadcast_to(keep, (view.batch, view.heads, keep.shape[-1]))

    # ----------------------------------------------------------------- niceties
    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        # named when not per_head, and always for a class whose default is another (TOVA)
        if self.selection != "per_head" or type(self).default_selection != "per_head":
            args = f"{args}, selection={self.selection!r}" if args else f"selection={self.selection!r}"
        return f"{type(self).__name__}({args})"

    def __eq__(self, other: object) -> bool:
        return (
            type(self) is type(other)
            and self.params() == other.params()  # type: ignore[attr-defined]
            and self.selection == other.selection  # type: ignore[attr-defined]
        )

    def __hash__(self) -> int:
        return hash((type(self).__name__, tuple(sorted(self.params().items())), self.selection))


class WrappingPolicy(EvictionPolicy):
    """A policy built around another (:attr:`wrapped`) whose scores the backends keep as that
    one's: its score statistic, history, key window, prompt rows, positions mode, ragged heads
    and capacity are the wrapped policy's (one place, for :class:`~kvpolicy.Composed`'s decode
    policy, :class:`~kvpolicy.PyramidKV`'s mean layer and :class:`~kvpolicy.AdaKV`'s scorer). A
    subclass sets :attr:`wrapped` in its constructor and overrides what differs.

    Example:
        >>> from kvpolicy import AdaKV, KeyDiff
        >>> p = AdaKV(KeyDiff(size=8, recent=2))
        >>> isinstance(p, WrappingPolicy), p.score_statistic, p.key_recent, p.capacity
        (True, 'key_diff', 2, 9)
    """

    wrapped: EvictionPolicy

    @property  # type: ignore[override]
    def score_statistic(self) -> ScoreStatistic:
        return self.wrapped.score_statistic

    @property
    def statistic_policy(self) -> EvictionPolicy:
        return self.wrapped.statistic_policy

    @property  # type: ignore[override]
    def score_history(self) -> int | None:
        return self.wrapped.score_history

    @property  # type: ignore[override]
    def key_recent(self) -> int:
        return self.wrapped.key_recent

    @property
    def prompt_rows(self) -> int | None:
        return self.wrapped.prompt_rows

    @property  # type: ignore[override]
    def ragged_heads(self) -> bool:
        return self.wrapped.ragged_heads

    @property  # type: ignore[override]
    def uses_scores(self) -> bool:
        return self.wrapped.uses_scores

    @property  # type: ignore[override]
    def default_positions(self) -> str:
        return self.wrapped.default_positions

    @property
    def capacity(self) -> int | None:
        return self.wrapped.capacity


def check_eviction_policy(name: str, value: object) -> EvictionPolicy:
    """Return ``value`` if it is an :class:`~kvpolicy.EvictionPolicy` instance, else raise
    ``ValueError`` naming ``name`` (and saying how to build one from a registered name)."""
    if isinstance(value, EvictionPolicy):
        return value
    hint = ""
    if isinstance(value, str):
        hint = f"; build one by name with kvpolicy.create_policy({value!r}, ...) or kvpolicy.make_policy({value!r}, budget, ...)"
    elif isinstance(value, type) and issubclass(value, EvictionPolicy):
        hint = f"; instantiate the class first, e.g. {value.__name__}(...)"
    raise ValueError(f"{name} must be an EvictionPolicy instance (e.g. kvpolicy.BUZZ()), got {value!r}{hint}")
