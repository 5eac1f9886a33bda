"""The rule H2O, TOVA, StreamingLLM, the local window, Knorm, KeyDiff and Expected Attention
share: keep at most ``limit`` tokens; while the cache holds more, the lowest-ranked token goes
(the lowest score outside a recent window, or the oldest position after the sinks). Each of them states its rule
once (:attr:`KeepAtMost.rule`) and declares only its parameters and where its scores come from.
"""

from __future__ import annotations

from abc import abstractmethod
from functools import cached_property
from typing import Any

from ..params import Param
from ..policy import Array, CacheView, DecodeEviction, EvictionPolicy, Ranking, SizeRule, keep_at_most


class KeepAtMost(EvictionPolicy):
    """Keep at most ``rule.limit`` tokens: while the cache holds more, evict its lowest-ranked
    tokens, all of them in one decision (a prompt) or one a step (decode).

    A subclass states its rule once, as a :class:`~kvpolicy.DecodeEviction` (:attr:`rule`): the
    tokens kept (``limit``), what ranks them (``victim``: ``"lowest"``, the score the policy's
    :attr:`~kvpolicy.EvictionPolicy.score_statistic` computes, NaN as ``-inf``, ties to the
    earliest position; ``"oldest"``: the position, for a policy that reads no scores) and the
    tokens never evicted (``recent`` newest with a score, ``sink`` first with positions). From it
    the base derives :attr:`capacity` (``limit + 1``: the new token before the eviction),
    :meth:`select` (the rule repeated until ``limit`` tokens remain: scores do not change between
    the evictions of one step, so that is one stable sort, or slot ranges for ``"oldest"``),
    :attr:`decode_eviction` (the rule itself, applied in O(1) by the backends) and
    :meth:`size_rule` (:func:`~kvpolicy.policy.keep_at_most`). A subclass adds its parameters
    (:class:`~kvpolicy.Param`), :meth:`from_size` and, if its scores are not accumulated
    attention, its statistic.

    Example:
        >>> from kvpolicy import H2O, StreamingLLM
        >>> p = H2O(heavy=2, recent=1)
        >>> p.rule, p.capacity, p.decode_eviction is p.rule, p.size_rule()(5, {})
        (DecodeEviction(limit=3, victim='lowest', sink=0, recent=1), 4, True, 3)
        >>> StreamingLLM(sink=1, window=2).rule
        DecodeEviction(limit=3, victim='oldest', sink=1, recent=0)
    """

    @property
    @abstractmethod
    def rule(self) -> DecodeEviction:
        """The policy's rule: tokens kept, what ranks them and what is never evicted. Subclasses
        define it as a ``functools.cached_property`` (parameters do not change after
        construction, and ``select`` reads it at every call)."""

    @property
    def capacity(self) -> int:
        return self.rule.limit + 1

    def select(self, view: CacheView) -> Array | None:
        rule, n = self.rule, view.n_cached
        if n <= rule.limit:
            return None
        if rule.victim == "lowest":
            # the lowest scores outside the recent window go, the earliest of a tie first
            return view.drop_lowest(n - rule.limit, rule.recent)
        # the oldest after the sinks go: the sinks and the newest limit - sink stay (the same
        # slots on every row and head, so 1-D parts)
        newest = view.arange(n - (rule.limit - rule.sink), n)
        return view.keep(view.arange(rule.sink), newest) if rule.sink else view.keep(newest)

    @property
    def decode_eviction(self) -> DecodeEviction:
        return self.rule

    def size_rule(self) -> SizeRule:
        return keep_at_most(self.rule.limit)

    # head-wise budgets (AdaKV): a "lowest" rule ranks a head's tokens by score
    def head_budget(self, n_cached: int, phase: str) -> int | None:
        rule = self.rule
        return rule.limit if rule.victim == "lowest" and n_cached > rule.limit else None

    def ranking(self, view: CacheView) -> Ranking:
        if self.rule.victim != "lowest":
            raise NotImplementedError(f"{self!r} keeps positions, not scores: it ranks no tokens")
        # select's order: the lowest score goes first, the earliest of a tie; the recent window stays
        return view.lowest_first(self.rule.recent)

    @property
    def ranks_tokens(self) -> bool:
        return self.rule.victim == "lowest" and super().ranks_tokens


class KeepHighest(KeepAtMost):
    """Keep ``size`` tokens: while the cache holds more, evict the token with the lowest score
    outside the newest ``recent`` (ties: the earliest position; a NaN score counts as ``-inf``).
    One token per decode step (the declared :class:`~kvpolicy.DecodeEviction`); after a prompt
    longer than ``size``, the ``size`` highest scores in one decision. Not registered: the
    policies built on it (TOVA, Knorm, KeyDiff, Expected Attention) say what a score is.

    Example:
        >>> from kvpolicy import Knorm
        >>> isinstance(Knorm(size=4), KeepHighest), Knorm(size=4).decode_eviction.limit
        (True, 4)
    """

    size = Param(int, minimum=1, doc="tokens kept")
    recent = Param(int, 0, minimum=0, maximum=lambda p: p.size - 1, doc="most recent tokens always kept (0: none)")

    @cached_property
    def rule(self) -> DecodeEviction:
        return DecodeEviction(limit=self.size, victim="lowest", recent=self.recent)

    min_size = 1

    @classmethod
    def from_size(cls, size: int, **overrides: Any) -> "KeepHighest":
        return cls(size=size, **overrides)
