"""The family matrix: tiny random-weight decoders of many transformers model types (built from
their configs, no download), each checked end to end, and a walk over transformers' whole
causal-LM auto mapping asserting that every type either works or is refused by name.

Per matrix type (prompt 24 tokens, 40 greedy new tokens, float32):

* FullCache is token-identical to transformers' ``DynamicCache(config=...)``;
* every registered policy runs to the end with at most its capacity kept per layer;
* StreamingLLM with original positions equals a reference forward of the whole sequence with the
  equivalent 4-D masks (one per layer type: a sliding layer's window, crossed during the
  generation, is measured on original positions);
* a local window longer than the run equals the full cache;
* pos-shift: each layer's measured RoPE layout rotates a key computed at position ``p`` onto the
  key the model computes at ``p + delta`` (half-split, interleaved, partial, NoPE layers, and the
  scaled variants).
"""

from __future__ import annotations

import re

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import DynamicCache  # noqa: E402

from families import tiny_model  # noqa: E402
from kvpolicy import FullCache, LocalWindow, StreamingLLM, make_policy  # noqa: E402
from kvpolicy.registry import available_policies  # noqa: E402
from kvpolicy_integrations.capabilities import LayerAttention, detect, rope_layouts, text_config  # noqa: E402
from kvpolicy_integrations.hf import EvictingCache, cache_kwargs  # noqa: E402
from kvpolicy_integrations.reconstruction import RepeatPrompts, reconstruct  # noqa: E402
from kvpolicy_torch import rope_matrix, rope_rotate  # noqa: E402

PROMPT, NEW = 24, 40
WINDOW = 32  # sliding window / chunk of the local-attention configs: crossed at position 32 < 64
SLIDING_ALL = {"sliding_window": WINDOW}
SLIDING_MIX = {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]}

#: model type -> config overrides (local layers shrunk so that generation crosses their window).
#: Llama-alikes that add nothing new to check (apertus, arcee, internlm3, seed_oss, olmo, granitemoe,
#: qwen3_moe) are left to the auto-mapping walk below, to keep the matrix near 3 minutes.
MATRIX: dict[str, dict] = {
    "llama": {}, "mistral": SLIDING_ALL, "qwen2": SLIDING_MIX, "qwen3": SLIDING_MIX, "phi3": SLIDING_ALL,
    "olmo2": {}, "olmo3": SLIDING_MIX, "olmoe": {}, "granite": {},
    "mixtral": SLIDING_ALL, "qwen2_moe": {}, "phimoe": {}, "gemma": {},
    "gemma3_text": SLIDING_MIX, "smollm3": {"no_rope_layers": [1, 0]}, "cohere": {}, "cohere2": SLIDING_MIX, "glm": {}, "glm4": {}, "gpt_neox": {}, "persimmon": {}, "phi": {},
    "helium": {}, "ernie4_5": {}, "exaone4": SLIDING_MIX, "starcoder2": SLIDING_ALL,
    "llama4_text": {"attention_chunk_size": WINDOW, "layer_types": ["chunked_attention", "full_attention"],
                    "no_rope_layers": [1, 0]},
    "gpt2": {}, "opt": {}, "gpt_bigcode": {}, "ministral3": SLIDING_ALL,
    "nanochat": {},
}

_MODELS: dict[str, torch.nn.Module] = {}


def _model(model_type: str) -> torch.nn.Module:
    if model_type not in _MODELS:
        _MODELS.clear()  # one model alive at a time
        _MODELS[model_type] = tiny_model(model_type, **MATRIX[model_type])
    return _MODELS[model_type]


def _prompt(model: torch.nn.Module) -> torch.Tensor:
    vocab = text_config(model).vocab_size
    return torch.randint(3, min(vocab, 256), (1, PROMPT), generator=torch.Generator().manual_seed(0))


def _greedy(model, ids, cache, n: int = NEW) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` greedy tokens after ``ids`` with ``cache``: ``(sequence [1, len + n], logits [n, vocab])``
    (a plain loop: ``generate()``'s per-step overhead dominates a tiny model)."""
    seq, logits = ids, []
    with torch.no_grad():
        step = model(input_ids=ids, **cache_kwargs(model, cache), use_cache=True).logits[:, -1]
        if isinstance(cache, EvictingCache) and cache.policy.needs_reconstruction:  # KVzip: its second forward
            reconstruct(model, cache, ids, RepeatPrompts([3, 4, 5, 6], [7, 8], [9]))
        for k in range(n):
            logits.append(step[0])
            tok = step.argmax(-1, keepdim=True)
            seq = torch.cat([seq, tok], dim=1)
            if k + 1 < n:
                step = model(input_ids=tok, **cache_kwargs(model, cache), use_cache=True).logits[:, -1]
    return seq, torch.stack(logits)


def _generate(model, ids, cache, n: int = NEW) -> torch.Tensor:
    return _greedy(model, ids, cache, n)[0]


def _plan(name: str, budget: float):
    """``name`` planned for ``budget`` over this file's short run, or at the smallest budget it can
    reach there (a prefill-only policy such as ``pyramidkv`` cannot go below what decoding adds)."""
    try:
        return make_policy(name, budget, context_length=PROMPT + 16, prompt_length=PROMPT)
    except ValueError as exc:
        low = re.search(r"allowed range: \[([0-9.]+), 1\]", str(exc))
        if low is None:
            raise
        return make_policy(name, min(1.0, float(low.group(1)) + 0.01), context_length=PROMPT + 16, prompt_length=PROMPT)


def _within_capacity(cache) -> bool:
    """Every layer within its own policy's capacity (per-layer budgets give layers their own)."""
    return all(layer.store.policy.capacity is None or n <= layer.store.policy.capacity
               for layer, n in zip(cache.layers, _mean_lengths(cache)))


def _mean_lengths(cache) -> list[int]:
    """Tokens per KV head each layer holds (on average over the heads, rounded up, under head-wise
    budgets, whose capacity is per head on average), the most over rows."""
    out = []
    for layer, n in zip(cache.layers, cache.lengths()):
        store = layer.store
        if store.policy.ragged_heads and store.is_initialized:
            n = -(-store.kv_bytes // store.token_bytes)  # (rows: one, as these tests run)
        out.append(n)
    return out


def _builtin_policies() -> list[str]:
    """The registered policies that ship with kvpolicy (other tests register their own), except
    the ``compose``, ``pyramid`` and ``adakv`` combinators, which are planned through their presets
    (``snapkv_buzz``, ``pyramid_h2o``, ``adakv_h2o``, ...)."""
    out = []
    for name, entry in available_policies().items():
        if name in ("compose", "pyramid", "adakv"):  # they need a policy name to wrap
            continue
        cls = getattr(entry, "policy", None) or getattr(entry, "cls", None) or entry
        if getattr(cls, "__module__", "").startswith("kvpolicy.policies"):
            out.append(name)
    return out


def test_matrix_has_25_types_with_local_layers():
    assert {"buzz", "h2o", "local", "streaming_llm", "full"} <= set(_builtin_policies())
    assert len(MATRIX) >= 25
    assert sum(1 for v in MATRIX.values() if v.get("sliding_window") or v.get("attention_chunk_size")) >= 8


def _reference_logits(model, caps, seq: torch.Tensor, sink: int, window: int) -> torch.Tensor:
    """Logits at positions ``PROMPT - 1 ..`` of one forward of ``seq`` with the 4-D masks
    equivalent to StreamingLLM(sink, window) with original positions (``sink=0``: the local
    window), one per layer type: a decode query ``i`` sees the sinks, the ``window`` newest tokens
    kept before it and itself; the prompt is attended in full (it is evicted after the prefill);
    a sliding layer also needs ``j > i - W``, a chunked one the query's chunk."""
    n = seq.shape[1]
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    kept = (j <= i) & ((i < PROMPT) | (j < sink) | (j >= i - window))
    masks = {}
    for layer in set(caps.layers):
        allowed = kept
        if layer.kind == "sliding":
            allowed = kept & (j > i - layer.window)
        elif layer.kind == "chunked":
            allowed = kept & (j // layer.window == i // layer.window)
        masks[f"{layer.kind}_attention"] = torch.zeros(n, n).masked_fill(~allowed, float("-inf"))[None, None]
    mask = masks if len(masks) > 1 else next(iter(masks.values()))
    with torch.no_grad():
        return model(seq, attention_mask=mask, position_ids=torch.arange(n)[None]).logits[0, PROMPT - 1 : n - 1]


@pytest.mark.slow
def test_mistral_window_shorter_than_the_prompt():
    """Mistral with sliding_window 16 < a 24-token prompt: every policy runs; FullCache equals
    DynamicCache, StreamingLLM and the local window equal the reference masks; a left-padded batch
    (the padding read from the 2-D mask, never from a window) equals DynamicCache's."""
    model = tiny_model("mistral", sliding_window=16)
    caps = detect(model)
    assert set(caps.layers) == {LayerAttention("sliding", 16)}
    ids = _prompt(model)
    assert torch.equal(_generate(model, ids, EvictingCache(FullCache(), model)),
                       _generate(model, ids, DynamicCache(config=model.config)))
    for name in _builtin_policies():
        policy = _plan(name, 1.0 if name == "full" else 0.3)
        cache = EvictingCache(policy, model)
        if policy.needs_reconstruction:  # KVzip: its reconstruction needs every layer to see the whole context
            with pytest.raises(NotImplementedError, match="full-attention layers only"):
                _generate(model, ids, cache, 16)
            continue
        assert _generate(model, ids, cache, 16).shape[1] == PROMPT + 16
        assert _within_capacity(cache), name
    for sink, window, policy in ((4, 8, StreamingLLM(4, 8)), (0, 10, LocalWindow(10))):
        seq, got = _greedy(model, ids, EvictingCache(policy, model, positions="original"), 24)
        torch.testing.assert_close(got, _reference_logits(model, caps, seq, sink, window), rtol=1e-4, atol=1e-4)
    # a left-padded batch of two prompts (24 and 17 real tokens)
    batch = ids.repeat(2, 1)
    attention = torch.ones_like(batch)
    batch[1, :7], attention[1, :7] = 0, 0
    outs = []
    for cache in (EvictingCache(FullCache(), model), DynamicCache(config=model.config)):
        with torch.no_grad():
            outs.append(model.generate(batch, attention_mask=attention, max_new_tokens=20, min_new_tokens=20,
                                       do_sample=False, **cache_kwargs(model, cache), pad_token_id=0))
    assert torch.equal(outs[0], outs[1])


def _queries_rotate_back(model) -> bool:
    from kvpolicy_integrations.capabilities import query_rotations

    try:
        query_rotations(model)
    except ValueError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(MATRIX))
def test_family_matrix(model_type):
    model = _model(model_type)
    ids = _prompt(model)
    caps = detect(model)
    if model_type in ("mistral", "qwen2", "gemma3_text", "cohere2", "llama4_text", "exaone4", "starcoder2"):
        assert caps.has_local_layers  # the window is detected, and crossed below (positions reach 63)

    # 1. FullCache == DynamicCache, token for token
    ref = _generate(model, ids, DynamicCache(config=model.config))
    full = EvictingCache(FullCache(), model)
    assert torch.equal(_generate(model, ids, full), ref)

    # 2. every registered policy runs to the end within its capacity (16 new tokens: all evict in
    # the prompt and again while decoding)
    for name in _builtin_policies():
        if name == "full":
            continue  # above
        policy = _plan(name, 0.3)
        if policy.observes_queries and not _queries_rotate_back(model):
            # a model whose keys move in a way no RoPE layout explains (a norm after RoPE): Expected
            # Attention cannot rotate its queries back, and says so (no model without RoPE lands here)
            with pytest.raises(ValueError, match="before RoPE"):
                EvictingCache(policy, model, positions="original")
            continue
        cache = EvictingCache(policy, model, positions="original")
        if policy.needs_reconstruction and caps.has_local_layers:
            # KVzip's reconstruction needs every layer to see the whole context: a local layer is refused by name
            with pytest.raises(NotImplementedError, match="full-attention layers only"):
                _generate(model, ids, cache, 16)
            continue
        assert _generate(model, ids, cache, 16).shape[1] == PROMPT + 16
        assert _within_capacity(cache), name
        if policy.capacity is not None:
            assert cache.kv_bytes < cache.full_kv_bytes(), name

    # 3. StreamingLLM (original positions) == reference forward with the equivalent 4-D masks
    sink, window = 4, 12
    cache = EvictingCache(StreamingLLM(sink, window), model, positions="original")
    seq, got = _greedy(model, ids, cache)  # got[k]: the logits at position PROMPT - 1 + k
    torch.testing.assert_close(got, _reference_logits(model, caps, seq, sink, window), rtol=1e-4, atol=1e-4)

    # 4. a local window longer than the run == the full cache
    assert torch.equal(_generate(model, ids, EvictingCache(LocalWindow(PROMPT + NEW + 8), model)), ref)


#: Scaled RoPE variants, on Llama (Phi-3 is LongRoPE's home, below).
SCALED = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
}


def _rope_cases():
    cases = [pytest.param(t, {}, id=t) for t in ("llama", "cohere", "gpt_neox", "glm", "phi", "gemma3_text",
                                                   "llama4_text", "smollm3", "persimmon", "ernie4_5")]
    for name, params in SCALED.items():
        cases.append(pytest.param("llama", {"rope_parameters": {"rope_theta": 10000.0, **params}}, id=f"llama-{name}"))
    long = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 0.1 * k for k in range(8)],
            "long_factor": [2.0 + 0.1 * k for k in range(8)], "original_max_position_embeddings": 64}
    cases.append(pytest.param("phi3", {"rope_parameters": long, "original_max_position_embeddings": 64}, id="phi3-longrope"))
    return cases


@pytest.mark.parametrize(("model_type", "overrides"), _rope_cases())
def test_pos_shift_rotation_matches_rope_at_the_shifted_position(model_type, overrides):
    extra = {**MATRIX.get(model_type, {}), **overrides}
    model = tiny_model(model_type, **extra)
    layouts = rope_layouts(model)
    # keys of one token at positions p and p + delta (one row each: rows never see each other)
    p, delta = 3, torch.tensor([0, 5, 17, 40])
    pos = (p + delta)[:, None]
    ids = torch.full((len(delta), 1), 7)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, position_ids=pos, attention_mask=torch.ones_like(ids), **cache_kwargs(model, cache))
    styles = set()
    for layout, layer in zip(layouts, cache.layers):
        keys = layer.keys[:, :, -1]  # [rows, kv_heads, head_dim]
        if layout is None:  # NoPE: the key does not move
            torch.testing.assert_close(keys, keys[:1].expand_as(keys))
            styles.add("nope")
            continue
        styles.add((layout.style, layout.rotary_dim < keys.shape[-1]))
        moved = rope_rotate(keys[:1].expand_as(keys), delta[:, None], layout.inv_freq, style=layout.style,
                            rotary_dim=layout.rotary_dim)
        torch.testing.assert_close(moved, keys, rtol=1e-4, atol=1e-5)
        # the matrix form (StreamingLLM's sinks in the storage) rotates the same way
        matrix = rope_matrix(delta, layout.inv_freq, keys.shape[-1], style=layout.style, rotary_dim=layout.rotary_dim)
        torch.testing.assert_close((keys[:1].expand_as(keys)[:, :, None] @ matrix)[:, :, 0], keys, rtol=1e-4, atol=1e-5)
    expected = {"cohere": ("interleaved", False), "glm": ("interleaved", True), "gpt_neox": ("half", True),
                "phi": ("half", True), "llama": ("half", False), "smollm3": "nope", "llama4_text": "nope"}
    if model_type in expected:
        assert expected[model_type] in styles


@pytest.mark.parametrize("model_type", ["llama", "cohere", "gpt_neox", "glm", "gemma3_text", "smollm3", "mistral"])
def test_pos_shift_runs_for_every_layout(model_type):
    model = tiny_model(model_type, **MATRIX[model_type])
    ids = _prompt(model)
    cache = EvictingCache(StreamingLLM(4, 12), model, positions="cache")
    out = _generate(model, ids, cache, 16)
    assert out.shape[1] == PROMPT + 16 and max(cache.lengths()) <= 16


# ------------------------------------------------------------------------------------------------
# The walk over transformers' causal-LM auto mapping
# ------------------------------------------------------------------------------------------------

#: The named refusals (capabilities.py, hf/); any other exception is an obscure error.
NAMED = (
    "attention interface", "not a causal decoder", "multi-head latent attention", "soft-capped",
    "attention sinks", "not softmax attention over a KV cache", "layer types cannot be read", "has no integer",
    "cannot run through SDPA", "cannot be applied to an evicting cache", "per-layer (heterogeneous)",
)
#: Too large to build in a test even with tiny sizes (GiBs) or needing an optional package (timm):
#: checked from their config only.
UNBUILT = {"blt", "phi4_multimodal", "moss_transcribe_diarize", "gemma3n"}


def _walk_types():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _named(exc: Exception) -> bool:
    return isinstance(exc, ValueError) and any(name in str(exc) for name in NAMED)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", _walk_types())
def test_every_auto_mapping_type_works_or_is_refused_by_name(model_type):
    """Each causal-LM type: its default config is accepted or refused by name; when accepted and a
    tiny model of it runs in transformers, FullCache generates what DynamicCache does (or a named
    error stops it), and pos-shift is available or refused by name."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.for_model(model_type)
    except Exception as exc:  # noqa: BLE001 - transformers cannot build its own default config
        pytest.skip(f"transformers cannot build a default {model_type} config: {type(exc).__name__}")
    try:
        EvictingCache(FullCache(), config)
    except ValueError as exc:
        assert _named(exc), str(exc)
        return
    if model_type in UNBUILT:
        return
    try:
        model = tiny_model(model_type)
        ids = torch.randint(3, 200, (1, 12), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                                 **cache_kwargs(model, DynamicCache(config=model.config)), pad_token_id=0)
    except Exception as exc:  # noqa: BLE001 - transformers itself cannot run this tiny config
        pytest.skip(f"config accepted; transformers cannot generate with a tiny {model_type} model: {type(exc).__name__}")
    try:
        cache = EvictingCache(FullCache(), model)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                                 **cache_kwargs(model, cache), pad_token_id=0)
    except ValueError as exc:
        assert _named(exc), str(exc)
        return
    assert torch.equal(out, ref)
    try:
        EvictingCache(StreamingLLM(2, 4), model)
    except ValueError as exc:
        assert "pos-shift" in str(exc) and "positions='original' works" in str(exc)
