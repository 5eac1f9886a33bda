"""kvpolicy_torch.LayerGroup: the layers of one cache leave their one-token victims (H2O, TOVA)
to one search per decode step for all of them. Held here to layers that evict alone on the same
inputs: the same positions, scores and bias after every step, under ties (small integer scores),
with reads of a layer between its eviction and the group's (which must finish it first), ragged
rows, layers of other capacities, ``select_batch`` and ``reset``.
"""

from __future__ import annotations

from typing import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from kvpolicy import H2O, TOVA, StreamingLLM  # noqa: E402
from kvpolicy_torch import LayerCache, LayerGroup  # noqa: E402
from strategies import h2o_policies, tova_policies  # noqa: E402

HEADS, DIM = 2, 2


def _state(layer: LayerCache) -> tuple[list[list[list[int]]], list[list[list[float]]], list[int]]:
    return layer.positions.tolist(), layer.scores.tolist(), layer.lengths


def _step(layers: list[LayerCache], kv: torch.Tensor, received: list[torch.Tensor], peek: int | None) -> list[list[list[int]]] | None:
    """One decode (or prompt) step of every layer in order; layer ``peek``'s positions (if any)
    read right after its eviction, before the group has searched the others' victims."""
    seen = None
    for i, layer in enumerate(layers):
        K, _ = layer.append(kv, kv)
        layer.accumulate(received[i][..., : K.shape[2]].clone())
        layer.evict()
        if peek == i:
            seen = layer.positions.tolist()  # the group must free this layer's victims first
    return seen


def _lockstep(stack: list[LayerCache], alone: list[LayerCache], g: torch.Generator, *, batch: int, steps: int,
              after_step: Callable[[int], None] | None = None) -> None:
    """Decode steps through both stacks on the same inputs (small integer scores: ties); the same
    state after every step."""
    for t in range(steps):
        kv = torch.randn(batch, HEADS, 1, DIM, generator=g)
        received = [torch.randint(0, 3, (batch, HEADS, 40), generator=g).float() for _ in stack]
        _step(stack, kv, received, None)
        _step(alone, kv, received, None)
        assert [_state(x) for x in stack] == [_state(x) for x in alone], t
        if after_step is not None:
            after_step(t)


@given(
    policy=st.one_of(h2o_policies(), tova_policies()),
    layers=st.integers(1, 4), batch=st.integers(1, 2), prompt=st.integers(1, 20), steps=st.integers(1, 30),
    static=st.booleans(), data=st.data(),
)
@settings(max_examples=200, deadline=None)
def test_a_group_evicts_what_each_layer_evicts_alone(policy, layers, batch, prompt, steps, static, data) -> None:
    group = LayerGroup(layers)
    grouped = [LayerCache(policy, group=group, static_shapes=static) for _ in range(layers)]
    alone = [LayerCache(policy, static_shapes=static) for _ in range(layers)]
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    decode_evictions = 0
    for t in range(steps + 1):
        q = prompt if t == 0 else 1
        kv = torch.randn(batch, HEADS, q, DIM, generator=g)
        # small integers: exact ties everywhere (the earliest position must go first in both);
        # wide enough for every slot of a static store
        received = [torch.randint(0, 3, (batch, HEADS, 512), generator=g).float() for _ in range(layers)]
        peek = data.draw(st.none() | st.integers(0, layers - 1))
        before = alone[0].evictions
        peeked = _step(grouped, kv, received, peek)
        _step(alone, kv, received, None)
        if peek is not None:
            assert peeked == alone[peek].positions.tolist(), t
        # (a read between the layers' evictions makes the group finish layer by layer)
        decode_evictions += (alone[0].evictions - before) if t > 0 and peek is None else 0
        for a, b in zip(grouped, alone):
            assert _state(a) == _state(b), t
            assert torch.equal(a.slot_positions, b.slot_positions)
    if decode_evictions and not static:
        assert group.batched_evictions > 0  # the common flow took the group's search (shared selections too)
    if static:  # static shapes evict on the device, layer by layer (kvpolicy_torch.static): never deferred
        assert group.batched_evictions == 0


def test_one_search_per_step_for_every_layer() -> None:
    policy = H2O(heavy=4, recent=4)
    group = LayerGroup(3)
    stack = [LayerCache(policy, group=group) for _ in range(3)]
    kv = torch.randn(1, HEADS, 1, DIM)
    for t in range(20):
        _step(stack, kv, [torch.rand(1, HEADS, 40) for _ in stack], None)
    assert group.batched_evictions == 20 - policy.decode_eviction.limit  # every step since the cache filled up
    assert [layer.length for layer in stack] == [policy.decode_eviction.limit] * 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_shared_selection_is_searched_by_the_group_on_the_heads_summed_scores(dtype) -> None:
    """TOVA's default (``selection="shared"``, one victim per row for all heads): the group sums
    every layer's heads and searches them at once, and keeps what each layer alone keeps on
    continuous random scores (the heads' sums rounded the same way in both)."""
    policy = TOVA(size=6)
    assert policy.selection == "shared"
    group = LayerGroup(3)
    stack = [LayerCache(policy, group=group) for _ in range(3)]
    alone = [LayerCache(policy) for _ in range(3)]
    g = torch.Generator().manual_seed(0)
    for t in range(40):
        kv = torch.randn(2, 3, 1, DIM, generator=g, dtype=dtype)
        received = [torch.rand(2, 3, 40, generator=g, dtype=dtype) for _ in stack]
        _step(stack, kv, received, None)
        _step(alone, kv, received, None)
        assert [_state(x) for x in stack] == [_state(x) for x in alone], t
    assert group.batched_evictions == 40 - policy.decode_eviction.limit
    assert all(len({tuple(h) for h in layer.positions[r].tolist()}) == 1 for layer in stack for r in range(2))


def test_layers_of_other_capacities_evict_alone() -> None:
    """PyramidKV-like: one layer's storage differs, so no layer defers to the group."""
    group = LayerGroup(2)
    stack = [LayerCache(H2O(heavy=4, recent=4), group=group), LayerCache(H2O(heavy=2, recent=2), group=group)]
    alone = [LayerCache(H2O(heavy=4, recent=4)), LayerCache(H2O(heavy=2, recent=2))]
    _lockstep(stack, alone, torch.Generator().manual_seed(0), batch=1, steps=30)
    assert not group.complete and group.batched_evictions == 0


def test_ragged_rows_select_batch_and_reset_leave_the_group_correct() -> None:
    policy = H2O(heavy=3, recent=3)
    group = LayerGroup(2)
    stack = [LayerCache(policy, group=group) for _ in range(2)]
    alone = [LayerCache(policy) for _ in range(2)]
    g = torch.Generator().manual_seed(1)
    valid = torch.tensor([[True] * 8, [False] * 3 + [True] * 5])  # a left-padded row: its own schedule
    kv = torch.randn(2, HEADS, 8, DIM, generator=g)
    for layer in stack + alone:
        layer.append(kv, kv, valid=valid)
        layer.accumulate(torch.ones(2, HEADS, 8))
        layer.evict()

    def swap_rows(t: int) -> None:
        if t == 6:
            for layer in stack + alone:
                layer.select_batch(torch.tensor([1, 0]))  # rows swap: tensors of its own

    _lockstep(stack, alone, g, batch=2, steps=12, after_step=swap_rows)
    assert not group.complete
    for layer in stack:
        layer.reset()
    assert not group.complete  # a reset layer rejoins at its next allocation
    for t in range(12):
        _step(stack, torch.randn(1, HEADS, 1, DIM, generator=g), [torch.rand(1, HEADS, 40, generator=g) for _ in stack], None)
    assert group.complete and group.batched_evictions > 0


def test_oldest_rules_do_not_defer() -> None:
    """StreamingLLM's ring needs no search: its evictions stay per layer."""
    group = LayerGroup(2)
    stack = [LayerCache(StreamingLLM(sink=2, window=4), group=group) for _ in range(2)]
    for t in range(12):
        _step(stack, torch.randn(1, HEADS, 1, DIM), [torch.rand(1, HEADS, 40) for _ in stack], None)
    assert group.batched_evictions == 0 and [x.positions[0, 0].tolist() for x in stack] == [[0, 1, 8, 9, 10, 11]] * 2


def test_bad_groups() -> None:
    with pytest.raises(ValueError, match="layers must be an integer >= 1"):
        LayerGroup(0)
    group = LayerGroup(1)
    LayerCache(H2O(heavy=1, recent=1), group=group)
    with pytest.raises(ValueError, match="made for 1 layers"):
        LayerCache(H2O(heavy=1, recent=1), group=group)
    with pytest.raises(ValueError, match="group must be a LayerGroup"):
        LayerCache(H2O(heavy=1, recent=1), group="all")  # type: ignore[arg-type]


def test_a_group_frees_its_storage_when_every_layer_left() -> None:
    group = LayerGroup(2)
    stack = [LayerCache(H2O(heavy=2, recent=2), group=group) for _ in range(2)]
    for layer in stack:
        layer.append(torch.randn(1, HEADS, 3, DIM), torch.randn(1, HEADS, 3, DIM))
    assert group.complete and group.nbytes > 0
    for layer in stack:
        layer.select_batch(torch.tensor([0, 0]))  # beam-search style: each layer takes tensors of its own
    assert not group.complete and group.nbytes == 0
    assert [layer.length for layer in stack] == [3, 3]


@given(prompt_chunks=st.integers(1, 3), steps=st.integers(1, 25), layers=st.integers(1, 3), batch=st.integers(1, 2),
       data=st.data())
@settings(max_examples=60, deadline=None)
def test_a_chunked_prefill_gives_its_room_back_and_the_group_stays_whole(prompt_chunks, steps, layers, batch, data) -> None:
    """A chunked prefill's room for a next chunk (``prompt_chunk``) is given back at the first decode
    step: every layer moves to the group's new, smaller tensors (``LayerGroup.move``), keeps what
    layers that never had the room keep (the same positions and scores), and the group's one search
    a step resumes at the next step (an earlier step's deferral left waiting once made it search
    layer by layer for good)."""
    policy, chunk = H2O(heavy=3, recent=3), 8
    group = LayerGroup(layers)
    roomy = [LayerCache(policy, group=group, prompt_chunk=chunk) for _ in range(layers)]
    plain = [LayerCache(policy) for _ in range(layers)]
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    for t in range(prompt_chunks + steps):
        q = chunk if t < prompt_chunks else 1
        kv = torch.randn(batch, HEADS, q, DIM, generator=g)
        received = [torch.randint(0, 3, (batch, HEADS, 64), generator=g).float() for _ in range(layers)]
        _step(roomy, kv, received, None)
        _step(plain, kv, received, None)
        for a, b in zip(roomy, plain):
            assert _state(a) == _state(b), t
        if t == prompt_chunks - 1:  # the room for a next chunk: one chunk more than the storage without it
            assert [layer.slots for layer in roomy] == [layer.slots + chunk for layer in plain]
        if t >= prompt_chunks:
            assert [layer.slots for layer in roomy] == [layer.slots for layer in plain]  # the room given back
    searched = group.batched_evictions
    _step(roomy, torch.randn(batch, HEADS, 1, DIM, generator=g), [torch.rand(batch, HEADS, 64, generator=g)] * layers, None)
    assert group.complete and group.batched_evictions == searched + 1
