"""kvpress's protocol for any scorer: compress the context once, at the end of the prompt, to a
share of its length, and keep every later token (NVIDIA's kvpress library: its presses'
``compression_ratio`` and its ``KVPressTextGenerationPipeline``, which prefills and compresses the
context, then feeds the question and generates the answer on that cache; the protocol of its
RULER leaderboard)."""

from __future__ import annotations

from typing import Any

from ..validation import check_float
from ..policy import Array, CacheView, DecodeEviction, EvictionPolicy, WrappingPolicy
from .adakv import AdaKV, headwise_keep, keep_best
from .chunkkv import ChunkKV

__all__ = ["PrefillOnly", "prefill_only"]


class PrefillOnly(WrappingPolicy):
    """A scorer run as kvpress runs its presses: one compression of the context, then nothing.

    Right after the first prompt (the context, one prefill of more than one token), each KV
    head keeps ``k = max(1, int(n_context x (1 - compression_ratio)))`` of the ``n_context``
    tokens it holds, the ``k`` the wrapped policy's :meth:`~kvpolicy.EvictionPolicy.ranking`
    evicts last (its protected tokens, e.g. SnapKV's observation window, first): kvpress's
    ``n_kept = int(k_len * (1 - compression_ratio))``. Every later token (a question fed after
    the context, the answer) is kept: :attr:`capacity` is unbounded and decode steps never evict.
    The scores are the wrapped policy's (its statistic, its prompt rows: SnapKV's window, TOVA's
    last row). With ``selection="shared"`` (TOVA's default) the scores are summed over a layer's
    heads and every head keeps the same tokens. Over :class:`~kvpolicy.AdaKV` the layer keeps
    ``heads x k`` tokens chosen head-wise, each head at least AdaKV's floor of ``k``. Over
    :class:`~kvpolicy.ChunkKV` each head keeps whole chunks within ``k`` (:meth:`ChunkKV.keep_chunks
    <kvpolicy.ChunkKV.keep_chunks>`).

    The compression ratio is kvpress's: the share of the *context* removed, once; the cache then
    grows by the question and the answer (kvpolicy's decode-time budgets are instead the average
    share of the whole cache kept over the decode steps).

    Parameters:
        policy: the scorer, a policy that ranks tokens (H2O, TOVA, Knorm, KeyDiff, SnapKV,
            Expected Attention: :attr:`~kvpolicy.EvictionPolicy.ranks_tokens`) or AdaKV or ChunkKV over one;
            its size does not matter, only how it ranks (e.g. SnapKV's window and kernel). Or a
            policy that keeps positions (StreamingLLM, the local window: a decode rule that evicts
            the oldest after ``sink``): its first ``sink`` and the newest ``k - sink`` are kept,
            kvpress's ``StreamingLLMPress``.
        compression_ratio: the share of the context removed, in ``[0, 1)``.

    Example:
        >>> from kvpolicy import Knorm, prefill_only
        >>> p = prefill_only(Knorm(size=1), compression_ratio=0.75)
        >>> p.capacity, p.kept_tokens(1000), p.score_statistic, p.decode_eviction
        (None, 250, 'key_norm', None)
    """

    name = "prefill_only"

    def __init__(self, policy: EvictionPolicy, compression_ratio: float) -> None:
        if not isinstance(policy, EvictionPolicy):
            raise ValueError(f"policy must be an EvictionPolicy instance (e.g. Knorm(size=64)), got {policy!r}")
        scorer = policy.scorer if isinstance(policy, (AdaKV, ChunkKV)) else policy
        if not scorer.ranks_tokens and _sinks(policy) is None:
            raise ValueError(
                f"policy must rank tokens by a score (declare ranking(): H2O, TOVA, Knorm, KeyDiff, SnapKV, Expected "
                f"Attention, or AdaKV over one) or keep the newest tokens after its sinks (StreamingLLM, the local "
                f"window), got {policy!r}: kvpress's protocol keeps each head's best tokens by it"
            )
        self.compression_ratio = check_float("compression_ratio", compression_ratio, low=0.0, high=1.0, high_open=True)
        super().__init__(selection=policy.selection)
        self.wrapped = self.policy = policy
        self.log_n = policy.log_n

    # ---------------------------------------------------------------- what backends read
    # (the rest is the wrapped policy's: WrappingPolicy)
    @property  # type: ignore[override]
    def default_positions(self) -> str:
        """``"original"``: kvpress's pipeline keeps every key at the position it was computed at
        (its StreamingLLMPress does not re-rotate the kept keys), whatever the wrapped policy's
        own default (StreamingLLM's pos-shift)."""
        return "original"

    @property
    def capacity(self) -> int | None:
        return None  # the question and the answer are never evicted

    @property
    def decode_eviction(self) -> DecodeEviction | None:
        return None

    def kept_tokens(self, n_context: int) -> int:
        """``k``: the tokens each head keeps of a context of ``n_context``: kvpress's
        ``int(n_context * (1 - compression_ratio))``, at least 1."""
        return max(1, int(n_context * (1 - self.compression_ratio)))

    # ---------------------------------------------------------------- the rule
    def init_state(self) -> dict[str, int]:
        return {"compressed": 0}

    def select(self, view: CacheView) -> Array | None:
        if view.state["compressed"] or view.phase != "prefill":
            return None
        view.state["compressed"] = 1  # once: later prompts (a question) and decode steps are kept
        k = self.kept_tokens(view.n_cached)
        if k >= view.n_cached:
            return None
        sinks = _sinks(self.policy)
        if sinks is not None:  # kvpress's StreamingLLMPress: the first `sink`, then the newest
            first = min(sinks, k)
            newest = view.arange(view.n_cached - (k - first), view.n_cached)
            return view.keep(view.arange(first), newest) if first else view.keep(newest)
        if isinstance(self.policy, AdaKV):
            ada = self.policy
            ranking = ada.scorer.ranking(view)
            return headwise_keep(view, ranking, view.heads * k, ada.floor_of(k))
        if isinstance(self.policy, ChunkKV):
            return self.policy.keep_chunks(view, k)
        return keep_best(view, self.policy.ranking(view), k)

    def for_layer(self, layer: int, layers: int) -> EvictionPolicy:
        """Over the wrapped policy for ``layer`` (e.g. a :class:`~kvpolicy.CriticalKV` bound to the
        layer's output projection); itself when that is the wrapped policy."""
        inner = self.policy.for_layer(layer, layers)
        return self if inner is self.policy else PrefillOnly(inner, self.compression_ratio)

    def params(self) -> dict[str, Any]:
        """The wrapped policy as plain data (registry name and parameters) and the ratio."""
        p = self.policy
        return {"policy": {"policy": p.name, **p.params(), "selection": p.selection},
                "compression_ratio": self.compression_ratio}

    def __repr__(self) -> str:
        return f"PrefillOnly(policy={self.policy!r}, compression_ratio={self.compression_ratio!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PrefillOnly) and (self.policy, self.compression_ratio) == (other.policy, other.compression_ratio)

    def __hash__(self) -> int:
        return hash(("PrefillOnly", self.policy, self.compression_ratio))


def _sinks(policy: EvictionPolicy) -> int | None:
    """The sinks of a policy that keeps positions, not scores (its decode rule evicts the oldest
    after the first ``sink``: StreamingLLM, the local window with 0), else ``None``."""
    rule = policy.decode_eviction
    return rule.sink if rule is not None and rule.victim == "oldest" else None


def prefill_only(policy: EvictionPolicy, compression_ratio: float) -> PrefillOnly:
    """``policy`` run as kvpress runs a press: see :class:`PrefillOnly`.

    Example:
        >>> import numpy as np, kvpolicy_numpy
        >>> from kvpolicy import Knorm, prefill_only
        >>> keys = np.array([0.1, 8, 7, 6, 3, 5, 2, 1, 4, 9.0])[:, None, None]  # one head, 1-d keys
        >>> trace = kvpolicy_numpy.replay(prefill_only(Knorm(size=1), 0.5), np.zeros((10, 1, 10)), 8, keys=keys)
        >>> trace.kept[7].tolist(), trace.kept[9].tolist()  # the 4 smallest norms of 8, then every new token
        ([[0, 4, 6, 7]], [[0, 4, 6, 7, 8, 9]])
    """
    return PrefillOnly(policy, compression_ratio)
