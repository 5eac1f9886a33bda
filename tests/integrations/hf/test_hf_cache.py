"""kvpolicy_integrations/hf/cache.py: the whole cache (``EvictingCache``) and the forward hooks that scope
the attention switch to its forwards, on tiny random Llama models (fast, CPU): logits and tokens
against DynamicCache, capacity and memory, the kept positions against the NumPy reference, a chunked
prefill's bound, positions from tokens seen, refused architectures, a forward interrupted by Ctrl-C
and update() called by hand. The real-model checks are in test_hf_real_model.py.

This file's tiny models (`kvpolicy_tools.models.tiny_llama`) have random weights: they check wiring and
numerics, not language quality. The issue 44 edge tests (class 9, 20) use a model of their own seed.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import numpy as np  # noqa: E402
from transformers import DynamicCache  # noqa: E402

import kvpolicy_numpy  # noqa: E402
from kvpolicy import BUZZ, H2O, TOVA, ExpectedAttention, FullCache, LocalWindow, Scissorhands, SnapKV, StreamingLLM, compose  # noqa: E402
from kvpolicy_tools.models import tiny_llama  # noqa: E402
from kvpolicy_integrations.hf import EvictingCache, cache_kwargs, greedy_decode  # noqa: E402

COVERING = [FullCache(), BUZZ(4, 64, 5, 300), H2O(100, 100), StreamingLLM(4, 100), LocalWindow(100)]
EVICTING = [BUZZ(2, 6, 3, 10), BUZZ(2, 6, 4, 12, log_n=True, log_base=8.0), H2O(8, 8), StreamingLLM(2, 10), LocalWindow(12), TOVA(12),
            Scissorhands(14, history=6, drop=0.25, recent=3), ExpectedAttention(12, sink=2, future=32, refresh=1)]

from hf_cases import EDGE_SEED as SEED, edge_ids as _edge_ids, greedy as _greedy, token_ids as _ids  # noqa: E402
from layer0 import layer0_logits as _layer0_logits  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.torch]


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

# --------------------------------------------------------------------------- issue 44, class 9: Ctrl-C mid-forward
class _Interrupt:
    """A forward hook on one decoder layer raising ``error`` (Ctrl-C arrives as KeyboardInterrupt)."""

    def __init__(self, error: type[BaseException]) -> None:
        self.error = error

    def __call__(self, module, args, output):
        raise self.error()

@pytest.mark.parametrize("error", [KeyboardInterrupt, SystemExit])
@pytest.mark.parametrize("through", ["model", "base_model"])
def test_an_interrupted_forward_leaves_the_model_as_found(error, through):
    """A KeyboardInterrupt (or SystemExit: not an Exception, so torch's always_call hooks do not
    run) raised inside a forward with an EvictingCache, after layer 0 appended: the model's next
    plain DynamicCache forward equals a fresh model's (was: an error about differential attention),
    and the half-updated cache is refused until reset(), after which it serves exactly."""
    model, fresh = tiny_llama(seed=SEED), tiny_llama(seed=SEED)
    ids = _edge_ids(16)
    runner = model if through == "model" else model.model
    cache = EvictingCache(H2O(4, 4), model)
    handle = model.model.layers[1].register_forward_hook(_Interrupt(error))
    with pytest.raises(error), torch.no_grad():
        runner(input_ids=ids, **cache_kwargs(model, cache))
    handle.remove()
    assert model.config._attn_implementation == "sdpa"
    with torch.no_grad():
        got = model(ids, cache=DynamicCache(config=model.config)).logits
        want = fresh(ids, cache=DynamicCache(config=fresh.config)).logits
    assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match=rf"last forward was interrupted mid-step \({error.__name__}\).*cache.reset\(\)"):
        with torch.no_grad():
            model(ids, **cache_kwargs(model, cache))
    cache.reset()
    expected = greedy_decode(fresh, ids, EvictingCache(H2O(4, 4), fresh), 4)
    assert torch.equal(greedy_decode(model, ids, cache, 4), expected)

# --------------------------------------------------------------------------- issue 44, class 20: update() by hand
@pytest.mark.parametrize("built_from", ["model", "config"])
def test_update_outside_a_forward_is_refused_plainly(edge_model, built_from):
    """cache.update(k, v, layer) called by hand, outside a model's forward, is refused saying so
    (was: advice to pass the model rather than its config, or about another model's hooks), and
    the cache is left untouched."""
    cache = EvictingCache(FullCache(), edge_model if built_from == "model" else edge_model.config)
    k = torch.randn(1, 2, 3, 16)
    with pytest.raises(RuntimeError, match=r"layer 0: update\(\) was called by hand, outside a model's forward, "
                                           r"which is not supported"):
        cache.update(k, k, 0)
    assert not cache.layers[0].store.is_initialized
    with torch.no_grad():  # and the cache still serves a forward
        edge_model(_edge_ids(8), **cache_kwargs(edge_model, cache))
    assert cache.layers[0].store.seen == [8]
