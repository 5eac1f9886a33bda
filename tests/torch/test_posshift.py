"""kvpolicy_torch.posshift: StreamingLLM's sinks held at their pos-shift positions in the storage.

``SinkShift`` rotates the sinks' original keys into their slots whenever the shift changes, through
a view of those slots made once; a storage that grew while the sinks were held shifted (it carries
the shifted keys) gets a view of its own, and ``undo`` puts the originals back in whatever storage
the layer holds then. The rotation here is a stand-in (a multiplication by ``1 + delta``: any map of
keys and shift will do, since SinkShift only stores what ``key_shift`` returns); the RoPE rotation
itself is held to transformers' here (``rope_rotate`` at a shifted position, a tiny random-weight
Llama's rotary embedding) and in tests/integrations/test_families.py. ``ShiftMatrices`` (the sinks
of every layer rotated in one batch) is held to ``rope_rotate`` one layer at a time.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from kvpolicy_torch.posshift import SinkShift, slot_shifts  # noqa: E402
from kvpolicy_torch.storage import Storage  # noqa: E402


def _key_shift(keys: torch.Tensor, delta: list[int]) -> torch.Tensor:
    return keys * (1 + torch.tensor(delta, dtype=keys.dtype).view(-1, 1, 1, 1))


def _storage(batch: int, slots: int, seed: int) -> Storage:
    g = torch.Generator().manual_seed(seed)
    store = Storage.allocate(torch.zeros(batch, 2, 1, 3), torch.zeros(batch, 2, 1, 3), slots, torch.float32)
    store.keys.copy_(torch.randn(store.keys.shape, generator=g))
    return store


def _grown(store: Storage, slots: int) -> Storage:
    """What growth does: a larger storage carrying the slots held (the sinks as they stand, shifted)."""
    grown = Storage.allocate(store.keys, store.values, slots, torch.float32)
    grown.copy_prefix(store, store.slots)
    return grown


@settings(max_examples=60, deadline=None)
@given(
    batch=st.integers(1, 3),
    sink=st.integers(1, 4),
    steps=st.lists(st.tuples(st.integers(0, 5), st.sampled_from(["apply", "apply", "grow", "undo"])), min_size=1, max_size=12),
    seed=st.integers(0, 2**16),
)
def test_sinks_hold_their_rotation_through_growth_and_undo(batch: int, sink: int, steps: list, seed: int) -> None:
    """After every apply the sinks' slots hold key_shift(originals, delta) and no other slot
    changes; a storage that grew in between is written, not the one it replaced; after undo the
    sinks' slots hold the originals again."""
    store = _storage(batch, sink + 4, seed)
    originals = store.keys[:, :, :sink].clone()
    rest = store.keys[:, :, sink:].clone()
    shift = SinkShift(_key_shift, sink)
    for step, (d, action) in enumerate(steps):
        if action == "grow":
            old = store
            store = _grown(store, store.slots + 2)
            rest = torch.cat([rest, torch.zeros(batch, 2, 2, 3)], dim=2)
            before = old.keys.clone()
        elif action == "undo":
            shift.undo(store)
            assert shift.delta is None
            assert torch.equal(store.keys[:, :, :sink], originals)
        else:
            delta = [d + r for r in range(batch)]
            shift.apply(store, delta)
            assert shift.delta == delta
            assert torch.allclose(store.keys[:, :, :sink], _key_shift(originals, delta))
            if any(a == "grow" for _, a in steps[:step]):
                assert torch.equal(old.keys, before)  # the storage replaced by growth is left alone
        assert torch.equal(store.keys[:, :, sink:], rest)  # only the sinks ever change
    shift.undo(store)
    assert torch.equal(store.keys[:, :, :sink], originals)


def test_an_unchanged_shift_writes_nothing() -> None:
    store = _storage(1, 6, 0)
    calls = []
    shift = SinkShift(lambda keys, delta: calls.append(delta) or _key_shift(keys, delta), sink=2)
    shift.apply(store, [3])
    shift.apply(store, [3])
    shift.apply(store, [4])
    assert calls == [[3], [4]]


def test_slot_shifts_move_each_kept_token_by_the_evictions_after_it() -> None:
    """A kept token's shifted position is seen - count + rank: with 4 evicted and holes between, the
    sinks move by 4 and the contiguous tail not at all."""
    assert slot_shifts(torch.tensor([[[0, 1, -1, 6, 7]]]), [4]).tolist() == [[[4, 4, 0, 0, 0]]]


# ---------------------------------------------------------------- the sinks of every layer in one rotation
@settings(max_examples=200, deadline=None)
@given(
    steps=st.lists(st.lists(st.integers(0, 3), min_size=3, max_size=3), min_size=1, max_size=6),
    fresh=st.lists(st.booleans(), min_size=6, max_size=6),
)
def test_shift_matrices_rotate_every_layer_as_rope_rotate_would(steps, fresh) -> None:
    """``ShiftMatrices.rotate`` (StreamingLLM's sinks of every layer in one batch) returns each
    layer's sinks rotated by its shift, as ``rope_rotate`` does one layer at a time: when all layers
    share the shift (the batch), when they differ within a step (it falls back to one product per
    layer), and when a layer takes new sinks (a prompt chunk put the originals back)."""
    from kvpolicy_torch import ShiftMatrices, rope_rotate

    g = torch.Generator().manual_seed(3)
    freq = 1.0 / (100.0 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
    sinks = [torch.randn(2, 2, 3, 8, generator=g) for _ in range(3)]
    shifts = ShiftMatrices()
    uniform = True
    for i, deltas in enumerate(steps):
        if fresh[i]:  # layer 1 takes its sinks anew (a new tensor)
            sinks[1] = torch.randn(2, 2, 3, 8, generator=g)
        uniform &= len(set(deltas)) == 1
        for layer, d in enumerate(deltas):
            delta = [d, d + 1]  # two rows, each its own shift
            got = shifts.rotate(layer, sinks[layer], delta, freq, "half", 8)
            want = rope_rotate(sinks[layer], torch.tensor(delta).view(-1, 1, 1), freq)
            assert torch.allclose(got, want, atol=1e-5)
    assert shifts.batched or not uniform  # layers that always agree keep the one batch


def test_shift_matrices_batch_serves_the_layers_of_a_step_from_one_rotation(monkeypatch) -> None:
    import kvpolicy_torch.posshift as hf  # (where ShiftMatrices calls rope_rotate)

    calls = []
    real = hf.rope_rotate
    monkeypatch.setattr(hf, "rope_rotate", lambda *a, **k: (calls.append(a[0].shape), real(*a, **k))[1])
    shifts = hf.ShiftMatrices()
    freq = torch.tensor([1.0, 0.1])
    sinks = [torch.randn(1, 2, 4, 4) for _ in range(30)]
    for step in range(1, 5):
        for layer in range(30):
            shifts.rotate(layer, sinks[layer], [step], freq, "half", 4)
    # the first step gathers the layers as they arrive; every later step is one rotation of all 30
    assert calls[-3:] == [torch.Size([30, 1, 2, 4, 4])] * 3 and shifts.batched


def test_rope_shift_reads_the_frequencies_at_each_use() -> None:
    """RopeShift (a layer's RoPE for pos-shift, built once) reads a rotary module's ``inv_freq`` at
    every rotation, as the layer did: dynamic RoPE scaling rewrites the buffer in place, and a
    shift must use the frequencies of now, for the sinks (through ShiftMatrices) and for queries."""
    from types import SimpleNamespace

    from kvpolicy_torch import rope_rotate
    from kvpolicy_torch.posshift import RopeShift, ShiftMatrices

    module = SimpleNamespace(inv_freq=torch.tensor([1.0, 0.1]))
    shift = RopeShift(module, "half", None, 0, ShiftMatrices())
    keys = torch.randn(1, 2, 3, 4, generator=torch.Generator().manual_seed(0))
    for freq in ([1.0, 0.1], [0.5, 0.05]):
        module.inv_freq = torch.tensor(freq)
        want = rope_rotate(keys, torch.tensor([3]).view(-1, 1, 1), module.inv_freq)
        assert torch.allclose(shift(keys, [3]), want, atol=1e-5)
        assert torch.allclose(shift.rotate(keys, torch.tensor([3]).view(-1, 1, 1)), want, atol=1e-6)


def test_rope_rotate_equals_rope_at_the_shifted_position() -> None:
    """Rotating a key RoPE'd at p by delta equals RoPE applied at p + delta (transformers' own)."""
    pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from kvpolicy_torch import rope_rotate
    from kvpolicy_tools.models import tiny_llama

    model = tiny_llama(num_layers=1, heads=4, kv_heads=2, head_dim=16, seed=0)
    rotary = model.model.rotary_emb
    raw = torch.randn(1, 2, 30, 16, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(30)
    delta = torch.randint(-25, 40, (1, 2, 30), generator=torch.Generator().manual_seed(2))
    cos, sin = rotary(raw, pos[None])
    at_p, _ = apply_rotary_pos_emb(raw, raw, cos, sin)
    got = rope_rotate(at_p, delta, rotary.inv_freq)
    for h in range(2):
        c, s = rotary(raw, (pos + delta[0, h])[None])
        want, _ = apply_rotary_pos_emb(raw[:, h : h + 1], raw[:, h : h + 1], c, s)
        torch.testing.assert_close(got[:, h : h + 1], want, rtol=1e-5, atol=1e-5)
