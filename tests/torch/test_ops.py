"""kvpolicy_torch/ops.py: ``first_argmin`` equals argmin's first index, ties and strided views included."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
import pytest

torch = pytest.importorskip("torch")


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
