"""kvpolicy_torch/attention.py: the fused decode attention against SDPA plus the score product, and
the window masks."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvpolicy_torch import decode_attention, received_attention  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("holes", [False, True])
def test_decode_attention_equals_sdpa_plus_score_product(dtype, holes) -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 1, 16, generator=g).to(dtype)
    k = torch.randn(2, 2, 30, 16, generator=g).to(dtype)
    v = torch.randn(2, 2, 30, 16, generator=g).to(dtype)
    bias = m = None
    if holes:  # per-head holes (H2O evicts per KV head): an additive bias, -inf at the holes
        allowed = torch.ones(2, 2, 30, dtype=torch.bool)
        allowed[0, 0, :4] = False
        allowed[1, 1, 7] = False
        bias = torch.zeros(2, 2, 30, dtype=dtype).masked_fill(~allowed, float("-inf"))
        m = allowed.repeat_interleave(3, dim=1)[:, :, None, :]  # per query head, for SDPA
    out, received = decode_attention(q, k, v, 0.3, bias=bias)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(out.transpose(1, 2), ref, rtol=1e-5, atol=1e-6)
    if not holes:
        torch.testing.assert_close(received, received_attention(q, k, 0.3), rtol=1e-6, atol=1e-7)
    else:
        assert torch.all(received[0, 0, :4] == 0) and received[1, 1, 7] == 0
        torch.testing.assert_close(received.sum(-1), torch.full((2, 2), 3.0, dtype=received.dtype))


@settings(max_examples=300, deadline=None)
@example(kind="sliding", width=5, positions=[-1, 0], q=1)  # (a hole inside the window: the store's bias masks it)
@given(kind=st.sampled_from(["sliding", "chunked"]), width=st.integers(1, 9),
       positions=st.lists(st.integers(-1, 40), min_size=1, max_size=12), q=st.integers(1, 4))
def test_window_masks_keep_exactly_the_positions_inside_the_window(kind, width, positions, q) -> None:
    """The window helpers (sliding: a key is seen while key > query - width, as transformers; chunked:
    in the query's own chunk of width positions) on host ints, on int64 tensors and as a chunk's
    mask agree with the rule written out per query and key (the window alone: holes and causality are
    the store's bias and the chunk's mask); a pad query (-1) keeps its mask row."""
    from kvpolicy_torch.attention import window_bias, window_chunk_mask, window_limit

    def seen(key: int, query: int) -> bool:  # the window alone (causality and holes are the caller's mask's)
        return key > query - width if kind == "sliding" else key >= query // width * width

    newest = max(positions)
    assert window_limit(torch.tensor([newest]), kind, width).tolist() == [window_limit(newest, kind, width)]
    pos = torch.tensor(positions)[None, None]
    bias = window_bias(pos, [window_limit(newest, kind, width)])[0, 0].tolist()
    assert bias == [0.0 if seen(p, newest) else float("-inf") for p in positions]
    # a chunk: its queries are the last q slots, every one attends to every slot before the chunk
    qpos = positions[-q:]
    mask = torch.ones(1, 1, min(q, len(positions)), len(positions), dtype=torch.bool)
    got = window_chunk_mask(mask, pos, kind, width)[0, 0].tolist()
    for row, query in zip(got, qpos):
        want = [True] * len(positions) if query < 0 else [seen(p, query) for p in positions]
        assert row == want, (query, positions)
