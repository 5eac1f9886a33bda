"""kvpolicy_tools/perf/decode.py: a prefill loaded into the benchmarked caches decodes like a real prefill."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvpolicy import BUZZ, FullCache  # noqa: E402
from kvpolicy_integrations.hf import EvictingCache, cache_kwargs  # noqa: E402
from kvpolicy_tools.models import tiny_llama  # noqa: E402
from kvpolicy_tools.perf.decode import Candidate, build_cache, prefill  # noqa: E402


def test_prefill_loaded_into_caches_decodes_like_a_real_prefill() -> None:
    model = tiny_llama(num_layers=2, heads=4, kv_heads=2, head_dim=16, vocab=128, seed=0)
    pre = prefill(model, 40, seed=3)
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(3))
    tok = torch.tensor([[7]])
    pos = torch.tensor([[40]])
    dyn = build_cache(model, Candidate("DynamicCache"), pre)
    full = build_cache(model, Candidate("FullCache", FullCache()), pre)
    with torch.no_grad():
        a = model(tok, **cache_kwargs(model, dyn), position_ids=pos).logits
        b = model(tok, **cache_kwargs(model, full), position_ids=pos).logits
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # an evicting cache ends in the size and state a real prefill leaves
    policy = BUZZ(2, 4, 3, 9)
    loaded = build_cache(model, Candidate("BUZZ", policy), pre)
    real = EvictingCache(policy, model)
    with torch.no_grad():
        model(ids, **cache_kwargs(model, real))
    assert loaded.lengths() == real.lengths()
    assert [layer.store.state for layer in loaded.layers] == [layer.store.state for layer in real.layers]
    assert loaded.get_seq_length() == real.get_seq_length() == 40
