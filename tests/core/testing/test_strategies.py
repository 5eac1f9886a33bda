"""kvpolicy/testing/strategies.py: parameter strategies derived from a signature, policies from anything,
``make_logits``, GQA shapes and padded batches."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpolicy import BUZZ, H2O, EvictionPolicy, LocalWindow, get_policy
from kvpolicy.testing import make_logits
from kvpolicy.testing.strategies import LOGIT_KINDS, gqa_shapes, padded_batches, params_strategy, policies


def test_params_strategy_derives_from_the_signature() -> None:
    from typing import Literal

    class Knobs(EvictionPolicy):
        def __init__(self, a: int, flag: bool = False, mode: Literal["x", "y"] = "x", scale: float = 2.5,
                     *, selection: str = "per_head") -> None:
            super().__init__(selection=selection)  # type: ignore[arg-type]
            self.a, self.flag, self.mode, self.scale = a, flag, mode, scale

        capacity = None

        def select(self, view):
            return None

    seen: dict[str, set] = {"a": set(), "flag": set(), "mode": set(), "scale": set(), "selection": set()}

    @settings(max_examples=60, database=None)
    @given(params_strategy(Knobs, a=st.integers(5, 6)))
    def draw(kw) -> None:
        for k, v in kw.items():
            seen[k].add(v)

    draw()
    assert seen["a"] <= {5, 6} and seen["flag"] == {False, True} and seen["mode"] == {"x", "y"}
    assert seen["scale"] == {2.5} and seen["selection"] == {"per_head", "shared"}

    class Opaque(EvictionPolicy):
        def __init__(self, thing) -> None:
            super().__init__()

    with pytest.raises(TypeError, match=r"describe it, e.g. params_strategy\(Opaque, thing="):
        params_strategy(Opaque)
    with pytest.raises(TypeError, match="has no parameter"):
        params_strategy(LocalWindow, windw=st.just(3))


def test_policies_from_anything() -> None:
    @settings(max_examples=20, database=None)
    @given(
        policies(get_policy("buzz_logn")),
        policies(LocalWindow(window=5)),
        policies(H2O, heavy=st.just(2)),
        policies(lambda window: LocalWindow(window), {"window": st.integers(1, 3)}),
    )
    def draw(logn, fixed, h2o, local) -> None:
        assert type(logn) is BUZZ and logn.log_n is not None
        assert fixed == LocalWindow(window=5)
        assert h2o.heavy == 2
        assert 1 <= local.window <= 3

    draw()


@settings(max_examples=40, database=None)
@given(st.sampled_from(LOGIT_KINDS), st.integers(1, 12), st.integers(1, 3), st.integers(0, 2**32 - 1))
def test_make_logits_is_pure_and_onehot_ties(kind, steps, heads, seed) -> None:
    a = make_logits(steps, heads, kind=kind, seed=seed, n_heavy=2)
    assert a.shape == (steps, heads, steps) and a.dtype == np.float64
    assert np.array_equal(a, make_logits(steps, heads, kind=kind, seed=seed, n_heavy=2))
    if kind == "onehot":  # one key per query, never a future one
        hot = a == 1.0e4
        assert (hot.sum(axis=-1) == 1).all()
        assert (np.argmax(hot, axis=-1) <= np.arange(steps)[:, None]).all()


@settings(max_examples=30, database=None)
@given(gqa_shapes(), st.data())
def test_gqa_shapes_and_padded_batches(shape, data) -> None:
    kv, group = shape
    batch = data.draw(padded_batches(query_heads=kv * group, max_steps=12))
    logits = batch.logits
    b, steps, hq, _ = logits.shape
    assert hq == kv * group and b == len(batch.pads)
    for row, pad in enumerate(batch.pads):
        assert (logits[row, pad:, :, :pad] == -1.0e4).all()  # real queries never attend to padding
    rebuilt = eval(batch.call(), {"kvpolicy": __import__("kvpolicy.testing.strategies")})
    assert np.array_equal(rebuilt, logits)
