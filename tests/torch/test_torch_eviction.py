"""kvpolicy_torch.eviction.HostEviction: which rule decides after a step, on the eager layout.

Driven through :class:`~kvpolicy_torch.LayerCache` (its ``evict`` is this module's ``evict``), with
random keys and scores on a tiny layer (no model):

* a policy's declared size rule only spares calls: a layer that declines where the rule keeps
  every token keeps exactly what a layer asking ``select`` at every step keeps, with fewer calls;
* a one-token rule evicts only in the rows that hold ``limit + 1`` tokens, one token each;
* the size rule, a closure, survives a copy of the layer.
"""

from __future__ import annotations

import copy
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from kvpolicy import BUZZ, H2O  # noqa: E402
from kvpolicy_torch import LayerCache  # noqa: E402

#: select() calls per policy class, counted by the two classes below
CALLS: dict[str, int] = {}


class CountedBUZZ(BUZZ):
    """BUZZ with its own size rule, counting the calls of ``select``."""

    size_rule = BUZZ.size_rule

    def select(self, view):  # type: ignore[no-untyped-def]
        CALLS["declining"] = CALLS.get("declining", 0) + 1
        return super().select(view)


class AskedEveryStep(BUZZ):
    """BUZZ without a size rule: the layer asks ``select`` after every step."""

    size_rule = None  # type: ignore[assignment]

    def select(self, view):  # type: ignore[no-untyped-def]
        CALLS["every"] = CALLS.get("every", 0) + 1
        return super().select(view)


def _step(layer: LayerCache, k: torch.Tensor, scores: torch.Tensor) -> list[tuple[int, int]]:
    K, _ = layer.append(k, k)
    layer.accumulate(scores[..., : K.shape[2]])
    return layer.evict()


def _asked_in_lockstep(declining: LayerCache, every: LayerCache, prompt: int, steps: int, seed: int):
    """Feed both layers the same prompt and decode steps; per step, the tokens appended, the
    rounds evicted and how often each policy's ``select`` was asked in it. Both layers keep the
    same rounds and positions at every step."""
    CALLS.clear()
    gen = torch.Generator().manual_seed(seed)
    for q in [prompt] + [1] * steps:
        k = torch.randn(1, 2, q, 4, generator=gen)
        scores = torch.rand(1, 2, declining.length + q, generator=gen)
        before = dict(CALLS)
        rounds = _step(declining, k, scores)
        assert rounds == _step(every, k, scores)
        assert torch.equal(declining.positions, every.positions)
        yield q, rounds, {name: CALLS.get(name, 0) - before.get(name, 0) for name in ("declining", "every")}


@settings(max_examples=40, deadline=None)
@given(sink=st.integers(1, 3), window=st.integers(1, 4), stride=st.integers(3, 5), prompt=st.integers(1, 30),
       steps=st.integers(1, 60), seed=st.integers(0, 2**16))
def test_declining_by_the_size_rule_keeps_what_asking_every_step_keeps(sink, window, stride, prompt, steps, seed) -> None:
    params = dict(sink=sink, window=window, stride=stride)
    declining, every = LayerCache(CountedBUZZ(**params)), LayerCache(AskedEveryStep(**params))
    for q, rounds, asked in _asked_in_lockstep(declining, every, prompt, steps, seed):
        if q == 1 and not rounds:  # the rule kept every token: not asked (the other asked once, in vain)
            assert asked == {"declining": 0, "every": 1}
        else:  # evicting, or a prompt chunk: asked alike (one call per round and one that declines)
            assert asked["declining"] == asked["every"] == len(rounds) + 1


@settings(max_examples=30, deadline=None)
@given(sink=st.integers(1, 3), window=st.integers(1, 4), stride=st.integers(3, 5), prompt=st.integers(1, 40),
       steps=st.integers(1, 60), seed=st.integers(0, 2**16))
def test_a_composition_declines_by_its_decode_policys_size_rule(sink, window, stride, prompt, steps, seed) -> None:
    """SnapKV then BUZZ (snapkv_buzz) declares no size rule of both phases (SnapKV cuts a prompt
    only) but its decode steps' (BUZZ's): a decode step at which BUZZ keeps every token does not
    ask select (it was asked at every step: ~35 us a layer more, SmolLM2-135M shapes, 2,048-token prompt),
    and the layer keeps what asking every step keeps."""
    from kvpolicy import SnapKV, compose

    params = dict(sink=sink, window=window, stride=stride)
    cap = CountedBUZZ(**params).capacity
    declining, every = (LayerCache(compose(prefill=SnapKV(size=cap - 1, window=1), decode=decode(**params)))
                        for decode in (CountedBUZZ, AskedEveryStep))
    for q, rounds, asked in _asked_in_lockstep(declining, every, prompt, steps, seed):
        if q == 1:
            # BUZZ keeping every token is not asked (the other is, in vain); evicting, asked alike
            assert asked == ({"declining": 0, "every": 1} if not rounds else {"declining": len(rounds) + 1, "every": len(rounds) + 1})


@settings(max_examples=30, deadline=None)
@given(heavy=st.integers(1, 4), recent=st.integers(1, 4), pads=st.integers(1, 6), prompt=st.integers(2, 12),
       steps=st.integers(1, 20), seed=st.integers(0, 2**16))
def test_a_one_token_rule_evicts_one_token_in_each_row_at_its_limit_only(heavy, recent, pads, prompt, steps, seed) -> None:
    """Row 1 is left-padded by ``pads``: it holds fewer tokens and reaches the limit later."""
    policy = H2O(heavy=heavy, recent=recent)
    limit = policy.decode_eviction.limit
    layer = LayerCache(policy)
    gen = torch.Generator().manual_seed(seed)
    q = prompt + pads
    valid = torch.ones(2, q, dtype=torch.bool)
    valid[1, :pads] = False
    K, _ = layer.append(torch.randn(2, 2, q, 4, generator=gen), torch.randn(2, 2, q, 4, generator=gen), valid=valid)
    layer.accumulate(torch.rand(2, 2, K.shape[2], generator=gen).masked_fill(~valid[:, None, :], 0.0))
    layer.evict()
    for _ in range(steps):
        before = layer.lengths
        K, _ = layer.append(torch.randn(2, 2, 1, 4, generator=gen), torch.randn(2, 2, 1, 4, generator=gen))
        layer.accumulate(torch.rand(2, 2, K.shape[2], generator=gen))
        rounds = layer.evict()
        after = layer.lengths
        expected = [n + 1 if n + 1 <= limit else limit for n in before]
        assert after == expected
        assert rounds == ([(limit + 1, limit)] if any(n + 1 > limit for n in before) else [])


@pytest.mark.parametrize("copier", [copy.deepcopy, lambda layer: pickle.loads(pickle.dumps(layer))], ids=["deepcopy", "pickle"])
def test_a_copied_layer_keeps_declining_by_its_size_rule(copier) -> None:
    CALLS.clear()
    layer = LayerCache(CountedBUZZ(sink=1, window=2, stride=3))
    gen = torch.Generator().manual_seed(0)
    _step(layer, torch.randn(1, 1, 12, 4, generator=gen), torch.rand(1, 1, 12, generator=gen))
    twin = copier(layer)
    for _ in range(6):
        k, s = torch.randn(1, 1, 1, 4, generator=gen), torch.rand(1, 1, 20, generator=gen)
        calls = [CALLS.get("declining", 0)]
        rounds = _step(layer, k, s)
        calls.append(CALLS["declining"])
        assert _step(twin, k, s) == rounds
        calls.append(CALLS["declining"])
        assert torch.equal(layer.positions, twin.positions)
        # the copy asks exactly as the original: not at all where the size rule keeps every token
        assert calls[2] - calls[1] == calls[1] - calls[0] == (len(rounds) + 1 if rounds else 0)
