"""Hypothesis strategies: policies with valid parameters, attention logits with controllable ties
and extremes, prompt lengths. Sizes are kept small so that evictions happen often."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import strategies as st

from kvpolicy import BUZZ, H2O, FullCache, LocalWindow, StreamingLLM

__all__ = [
    "buzz_policies",
    "h2o_policies",
    "streaming_policies",
    "local_policies",
    "any_policy",
    "selections",
    "logits_arrays",
    "replay_cases",
    "LOGIT_LEVELS",
]

#: Few distinct logit values: many exact ties in the accumulated scores.
LOGIT_LEVELS = (-2.0, 0.0, 0.5, 1.0, 3.0)
#: Extremes: probabilities that are exactly 0 or 1 after the softmax (ties at 0).
LOGIT_EXTREMES = (-1.0e4, -30.0, 0.0, 30.0, 1.0e4)

selections = st.sampled_from(["per_head", "shared"])
MIN_THRESHOLD = 3  # smallest threshold that shrinks the middle, for every stride >= 3 (tested)


@st.composite
def buzz_policies(draw: st.DrawFn, *, max_window: int = 6, max_threshold: int = 24) -> BUZZ:
    stride = draw(st.integers(3, 8))
    log_n = draw(st.booleans())
    kwargs: dict[str, Any] = {}
    if log_n:
        # A small base so that the scale actually moves within a short replay.
        kwargs.update(
            log_n=True,
            log_base=draw(st.sampled_from([2.0, 3.0, 8.0, 512.0])),
            log_floor=draw(st.sampled_from([0.0, 0.5, 1.0])),
        )
    return BUZZ(
        sink=draw(st.integers(1, 4)),
        window=draw(st.integers(1, max_window)),
        stride=stride,
        threshold=draw(st.integers(MIN_THRESHOLD, max_threshold)),
        interval_keep=draw(st.sampled_from(["first", "last"])),
        selection=draw(selections),
        **kwargs,
    )


@st.composite
def h2o_policies(draw: st.DrawFn) -> H2O:
    return H2O(heavy=draw(st.integers(1, 10)), recent=draw(st.integers(1, 8)), selection=draw(selections))


@st.composite
def streaming_policies(draw: st.DrawFn) -> StreamingLLM:
    return StreamingLLM(sink=draw(st.integers(1, 5)), window=draw(st.integers(1, 10)))


@st.composite
def local_policies(draw: st.DrawFn) -> LocalWindow:
    return LocalWindow(window=draw(st.integers(1, 12)))


def any_policy() -> st.SearchStrategy:
    return st.one_of(
        buzz_policies(),
        h2o_policies(),
        streaming_policies(),
        local_policies(),
        st.just(FullCache()),
    )


@st.composite
def logits_arrays(
    draw: st.DrawFn,
    *,
    min_steps: int = 1,
    max_steps: int = 48,
    max_heads: int = 3,
    steps: int | None = None,
    heads: int | None = None,
) -> np.ndarray:
    """``[steps, heads, steps]`` float64 logits, drawn as one of:

    * ``levels``: every entry from :data:`LOGIT_LEVELS` (exact ties in the scores);
    * ``extremes``: every entry from :data:`LOGIT_EXTREMES` (probabilities 0 and 1);
    * ``constant``: one value everywhere (all scores tie at every step);
    * ``normal``: Gaussian with a drawn temperature, plus a few heavy-hitter columns;
    * ``heavy``: recency bias plus heavy-hitter columns (realistic-ish attention).
    """
    if steps is None:
        steps = draw(st.integers(min_steps, max_steps))
    if heads is None:
        heads = draw(st.integers(1, max_heads))
    seed = draw(st.integers(0, 2**32 - 1))
    kind = draw(st.sampled_from(["levels", "extremes", "constant", "normal", "heavy"]))
    rng = np.random.default_rng(seed)
    shape = (steps, heads, steps)
    if kind == "levels":
        return rng.choice(np.asarray(LOGIT_LEVELS), size=shape)
    if kind == "extremes":
        return rng.choice(np.asarray(LOGIT_EXTREMES), size=shape)
    if kind == "constant":
        return np.full(shape, draw(st.sampled_from(LOGIT_LEVELS)))
    scale = draw(st.sampled_from([0.1, 1.0, 4.0]))
    out = rng.normal(0.0, scale, size=shape)
    n_heavy = min(steps, draw(st.integers(0, 4)))
    if n_heavy:
        cols = rng.choice(steps, size=n_heavy, replace=False)
        out[:, :, cols] += rng.uniform(1.0, 5.0, size=n_heavy)
    if kind == "heavy":
        q = np.arange(steps)[:, None, None]
        k = np.arange(steps)[None, None, :]
        out -= 0.1 * np.maximum(q - k, 0)
    return out


@st.composite
def replay_cases(draw: st.DrawFn, policies: st.SearchStrategy | None = None, **logit_kw: Any):
    """``(policy, logits, prompt_len)`` with ``0 <= prompt_len <= steps``."""
    policy = draw(policies if policies is not None else any_policy())
    logits = draw(logits_arrays(**logit_kw))
    steps = logits.shape[0]
    prompt_len = draw(st.one_of(st.just(0), st.integers(0, steps)))
    return policy, logits, prompt_len
