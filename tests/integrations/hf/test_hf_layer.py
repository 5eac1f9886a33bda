"""kvpolicy_integrations/hf/layer.py: one cache layer (``EvictingLayer``) on tiny random Llama models (fast,
CPU): which attention path a prompt chunk and a decode step take (SDPA's causal kernel, one fused
pass, the fused decode attention), pos-shift keys at their slots, log n as one logit scale, a
left-padded batch's keys in transformers' shape, and a layer updated by hand. ``ShiftMatrices`` is
held by tests/torch/test_layer.py beside the store it rotates for.

This file's tiny models (`kvpolicy_tools.models.tiny_llama`) have random weights: they check wiring and
numerics, not language quality. The issue 44 edge tests (class 19, 20) use a model of their own seed.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import DynamicCache  # noqa: E402

from kvpolicy import BUZZ, H2O, TOVA, FullCache, LocalWindow, StreamingLLM  # noqa: E402
from kvpolicy_tools.models import tiny_llama  # noqa: E402
from kvpolicy_integrations.hf import EvictingCache, cache_kwargs, greedy_decode  # noqa: E402

from hf_cases import token_ids as _ids, edge_ids as _edge_ids  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.torch]


@pytest.mark.parametrize("policy", [FullCache(), StreamingLLM(2, 10), TOVA(12)], ids=repr)
def test_first_prompt_chunk_takes_the_causal_kernel(model, policy, monkeypatch):
    """A prompt's first chunk (no pads, nothing cached) runs SDPA with is_causal=True and no mask,
    as a plain DynamicCache prefill does (an explicit causal mask makes SDPA's CPU kernel compute
    every masked block: 2.4x the attention time at 2,048 tokens); a later chunk, or a padded
    one, is masked from the slots. The logits are DynamicCache's, bit for bit, where the policy
    does not change the attention (log n does). (A policy reading every prompt row's attention
    takes prefill_attention instead: the next test.)"""
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, value, attn_mask=None, *args, is_causal=False, **kwargs):
        calls.append((query.shape[2], attn_mask is None, is_causal))
        return sdpa(query, key, value, attn_mask, *args, is_causal=is_causal, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    ids = _ids(batch=1, length=40)
    with torch.no_grad():
        want = model(ids[:, :24], **cache_kwargs(model, DynamicCache(config=model.config))).logits
        cache = EvictingCache(policy, model)  # (pos-shift measures the RoPE layout with a forward)
        calls.clear()
        got = model(ids[:, :24], **cache_kwargs(model, cache)).logits
        assert calls == [(24, True, True)] * 2  # both layers
        if policy.log_n is None:
            assert torch.equal(got, want)
        calls.clear()
        model(ids[:, 24:], position_ids=torch.arange(24, 40)[None], **cache_kwargs(model, cache))
        assert calls == [(16, False, False)] * 2
        padded = EvictingCache(policy, model)
        mask = torch.ones(2, 12, dtype=torch.long)
        mask[1, :3] = 0
        calls.clear()
        model(_ids(batch=2, length=12), attention_mask=mask, **cache_kwargs(model, padded))
        assert calls == [(12, False, False)] * 2

@pytest.mark.parametrize("policy", [H2O(8, 8), BUZZ(2, 6, 4, 12, log_n=True, log_base=8.0)], ids=repr)
def test_prompt_scored_on_every_row_takes_one_fused_pass(model, policy, monkeypatch):
    """H2O and BUZZ read every prompt row's attention: a float32 prompt chunk (first, later or
    left-padded) takes kvpolicy_torch.prefill_attention, one blocked pass giving the output and
    the received sums, neither SDPA nor a second received_attention pass (which cost 1.3-1.4x a
    plain prefill at 2,048 tokens, issue 40); the logits are DynamicCache's up to rounding where
    the policy does not change the attention (log n does). A bfloat16 model keeps SDPA and the
    second pass (its softmax wants float32)."""
    import kvpolicy_integrations.hf.layer as hf  # (where the layer calls received_attention)

    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    second = hf.received_attention

    def spy(*args, **kwargs):
        calls.append("sdpa")
        return sdpa(*args, **kwargs)

    def spy_received(*args, **kwargs):
        calls.append("received_attention")
        return second(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(hf, "received_attention", spy_received)
    ids = _ids(batch=1, length=40)
    with torch.no_grad():
        want = model(ids[:, :24], **cache_kwargs(model, DynamicCache(config=model.config))).logits
        cache = EvictingCache(policy, model)
        calls.clear()
        got = model(ids[:, :24], **cache_kwargs(model, cache)).logits
        model(ids[:, 24:], position_ids=torch.arange(24, 40)[None], **cache_kwargs(model, cache))
        mask = torch.ones(2, 12, dtype=torch.long)
        mask[1, :3] = 0
        model(_ids(batch=2, length=12), attention_mask=mask, **cache_kwargs(model, EvictingCache(policy, model)))
        assert calls == []
        assert all(layer.store.evictions > 0 for layer in cache.layers)
        if policy.log_n is None:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        half = tiny_llama(num_layers=2, heads=4, kv_heads=2, head_dim=16, vocab=128, seed=0).to(torch.bfloat16)
        model(ids[:, :24], **cache_kwargs(model, EvictingCache(policy, model)))  # (float32 again: nothing called)
        assert calls == []
        half(ids[:, :24], **cache_kwargs(half, EvictingCache(policy, half)))
        assert calls == ["sdpa", "received_attention"] * 2

@pytest.mark.parametrize("policy", [StreamingLLM(sink=2, window=5), H2O(3, 4), LocalWindow(5)], ids=repr)
def test_cache_positions_mode_scores_keys_at_their_slots(model, policy):
    """pos-shift: after eviction every kept key must be attended as if RoPE had been applied at
    its place among the kept tokens (slot ``seen - kept + rank``). StreamingLLM rotates only its
    sinks' part (the query, rotated back); other policies re-rotate keys; both against RoPE
    applied directly at those positions."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from kvpolicy_torch import decode_attention

    cache = EvictingCache(policy, model, positions="cache")
    layer = cache.layers[0]
    rotary = model.model.rotary_emb
    g = torch.Generator().manual_seed(0)
    raw = torch.randn(1, 2, 20, 16, generator=g)
    rq = torch.randn(1, 4, 20, 16, generator=g)
    pos = torch.arange(20)[None]
    cos, sin = rotary(raw, pos)
    rotated, _ = apply_rotary_pos_emb(raw, raw, cos, sin)
    queries, _ = apply_rotary_pos_emb(rq, rq, cos, sin)
    cache.enter()  # (what a forward's hooks do: a cache built for a model takes updates inside its forwards)
    for t in range(20):
        keys, values = layer.update(rotated[:, :, t : t + 1], rotated[:, :, t : t + 1], kwargs={})
        q = queries[:, :, t : t + 1]
        _, received = decode_attention(q, keys, values, 0.25, bias=layer.store.bias, prefix=layer.take_prefix(q))
        # the reference, per KV head: its kept keys, RoPE at their slot among the kept tokens
        slot_pos = torch.arange(layer.store.length) + (layer.store.n_seen - layer.store.length)
        c, s = rotary(raw, slot_pos[None])
        want = []
        for h in range(2):
            kept = layer.store.positions[0, h]
            want_k, _ = apply_rotary_pos_emb(raw[:, h : h + 1, kept], raw[:, h : h + 1, kept], c, s)
            logits = torch.einsum("bhqd,bhkd->bhqk", q[:, 2 * h : 2 * h + 2], want_k) * 0.25
            want.append(torch.softmax(logits, dim=-1).sum(dim=(1, 2)))  # summed over the group
        want = torch.stack(want, dim=1)
        torch.testing.assert_close(layer.store.to_slots(want), received, rtol=1e-5, atol=1e-5)
        layer.finish_received(received)
    cache.leave()
    if isinstance(policy, StreamingLLM):
        assert layer.store.positions[0, 0].tolist() == [0, 1, 15, 16, 17, 18, 19]

# ---------------------------------------------------------------------------- the fused decode attention (issue 7's fast path)


@pytest.mark.parametrize("policy", [BUZZ(2, 6, 3, 10), BUZZ(2, 6, 4, 12, log_n=True, log_base=8.0), H2O(8, 8)], ids=repr)
def test_fused_and_unfused_decode_agree(policy) -> None:
    model = tiny_llama(num_layers=2, heads=4, kv_heads=2, head_dim=16, vocab=128, seed=0)
    ids = torch.randint(3, 128, (2, 30), generator=torch.Generator().manual_seed(4))
    outs, caches = [], []
    for fused in (True, False):
        cache = EvictingCache(policy, model, fused_decode=fused)
        with torch.no_grad():
            outs.append(model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False, **cache_kwargs(model, cache)))
        caches.append(cache)
    assert torch.equal(outs[0], outs[1])
    for a, b in zip(caches[0].layers, caches[1].layers):
        assert torch.equal(a.store.positions, b.store.positions)
        torch.testing.assert_close(a.store.scores, b.store.scores, rtol=1e-5, atol=1e-5)

def test_fused_path_is_taken_in_decode_only(monkeypatch) -> None:
    from kvpolicy_torch import LayerCache

    model = tiny_llama(num_layers=1, seed=2)
    calls = []
    original = LayerCache.attend

    def spy(self, query, *a, **k):
        calls.append(query.shape[2])
        return original(self, query, *a, **k)

    monkeypatch.setattr(LayerCache, "attend", spy)
    # prefill goes through SDPA; so does a decode step that needs neither scores nor a mask:
    # StreamingLLM's sink shift is done in the storage (its sinks' keys rotated), so it takes SDPA
    for policy, expected in ((H2O(6, 6), [1, 1, 1]), (StreamingLLM(2, 8), []), (LocalWindow(8), []), (FullCache(), [])):
        calls.clear()
        cache = EvictingCache(policy, model)
        with torch.no_grad():
            model.generate(torch.arange(3, 23)[None], max_new_tokens=4, do_sample=False, **cache_kwargs(model, cache))
        assert calls == expected, policy

def test_log_n_of_rows_alike_is_one_logit_scale(monkeypatch) -> None:
    """BUZZ with log n: a decode step whose rows attend to as many keys (one row, always) folds the
    log n scale into the logit scale, so the store takes its grouped step (a tensor of row scales
    took the general one, ~7 more ops a layer); rows of different lengths still pass one scale
    per row (tiny random model)."""
    from kvpolicy_torch import LayerCache

    model = tiny_llama(num_layers=1, seed=2)
    policy = BUZZ(2, 6, 4, 12, log_n=True, log_base=8.0)
    seen = []
    original = LayerCache.attend

    def spy(self, query, scaling, **k):
        seen.append((scaling, k.get("row_scale")))
        return original(self, query, scaling, **k)

    monkeypatch.setattr(LayerCache, "attend", spy)
    plain = model.config.head_dim ** -0.5
    for mask in (None, torch.tensor([[1] * 20, [0] * 5 + [1] * 15])):
        seen.clear()
        ids = torch.arange(3, 23)[None].expand(1 if mask is None else 2, -1)
        cache = EvictingCache(policy, model)
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids) if mask is None else mask, max_new_tokens=4,
                           do_sample=False, **cache_kwargs(model, cache))
        assert len(seen) == 3
        for scaling, row_scale in seen:
            if mask is None:
                assert row_scale is None and scaling != plain
            else:  # (the padded row holds 5 tokens fewer: its own scale)
                assert scaling == plain and row_scale.shape == (2,) and row_scale[0] != row_scale[1]

# --------------------------------------------------------------------------- issue 44, class 19: keys of a left-padded batch
@pytest.mark.parametrize("policy", [FullCache(), H2O(5, 5), StreamingLLM(sink=2, window=6)], ids=repr)
def test_keys_of_a_left_padded_batch_in_transformers_shape(edge_model, policy):
    """After a left-padded prompt (and decode steps) rows keep different numbers of tokens;
    layer.keys / .values are [batch, kv_heads, longest, head_dim] with each row's kept tokens in
    position order at the end and zeros in front, and layer.kept_mask says which are kept (was: a
    ValueError 'rows differ in kept tokens'). For the full cache they equal DynamicCache's keys at
    the real columns, pads where DynamicCache has its pad columns."""
    ids = _edge_ids(14, batch=3, seed=2)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    mask[2, :2] = 0
    cache = EvictingCache(policy, edge_model)
    greedy_decode(edge_model, ids, cache, 3, attention_mask=mask)
    for layer in cache.layers:
        keys, values, kept = layer.keys, layer.values, layer.kept_mask
        lengths = layer.store.lengths
        assert keys.shape == (3, 2, max(lengths), 16) and values.shape == keys.shape and kept.shape == keys.shape[:3]
        for row, n in enumerate(lengths):
            assert kept[row].sum(-1).tolist() == [n, n]
            assert not kept[row, :, : max(lengths) - n].any() and kept[row, :, max(lengths) - n :].all()
            assert not keys[row][~kept[row]].any() and not values[row][~kept[row]].any()
            positions, _ = layer.store.kept(row)
            assert torch.equal(layer.store.positions[row][kept[row]].view(2, n), positions)
    if isinstance(policy, FullCache):  # against transformers' own cache, the same prompt and positions
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        full = DynamicCache(config=edge_model.config)
        fresh = EvictingCache(FullCache(), edge_model)
        with torch.no_grad():
            edge_model(ids, attention_mask=mask, position_ids=positions, cache=full)
            edge_model(ids, attention_mask=mask, position_ids=positions, **cache_kwargs(edge_model, fresh))
        for ours, theirs in zip(fresh.layers, full.layers):
            assert ours.keys.shape == theirs.keys.shape
            real = mask.bool()[:, None, :].expand(-1, 2, -1)
            assert torch.equal(ours.kept_mask, real)
            torch.testing.assert_close(ours.keys[real], theirs.keys[real])
            torch.testing.assert_close(ours.values[real], theirs.values[real])

# --------------------------------------------------------------------------- issue 44, class 20: update() by hand
@pytest.mark.parametrize("policy", [StreamingLLM(sink=2, window=4), H2O(3, 3)], ids=repr)
def test_a_layer_updated_by_hand_is_refused_at_the_first_call(edge_model, policy):
    """cache.layers[i].update(k, v) called by hand is refused at once, saying so (was: the first
    call appended all 10 keys past the capacity of 7 and evicted nothing, the next call blamed
    the model's attention switch), and leaves the layer untouched: the cache still serves a
    forward. A model whose attention hands no kwargs to cache.update (GPT-NeoX) is still served
    (tests/integrations/test_families.py)."""
    cache = EvictingCache(policy, edge_model)
    k = torch.randn(1, 2, 10, 16)
    with pytest.raises(RuntimeError, match=r"^layer 1: update\(\) was called by hand, outside a model's "
                                           r"forward, which is not supported: .*DynamicCache"):
        cache.layers[1].update(k, k)
    assert not cache.layers[1].store.is_initialized and not cache.layers[1].is_initialized
    with torch.no_grad():
        edge_model(_edge_ids(12), **cache_kwargs(edge_model, cache))
    assert cache.layers[1].store.seen == [12] and cache.layers[1].store.length <= policy.capacity


def _grouped_twin(seed: int = 3):
    """A GQA model (4 query heads over 2 KV heads) whose two query heads of each group are one
    head twice, and the MHA model (2 heads) it equals: the same keys, values and outputs (its
    ``o_proj`` sums the pair's columns), and per KV head exactly twice the attention the MHA head
    receives (a pair's probabilities are equal, and x + x = 2x exactly). Tiny random weights, float64."""
    gqa = tiny_llama(num_layers=2, heads=4, kv_heads=2, head_dim=8, vocab=96, seed=seed).double()
    mha = tiny_llama(num_layers=2, heads=2, kv_heads=2, head_dim=8, vocab=96, seed=seed, hidden_size=32,
                     intermediate_size=64).double()
    state = gqa.state_dict()
    twin = {}
    for name, w in state.items():
        if name.endswith("self_attn.q_proj.weight"):
            w = w.view(4, 8, 32).clone()
            w[1], w[3] = w[0], w[2]  # each group's second query head is its first
            state[name] = w.reshape(32, 32)
            twin[name] = w[[0, 2]].reshape(16, 32)
        elif name.endswith("self_attn.o_proj.weight"):
            cols = w.view(32, 4, 8)
            twin[name] = torch.cat([cols[:, 0] + cols[:, 1], cols[:, 2] + cols[:, 3]], dim=1)
        else:
            twin[name] = w
    gqa.load_state_dict(state)
    mha.load_state_dict(twin)
    return gqa, mha


@pytest.mark.parametrize("chunk", [7, 16])
def test_adakv_chunks_per_kv_head_mask_serves_each_query_head_its_groups(chunk):
    """GQA: a prompt chunk after a head-wise eviction attends through a mask per KV head, which the
    SDPA call repeats over each KV head's query heads and the score pass broadcasts over the group.
    Against the MHA twin (:func:`_grouped_twin`): every layer keeps the same tokens in every head
    (the heads end with different lengths, so the per-head masks mattered) and the logits agree."""
    from kvpolicy import AdaKV

    gqa, mha = _grouped_twin()
    ids = _ids(batch=1, length=45, seed=5) % 96
    policy = AdaKV(TOVA(12, selection="per_head"))
    caches = [EvictingCache(policy, m, prefill_chunk=chunk) for m in (gqa, mha)]
    logits = []
    for m, cache in zip((gqa, mha), caches):
        with torch.no_grad():
            for start in range(0, ids.shape[1], chunk):
                out = m(input_ids=ids[:, start:start + chunk], **cache_kwargs(m, cache), use_cache=True)
        logits.append(out.logits[:, -1])
    for a, b in zip(caches[0].layers, caches[1].layers):
        assert torch.equal(a.store.positions, b.store.positions)
    held = (caches[0].layers[0].store.positions[0] >= 0).sum(-1)
    assert int(held.max()) > int(held.min()), held
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-9, atol=1e-9)
