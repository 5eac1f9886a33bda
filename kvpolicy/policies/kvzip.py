"""KVzip (Kim et al., 2025, "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction")."""

from __future__ import annotations

from typing import Any

from ..params import Param
from ..policy import RECONSTRUCTION, Array, CacheView, EvictionPolicy, Ranking
from ..registry import register_policy
from .adakv import AdaKV, keep_best

__all__ = ["KVzip"]


@register_policy
class KVzip(EvictionPolicy):
    """A prefill policy scored by context reconstruction: keep the ``size`` prompt tokens the
    model attends to most while it repeats the prompt.

    After the prompt (the context), the backend feeds the model a repeat prompt and the context
    again ("Repeat the previous context exactly." then the context, in chunks of kvpress's 2,048
    tokens: ``kvpolicy_integrations.reconstruction.reconstruct``), on the cache holding the context, without
    keeping those tokens. Each context token's score is the most attention it receives from any
    query of that pass, in any query head of its KV head (``score_statistic =
    "reconstruction"``, :func:`kvpolicy.statistics.reconstruction_scores`). The policy is then
    asked once: each KV head keeps its first ``sink`` positions and the ``size - sink`` other
    tokens with the highest scores (ties: the later position stays). Nothing is evicted while the
    prompt is appended, nor at decode steps: the cache grows from there (``capacity`` is
    ``None``), as after SnapKV.

    The paper's (and kvpress's ``KVzipPress``) budgets are head-wise, with no floor per head:
    ``AdaKV(KVzip(size), alpha_safeguard=0)``, registered as ``kvzip_headwise``; kvpress's
    protocol (the context compressed to a ratio) is :func:`~kvpolicy.prefill_only` over either.
    kvpress's default budget is shared over the layers too (its ``layerwise=False``: one top-k
    over every layer's scores), which kvpolicy's per-layer policies cannot express: its
    ``layerwise=True`` is what runs here. The extra cost is the reconstruction's prefill, about
    the prompt's again (docs/policies.md).

    Parameters:
        size: tokens kept after the prompt per KV head, the sinks included (> ``sink``).
        sink: the first positions always kept (kvpress's ``n_sink``, 4), at most ``size - 1``.
        selection: ``"per_head"`` (default) or ``"shared"``: the scores summed over a layer's
            heads, the same tokens on every head.

    Example:
        >>> from kvpolicy import KVzip
        >>> p = KVzip(size=64)
        >>> p.capacity is None, p.score_statistic, p.captures_attention, p.needs_reconstruction
        (True, 'reconstruction', False, True)
    """

    name = "kvzip"
    score_statistic = RECONSTRUCTION

    size = Param(int, minimum=lambda p: p.sink + 1, doc="tokens a prompt keeps per KV head (sinks included)")
    sink = Param(int, 4, minimum=0, doc="first positions always kept (kvpress's n_sink)")

    @property
    def capacity(self) -> None:
        return None

    def select(self, view: CacheView) -> Array | None:
        if view.phase != "prefill" or view.n_cached <= self.size:
            return None
        return keep_best(view, self.ranking(view), self.size)

    def head_budget(self, n_cached: int, phase: str) -> int | None:
        return self.size if phase == "prefill" and n_cached > self.size else None

    def ranking(self, view: CacheView) -> Ranking:
        # the lowest score goes first, the earliest position of a tie; the sinks stay
        protected = view.held & (view.positions < self.sink)
        return Ranking(protected, (view.ranking_scores, view.positions))

    min_size = 5  # the default sinks and one token more

    @classmethod
    def from_size(cls, size: int, **overrides: Any) -> "KVzip":
        sink = overrides.pop("sink", min(4, max(size - 1, 0)))
        return cls(size=size, sink=sink, **overrides)


register_policy(
    AdaKV, name="kvzip_headwise", preset={"scorer": "kvzip", "alpha_safeguard": 0.0},
    doc="KVzip with the paper's head-wise budgets (AdaKV over kvzip, no floor per head: kvpress's KVzipPress)",
)
