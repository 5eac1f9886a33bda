"""kvpolicy_torch/compaction.py: in-place compaction keeps exactly what gather-then-copy keeps."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvpolicy import BUZZ, H2O, StreamingLLM  # noqa: E402
from kvpolicy_torch import LayerCache  # noqa: E402


@pytest.mark.parametrize("policy", [BUZZ(2, 5, 3, 12), H2O(6, 5), StreamingLLM(3, 9), BUZZ(1, 4, 4, 9, selection="shared")], ids=repr)
@pytest.mark.parametrize("chunk_bytes", [1, 700])  # one slot per chunk; a few slots per chunk
def test_in_place_compaction_equals_gather_then_copy(policy, chunk_bytes, monkeypatch) -> None:
    """The chunked in-place compaction moves every kept token exactly where one gather of the
    whole cache would (a chunk larger than the cache), keys, values, positions and scores alike,
    whatever the chunk size."""
    g = torch.Generator().manual_seed(7)
    steps = [(torch.randn(2, 3, q, 4, generator=g), torch.rand(2, 3, 64, generator=g)) for q in [20] + [1] * 40]
    stores = []
    for mode in (1 << 40, chunk_bytes):
        monkeypatch.setattr(LayerCache, "compaction_chunk_bytes", mode)
        layer = LayerCache(policy)
        for kv, rec in steps:
            layer.append(kv, kv * 2)
            # what a token receives depends on its position, not its slot: the two storages may
            # differ in slack (the chunk bounds it), so slot layouts differ while decisions must not
            pos = layer.slot_positions
            layer.accumulate(rec.gather(-1, pos.clamp(min=0)) * (pos >= 0))
            layer.evict()
        stores.append(layer)
    a, b = stores
    assert a.length == b.length and a.evictions == b.evictions > 0
    for x, y in ((a.keys, b.keys), (a.values, b.values), (a.positions, b.positions), (a.scores, b.scores)):
        assert torch.equal(x, y)
