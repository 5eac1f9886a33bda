"""CriticalKV and CriticalAdaKV (Feng et al., 2025, "Identify Critical KV Cache in LLM Inference
from an Output Perturbation Perspective"): a scorer's scores refined by how much each value moves
the attention output, its projection through the output projection ``W_o``."""

from __future__ import annotations

import sys
from typing import Any, Sequence

from ..validation import check_float
from ..policy import KEY_STATISTICS, Array, CacheView, DecodeEviction, EvictionPolicy, Ranking, SizeRule, WrappingPolicy
from ..registry import get_policy, register_policy
from ..statistics import CachedTokens, critical_scores, value_weights
from .adakv import AdaKV

__all__ = ["CriticalKV"]


@register_policy
class CriticalKV(WrappingPolicy):
    """Two stages over a scorer: half the budget by the scorer's scores, the rest by those scores
    times each value's projected norm.

    Of the ``b`` tokens a head keeps (the ``scorer``'s budget, its
    :meth:`~kvpolicy.EvictionPolicy.head_budget`), the first ``int(b x first_stage_ratio)`` are the
    scorer's highest scores (stage one); every other token scores ``(score + epsilon) x w``, where
    ``w`` is the L1 norm of its value projected through ``W_o``, the output projection of each
    query head of its KV head, averaged over the group (stage two,
    :func:`kvpolicy.statistics.critical_scores` and :func:`~kvpolicy.statistics.value_weights`).
    The scorer's rule then keeps the highest of these scores (stage-one tokens score
    :data:`~kvpolicy.statistics.FIRST_STAGE`, above every other): one
    token a decode step once full, or ``b`` after a prompt: kvpress's ``CriticalKVPress``, with
    the budget ``int(int(n (1 - r)) x first_stage_ratio)`` where kvpress takes ``int(n (1 - r) x
    first_stage_ratio)`` (equal at kvpress's ratio 0.5).

    ``W_o`` is the model's: a policy built with ``projections`` (one ``[kv_heads, group,
    head_dim, hidden]`` array per layer, :func:`kvpolicy.hf.output_projections` reads them from a
    transformers model) scores each layer with its own, once a cache binds it to the layer
    (:meth:`for_layer`). Without ``projections`` ``w`` is the value's own L1 norm (``W_o`` taken as
    the identity): the value-norm half of the method, not the paper's. With ``projections`` a
    scoring costs ``n x head_dim x hidden`` multiply-adds per query head, at every decode step in
    decode-time use (kvpress's protocol, :func:`kvpolicy.prefill_only`, scores once).

    The scorer's scores must come from the cache (Knorm, KeyDiff, Expected Attention, LagKV:
    :data:`kvpolicy.KEY_STATISTICS`), the only ones computed beside the values; a scorer reading
    attention (SnapKV, H2O, TOVA; kvpress's ``critical_snapkv``) is refused by name. kvpress's
    leaderboard runs it over Expected Attention without the value norm
    (``critical_expected_attention``: ``value_norm=False``).

    Parameters:
        scorer: a policy that ranks tokens by a score from the cache, e.g.
            ``ExpectedAttention(size=64, value_norm=False)``.
        epsilon: added to a score before the value weight multiplies it (``>= 0``; 1e-4).
        first_stage_ratio: the share of the budget chosen by the scorer alone (``[0, 1]``; 0.5).
        projections: ``None`` (``W_o`` the identity), or one ``W_o`` per layer as above.

    Registered as ``critical_kv`` (``scorer="<registry name>"``, default Expected Attention with
    ``value_norm=False``), with the preset ``critical_expected_attention``; head-wise budgets over
    it as ``critical_adakv_expected_attention`` (:class:`~kvpolicy.AdaKV` over CriticalKV: see
    docs/policies.md for how it differs from kvpress's ``CriticalAdaKVPress``).

    Example:
        >>> from kvpolicy import CriticalKV, Knorm
        >>> p = CriticalKV(Knorm(size=64))
        >>> p.capacity, p.score_statistic, p.first_stage
        (65, 'key_norm', 32)
    """

    name = "critical_kv"

    def __init__(
        self,
        scorer: EvictionPolicy,
        epsilon: float = 1e-4,
        first_stage_ratio: float = 0.5,
        projections: Sequence[Array] | None = None,
        *,
        layer: int | None = None,
    ) -> None:
        if not isinstance(scorer, EvictionPolicy):
            raise ValueError(
                f"scorer must be an EvictionPolicy instance (e.g. ExpectedAttention(size=64, value_norm=False)), got "
                f"{scorer!r}; to plan one from a budget use make_policy('critical_kv', budget, ..., scorer='knorm')"
            )
        if not scorer.ranks_tokens or scorer.ragged_heads or scorer.score_statistic not in KEY_STATISTICS:
            raise ValueError(
                f"scorer must rank tokens by a score computed from the cache (Knorm, KeyDiff, Expected Attention, "
                f"LagKV: its values are read beside it), got {scorer!r}"
            )
        self.epsilon = check_float("epsilon", epsilon, low=0.0, high=float("inf"), high_open=True)
        self.first_stage_ratio = check_float("first_stage_ratio", first_stage_ratio, low=0.0, high=1.0)
        if projections is not None:
            projections = tuple(projections)
            if not projections:
                raise ValueError("projections must hold one W_o per layer (or be None), got an empty sequence")
            for i, w in enumerate(projections):
                if len(getattr(w, "shape", ())) != 4:
                    raise ValueError(
                        f"projections[{i}] must be an array [kv_heads, group, head_dim, hidden] (W_o of a layer), "
                        f"got {getattr(w, 'shape', type(w).__name__)}"
                    )
        if layer is not None and (projections is None or not 0 <= layer < len(projections)):
            raise ValueError(f"layer must index projections (0 to {0 if projections is None else len(projections) - 1}), got {layer!r}")
        super().__init__(selection=scorer.selection)
        self.scorer = self.wrapped = scorer
        self.projections = projections
        self.layer = layer
        self.log_n = scorer.log_n

    # ---------------------------------------------------------------- the score
    @property
    def statistic_policy(self) -> EvictionPolicy:
        return self  # backends call this policy's cache_score (which calls the scorer's)

    @property
    def sink(self) -> int:
        """The scorer's sinks (Expected Attention's, whose queries the backends leave out)."""
        return int(getattr(self.scorer, "sink", 0))

    @property
    def refresh(self) -> int:
        """The scorer's decode steps between two scorings (Expected Attention's)."""
        return int(getattr(self.scorer, "refresh", 1))

    @property
    def first_stage(self) -> int:
        """Tokens a head keeps by the scorer's scores alone: ``int(b x first_stage_ratio)``."""
        b = self.scorer.head_budget(sys.maxsize, "prefill")
        assert b is not None  # a scorer evicts from any number of tokens after a prompt
        return int(b * self.first_stage_ratio)

    def projection(self) -> Array | None:
        """This layer's ``W_o`` (``None``: the identity). ``ValueError`` for a policy holding
        several layers' projections that no cache bound to its layer (:meth:`for_layer`)."""
        if self.projections is None:
            return None
        if len(self.projections) == 1:
            return self.projections[0]
        if self.layer is None:
            raise ValueError(
                f"{self!r} holds W_o of {len(self.projections)} layers and was bound to none: a cache of a model with "
                f"{len(self.projections)} layers binds it (policy.for_layer(layer, layers)); to replay one layer pass "
                "projections=[w_o]"
            )
        return self.projections[self.layer]

    def cache_score(self, tokens: CachedTokens) -> Array:
        """The scorer's scores, the first stage ``FIRST_STAGE``, the rest times the values' projected L1
        norms (:func:`kvpolicy.statistics.critical_scores`)."""
        scores = self.scorer.cache_score(tokens)
        xp_values = tokens.values
        if xp_values is None:
            raise ValueError(f"{self!r} weighs each token by its value: values are required")
        weights = value_weights(xp_values, self.projection())
        return critical_scores(scores, weights, tokens.positions, self.first_stage, self.epsilon)

    # ---------------------------------------------------------------- the rule: the scorer's, on these scores
    @property
    def rule_policy(self) -> EvictionPolicy:
        return self.scorer.rule_policy  # (select, ranking, head_budget and the decode rule below are the scorer's)

    def select(self, view: CacheView) -> Array | None:
        return self.scorer.select(view)

    @property
    def decode_eviction(self) -> DecodeEviction | None:
        return self.scorer.decode_eviction

    def size_rule(self) -> SizeRule | None:
        return self.scorer.size_rule()

    def head_budget(self, n_cached: int, phase: str) -> int | None:  # type: ignore[override]
        return self.scorer.head_budget(n_cached, phase)  # type: ignore[arg-type]

    def ranking(self, view: CacheView) -> Ranking:
        return self.scorer.ranking(view)

    def init_state(self) -> dict[str, int]:
        return self.scorer.init_state()

    def for_layer(self, layer: int, layers: int) -> EvictionPolicy:
        """Bound to ``layer``'s ``W_o`` when it holds one for each of the ``layers``; itself
        otherwise (no projections, one for every layer, or another layer count: the planners ask
        two layers for their sizes, which ``W_o`` does not change; a cache of another model then
        fails at its first scoring, by :meth:`projection`)."""
        if self.projections is None or len(self.projections) == 1 or len(self.projections) != layers or layer == self.layer:
            return self
        return CriticalKV(self.scorer, self.epsilon, self.first_stage_ratio, self.projections, layer=layer)

    # ---------------------------------------------------------------- niceties
    def params(self) -> dict[str, Any]:
        """The scorer as plain data (registry name and parameters), ``epsilon``,
        ``first_stage_ratio``, and whether ``W_o`` is the model's (``projections``: the layer count)."""
        out: dict[str, Any] = {
            "scorer": {"policy": self.scorer.name, **self.scorer.params(), "selection": self.scorer.selection},
            "epsilon": self.epsilon,
            "first_stage_ratio": self.first_stage_ratio,
        }
        if self.projections is not None:
            out["projections"] = len(self.projections)
        return out

    def __repr__(self) -> str:
        extra = "" if self.projections is None else f", projections=<{len(self.projections)} layers>"
        extra += "" if self.layer is None else f", layer={self.layer}"
        return (f"CriticalKV(scorer={self.scorer!r}, epsilon={self.epsilon!r}, "
                f"first_stage_ratio={self.first_stage_ratio!r}{extra})")

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, CriticalKV)
                and (self.scorer, self.epsilon, self.first_stage_ratio, self.layer)
                == (other.scorer, other.epsilon, other.first_stage_ratio, other.layer)
                and self.projections is other.projections)

    def __hash__(self) -> int:
        return hash(("CriticalKV", self.scorer, self.epsilon, self.first_stage_ratio, self.layer, id(self.projections)))

    min_size = 1  # (from_size plans the scorer at its own smallest size)

    @classmethod
    def from_size(cls, size: int, **overrides: Any) -> "CriticalKV":
        """``scorer`` (a registry name; default ``"expected_attention"``, then with
        ``value_norm=False`` unless given, kvpress's leaderboard entry) planned with
        ``from_size(size)``; ``epsilon``, ``first_stage_ratio`` and ``projections`` are
        CriticalKV's; the other overrides (``selection`` included) are the scorer's."""
        scorer = overrides.pop("scorer", "expected_attention")
        if not isinstance(scorer, str):
            raise ValueError(f"CriticalKV plans from a scorer's registry name (scorer='expected_attention', 'knorm', ...), got {scorer!r}")
        own = {k: overrides.pop(k) for k in ("epsilon", "first_stage_ratio", "projections") if k in overrides}
        entry = get_policy(scorer)
        if entry.name == "expected_attention":
            overrides.setdefault("value_norm", False)  # the projected value norm replaces it (kvpress warns otherwise)
        return cls(entry.from_size(max(size, entry.min_size), **overrides), **own)


register_policy(CriticalKV, name="critical_expected_attention", preset={"scorer": "expected_attention"},
                doc="CriticalKV over Expected Attention without its value norm (kvpress's critical_expected_attention)")
register_policy(AdaKV, name="critical_adakv_expected_attention", preset={"scorer": "critical_expected_attention"},
                doc="AdaKV head-wise budgets over CriticalKV over Expected Attention (kvpress's critical_adakv_expected_attention)")
