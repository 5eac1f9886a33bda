"""The transformers integration (kvpolicy_integrations/hf.py) on tiny random Llama models (fast, CPU).

The tiny models (`kvpolicy_tools.models.tiny_llama`) have random weights: they check wiring and
numerics, not language quality. The real-model checks are in test_hf_real_model.py.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import DynamicCache  # noqa: E402

import kvpolicy_numpy  # noqa: E402
from kvpolicy import BUZZ, H2O, TOVA, ExpectedAttention, FullCache, LocalWindow, Scissorhands, SnapKV, StreamingLLM, compose, make_policy  # noqa: E402
from kvpolicy_tools.models import tiny_llama  # noqa: E402
from tiny_eval import CallTokenizer
from kvpolicy_integrations.hf import EvictingCache, cache_kwargs, generate, greedy_decode  # noqa: E402

COVERING = [FullCache(), BUZZ(4, 64, 5, 300), H2O(100, 100), StreamingLLM(4, 100), LocalWindow(100)]
EVICTING = [BUZZ(2, 6, 3, 10), BUZZ(2, 6, 4, 12, log_n=True, log_base=8.0), H2O(8, 8), StreamingLLM(2, 10), LocalWindow(12), TOVA(12),
            Scissorhands(14, history=6, drop=0.25, recent=3), ExpectedAttention(12, sink=2, future=32)]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(num_layers=2, heads=4, kv_heads=2, head_dim=16, vocab=128, seed=0)


def _ids(batch=2, length=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (batch, length), generator=g)


def _greedy(model, ids, cache, n=16):
    with torch.no_grad():
        return model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, **cache_kwargs(model, cache)
        )


@pytest.mark.parametrize("policy", COVERING, ids=repr)
def test_covering_capacity_generates_like_dynamic_cache(model, policy):
    ids = _ids()
    ref = _greedy(model, ids, DynamicCache(config=model.config))
    cache = EvictingCache(policy, model)
    out = _greedy(model, ids, cache)
    assert torch.equal(out, ref)
    assert cache.get_seq_length() == ids.shape[1] + 15  # the last token is never fed back
    assert all(layer.store.evictions == 0 for layer in cache.layers)


@pytest.mark.parametrize("policy", COVERING[:3], ids=repr)
def test_logits_match_dynamic_cache_chunked_prefill_and_decode(model, policy):
    ids = _ids(batch=1, length=48)
    ref_cache, cache = DynamicCache(config=model.config), EvictingCache(policy, model)
    with torch.no_grad():
        for lo, hi in [(0, 20), (20, 37), (37, 48)] + [(i, i + 1) for i in range(48, 48)]:
            a = model(ids[:, lo:hi], **cache_kwargs(model, ref_cache)).logits
            b = model(ids[:, lo:hi], **cache_kwargs(model, cache)).logits
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        tok = ids[:, -1:]
        for _ in range(5):
            a = model(tok, **cache_kwargs(model, ref_cache)).logits
            b = model(tok, **cache_kwargs(model, cache)).logits
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
            tok = a[:, -1:].argmax(-1)


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
    import kvpolicy_integrations.hf as hf

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


def test_mask_function_hands_padding_to_the_cache_and_serves_other_caches(model):
    """The mask function registered under our name builds no 4-D mask for an EvictingCache (its
    slots define what each query sees) but takes the forward's 2-D padding; any other cache on the
    same model gets transformers' own mask (DynamicCache logits unchanged)."""
    ids = _ids(batch=2, length=12)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    cache = EvictingCache(FullCache(), model)
    with torch.no_grad():
        model(ids, attention_mask=mask, **cache_kwargs(model, cache))
    assert cache.padding.real == [12, 8] and torch.equal(cache.padding.valid, mask.bool())
    assert cache.layers[0].store.lengths == [12, 8]
    ref_model = tiny_llama(num_layers=2, heads=4, kv_heads=2, head_dim=16, vocab=128, seed=0)
    with torch.no_grad():
        want = ref_model(ids, attention_mask=mask, **cache_kwargs(ref_model, DynamicCache(config=model.config))).logits
        got = model(ids, attention_mask=mask, **cache_kwargs(model, DynamicCache(config=model.config))).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("policy", EVICTING, ids=repr)
def test_cache_never_exceeds_capacity_and_frees_memory(model, policy):
    ids = _ids(length=40)
    cache = EvictingCache(policy, model)
    _greedy(model, ids, cache, n=24)
    for layer in cache.layers:
        store = layer.store
        assert store.keys.shape[2] == store.length <= policy.capacity
        # preallocated once to capacity (plus the slack of one-token evictions), never regrown
        slack = 0 if store.compaction_period is None else store.compaction_period - 1
        assert store.slots == policy.capacity + slack and slack <= max(1, policy.capacity // 8, min(policy.capacity // 2, 64))
    full = cache.full_kv_bytes()
    assert cache.kv_bytes <= full * policy.capacity / cache.get_seq_length() + 1


def _layer0_logits(model, tokens):
    """Pre-softmax logits of layer 0 for a full (non-evicting) forward, [steps, heads, steps]."""
    from layer0 import layer0_inputs

    attn = model.model.layers[0].self_attn
    hidden, pos = layer0_inputs(model, tokens)
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    x = hidden
    b, s, _ = x.shape
    d = attn.head_dim
    q = attn.q_proj(x).view(b, s, -1, d).transpose(1, 2)
    k = attn.k_proj(x).view(b, s, -1, d).transpose(1, 2)
    cos, sin = pos
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    logits = torch.einsum("bhqd,bhkd->bqhk", q, k) * attn.scaling
    return logits[0].detach().double().numpy()


@pytest.mark.parametrize(
    "policy",
    [BUZZ(2, 5, 3, 8), BUZZ(1, 4, 4, 9, selection="shared"), H2O(6, 6), H2O(5, 7, selection="shared"), StreamingLLM(2, 9), LocalWindow(9),
     TOVA(12), TOVA(10, recent=2, selection="shared"), SnapKV(12, window=4), SnapKV(10, window=3, kernel=3, selection="shared"),
     compose(prefill=SnapKV(11, window=4), decode=BUZZ(1, 4, 3, 7)), compose(prefill=SnapKV(12, window=3), decode=H2O(5, 6)),
     Scissorhands(12, history=5, drop=0.25, recent=2), Scissorhands(9, history=3, drop=0.5, recent=0)],
    ids=repr,
)
def test_kept_positions_equal_numpy_replay(policy):
    """Differential: layer 0 of an evicting greedy generation keeps what the reference keeps on
    the same logits. Layer 0 sees only token embeddings, so its logits are reproducible from a
    full forward over the generated sequence (float64, no GQA so one softmax per head)."""
    model = tiny_llama(num_layers=2, heads=4, kv_heads=4, head_dim=8, vocab=96, seed=3).double()
    ids = _ids(batch=1, length=30, seed=5) % 96
    cache = EvictingCache(policy, model)
    out = _greedy(model, ids, cache, n=20)
    seq = out[:, :-1]  # the last generated token never enters the cache
    trace = kvpolicy_numpy.replay(policy, _layer0_logits(model, seq), prompt_len=ids.shape[1])
    got = cache.layers[0].store.positions[0].numpy()
    np.testing.assert_array_equal(got, trace.kept[-1])


@pytest.mark.parametrize(
    "policy",
    [BUZZ(2, 5, 3, 8), BUZZ(2, 6, 4, 12, log_n=True, log_base=8.0), H2O(6, 6), StreamingLLM(2, 9), LocalWindow(9),
     TOVA(12), SnapKV(12, window=4), compose(prefill=SnapKV(12, window=3), decode=H2O(5, 6)),
     Scissorhands(12, history=5, drop=0.25, recent=2)],
    ids=repr,
)
@pytest.mark.parametrize("chunk", [7, 16])
def test_chunked_prefill_keeps_what_the_numpy_replay_keeps(policy, chunk):
    """Differential: a prompt prefilled in chunks (greedy_decode's prefill_chunk) keeps, in layer 0,
    what the reference keeps for the same chunking (kvpolicy_numpy.replay's prompt_chunk), through
    the decode steps that follow (float64 tiny random model, as above)."""
    model = tiny_llama(num_layers=2, heads=4, kv_heads=4, head_dim=8, vocab=96, seed=3).double()
    ids = _ids(batch=1, length=37, seed=5) % 96
    cache = EvictingCache(policy, model, prefill_chunk=chunk)
    new = greedy_decode(model, ids, cache, 12, prefill_chunk=chunk)
    seq = torch.cat([ids, new[:, :-1]], dim=1)  # the last generated token never enters the cache
    trace = kvpolicy_numpy.replay(policy, _layer0_logits(model, seq), prompt_len=ids.shape[1], prompt_chunk=chunk)
    np.testing.assert_array_equal(cache.layers[0].store.positions[0].numpy(), trace.kept[-1])
    assert cache.layers[0].store.evictions > 0


def test_greedy_decode_prefills_in_chunks_with_the_same_tokens(model):
    """greedy_decode feeds a long prompt in chunks by default; with a cache that evicts nothing the
    new tokens are those of a one-shot prefill (and of DynamicCache), a left-padded batch too."""
    ids = _ids(batch=2, length=70)
    mask = torch.ones_like(ids)
    mask[1, :40] = 0  # more pads than a chunk: the second row's first chunk is all pads
    for attention_mask in (None, mask):
        want = greedy_decode(model, ids, DynamicCache(config=model.config), 6, attention_mask=attention_mask, prefill_chunk=None)
        for chunk in (None, 0, 16, 32):
            got = greedy_decode(model, ids, EvictingCache(FullCache(), model, prefill_chunk=chunk or None), 6,
                                attention_mask=attention_mask, prefill_chunk=chunk)
            assert torch.equal(got, want), (chunk, attention_mask is None)
    with pytest.raises(ValueError, match="prefill_chunk"):
        greedy_decode(model, ids, EvictingCache(FullCache(), model), 2, prefill_chunk=-3)
    with pytest.raises(ValueError, match="prefill_chunk"):
        EvictingCache(FullCache(), model, prefill_chunk=2.5)


@pytest.mark.parametrize("policy", [H2O(12, 12), BUZZ(2, 6, 3, 10), StreamingLLM(2, 20), TOVA(24)], ids=repr)
def test_chunked_prefill_holds_the_capacity_and_one_chunk(model, policy):
    """A chunked prefill's cache never allocates more than its storage without the room (the
    policy's capacity plus the spare slots of a one-token eviction by score) and one chunk,
    however long the prompt; without the room each chunk that does not fit is copied, with the
    kept tokens, into a transient set beside the storage."""
    ids, chunk = _ids(batch=1, length=200), 16

    def peak(cache):
        with torch.no_grad():
            for lo in range(0, ids.shape[1], chunk):
                hi = min(lo + chunk, ids.shape[1])
                model(input_ids=ids[:, lo:hi], position_ids=torch.arange(lo, hi)[None], use_cache=True, **cache_kwargs(model, cache))
        assert max(cache.lengths()) <= policy.capacity
        return [layer.store.peak_bytes for layer in cache.layers]

    roomless = EvictingCache(policy, model, prefill_chunk=None)
    beside = peak(roomless)
    storage = roomless.layers[0].store.slots  # the capacity and its spare slots
    per_slot = roomless.layers[0].store.nbytes // storage
    assert storage < policy.capacity + chunk
    bounded = peak(EvictingCache(policy, model, prefill_chunk=chunk))
    assert bounded == [per_slot * (storage + chunk)] * len(roomless.layers)
    assert all(b > per_slot * (storage + chunk) for b in beside)


def test_manual_loop_positions_follow_tokens_seen(model):
    """get_seq_length() is the number of tokens seen, so a manual loop that forgets
    position_ids still gets the right RoPE positions after eviction."""
    ids = _ids(batch=1, length=30)
    policy = H2O(6, 6)
    with_pos, without = EvictingCache(policy, model), EvictingCache(policy, model)
    with torch.no_grad():
        a = model(ids, **cache_kwargs(model, with_pos), position_ids=torch.arange(30)[None]).logits
        b = model(ids, **cache_kwargs(model, without)).logits
        tok = a[:, -1:].argmax(-1)
        for t in range(30, 40):
            a = model(tok, **cache_kwargs(model, with_pos), position_ids=torch.tensor([[t]])).logits
            b = model(tok, **cache_kwargs(model, without)).logits
            torch.testing.assert_close(a, b)
            tok = a[:, -1:].argmax(-1)
    assert without.get_seq_length() == 40
    assert without.get_mask_sizes(1, 0) == (41, 0)  # no 4-D mask is built from it (kvpolicy_mask)


def test_other_architectures_are_refused():
    from transformers import AutoModelForCausalLM, FalconConfig, GPT2Config

    # refused by capability, with what is missing (tests/integrations/test_families.py walks every model type)
    with pytest.raises(ValueError, match="attention interface"):
        EvictingCache(H2O(4, 4), FalconConfig(num_hidden_layers=1))
    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=64))
    EvictingCache(H2O(4, 4), gpt2)  # original positions work without RoPE
    with pytest.raises(ValueError, match="needs RoPE.*positions='original' works"):
        EvictingCache(StreamingLLM(sink=2, window=4), gpt2)


def test_attention_not_routed_through_kvpolicy_is_caught():
    model = tiny_llama(num_layers=1, seed=1)
    cache = EvictingCache(H2O(4, 4), model.config)  # a config: the model is not switched
    with pytest.raises(RuntimeError, match="use_kvpolicy_attention"):
        _greedy(model, _ids(batch=1, length=10), cache, n=3)


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
    if isinstance(policy, StreamingLLM):
        assert layer.store.positions[0, 0].tolist() == [0, 1, 15, 16, 17, 18, 19]


def test_generate_helper_reports_sizes(model):
    class Tok:
        chat_template = None
        pad_token_id = 0
        eos_token_id = 2

        def __call__(self, text, return_tensors=None):
            return {"input_ids": torch.tensor([[3 + ord(c) % 100 for c in text]])}

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    res = generate(model, Tok(), "abcdefghij" * 6, "buzz", budget=0.4, max_new_tokens=10)
    assert len(res.token_ids) == 10 and res.prompt_tokens == 60
    plan_policy = make_policy("buzz", 0.4, context_length=70, prompt_length=60)
    assert res.policy == plan_policy
    assert 0 < res.cache_ratio < 1
    assert max(res.cache_lengths) <= plan_policy.capacity


def test_generate_prefills_a_long_prompt_in_chunks(model):
    """generate() hands prefill_chunk to transformers' chunked prefill: the tokens are greedy_decode's
    with the same chunks, and for a cache that evicts nothing those of a one-shot prefill."""
    prompt = "the quick brown fox jumps over the lazy dog " * 2  # 88 tokens
    ids = CallTokenizer()(prompt)["input_ids"]
    one_shot = generate(model, CallTokenizer(), prompt, FullCache(), max_new_tokens=6, prefill_chunk=None).token_ids
    assert generate(model, CallTokenizer(), prompt, FullCache(), max_new_tokens=6, prefill_chunk=16).token_ids == one_shot
    policy = H2O(10, 10)
    got = generate(model, CallTokenizer(), prompt, policy, max_new_tokens=6, prefill_chunk=16).token_ids
    want = greedy_decode(model, ids, EvictingCache(policy, model, prefill_chunk=16), 6, prefill_chunk=16)
    assert got == want[0].tolist()
    with pytest.raises(ValueError, match="prefill_chunk"):
        generate(model, CallTokenizer(), prompt, policy, prefill_chunk=True)


def test_full_cache_allocates_what_it_needs(model):
    """FullCache: sized once from max_tokens when known (generate() knows it), otherwise grown by
    1/10 at a time: its keys and values never take more than 1.1x a tight cache."""
    ids = _ids(batch=2, length=100)
    for max_tokens in (None, 130):
        cache = EvictingCache(FullCache(), model, max_tokens=max_tokens)
        _greedy(model, ids, cache, n=30)
        for layer in cache.layers:
            store = layer.store
            tight = store.kv_bytes  # 129 tokens held (the last generated one never enters)
            allocated = store.kv_bytes // store.length * store.slots
            assert store.length == 129
            assert allocated <= 1.1 * tight, (max_tokens, store.slots)
            if max_tokens is not None:
                assert store.slots == max_tokens


def test_full_cache_grows_in_bounded_chunks():
    """Issue 25, item 7: without max_tokens the full cache grows by 1/16 (16 to 4,096 slots a
    time): after a 1,000-token prompt and 8 decoded tokens everything it allocates (positions,
    scores and bias included) is under 1.1x a tight cache of SmolLM2's head geometry (random
    weights, 2 layers)."""
    model = tiny_llama(num_layers=2, heads=9, kv_heads=3, head_dim=64, vocab=256, seed=0, max_position_embeddings=2048)
    cache = EvictingCache(FullCache(), model)
    greedy_decode(model, torch.randint(3, 256, (1, 1000), generator=torch.Generator().manual_seed(0)), cache, 9)
    for layer in cache.layers:
        assert layer.store.length == 1008
        assert layer.store.nbytes <= 1.1 * layer.store.kv_bytes, layer.store.slots


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
