"""SnapKV (Li et al., 2024, "SnapKV: LLM Knows What You are Looking for Before Generation")."""

from __future__ import annotations

from typing import Any

from ..params import Param
from ..policy import Array, CacheView, EvictionPolicy, Ranking, SizeRule
from ..registry import register_policy


def _odd_kernel(kernel: int) -> int:
    if kernel % 2 == 0:
        raise ValueError(f"kernel must be odd (a window centred on each token), got {kernel}")
    return kernel


def max_pool(view: CacheView, scores: Array, kernel: int) -> Array:
    """1-D max pooling along the last axis, stride 1, ``kernel // 2`` positions each side, edges
    padded with ``-inf`` (``torch.nn.functional.max_pool1d(s, kernel, 1, kernel // 2)``): pooled
    ``[j]`` is the largest score of the ``kernel`` positions centred on ``j`` that exist.

    Example:
        >>> import numpy as np
        >>> s = np.array([[[0.1, 0.9, 0.2, 0.0, 0.3]]])
        >>> max_pool(CacheView(np.arange(5)[None, None], s, 5), s, 3).tolist()
        [[[0.9, 0.9, 0.9, 0.3, 0.3]]]
    """
    xp = view.xp
    n = scores.shape[-1]
    pooled = scores
    for shift in range(1, min(kernel // 2, n - 1) + 1):  # neighbours further than n - 1 do not exist
        pad = xp.full_like(scores[..., :shift], -xp.inf)
        left = xp.concat([pad, scores[..., : n - shift]], axis=-1)  # left[j] = scores[j - shift]
        right = xp.concat([scores[..., shift:], pad], axis=-1)  # right[j] = scores[j + shift]
        pooled = xp.maximum(pooled, xp.maximum(left, right))
    return pooled


def avg_pool(view: CacheView, scores: Array, kernel: int) -> Array:
    """1-D average pooling along the last axis, stride 1, ``kernel // 2`` positions each side,
    edges padded with zeros that count (``torch.nn.functional.avg_pool1d(s, kernel, 1, kernel //
    2)``, the SnapKV authors' and kvpress's pooling): pooled ``[j]`` is the sum of the scores of
    the ``kernel`` positions centred on ``j`` that exist, over ``kernel``. Each window's values
    (zeros for missing neighbours) are added in ascending order, one at a time, so two windows
    holding equal values pool to the same bits and :class:`SnapKV`'s tie rule (the higher own
    score, then the earlier position) decides between them, on every backend alike, rather than
    float rounding; a NaN (``+inf`` next to ``-inf``) counts as ``-inf``.

    Example:
        >>> import numpy as np
        >>> s = np.array([[[0.3, 0.9, 0.0, 0.0, 0.6]]])
        >>> avg_pool(CacheView(np.arange(5)[None, None], s, 5), s, 3).round(2).tolist()
        [[[0.4, 0.4, 0.3, 0.2, 0.2]]]
        >>> t = np.array([[[0.1, 0.7, 0.2, 0.1]]])  # windows 1 and 2 hold 0.1, 0.7 and 0.2 alike
        >>> pooled = avg_pool(CacheView(np.arange(4)[None, None], t, 4), t, 3)[0, 0]
        >>> bool(pooled[1] == pooled[2])
        True
    """
    xp = view.xp
    n = scores.shape[-1]
    half = kernel // 2
    terms = []
    for offset in range(-half, half + 1):  # terms[k][j] = scores[j + offset], zero where it does not exist
        if offset == 0:
            terms.append(scores)
        elif abs(offset) >= n:
            terms.append(xp.zeros_like(scores))
        elif offset < 0:
            terms.append(xp.concat([xp.zeros_like(scores[..., :-offset]), scores[..., : n + offset]], axis=-1))
        else:
            terms.append(xp.concat([scores[..., offset:], xp.zeros_like(scores[..., :offset])], axis=-1))
    window = xp.sort(xp.stack(terms, axis=-1), axis=-1)  # [..., n, kernel], ascending
    total = window[..., 0]
    for k in range(1, kernel):
        total = total + window[..., k]
    pooled = total / kernel
    return xp.where(xp.isnan(pooled), -xp.inf, pooled)


_POOLS = {"avg": avg_pool, "max": max_pool}


@register_policy
class SnapKV(EvictionPolicy):
    """A prefill policy: after the prompt, keep the observation window and the ``size - window``
    earlier tokens that the window's queries attend to most, pooled.

    A prompt's scores come from its last ``window`` rows only (the observation window:
    ``prompt_rows = window``), summed over those rows and the query heads of each KV head. Right
    after a prompt (chunk) of more than ``size`` tokens, the scores of the tokens before the last
    ``window`` are pooled (``kernel`` positions centred on each token, stride 1: averaged by
    default, as in the authors' code and kvpress, or their maximum) and the
    ``size - window`` highest pooled scores are kept per KV head (ties, which pooling makes
    common: the higher own score, then the earliest position; a NaN score counts as ``-inf``),
    with the last ``window`` tokens. Decode steps never evict:
    the cache grows from there (``capacity`` is ``None``), unless SnapKV is composed with a decode
    policy.

    Parameters:
        size: tokens kept after the prompt, the window included (the paper's prompt capacity;
            > ``window``).
        window: the observation window, the last prompt tokens (>= 1; the paper uses 32).
        kernel: the pooling kernel, odd (>= 1; the paper's clustering kernel is 5 to 7; 1 turns
            pooling off).
        pooling: ``"avg"`` (default: the authors' code, FasterDecoding/SnapKV ``snapkv_utils.py``,
            and kvpress's ``SnapKVPress``; zeros past the edges count, :func:`avg_pool`) or
            ``"max"`` (the authors' option, :func:`max_pool`).
        selection: ``"per_head"`` (default) or ``"shared"`` across KV heads.

    Example:
        >>> from kvpolicy import SnapKV
        >>> p = SnapKV(size=64, window=16)
        >>> p.capacity is None, p.prompt_rows
        (True, 16)
    """

    name = "snapkv"

    size = Param(int, minimum=lambda p: p.window + 1, doc="tokens a prompt keeps (window included)")
    window = Param(int, 32, minimum=1, doc="the observation window: last prompt positions that score, always kept")
    kernel = Param(int, 5, minimum=1, check=lambda p, k: _odd_kernel(k), doc="pooling kernel (odd)")
    pooling = Param(str, "avg", choices=("avg", "max"), doc="how scores are pooled: avg (the authors' default) or max")

    @property
    def capacity(self) -> None:
        return None

    @property
    def prompt_rows(self) -> int:
        return self.window

    def decode_size_rule(self) -> SizeRule:
        """A decode step never evicts (:meth:`select` cuts a prompt only)."""
        return lambda n, state: n

    def select(self, view: CacheView) -> Array | None:
        n = view.n_cached
        if view.phase != "prefill" or n <= self.size:
            return None
        xp = view.xp
        prefix = n - self.window
        scores = view.ranking_scores[..., :prefix]
        pooled = _POOLS[self.pooling](view, scores, self.kernel)
        # Highest pooled score first; pooling makes ties systematic (a peak's neighbours share
        # its value), so a tie goes to the higher own score, then to the earliest position: a
        # stable sort by own score, then a stable sort by pooled score.
        by_own = xp.argsort(-scores, axis=-1, stable=True)
        order = xp.take_along_axis(by_own, xp.argsort(-xp.take_along_axis(pooled, by_own, axis=-1), axis=-1, stable=True), axis=-1)
        kept = xp.sort(order[..., : self.size - self.window], axis=-1)
        return view.keep(kept, view.arange(prefix, n))

    def head_budget(self, n_cached: int, phase: str) -> int | None:
        return self.size if phase == "prefill" and n_cached > self.size else None

    def ranking(self, view: CacheView) -> Ranking:
        # select's order reversed: the lowest pooled score goes first, a tie to the lower own
        # score, then to the later position; the observation window stays
        xp = view.xp
        n = view.n_cached
        prefix = max(n - self.window, 0)
        own = view.ranking_scores
        pooled = xp.concat([_POOLS[self.pooling](view, own[..., :prefix], self.kernel), own[..., prefix:]], axis=-1)
        protected = xp.broadcast_to(view.arange(n) >= prefix, view.positions.shape)
        return Ranking(protected, (pooled, own, -view.positions))

    min_size = 2

    @classmethod
    def from_size(cls, size: int, **overrides: Any) -> "SnapKV":
        # a window given with a size too small for it: keep the window and one token more
        window = overrides.pop("window", min(32, max(1, size // 2)))
        return cls(size=max(size, window + 1) if isinstance(window, int) else size, window=window, **overrides)
