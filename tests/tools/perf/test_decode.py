"""kvpolicy_tools/perf/decode.py: a prefill loaded into the benchmarked caches decodes like a real prefill."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvpolicy import BUZZ, H2O, FullCache  # noqa: E402
from kvpolicy_integrations.hf import EvictingCache, cache_kwargs  # noqa: E402
from kvpolicy_tools.models import tiny_llama  # noqa: E402
from kvpolicy_tools.perf.decode import Candidate, build_cache, hold_last, measure_decode, prefill  # noqa: E402


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


def test_the_limit_is_held_at_its_budgets_policies_count() -> None:
    """Before every round the limit is cut back to the most its budget's policies keep, so at the
    end of the run it holds that count plus one round's steps, not the prompt's share plus every
    decoded token (a limit left to grow attends to ever more keys than the policies). Tiny
    random-weight model: sizes only."""
    model = tiny_llama(num_layers=2, heads=4, kv_heads=2, head_dim=16, vocab=128, seed=0)
    pre = prefill(model, 40, seed=3)
    policy = H2O(heavy=8, recent=6)
    candidates = [Candidate("DynamicCache"), Candidate("limit 25%", budget=0.25, keep_last=10),
                  Candidate("H2O 25%", policy, budget=0.25), Candidate("limit 50%", budget=0.5, keep_last=20)]
    results = {r.label: r for r in measure_decode(model, pre, candidates, rounds=4, steps=3, warmup=1)}
    assert results["H2O 25%"].kept == 14
    assert results["limit 25%"].kept == 14 + 3  # held at 14 before the last round, then 3 steps
    assert results["limit 50%"].kept == 20 + 1 + 4 * 3  # no policy of its budget: built and grown as before
    assert results["DynamicCache"].kept == 40 + 1 + 4 * 3
    assert len(results["H2O 25%"].share_of_limit) == 4
    assert results["H2O 25%"].limit_kept == 14 + 3  # its own limit: held at its count


def test_each_policy_is_timed_against_a_limit_held_at_its_own_count() -> None:
    """Two policies of one budget keep different counts: each share is taken against a limit held
    at that policy's count (one limit held at the most of both flattered the smaller one, as BUZZ's
    count, rising to its threshold, did the others'). The budget's reported limit is still held
    at the most. Tiny random-weight model: sizes only."""
    from kvpolicy import LocalWindow

    model = tiny_llama(num_layers=2, heads=4, kv_heads=2, head_dim=16, vocab=128, seed=0)
    pre = prefill(model, 40, seed=3)
    candidates = [Candidate("DynamicCache"), Candidate("limit 25%", budget=0.25, keep_last=10),
                  Candidate("H2O 25%", H2O(heavy=8, recent=6), budget=0.25),
                  Candidate("local 25%", LocalWindow(window=6), budget=0.25)]
    results = {r.label: r for r in measure_decode(model, pre, candidates, rounds=3, steps=2, warmup=1)}
    small, large = results["local 25%"], results["H2O 25%"]
    assert small.kept < large.kept
    assert small.limit_kept == small.kept + 2 and large.limit_kept == large.kept + 2
    assert results["limit 25%"].kept == large.kept + 2


def test_hold_last_keeps_the_newest_tokens_contiguous() -> None:
    cache = build_cache(tiny_llama(num_layers=2, heads=4, kv_heads=2, head_dim=16, vocab=128, seed=0),
                        Candidate("DynamicCache"), prefill(tiny_llama(num_layers=2, heads=4, kv_heads=2, head_dim=16, vocab=128, seed=0), 12, seed=1))
    before = [layer.keys.clone() for layer in cache.layers]
    hold_last(cache, 5)
    for layer, old in zip(cache.layers, before):
        assert torch.equal(layer.keys, old[:, :, -5:]) and layer.keys.is_contiguous() and layer.values.shape[2] == 5
    hold_last(cache, 9)  # holding more than it has: unchanged
    assert cache.layers[0].keys.shape[2] == 5
