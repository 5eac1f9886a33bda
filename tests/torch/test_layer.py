"""kvpolicy_torch.LayerCache (kvpolicy_torch/layer.py): what it refuses, its NaN rule, and the ring of
"oldest" evictions (StreamingLLM, the local window).

A decode step's append refills the slot the previous step's eviction freed, so the tokens after
the sinks go round the storage and nothing is compacted while decoding. Slot order is then a
rotation of position order; everything that reads the cache in order (``positions``, ``keys``,
``kept``, ``to_slots``), a later prompt chunk (multi-turn) and a general eviction must see the
tokens in position order again. Held here to a literal ordered model: a Python list of kept
positions that :meth:`EvictionPolicy.evict` decides on (the NumPy reference's own loop), with
each key and value a known function of its position.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from kvpolicy import CacheView, FullCache, LocalWindow, StreamingLLM  # noqa: E402
from kvpolicy_torch import LayerCache, received_attention  # noqa: E402

HEADS, DIM = 2, 3


def _kv(positions: list[int], batch: int) -> torch.Tensor:
    """``[batch, heads, q, dim]`` keys whose content names the position (and the head)."""
    p = torch.tensor(positions, dtype=torch.float64)
    head = torch.arange(HEADS, dtype=torch.float64)[:, None, None]
    kv = p[None, :, None] + 1000.0 * head + torch.arange(DIM, dtype=torch.float64) / 10
    return kv[None].expand(batch, -1, -1, -1).contiguous()


def _reference_evict(policy, kept: list[int], seen: int, state: dict, phase: str) -> list[int]:
    while True:
        pos = np.array(kept)[None, None].repeat(HEADS, 1)
        keep = policy.evict(CacheView(pos, np.zeros(pos.shape), seen, state, phase))
        if keep is None:
            return kept
        kept = [kept[i] for i in np.asarray(keep)[0, 0].tolist()]


policies = st.one_of(
    st.builds(StreamingLLM, sink=st.integers(1, 3), window=st.integers(1, 9)),
    st.builds(LocalWindow, window=st.integers(1, 9)),
)
#: mostly decode steps (q = 1), now and then a prompt chunk (a new turn)
schedules = st.lists(st.one_of(st.just(1), st.just(1), st.just(1), st.integers(2, 6)), min_size=1, max_size=60)


def _shift(keys: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """A stand-in for RoPE in ``key_shift``: any function of (original key, shift) tells whether the
    store applied the right shift to the right slots from the right originals."""
    return keys + 0.5 * torch.tensor(delta, dtype=keys.dtype).view(-1, 1, 1, 1)


@given(policy=policies, first=st.integers(1, 12), schedule=schedules, batch=st.integers(1, 2),
       key_shift=st.booleans(), read_keys=st.booleans())
@settings(max_examples=150, deadline=None)
def test_ring_reads_in_position_order_and_matches_the_ordered_model(policy, first, schedule, batch, key_shift, read_keys) -> None:
    """With ``key_shift`` (pos-shift in the storage) a decode step's returned sink keys are their
    originals shifted by the tokens evicted so far; every other read sees the originals."""
    layer = LayerCache(policy, key_shift=_shift if key_shift else None)
    kept: list[int] = []
    state = policy.init_state()
    seen = 0
    for q in [first, *schedule]:
        new = list(range(seen, seen + q))
        keys, values = layer.append(_kv(new, batch), _kv(new, batch))
        # what the queries attend: every kept token and the new ones, each slot holding its own key
        attended = kept + new
        pos = layer.slot_positions
        live = pos[0, 0][pos[0, 0] >= 0]
        assert sorted(live.tolist()) == attended
        expect = _kv(pos[0, 0].clamp(min=0).tolist(), 1)[0]  # [heads, n, dim]: original keys per slot
        if layer.keys_shifted:
            sink, delta = layer.shift()
            assert q == 1 and key_shift and sink == policy.sink and delta == [seen - len(kept)] * batch
            expect = torch.cat([_shift(expect[None, :, :sink], delta[:1])[0], expect[:, sink:]], dim=1)
        else:
            assert not (key_shift and q == 1 and isinstance(policy, StreamingLLM) and seen > len(kept))
        for h in range(HEADS):
            slots = (pos[0, h] >= 0).nonzero().flatten()
            torch.testing.assert_close(keys[0, h, slots], expect[h, slots])
        if q > 1:  # a chunk: causal inside it, everything kept before it
            mask = layer.chunk_mask()[0, 0]
            for i in range(q):
                sees = pos[0, 0][mask[i]].tolist()
                assert sorted(sees) == kept + new[: i + 1]
        if policy.uses_scores:
            layer.accumulate(torch.zeros(pos.shape, dtype=torch.float64))
        layer.evict()
        seen += q
        kept = _reference_evict(policy, attended, seen, state, "prefill" if q > 1 else "decode")
        assert layer.positions[:, 0].tolist() == [kept] * batch
        if read_keys:
            torch.testing.assert_close(layer.keys, _kv(kept, batch))
        assert layer.kept(batch - 1)[0][0].tolist() == kept
        assert layer.slots <= policy.capacity  # the ring needs no slack
    # to_slots places ordered values back at the slots they belong to
    layer.append(_kv([seen], batch), _kv([seen], batch))
    ordered = layer.positions.to(torch.float64)
    placed = layer.to_slots(ordered)
    pos = layer.slot_positions
    assert torch.equal(placed, torch.where(pos >= 0, pos.to(torch.float64), 0.0))


def test_ring_refills_the_freed_slot_and_never_compacts() -> None:
    """StreamingLLM(sink=1, window=3) at its limit: each decode step's new token takes the slot
    of the token the previous step evicted, so the storage never moves."""
    layer = LayerCache(StreamingLLM(sink=1, window=3))
    layer.append(_kv([0, 1, 2, 3], 1), _kv([0, 1, 2, 3], 1))
    layer.evict()
    slots_seen = []
    for t in range(4, 12):
        layer.append(_kv([t], 1), _kv([t], 1))
        slots_seen.append(layer.slot_positions[0, 0].tolist())
        layer.evict()
    assert layer.slots == 5 and layer.compaction_period is None
    # slot 0 holds the sink; slots 1-4 go round: the newest token replaces the oldest
    assert slots_seen[:5] == [
        [0, 1, 2, 3, 4],
        [0, 5, 2, 3, 4],
        [0, 5, 6, 3, 4],
        [0, 5, 6, 7, 4],
        [0, 5, 6, 7, 8],
    ]
    assert layer.positions[0, 0].tolist() == [0, 9, 10, 11]
    assert layer.bias is None  # no hole when the queries attend: the plain attention path serves it


# ---------------------------------------------------------------------------- validation: bad input raises a ValueError naming the parameter

def test_layer_cache_refuses_steps_out_of_order_and_changed_inputs() -> None:
    """LayerCache: evict()/accumulate() before any append, and keys whose head_dim, dtype or
    batch/heads differ from the first append, get a ValueError saying what is wrong (no raw
    TypeError, no silent cast)."""
    torch = pytest.importorskip("torch")
    from kvpolicy import H2O
    from kvpolicy_torch import LayerCache

    layer = LayerCache(H2O(2, 2))
    with pytest.raises(ValueError, match="append\\(\\) first"):
        layer.evict()
    with pytest.raises(ValueError, match="append\\(\\) first"):
        layer.accumulate(torch.zeros(1, 2, 1))
    k = torch.zeros(1, 2, 1, 4)
    layer.append(k, k)
    layer.accumulate(torch.zeros(1, 2, 1))
    layer.evict()
    with pytest.raises(ValueError, match="head_dim changed"):
        layer.append(torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8))
    with pytest.raises(ValueError, match="dtype changed"):
        layer.append(k.double(), k.double())
    with pytest.raises(ValueError, match="batch and kv_heads changed"):
        layer.append(torch.zeros(2, 2, 1, 4), torch.zeros(2, 2, 1, 4))
    with pytest.raises(ValueError, match="must be real"):
        layer.append(k, k)
        layer.accumulate(torch.zeros(1, 2, 2, dtype=torch.complex64))


def test_layer_cache_nan_scores_count_as_minus_inf() -> None:
    """A NaN received score (an fp16 overflow upstream) is accumulated as -inf: H2O's one-token
    eviction takes that token first, as the NumPy rule (CacheView.ranking_scores) does."""
    torch = pytest.importorskip("torch")
    from kvpolicy import H2O
    from kvpolicy_torch import LayerCache

    layer = LayerCache(H2O(2, 1))
    for t in range(4):
        k = torch.zeros(1, 1, 1, 2)
        layer.append(k, k)
        received = torch.ones(1, 1, layer.slot_positions.shape[-1])
        if t == 1:
            received[..., 1] = float("nan")  # token 1 gets a NaN
        layer.accumulate(received * (layer.slot_positions >= 0))
        layer.evict()
    assert 1 not in layer.positions[0, 0].tolist() and layer.length == 3


@pytest.mark.parametrize("layers", [1, 2], ids=["alone", "group"])
@pytest.mark.parametrize("selection", ["per_head", "shared"])
@pytest.mark.parametrize("kind", ["h2o", "tova"])
@pytest.mark.parametrize("batch", [1, 2])
def test_a_nan_query_never_evicts_a_hole(kind, selection, batch, layers) -> None:
    """A NaN query (an overflow upstream) makes a decode step's whole attention NaN, the holes'
    included: every kept token's score becomes -inf (the NaN rule) and the victim is the earliest
    kept token outside the recent ones, never a hole. Each layer then holds exactly ``length``
    tokens (alone, and in a ``LayerGroup``, whose one search serves both layers)."""
    from kvpolicy import H2O, TOVA
    from kvpolicy_torch import LayerGroup

    policy = H2O(3, 1, selection=selection) if kind == "h2o" else TOVA(size=4, recent=1, selection=selection)
    group = LayerGroup(layers) if layers > 1 else None
    stack = [LayerCache(policy, group=group) for _ in range(layers)]
    rng = torch.Generator().manual_seed(0)
    nan_steps = (8, 11, 12)
    for t in range(16):
        before = [layer.positions[0, 0].tolist() if t else [] for layer in stack]
        for layer in stack:
            kv = torch.randn(batch, 1, 1, 4, generator=rng)
            layer.append(kv, kv)
            query = torch.full((batch, 1, 1, 4), float("nan")) if t in nan_steps else torch.randn(batch, 1, 1, 4, generator=rng)
            layer.attend(query, 0.5)
            layer.evict()
        for layer, was in zip(stack, before):
            layout = layer.unsynced()
            held = layout.store.positions[:, :, : max(layout.rows.front)] >= 0
            assert held.sum(dim=-1).tolist() == [[layer.length]] * batch, (t, layout.store.positions.tolist())
            if t in nan_steps:  # all kept tied at -inf: the earliest outside the recent one goes
                assert layer.positions[0, 0].tolist() == (was + [t])[1:], (t, was)

# ---------------------------------------------------------------------------- the index_select gather of broadcast keep arrays
from kvpolicy import BUZZ, H2O  # noqa: E402


def test_layer_cache_index_select_path_keeps_the_same_tokens() -> None:
    """Shared keeps (StreamingLLM's broadcast arrays; shared selection) take index_select;
    per-head keeps (BUZZ) take gather: both against the NumPy reference."""
    import kvpolicy_numpy

    for policy in (StreamingLLM(sink=2, window=5), LocalWindow(6), H2O(3, 3, selection="shared"), BUZZ(1, 3, 3, 6)):
        rng = np.random.default_rng(1)
        logits = rng.normal(size=(30, 1, 30))
        trace = kvpolicy_numpy.replay(policy, logits)
        layer = LayerCache(policy)
        vals = torch.arange(30, dtype=torch.float64)
        for t in range(30):
            k = v = torch.full((1, 1, 1, 2), float(t), dtype=torch.float64)
            layer.append(k, v)
            cached = layer.slot_positions[0]  # slot order, -1 at holes
            rows = torch.as_tensor(logits[t, 0])[cached.clamp(min=0)].masked_fill(cached < 0, float("-inf"))
            layer.accumulate(torch.softmax(rows, dim=-1)[None])
            layer.evict()
            assert layer.positions[0].tolist() == trace.kept[t].tolist(), (policy, t)
            assert layer.keys[0, 0, :, 0].tolist() == vals[layer.positions[0, 0]].tolist()  # K/V moved with positions


# ---------------------------------------------------------------------------- positions written ahead (update.ready_tail)


@pytest.mark.parametrize("policy", [H2O(4, 2), StreamingLLM(sink=1, window=4), BUZZ(1, 3, 3, 6)], ids=repr)
def test_one_row_tail_written_ahead_never_shows(policy) -> None:
    """One row's frontier writes store only the key and the value: the slots past its frontier
    hold their position, score and bias ahead of time (``update.ready_tail``). A batch of two
    equal rows writes every field itself, so both keep the same tokens at every step; and the
    tail is holes again (position -1) whenever it is not ready: after BUZZ's compactions and a
    restored snapshot."""
    one, two = LayerCache(policy), LayerCache(policy)
    rng = torch.Generator().manual_seed(3)
    snap = None
    for t in range(40):
        k = torch.randn(1, HEADS, 1, DIM, generator=rng, dtype=torch.float64)
        for layer, kv in ((one, k), (two, k.expand(2, -1, -1, -1).contiguous())):
            K, _ = layer.append(kv, kv)
            layer.accumulate(torch.rand(1, HEADS, K.shape[2], generator=torch.Generator().manual_seed(t), dtype=torch.float64).expand(kv.shape[0], -1, -1))
            layer.evict()
        assert one.positions[0].tolist() == two.positions[0].tolist() == two.positions[1].tolist(), t
        layout = one.unsynced()
        front, seen = layout.rows.front[0], layout.rows.seen[0]
        tail = layout.store.positions[0, :, front:]
        if layout.tail_ready:
            assert tail.tolist() == [list(range(seen, seen + tail.shape[1]))] * HEADS, t
        else:  # holes in full: position -1, score +inf, bias -inf
            assert bool((tail == -1).all()), t
            assert bool((layout.store.scores[0, :, front:] == math.inf).all()), t
            assert bool((layout.store.bias[0, :, front:] == -math.inf).all()), t
        if t == 20:
            snap = one.snapshot()
            assert bool((snap.positions[0, :, front:] == -1).all())  # (a copy shows holes past the frontier)
        if t == 25:
            one.restore(snap)
            break
    assert not one.unsynced().tail_ready and bool((one.unsynced().store.positions[0, :, one.unsynced().rows.front[0]:] == -1).all())


@pytest.mark.parametrize("policy", [FullCache(), H2O(8, 8)], ids=repr)
def test_rows_repeated_after_a_ready_tail_attend_to_their_own_tokens(policy) -> None:
    """A one-row layer readies the slots past its frontier (score and bias 0); repeating that row
    (``select_batch``, beam search) and then a left-padded chunk gives rows different frontiers,
    so a shorter row's attention covers slots past its own frontier: they must be holes in full
    (bias ``-inf``), not the ready tail's bias 0 (a zero key took part in the softmax before).
    Every decode output equals exact attention over the row's own tokens (no eviction happens:
    the budgets hold them all)."""
    rng = torch.Generator().manual_seed(1)

    def rnd(*shape):
        return torch.randn(*shape, generator=rng, dtype=torch.float64)

    layer = LayerCache(policy, reserve=50)
    k, v = rnd(1, 1, 1, 2), rnd(1, 1, 1, 2)
    layer.append(k, v)
    layer.attend(rnd(1, 1, 1, 2), 0.5)
    layer.evict()
    seen = [[(k[0, 0, 0], v[0, 0, 0])] for _ in range(3)]
    layer.select_batch(torch.tensor([0, 0, 0]))
    valid = torch.tensor([[j >= p for j in range(5)] for p in (3, 1, 3)])
    k, v = rnd(3, 1, 5, 2), rnd(3, 1, 5, 2)
    K, _ = layer.append(k, v, valid=valid)
    layer.accumulate(received_attention(rnd(3, 1, 5, 2), K, 0.5, mask=layer.chunk_mask(), query_valid=layer.query_valid))
    layer.evict()
    for b in range(3):
        seen[b] += [(k[b, 0, j], v[b, 0, j]) for j in range(5) if valid[b, j]]
    for step in range(3):
        k, v, q = rnd(3, 1, 1, 2), rnd(3, 1, 1, 2), rnd(3, 1, 1, 2)
        layer.append(k, v)
        out = layer.attend(q, 0.5)
        layer.evict()
        for b in range(3):
            seen[b].append((k[b, 0, 0], v[b, 0, 0]))
            keys, values = torch.stack([x for x, _ in seen[b]]), torch.stack([y for _, y in seen[b]])
            want = torch.softmax(keys @ q[b, 0, 0] * 0.5, 0) @ values
            assert torch.allclose(out[b, 0, 0], want, atol=1e-12), (step, b)


def _rows_kv(rows: list[list[int]]) -> torch.Tensor:
    """``[batch, heads, q, dim]``: row ``r``'s keys name the positions ``rows[r]`` (``-1``: a pad,
    whose key names position 500, never kept)."""
    return torch.stack([_kv([p if p >= 0 else 500 for p in row], 1)[0] for row in rows])


@given(policy=st.one_of(policies, st.just(FullCache())), pads=st.lists(st.integers(0, 4), min_size=2, max_size=3),
       steps=st.integers(0, 14))
@settings(max_examples=60, deadline=None)
def test_rows_keeping_different_counts_read_in_transformers_shape(policy, pads, steps) -> None:
    """Issue 44, class 19: after a left-padded prompt rows keep different numbers of tokens (and
    evict on their own schedules); ``keys``, ``values``, ``positions`` and ``scores`` are ``[batch,
    heads, longest, ...]`` with each row's kept tokens in position order at the end and zeros
    (position ``-1``) in front, and ``kept_mask`` is True exactly at the kept tokens (was: a
    ``ValueError`` "rows differ in kept tokens"). Each row is held to the ordered model."""
    q = 6
    layer = LayerCache(policy)
    rows = [[j - p if j >= p else -1 for j in range(q)] for p in pads]
    valid = torch.tensor([[p >= 0 for p in row] for row in rows])
    layer.append(_rows_kv(rows), _rows_kv(rows), valid=valid)
    layer.evict()
    seen = [q - p for p in pads]
    states = [policy.init_state() for _ in pads]
    kept = [_reference_evict(policy, list(range(s)), s, st_, "prefill") for s, st_ in zip(seen, states)]
    for step in range(steps + 1):
        longest = max(map(len, kept))
        keys, values, positions, mask = layer.keys, layer.values, layer.positions, layer.kept_mask
        assert keys.shape == values.shape == (len(pads), HEADS, longest, DIM) and mask.shape == positions.shape
        for r, row in enumerate(kept):
            front = longest - len(row)
            assert positions[r].tolist() == [[-1] * front + row] * HEADS
            assert mask[r].tolist() == [[False] * front + [True] * len(row)] * HEADS
            torch.testing.assert_close(keys[r, :, front:], _kv(row, 1)[0])
            torch.testing.assert_close(values[r, :, front:], _kv(row, 1)[0])
            assert not keys[r, :, :front].any() and not values[r, :, :front].any()
            assert not layer.scores[r, :, :front].any()
        if step == steps:
            break
        new = [[s] for s in seen]
        layer.append(_rows_kv(new), _rows_kv(new))
        layer.evict()
        for r in range(len(pads)):
            seen[r] += 1
            kept[r] = _reference_evict(policy, kept[r] + new[r], seen[r], states[r], "decode")
