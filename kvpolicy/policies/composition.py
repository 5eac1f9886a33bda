"""Composition: a prefill policy (e.g. SnapKV) followed by a decode policy (e.g. BUZZ, H2O)."""

from __future__ import annotations

from typing import Any

from ..policy import KEY_STATISTICS, Array, CacheView, DecodeEviction, DeferredScoresView, EvictionPolicy, LogNScaling, ScoreStatistic, SizeRule, WrappingPolicy
from ..registry import get_policy, register_policy

__all__ = ["Composed", "compose"]


def _sub_view(view: CacheView, state: dict[str, int]) -> CacheView:
    """``view`` with another ``state`` dict; scores stay deferred (read only if the policy does)."""
    return DeferredScoresView(view.positions, lambda: view.scores, view.n_seen, state, view.phase)


@register_policy
class Composed(WrappingPolicy):
    """A prefill policy, then a decode policy, on one cache.

    Right after a prompt (chunk) that leaves more than ``decode.capacity - 1`` tokens, the
    ``prefill`` policy evicts (repeatedly, until it declines); then, still after the prompt, the
    ``decode`` policy applies its own rule (so its bound holds from the first decode step); every
    decode step is the ``decode`` policy's alone. Scores: a prompt is scored as the prefill
    policy scores one (its ``prompt_rows``, e.g. SnapKV's observation window), decode steps update
    them as the decode policy does (its ``score_statistic``). Attention scaling (log n) and the
    positions mode are the decode policy's. Both must use the same ``selection``. Each keeps its
    own state (``prefill.`` / ``decode.`` prefixed keys in the layer's state).

    Parameters:
        prefill: the policy applied right after a prompt (e.g. :class:`~kvpolicy.SnapKV`).
        decode: the policy applied after the prefill policy and at every decode step.

    Registered presets (planned like any policy: ``make_policy("snapkv_buzz", 0.3, ...)``):
    ``snapkv_buzz``, ``snapkv_h2o``, ``snapkv_tova``; :meth:`from_size` plans the decode policy for
    the size and gives SnapKV a ``size`` of the decode policy's ``capacity - 1``.

    Example:
        >>> from kvpolicy import H2O, SnapKV, compose
        >>> p = compose(prefill=SnapKV(size=64, window=16), decode=H2O(heavy=32, recent=32))
        >>> p.capacity, p.prompt_rows, p.decode_eviction.victim
        (65, 16, 'lowest')
    """

    name = "compose"

    def __init__(self, prefill: EvictionPolicy, decode: EvictionPolicy) -> None:
        for label, p in (("prefill", prefill), ("decode", decode)):
            if not isinstance(p, EvictionPolicy):
                raise ValueError(
                    f"{label} must be an EvictionPolicy instance (e.g. SnapKV(size=64)), got {p!r}; to plan one "
                    "from a budget use make_policy('snapkv_buzz', budget, ...)"
                )
        if prefill.selection != decode.selection:
            raise ValueError(
                f"prefill and decode must use the same selection, got {prefill.selection!r} and {decode.selection!r}"
            )
        statistics = {p.score_statistic for p in (prefill, decode) if p.uses_scores}
        if "low_history" in statistics and len(statistics) > 1:
            # one score per token serves both: Scissorhands' records cannot be another policy's sums
            raise ValueError(
                f"prefill and decode must keep the same kind of score: {prefill!r} and {decode!r} do not (a "
                "Scissorhands record of low-attention events cannot serve a policy that ranks attention)"
            )
        if "reconstruction" in statistics and len(statistics) > 1:
            # KVzip's scores exist once, after the prompt's reconstruction: no decode step updates them
            raise ValueError(
                f"prefill and decode must keep the same kind of score: {prefill!r} and {decode!r} do not (a context "
                "reconstruction's scores, KVzip's, come once after the prompt and cannot serve a policy that ranks "
                "attention or keys)"
            )
        if len(statistics) > 1 and statistics & set(KEY_STATISTICS):
            # one score per token serves both: scores from keys are recomputed before each decision
            raise ValueError(
                f"prefill and decode must keep the same kind of score: {prefill!r} and {decode!r} do not (scores "
                "computed from the keys, Knorm's or KeyDiff's, cannot serve a policy that ranks attention)"
            )
        same_statistic = prefill.uses_scores and decode.uses_scores and prefill.score_statistic == decode.score_statistic
        if same_statistic and (prefill.key_recent, prefill.score_history) != (decode.key_recent, decode.score_history):
            # the backends compute one statistic per layer, with one anchor window / one history
            raise ValueError(
                f"prefill and decode must compute their {prefill.score_statistic!r} scores alike: {prefill!r} and "
                f"{decode!r} differ in key_recent ({prefill.key_recent} vs {decode.key_recent}) or score_history "
                f"({prefill.score_history} vs {decode.score_history}); give both the same recent/history"
            )
        if prefill.ragged_heads:
            # its heads leave the prompt holding different numbers of tokens (holes): only AdaKV's
            # own rule reads such a layer, and a fresh AdaKV would take the widest head for the mean
            raise ValueError(
                f"prefill must keep the same number of tokens on every head, got the head-wise {prefill!r}: AdaKV is "
                "supported as the decode policy (compose(prefill=SnapKV(...), decode=AdaKV(...))), and compressing "
                "the prompt once with it, keeping every later token, is kvpolicy.prefill_only(AdaKV(...), "
                "compression_ratio)"
            )
        if "expected_attention" in statistics:
            # its scores are computed by the backend with its own parameters (sink, future, ...),
            # which a composition would have to choose between
            raise ValueError(
                f"Expected Attention cannot be composed (its scores come from its own parameters and the queries' "
                f"statistics); got prefill={prefill!r}, decode={decode!r}: use ExpectedAttention alone"
            )
        super().__init__(selection=decode.selection)
        self.prefill, self.decode = prefill, decode
        self.wrapped = decode
        self.log_n: LogNScaling | None = decode.log_n

    # ---------------------------------------------------------------- what backends read
    # (the rest is the decode policy's: WrappingPolicy)
    @property
    def scorer(self) -> EvictionPolicy:
        """The policy whose score statistic the backends compute for the composition: the
        decode policy, or the prefill policy when the decode policy reads no scores (so
        ``compose(prefill=Knorm(size=4), decode=FullCache())`` computes key norms; the
        constructor refuses pairs whose statistics differ in a way one score cannot serve).

        Example:
            >>> from kvpolicy import FullCache, Knorm, compose
            >>> p = compose(prefill=Knorm(size=4), decode=FullCache())
            >>> p.scorer, p.score_statistic, p.captures_attention
            (Knorm(size=4, recent=0), 'key_norm', False)
        """
        return self.prefill if self.prefill.uses_scores and not self.decode.uses_scores else self.decode

    @property  # type: ignore[override]
    def score_statistic(self) -> ScoreStatistic:
        return self.scorer.score_statistic

    @property
    def statistic_policy(self) -> EvictionPolicy:
        return self.scorer.statistic_policy

    @property  # type: ignore[override]
    def score_history(self) -> int | None:
        return self.scorer.score_history

    @property  # type: ignore[override]
    def key_recent(self) -> int:
        return self.scorer.key_recent

    @property
    def prompt_rows(self) -> int | None:
        return self.prefill.prompt_rows

    @property  # type: ignore[override]
    def ragged_heads(self) -> bool:
        return self.decode.ragged_heads  # (a head-wise prefill policy is refused)

    def head_capacity(self, heads: int) -> int | None:
        """Under a head-wise decode policy (:class:`~kvpolicy.AdaKV`): the most tokens one of
        ``heads`` heads ever holds, the decode policy's (the prefill policy leaves every head the
        same number); ``None`` otherwise, as for an unbounded policy."""
        return self.decode.head_capacity(heads) if self.decode.ragged_heads else None  # type: ignore[attr-defined]

    @property  # type: ignore[override]
    def uses_scores(self) -> bool:
        return self.prefill.uses_scores or self.decode.uses_scores

    @property
    def decode_eviction(self) -> DecodeEviction | None:
        # Decode steps are the decode policy's alone (backends apply a rule in decode only). Not
        # an "oldest" rule with sinks: it protects *positions* below `sink`, which the prefill
        # policy may have evicted, while the decode policy's select keeps its first `sink` slots.
        rule = self.decode.decode_eviction
        if rule is not None and rule.victim == "oldest" and rule.sink:
            return None
        return rule

    def decode_size_rule(self) -> SizeRule | None:
        """The decode policy's decode size rule, on its ``decode.`` part of the state: a decode
        step is the decode policy's alone (the prefill policy cuts only a prompt, so the
        composition declares no :meth:`size_rule` of both phases)."""
        rule = self.decode.decode_size_rule()
        if rule is None:
            return None

        def decode_step(n: int, state: dict[str, int]) -> int:
            sub = {k[len("decode.") :]: v for k, v in state.items() if k.startswith("decode.")}
            after = rule(n, sub)
            state.update({f"decode.{k}": v for k, v in sub.items()})
            return after

        return decode_step

    # ---------------------------------------------------------------- the rule
    def init_state(self) -> dict[str, int]:
        state = {f"prefill.{k}": v for k, v in self.prefill.init_state().items()}
        state.update({f"decode.{k}": v for k, v in self.decode.init_state().items()})
        return state

    def _ask(self, policy: EvictionPolicy, prefix: str, view: CacheView) -> Array | None:
        sub = {k[len(prefix) :]: v for k, v in view.state.items() if k.startswith(prefix)}
        keep = policy.select(_sub_view(view, sub))
        for k, v in sub.items():
            view.state[prefix + k] = v
        return keep

    def select(self, view: CacheView) -> Array | None:
        cap = self.decode.capacity
        if view.phase == "prefill" and (cap is None or view.n_cached > cap - 1):
            keep = self._ask(self.prefill, "prefill.", view)
            if keep is not None:
                return keep
        return self._ask(self.decode, "decode.", view)

    def params(self) -> dict[str, Any]:
        """The two policies as plain data (registry name and parameters), so reports can store
        them as JSON; the policies themselves are :attr:`prefill` and :attr:`decode`."""
        return {
            part: {"policy": p.name, **p.params(), "selection": p.selection}
            for part, p in (("prefill", self.prefill), ("decode", self.decode))
        }

    def __repr__(self) -> str:
        return f"Composed(prefill={self.prefill!r}, decode={self.decode!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Composed) and (self.prefill, self.decode) == (other.prefill, other.decode)

    def __hash__(self) -> int:
        return hash(("Composed", self.prefill, self.decode))

    min_size = 6  # the largest of the built-in decode policies' (BUZZ's)

    @classmethod
    def from_size(cls, size: int, **overrides: Any) -> "Composed":
        """``decode``: the decode policy's registry name, planned with ``from_size(size)``;
        ``prefill``: the prefill policy's name (``"snapkv"``), given ``size = decode.capacity - 1``
        (or ``size`` for an unbounded decode policy). Overrides named ``prefill_X`` go to the
        prefill policy as ``X``; the others to the decode policy."""
        prefill_name = overrides.pop("prefill", "snapkv")
        decode_name = overrides.pop("decode", None)
        if not isinstance(decode_name, str) or not isinstance(prefill_name, str):
            raise ValueError(
                "compose plans from registry names: decode='buzz' (or h2o, tova, ...) and prefill='snapkv'; "
                f"got prefill={prefill_name!r}, decode={decode_name!r} (or use a preset such as snapkv_buzz)"
            )
        pre = {k[len("prefill_") :]: overrides.pop(k) for k in list(overrides) if k.startswith("prefill_")}
        decode = get_policy(decode_name).from_size(size, **overrides)
        cap = decode.capacity
        prefill = get_policy(prefill_name).from_size(size if cap is None else cap - 1, selection=decode.selection, **pre)
        return cls(prefill=prefill, decode=decode)


def compose(*, prefill: EvictionPolicy, decode: EvictionPolicy) -> Composed:
    """``prefill`` right after a prompt, then ``decode``: see :class:`Composed`.

    Example:
        >>> from kvpolicy import BUZZ, SnapKV, compose
        >>> compose(prefill=SnapKV(size=100, window=8), decode=BUZZ(sink=4, window=16, stride=5, threshold=60)).capacity
        80
    """
    return Composed(prefill=prefill, decode=decode)


for _decode in ("buzz", "h2o", "tova"):
    register_policy(
        Composed,
        name=f"snapkv_{_decode}",
        preset={"prefill": "snapkv", "decode": _decode},
        doc=f"SnapKV after the prompt, then {_decode} (planned: SnapKV keeps the decode policy's capacity - 1)",
    )
