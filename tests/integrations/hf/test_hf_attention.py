"""kvpolicy_integrations/hf/attention.py: the ``"kvpolicy_sdpa"`` attention and its mask function, their
registration in transformers, switching a model to it for good (``use_kvpolicy_attention``), and a
forward whose attention did not go through it. (The switch scoped to a cache's forwards,
``scope_attention``, is tested with the cache: test_hf_cache.py.)

This file's tiny models (`kvpolicy_tools.models.tiny_llama`) have random weights: they check wiring and
numerics, not language quality.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import AttentionInterface, DynamicCache  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # noqa: E402

from kvpolicy import H2O, FullCache  # noqa: E402
from kvpolicy_tools.models import tiny_llama  # noqa: E402
from kvpolicy_integrations.hf import ATTENTION_NAME, EvictingCache, cache_kwargs, register_attention, use_kvpolicy_attention  # noqa: E402
from kvpolicy_integrations.hf.attention import kvpolicy_sdpa_attention  # noqa: E402

from hf_cases import token_ids as _ids, greedy as _greedy  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.torch]


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

def test_attention_not_routed_through_kvpolicy_is_caught():
    model = tiny_llama(num_layers=1, seed=1)
    cache = EvictingCache(H2O(4, 4), model.config)  # a config: the model is not switched
    with pytest.raises(RuntimeError, match="use_kvpolicy_attention"):
        _greedy(model, _ids(batch=1, length=10), cache, n=3)

def test_register_attention_registers_the_function_and_sdpas_mask_under_its_name():
    """register_attention (run at import, idempotent) names the attention function and transformers'
    sdpa_mask under "kvpolicy_sdpa": without the mask function transformers passes no mask, and SDPA's
    top-left is_causal then drops keys during a chunked prefill."""
    assert register_attention() == ATTENTION_NAME == register_attention()
    assert AttentionInterface()[ATTENTION_NAME] is kvpolicy_sdpa_attention
    assert AttentionMaskInterface()[ATTENTION_NAME] is sdpa_mask

def test_use_kvpolicy_attention_serves_a_cache_built_from_the_config_and_other_caches_as_sdpa():
    """A model switched for good (as attn_implementation="kvpolicy_sdpa" at load time) serves an
    EvictingCache built from its config alone, token for token as one built from the model, and a
    DynamicCache as its SDPA model does (tiny random-weight Llamas of one seed)."""
    model, plain = tiny_llama(num_layers=2, seed=4), tiny_llama(num_layers=2, seed=4)
    use_kvpolicy_attention(model)
    use_kvpolicy_attention(model)  # (idempotent)
    assert model.config._attn_implementation == ATTENTION_NAME
    ids = _ids(batch=1, length=20)
    with torch.no_grad():
        got = model(ids, **cache_kwargs(model, DynamicCache(config=model.config))).logits
        want = plain(ids, **cache_kwargs(plain, DynamicCache(config=plain.config))).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for policy in (FullCache(), H2O(4, 4)):
        from_config = _greedy(model, ids, EvictingCache(policy, model.config), n=6)
        assert torch.equal(from_config, _greedy(plain, ids, EvictingCache(policy, plain), n=6)), policy
