"""AdaKV over a layer whose KV heads are split over processes (:class:`kvpolicy.policies.ShardedAdaKV`).

Each "process" is a thread running the NumPy reference (``kvpolicy_numpy.replay``) on its own heads'
logits and keys, with a :class:`HeadExchange` between the threads; every step, each keeps per head
exactly what AdaKV keeps on the whole layer, in rows as wide as its own widest head. The torch
backend under DeepSpeed is held to the single process in tests/integrations/test_deepspeed_multi.py (2 ranks).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvpolicy_numpy
from kvpolicy import H2O, AdaKV, CacheView
from kvpolicy.testing.strategies import adakv_policies
from kvpolicy.driver import PolicyError, check_capacity_kept, check_keep
from kvpolicy.policies import HeadExchange, ShardedAdaKV

class Threads:
    """A :class:`HeadExchange` between threads, one a process, holding ``sizes`` heads each."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes
        self.parts: dict[int, np.ndarray] = {}
        self.barrier = threading.Barrier(len(sizes), timeout=30)
        self.calls = [0] * len(sizes)

    def rank(self, r: int) -> HeadExchange:
        threads = self

        class Rank:
            heads, start = sum(threads.sizes), sum(threads.sizes[:r])

            def gather(self, x: Any, fill: Any) -> Any:
                threads.calls[r] += 1
                threads.parts[r] = x.cpu().numpy() if hasattr(x, "cpu") else np.asarray(x)  # (NumPy or torch)
                threads.barrier.wait()
                m = max(p.shape[-1] for p in threads.parts.values())
                out = np.concatenate(
                    [np.pad(threads.parts[i], ((0, 0), (0, 0), (m - threads.parts[i].shape[-1], 0)), constant_values=fill)
                     for i in range(len(threads.sizes))], axis=1,
                )  # fmt: skip
                threads.barrier.wait()  # nobody writes its next part before all have read this one
                if hasattr(x, "cpu"):  # the torch backend's tensors
                    import torch

                    return torch.from_numpy(np.ascontiguousarray(out))
                return out

        return Rank()


def sharded_replays(policy: AdaKV, sizes: list[int], logits: np.ndarray, prompt: int, keys: np.ndarray,
                    replay: Any = kvpolicy_numpy.replay) -> tuple[list[Any], list[int]]:
    """Each process's ``replay`` of its heads (threads), and how often each gathered."""
    exchange, traces, errors = Threads(sizes), [None] * len(sizes), []

    def run(r: int) -> None:
        lo, hi = sum(sizes[:r]), sum(sizes[: r + 1])
        try:
            traces[r] = replay(ShardedAdaKV(policy, exchange.rank(r)), logits[:, lo:hi], prompt, keys=keys[:, lo:hi])
        except BaseException as e:  # (the others must not wait for this one)
            errors.append(e)
            exchange.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(sizes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return traces, exchange.calls


def check_shares(whole: Any, traces: list[Any], calls: list[int], sizes: list[int]) -> None:
    """Every process's heads keep, at every step, what the whole layer's replay keeps for them."""
    for t, kept in enumerate(whole.kept):
        if kept is None:
            continue
        wide = kept.shape[-1]
        for r, trace in enumerate(traces):
            lo, hi = sum(sizes[:r]), sum(sizes[: r + 1])
            mine = trace.kept[t]
            k = mine.shape[-1]
            assert k <= wide and (kept[lo:hi, : wide - k] == -1).all(), (t, r)
            np.testing.assert_array_equal(mine, kept[lo:hi, wide - k :], err_msg=f"step {t} process {r}")
            # a process's rows are as wide as its widest head (one hole if its heads keep nothing)
            assert (mine[:, 0] >= 0).any() or (k == 1 and (mine == -1).all())
    assert len(set(calls)) == 1  # every process gathered as often (the collectives pair up)
    assert calls[0] == 2 * len(whole.evictions)  # positions and scores, only in a round that evicts


CASES = (adakv_policies(), st.lists(st.integers(1, 2), min_size=2, max_size=3), st.integers(2, 26), st.data())


def draw_layer(sizes: list[int], steps: int, data: Any) -> tuple[int, np.ndarray, np.ndarray]:
    prompt = data.draw(st.integers(0, steps - 1))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    heads = sum(sizes)
    return prompt, rng.normal(size=(steps, heads, steps)), rng.normal(size=(steps, heads, 4))


@given(*CASES)
@settings(max_examples=60, deadline=None)
def test_each_process_keeps_what_adakv_keeps_on_the_whole_layer(policy, sizes, steps, data) -> None:
    prompt, logits, keys = draw_layer(sizes, steps, data)
    whole = kvpolicy_numpy.replay(policy, logits, prompt, keys=keys)
    check_shares(whole, *sharded_replays(policy, sizes, logits, prompt, keys), sizes)


@given(*CASES)
@settings(max_examples=25, deadline=None)
def test_torch_layer_caches_keep_what_one_layer_cache_keeps(policy, sizes, steps, data) -> None:
    """The torch backend (LayerCache: no size rule, so asked every step; rows as wide as the
    process's widest head, grown up to the whole layer's head capacity)."""
    pytest.importorskip("torch")
    import kvpolicy_torch

    prompt, logits, keys = draw_layer(sizes, steps, data)
    whole = kvpolicy_torch.replay(policy, logits, prompt, keys=keys)
    traces, calls = sharded_replays(policy, sizes, logits, prompt, keys, replay=kvpolicy_torch.replay)
    check_shares(whole, traces, calls, sizes)


def view_of(positions: np.ndarray, scores: np.ndarray, adakv: AdaKV, state: dict[str, int] | None = None) -> Any:
    return CacheView(positions, scores, positions.shape[-1], adakv.init_state() if state is None else state)


def test_a_process_whose_heads_lose_nothing_still_answers() -> None:
    """Head 0 attends broadly and keeps every token; the eviction falls on the other process's head,
    and the first process still answers (all its slots), so both record the round."""
    scores = np.array([[[5.0, 5, 5, 5], [9, 0, 0, 1]]])
    positions = np.broadcast_to(np.arange(4), (1, 2, 4))

    class Rank0:
        heads, start = 2, 0

        def gather(self, x: np.ndarray, fill: Any) -> np.ndarray:
            return np.concatenate([x, (positions if fill == -1 else scores)[:, 1:]], axis=1)

    adakv = AdaKV(H2O(heavy=2, recent=1), alpha_safeguard=0.0)  # 2 heads x 3 tokens, no floor
    assert adakv.select(view_of(positions, scores, adakv)).tolist() == [[[0, 1, 2, 3], [-1, -1, 0, 3]]]
    share = ShardedAdaKV(adakv, Rank0())
    state = adakv.init_state()
    keep = share.select(view_of(positions[:, :1], scores[:, :1], adakv, state))
    assert keep.tolist() == [[[0, 1, 2, 3]]] and state == {"seen": 4, "kept": 3}
    check_keep(share, keep, positions[:, :1])  # keeping every slot: allowed for a process's share
    with pytest.raises(PolicyError, match="asked to evict but kept 4 of 4"):
        check_keep(adakv, keep, positions[:, :1])  # not for a whole layer
    check_capacity_kept(share, 4, positions[:, :1])  # (its heads hold more than the layer's mean: allowed)


def test_rules_and_refusals() -> None:
    ex = Threads([2, 1]).rank(1)
    share = ShardedAdaKV(AdaKV(H2O(6, 2), 0.25), ex)
    assert share.size_rule() is None and share.decode_eviction is None  # a process's count says nothing of the layer's
    assert share.ragged_heads and share.sharded_heads and not AdaKV(H2O(6, 2)).sharded_heads
    assert share.capacity == 9 and share.head_capacity(1) == AdaKV(H2O(6, 2), 0.25).head_capacity(3) == 21
    assert share.score_statistic == "accumulate" and share.init_state() == {"seen": 0, "kept": 0}
    assert share.for_layer(3, 30) is share
    with pytest.raises(ValueError, match="adakv must be an AdaKV"):
        ShardedAdaKV(H2O(6, 2), ex)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="exchange must be a HeadExchange"):
        ShardedAdaKV(AdaKV(H2O(6, 2)), object())  # type: ignore[arg-type]

    class Bad:
        heads, start = 2, 2

        def gather(self, x: Any, fill: Any) -> Any:
            return x

    with pytest.raises(ValueError, match=r"exchange.start must be an integer in \[0, 2\)"):
        ShardedAdaKV(AdaKV(H2O(6, 2)), Bad())
