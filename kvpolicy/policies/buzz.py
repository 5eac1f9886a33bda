"""BUZZ (Zhao et al., 2024, "BUZZ: Beehive-structured Sparse KV Cache with Segmented Heavy
Hitters for Efficient LLM Inference"), Algorithms 1 and 2, and its parameter-estimation rule.

The cache of one head is ``sink | old | new | window``: the first ``sink`` positions, the middle,
and the last ``window`` positions. ``old`` are middle tokens that survived the last eviction,
``new`` the middle tokens that arrived since. Whenever the middle holds ``threshold`` tokens or
more, one eviction runs:

* old tokens are interval-sampled with ``s_hat = floor((s + 1) / 2)``: of each group of
  ``s_hat`` consecutive old tokens, the first is kept (``interval_keep="last"`` keeps the last);
* new tokens are split from their start into segments of ``stride`` (the last, partial segment
  included) and each segment keeps its highest-score token (ties: the earliest position; a NaN
  score counts as ``-inf``, see :attr:`kvpolicy.CacheView.ranking_scores`);
* the survivors become the old tokens.

After a prefill the rule repeats (survivors are then all old) until the middle is below the
threshold, so a head never holds more than ``sink + window + threshold`` tokens.
"""

from __future__ import annotations

import math
from typing import Any

from array_api_compat import device

from ..validation import check_float, check_int
from ..params import Param
from ..policy import Array, CacheView, EvictionPolicy, LogNScaling, SizeRule
from ..registry import register_policy

__all__ = ["BUZZ", "estimate_threshold", "threshold_ratio", "small_stride", "fixed_point_middle", "check_ratio", "window_for_size"]


def small_stride(stride: int) -> int:
    """``s_hat = floor((s + 1) / 2)``, the interval at which old tokens are sampled."""
    return (stride + 1) // 2


def threshold_ratio(stride: int) -> float:
    """The parameter-estimation theorem's optimal ``T / w`` for stride ``s``.

    Between evictions the middle grows from its post-eviction size ``a`` to ``T``; one eviction
    maps ``a -> a / s_hat + (T - a) / s`` (old tokens thinned by ``s_hat``, the ``T - a`` new ones
    by ``s``). Its fixed point is ``a* = T / (s - s / s_hat + 1)``. Setting ``a* = w`` (as many
    sampled middle tokens as window tokens) gives ``T / w = s - s / s_hat + 1``:
    ``(s^2 + 1) / (s + 1)`` for odd ``s`` (``s_hat = (s + 1) / 2``) and ``s - 1`` for even ``s``
    (``s_hat = s / 2``).

    Example:
        >>> round(threshold_ratio(5), 4)
        4.3333
        >>> threshold_ratio(6)
        5.0
    """
    s = check_int("stride", stride, minimum=3)
    return s - s / small_stride(s) + 1


def fixed_point_middle(stride: int, threshold: int) -> float:
    """Long-run post-eviction middle size ``a*`` of the recurrence (before rounding)."""
    return threshold / threshold_ratio(stride)


def estimate_threshold(stride: int, window: int, ratio: float | None = None) -> int:
    """The threshold ``T = round(ratio * window)`` (at least the smallest legal one, 3).

    ``ratio`` defaults to the theorem's :func:`threshold_ratio` (4.33 for stride 5); pass another
    ``T / w`` (e.g. 2.5, the default of the paper authors' code) to tune it.

    Example:
        >>> estimate_threshold(5, 30)
        130
        >>> estimate_threshold(5, 30, ratio=2.5)
        75
    """
    stride = check_int("stride", stride, minimum=3)  # before _min_threshold, which loops forever for s < 3
    window = check_int("window", window, minimum=1)
    r = threshold_ratio(stride) if ratio is None else check_ratio(ratio)
    return max(_min_threshold(stride), round(r * window))


def check_ratio(ratio: object) -> float:
    """``ratio`` as a float if it is a valid ``threshold_ratio`` (a finite ``T / w > 0``), else
    ``ValueError`` naming the parameter and the range."""
    return check_float("threshold_ratio", ratio, low=0.0, high=math.inf, low_open=True, high_open=True)


def _shrinks(stride: int, threshold: int) -> bool:
    """Whether every eviction leaves fewer than ``threshold`` middle tokens.

    In decode the middle reaches exactly ``threshold`` with ``a`` old tokens (``0 <= a < T``);
    one eviction keeps ``ceil(a / s_hat) + ceil((T - a) / s)``.
    """
    s_hat = small_stride(stride)
    return all(
        -(-a // s_hat) + -(-(threshold - a) // stride) < threshold for a in range(threshold)
    ) and -(-threshold // s_hat) < threshold


def _min_threshold(stride: int) -> int:
    t = 1
    while not _shrinks(stride, t):
        t += 1
    return t


@register_policy
class BUZZ(EvictionPolicy):
    """BUZZ: sink, beehive-sampled middle, sliding window.

    Parameters:
        sink: first positions kept forever (>= 1; the paper uses 1 to 5).
        window: last positions always kept (>= 1).
        stride: segment length ``s`` for new tokens (>= 3; old tokens use ``s_hat = (s+1)//2``,
            and ``s_hat = 1`` would never thin them, leaving the cache unbounded).
        threshold: middle size ``T`` that triggers an eviction (at least the smallest value for
            which an eviction shrinks the middle, 3 for every stride). See
            :func:`estimate_threshold` for the theorem's choice.
        log_n: scale attention logits by ``log_base(n)`` ("BUZZ with log n"), ``n`` the number of
            keys the query attends to (paper, section 3.5; see :class:`~kvpolicy.LogNScaling`).
        log_base: the base of that logarithm (the paper: 512).
        log_floor: lower bound of the scale (default 0.0: the paper's formula, no floor, so
            queries attending to fewer than ``log_base`` keys get softer attention; 1.0: the
            earlier kvpolicy variant, ordinary attention below ``log_base`` keys).
        interval_keep: which token of each ``s_hat`` group of old tokens survives (``"first"``).
        selection: ``"per_head"`` (default) or ``"shared"`` across KV heads.

    Example:
        >>> from kvpolicy import BUZZ
        >>> p = BUZZ(sink=4, window=30, stride=5, threshold=130)
        >>> p.capacity
        164
    """

    name = "buzz"

    sink = Param(int, 4, minimum=1, doc="first positions kept forever")
    window = Param(int, 64, minimum=1, doc="last positions always kept")
    stride = Param(int, 5, minimum=3, doc="segment length s for new tokens")
    threshold = Param(int, None, minimum=lambda p: _min_threshold(p.stride),
                      if_none=lambda p: estimate_threshold(p.stride, p.window),
                      doc="middle size T that triggers an eviction (None: the theorem's)")
    # log_n=True is stored as use_log_n: `log_n` is the scaling backends apply (EvictionPolicy.log_n)
    use_log_n = Param(bool, False, keyword="log_n", keyword_only=True, shown="non-default",
                      doc="scale attention logits by log_base(n)")
    log_base = Param(float, 512.0, minimum=1.0, low_open=True, high_open=True, keyword_only=True, shown=lambda p: p.use_log_n,
                     doc="the base of that logarithm")
    log_floor = Param(float, 0.0, minimum=0.0, high_open=True, keyword_only=True, shown=lambda p: p.use_log_n,
                      doc="lower bound of the scale")
    interval_keep = Param(str, "first", choices=("first", "last"), keyword_only=True, shown="non-default",
                          doc="which token of each s_hat group of old tokens survives")

    def __post_init__(self) -> None:
        self.s_hat = small_stride(self.stride)
        self.log_n = LogNScaling(self.log_base, self.log_floor) if self.use_log_n else None

    @property
    def capacity(self) -> int:
        return self.sink + self.window + self.threshold

    def init_state(self) -> dict[str, int]:
        return {"n_old": 0}

    def select(self, view: CacheView) -> Array | None:
        n = view.n_cached
        middle = n - self.sink - self.window
        if middle < self.threshold:
            return None
        xp = view.xp
        n_old = view.state.get("n_old", 0)
        n_new = middle - n_old
        start_old = self.sink
        start_new = self.sink + n_old

        # Old tokens: interval sampling, pure index arithmetic.
        first = view.arange(start_old, start_new, self.s_hat)
        if self.interval_keep == "first":
            old_slots = first
        else:
            old_slots = xp.clip(first + (self.s_hat - 1), max=start_new - 1)

        # New tokens: one argmax per stride segment over a -inf padded [.., segments, stride] view.
        n_seg = -(-n_new // self.stride)
        parts = [view.arange(self.sink), old_slots]
        if n_seg:
            scores = view.ranking_scores[..., start_new : start_new + n_new]
            pad = n_seg * self.stride - n_new
            if pad:
                filler = xp.full(
                    (*scores.shape[:-1], pad), -xp.inf, dtype=scores.dtype, device=_device(scores)
                )
                scores = xp.concat([scores, filler], axis=-1)
            segments = xp.reshape(scores, (*scores.shape[:-1], n_seg, self.stride))
            winner = xp.argmax(segments, axis=-1)  # first maximum: ties go to the earliest
            parts.append(start_new + view.arange(0, n_seg * self.stride, self.stride) + winner)
        parts.append(view.arange(n - self.window, n))
        view.state["n_old"] = int(old_slots.shape[0]) + n_seg
        return view.keep(*parts)

    def size_rule(self) -> SizeRule:
        # select()'s counts: ceil(old / s_hat) old and ceil(new / stride) new middle tokens are
        # kept, repeatedly while the middle holds threshold or more.
        sink, window, threshold, stride, s_hat = self.sink, self.window, self.threshold, self.stride, self.s_hat

        def rule(n: int, state: dict[str, int]) -> int:
            middle = n - sink - window
            while middle >= threshold:
                n_old = state.get("n_old", 0)
                middle = -(-n_old // s_hat) + -(-(middle - n_old) // stride)
                state["n_old"] = middle
            return sink + window + middle if n - sink - window >= threshold else n

        return rule

    min_size = 6

    @classmethod
    def from_size(cls, size: int, **overrides: Any) -> "BUZZ":
        """BUZZ whose steady average cache size is about ``size``.

        ``threshold_ratio=r`` (optional, > 0) sets ``T = round(r * w)`` (at least 3, the smallest
        legal threshold); without it ``T / w`` is the theorem's (:func:`threshold_ratio`, 4.33 for
        stride 5). ``window`` is solved from the steady state (:func:`window_for_size`). Giving
        both ``threshold`` and ``threshold_ratio`` is an error.

        Example:
            >>> p = BUZZ.from_size(100, threshold_ratio=2.5)
            >>> p.window, p.threshold
            (38, 95)
        """
        ratio = overrides.pop("threshold_ratio", None)
        if ratio is not None:
            ratio = check_ratio(ratio)
            if "threshold" in overrides:
                raise ValueError("give threshold or threshold_ratio, not both")
        sink = overrides.pop("sink", 4)
        stride = overrides.pop("stride", 5)
        window = overrides.pop("window", None)
        if window is None:
            window = window_for_size(size, stride=check_int("stride", stride, minimum=3), sink=sink, ratio=ratio)
        threshold = overrides.pop("threshold", None)
        if threshold is None:
            threshold = estimate_threshold(stride, window, ratio)
        return cls(sink=sink, window=window, stride=stride, threshold=threshold, **overrides)


def window_for_size(size: float, *, stride: int = 5, sink: int = 4, ratio: float | None = None) -> int:
    """The window whose BUZZ (threshold ``ratio * w``) has a long-run average cache of ``size``.

    In steady state the middle grows from the post-eviction fixed point ``a* = T / r*`` (``r*``
    the theorem's ratio for the stride, whatever ``T``) to ``T``, so the cache averages
    ``sink + w + (a* + T) / 2 = sink + w (1 + ratio (1 + 1 / r*) / 2)``; with the theorem's ratio
    this is ``sink + w + (w + T) / 2``.

    Example:
        >>> window_for_size(100), window_for_size(100, ratio=2.5)
        (26, 38)
    """
    r_star = threshold_ratio(stride)
    if ratio is None:
        denominator = 1 + (1 + r_star) / 2
    else:
        denominator = 1 + check_ratio(ratio) * (1 + 1 / r_star) / 2
    return max(1, int(round((size - sink) / denominator)))


def _device(x: Array) -> Any:
    return device(x)

