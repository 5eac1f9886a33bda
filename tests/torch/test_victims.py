"""kvpolicy_torch/victims.py: the one-token victim search, held to plain scans.

* H2O's victim search among candidates (:class:`~kvpolicy_torch.LayerCache`, ``victim="lowest"`` on
  CPU). Above ``candidate_min_scores`` scores per step the store finds the lowest eligible score
  among a candidate set and the slots that became eligible since its last full search, trusting that
  accumulated scores only grow. Held here to the full scan on the same inputs: every decode step
  evicts the same slot, under ties (small integer scores), zeros, and received values that break
  monotonicity (negative, NaN), for one row and for batches.
* :class:`~kvpolicy_torch.LayerGroup`: the layers of one cache leave their one-token victims (H2O,
  TOVA) to one search per decode step for all of them. Held here to layers that evict alone on the
  same inputs: the same positions, scores and bias after every step, under ties (small integer
  scores), with reads of a layer between its eviction and the group's (which must finish it first),
  ragged rows, layers of other capacities, ``select_batch`` and ``reset``.
* ``first_argmin`` equals argmin's first index, ties and strided views included.
"""

from __future__ import annotations

import math
from typing import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from kvpolicy import H2O, TOVA, StreamingLLM  # noqa: E402
from kvpolicy_torch import LayerCache, LayerGroup  # noqa: E402
from strategies import h2o_policies, tova_policies  # noqa: E402

HEADS, DIM = 2, 2

received_values = st.one_of(
    st.integers(0, 3).map(float),  # small integers: exact ties everywhere
    st.floats(0, 1, allow_nan=False, width=32),
    st.sampled_from([-1.0, math.nan, math.inf]),  # not monotone (or infinite): the candidates are dropped
)


def _layers(policy: H2O, candidates: int) -> tuple[LayerCache, LayerCache]:
    fast, full = LayerCache(policy), LayerCache(policy)
    fast.candidate_min_scores, fast.candidates = 1, candidates
    full.candidate_min_scores = 1 << 60
    return fast, full


@given(
    heavy=st.integers(10, 30), recent=st.integers(1, 6), candidates=st.integers(1, 3), batch=st.integers(1, 2),
    prompt=st.integers(1, 40), steps=st.integers(1, 60), data=st.data(),
)
@settings(max_examples=200, deadline=None)
def test_candidate_search_evicts_what_the_full_scan_evicts(heavy, recent, candidates, batch, prompt, steps, data) -> None:
    policy = H2O(heavy=heavy, recent=recent)
    fast, full = _layers(policy, candidates)
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    kv = torch.randn(batch, HEADS, prompt, DIM, generator=g)
    for layer in (fast, full):
        layer.append(kv, kv)
    monotone_only = data.draw(st.booleans())
    values = st.integers(0, 3).map(float) if monotone_only else received_values
    for t in range(steps + 1):
        n = fast.slot_positions.shape[-1]
        received = torch.tensor(data.draw(st.lists(values, min_size=batch * HEADS * n, max_size=batch * HEADS * n)))
        received = received.view(batch, HEADS, n)
        for layer in (fast, full):
            layer.accumulate(received.clone())
            layer.evict()
        assert torch.equal(fast.positions, full.positions), t
        if t == steps:
            break
        token = torch.randn(batch, HEADS, 1, DIM, generator=g)
        for layer in (fast, full):
            layer.append(token, token)


def test_candidate_search_is_taken_and_searches_rarely() -> None:
    """A long decode with growing scores: the candidate path answers (its full searches are a few
    per hundred steps), and what it keeps equals the full scan's."""
    policy = H2O(heavy=300, recent=20)
    fast, full = _layers(policy, 8)
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(1, HEADS, 400, DIM, generator=g)
    for layer in (fast, full):
        layer.append(kv, kv)
    for _ in range(300):
        received = torch.rand(fast.slot_positions.shape, generator=g) ** 4  # a few tokens get most
        for layer in (fast, full):
            layer.accumulate(received)
            layer.evict()
        token = torch.randn(1, HEADS, 1, DIM, generator=g)
        for layer in (fast, full):
            layer.append(token, token)
    assert torch.equal(fast.positions, full.positions)
    assert full.candidate_searches == 0
    assert 1 <= fast.candidate_searches <= 150


def test_tova_never_takes_the_candidate_path() -> None:
    """TOVA's scores are the latest query's attention (they go down as well as up): the bound
    would not hold, so its victim is always found by the full scan."""
    from kvpolicy import TOVA

    layer = LayerCache(TOVA(size=40))
    layer.candidate_min_scores, layer.candidates = 1, 2
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(1, HEADS, 40, DIM, generator=g)
    layer.append(kv, kv)
    for _ in range(30):
        layer.accumulate(torch.rand(layer.slot_positions.shape, generator=g))
        layer.evict()
        token = torch.randn(1, HEADS, 1, DIM, generator=g)
        layer.append(token, token)
    assert layer.candidate_searches == 0


# ---------------------------------------------------------------------- LayerGroup: every layer's victims in one search
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


def test_layers_of_other_capacities_join_one_flat_tensor_and_are_searched_at_once() -> None:
    """PyramidKV-like: the layers' storages differ in slots, so they keep their own tensors
    through the prompt, move into the group's flat tensor at their decode steps, and from then on
    the group searches them at once; the kept tokens stay each layer's own eviction's."""
    group = LayerGroup(3)
    sizes = [(4, 4), (2, 2), (3, 1)]
    stack = [LayerCache(H2O(heavy=a, recent=b), group=group) for a, b in sizes]
    alone = [LayerCache(H2O(heavy=a, recent=b)) for a, b in sizes]
    _lockstep(stack, alone, torch.Generator().manual_seed(0), batch=2, steps=30)
    assert group.ragged and group.complete and not group.assembling
    assert group.batched_evictions > 20
    # the group's tensors hold each layer's slots once (no stacked copy of the widest)
    assert group.nbytes == sum(layer.slots for layer in stack) * 2 * HEADS * (8 + 4 + 4)
    for layer in stack:  # a reset leaves the group; the layers join again at the next sequence's decode steps
        layer.reset()
    assert not group.complete and group.nbytes == 0
    for layer in alone:
        layer.reset()
    _lockstep(stack, alone, torch.Generator().manual_seed(1), batch=1, steps=20)
    assert group.complete


@given(
    policy=st.one_of(h2o_policies(), tova_policies()), extra=st.lists(st.integers(0, 6), min_size=1, max_size=4),
    batch=st.integers(1, 2), prompt=st.integers(1, 20), steps=st.integers(1, 30), data=st.data(),
)
@settings(max_examples=100, deadline=None)
def test_layers_of_other_sizes_evict_what_each_evicts_alone(policy, extra, batch, prompt, steps, data) -> None:
    """Layers of different capacities (the same rule, each layer ``extra`` tokens larger, as
    PyramidKV's budgets make them) in one group keep exactly what each keeps alone: through the
    prompt, the move into the flat tensor, the search of every segment at once, compactions and
    reads between the layers' evictions."""
    rule = policy.decode_eviction
    if isinstance(policy, H2O):
        policies = [H2O(heavy=policy.heavy + e, recent=policy.recent, selection=policy.selection) for e in extra]
    else:
        policies = [TOVA(size=rule.limit + e, selection=policy.selection) for e in extra]
    group = LayerGroup(len(policies))
    grouped = [LayerCache(p, group=group) for p in policies]
    alone = [LayerCache(p) for p in policies]
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    for t in range(steps + 1):
        q = prompt if t == 0 else 1
        kv = torch.randn(batch, HEADS, q, DIM, generator=g)
        received = [torch.randint(0, 3, (batch, HEADS, 512), generator=g).float() for _ in policies]
        peek = data.draw(st.none() | st.integers(0, len(policies) - 1))
        peeked = _step(grouped, kv, received, peek)
        _step(alone, kv, received, None)
        if peek is not None:
            assert peeked == alone[peek].positions.tolist(), t
        for a, b in zip(grouped, alone):
            assert _state(a) == _state(b), t
            assert torch.equal(a.slot_positions, b.slot_positions)


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


# ---------------------------------------------------------------------- first_argmin: the rule's first index of the lowest
@pytest.mark.parametrize("n", [1, 7, 1024, 70_000, 100_003])
def test_first_argmin_equals_argmin_with_ties(n) -> None:
    """first_argmin (blocked on large CPU inputs) returns torch.argmin's first minimum, ties and
    -inf included."""
    from kvpolicy_torch import first_argmin

    g = torch.Generator().manual_seed(n)
    x = torch.randint(0, 5, (3, n), generator=g).to(torch.float32)  # many ties
    x[1, n // 2 :] = float("-inf") if n > 1 else x[1, n // 2 :]
    x[2] = float("inf")
    assert torch.equal(first_argmin(x), torch.argmin(x, dim=-1))


@given(
    rows=st.integers(1, 4), blocks=st.integers(16, 80), extra=st.integers(-1023, 1023), spare=st.integers(0, 50),
    levels=st.integers(1, 6), seed=st.integers(0, 2**16),
)  # fmt: skip
@settings(max_examples=40, deadline=None)
def test_first_argmin_on_strided_views_with_a_partial_block(rows, blocks, extra, spare, levels, seed) -> None:
    """The blocked search on a slice of a wider storage (as LayerCache passes it), with a partial
    last block, many ties and the minimum anywhere (the tail included): torch.argmin's answer."""
    from kvpolicy_torch import first_argmin

    n = blocks * 1024 + extra
    g = torch.Generator().manual_seed(seed)
    storage = torch.randint(0, levels, (rows, 2, n + spare), generator=g).to(torch.float32)
    view = storage[:, :, :n]
    assert torch.equal(first_argmin(view), torch.argmin(view, dim=-1))
