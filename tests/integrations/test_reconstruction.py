"""kvpolicy_integrations/reconstruction.py, KVzip's context reconstruction on transformers: the
scores equal what an eager forward of the repeat prompt and the context (on a DynamicCache holding
the context) shows in its attention maps, the layers then keep exactly what the NumPy reference
keeps given those scores, generate() runs it, and the cache is left holding the context alone.
Tiny random-weight Llama for the fast tests; the embedded SmolLM2 in the slow one."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kvpolicy_numpy  # noqa: E402
from kvpolicy import AdaKV, KVzip, prefill_only  # noqa: E402
from kvpolicy_integrations.hf import EvictingCache, cache_kwargs, generate  # noqa: E402
from kvpolicy_integrations.reconstruction import RepeatPrompts, reconstruct, repeat_prompts, score_context  # noqa: E402
from kvpolicy_tools.models import tiny_llama  # noqa: E402
from transformers import DynamicCache  # noqa: E402

PROMPTS = RepeatPrompts(first=[5, 6, 7, 8], part=[9, 10], suffix=[11])


def _eager_scores(model, ids: torch.Tensor, prompts: RepeatPrompts) -> list[np.ndarray]:
    """What each context token receives while the model repeats the whole context in one chunk,
    read from an eager forward's attention maps: ``[batch, kv_heads, n]`` per layer, the most over
    the repeat's rows and the KV head's query heads."""
    n = ids.shape[1]
    saved = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            cache = DynamicCache(config=model.config)
            model(ids, **cache_kwargs(model, cache))
            repeat = torch.cat([torch.tensor([prompts.first + prompts.suffix]).expand(ids.shape[0], -1), ids], dim=1)
            out = model(repeat, output_attentions=True, **cache_kwargs(model, cache))
    finally:
        model.set_attn_implementation(saved)
    kv = model.config.num_key_value_heads
    result = []
    for maps in out.attentions:  # [batch, q_heads, r, n + r]
        b, q_heads, r, _ = maps.shape
        grouped = maps[..., :n].reshape(b, kv, q_heads // kv, r, n)
        result.append(grouped.amax(dim=(2, 3)).double().numpy())
    return result


def _prefilled(model, policy, ids):
    cache = EvictingCache(policy, model)
    with torch.no_grad():
        model(ids, **cache_kwargs(model, cache))
    return cache


def test_scores_are_the_attention_the_repeat_pays_the_context() -> None:
    """One chunk: each context token's score is the most any query of the repeat prompt and the
    context pays it in any query head of its KV head, as an eager forward's attention maps show;
    the EvictingCache still holds the context, whole."""
    model = tiny_llama()
    ids = torch.randint(12, 128, (2, 30), generator=torch.Generator().manual_seed(0))
    cache = _prefilled(model, KVzip(size=8, sink=0), ids)
    got = score_context(model, cache, ids, PROMPTS)
    for layer, expected in zip(got, _eager_scores(model, ids, PROMPTS)):
        np.testing.assert_allclose(layer.numpy(), expected, rtol=1e-4, atol=1e-6)
    assert cache.lengths() == [30, 30] and [layer.store.seen for layer in cache.layers] == [[30, 30]] * 2


@pytest.mark.parametrize("policy", [
    KVzip(size=9), AdaKV(KVzip(size=9), alpha_safeguard=0.0), prefill_only(AdaKV(KVzip(size=5), alpha_safeguard=0.0), 0.75),
])
@pytest.mark.parametrize("chunk", [2048, 7])
def test_layers_keep_what_the_reference_keeps_given_the_scores(policy, chunk) -> None:
    """reconstruct() keeps, in every layer, exactly the tokens the NumPy reference keeps given the
    same scores (score_context on a twin cache), chunked or not; a chunk's prompt quotes the previous
    chunk, and every context token is scored."""
    model = tiny_llama()
    ids = torch.randint(12, 128, (1, 33), generator=torch.Generator().manual_seed(1))
    scores = score_context(model, _prefilled(model, policy, ids), ids, PROMPTS, chunk=chunk)
    cache = _prefilled(model, policy, ids)
    reconstruct(model, cache, ids, PROMPTS, chunk=chunk)
    heads = model.config.num_key_value_heads
    for layer, s in zip(cache.layers, scores):
        assert bool((s[..., 4:] > 0).all())  # (the sinks before a chunk score only where chunked)
        trace = kvpolicy_numpy.replay(policy, np.zeros((33, heads, 33)), 33, reconstruction=s[0].numpy())
        expected = trace.kept[32]
        got = np.sort(layer.store.positions[0].numpy(), axis=-1)
        width = int((expected >= 0).sum(-1).max())
        assert got[:, got.shape[-1] - width:].tolist() == expected[:, expected.shape[-1] - width:].tolist()


def test_generate_runs_the_reconstruction_and_refusals_name_what_is_missing() -> None:
    """generate() with kvzip reconstructs after the prompt (the cache then grows by the new tokens);
    reconstruct() refuses a cache that holds more than the prompt or whose policy is not KVzip."""

    class Tok:  # a stand-in tokenizer (tests/tiny_eval.CallTokenizer has no encode)
        chat_template = None

        def __call__(self, text, return_tensors=None):
            return {"input_ids": torch.tensor([[12 + ord(c) % 100 for c in text]])}

        def encode(self, text, add_special_tokens=False):
            return [12 + ord(c) % 100 for c in text]

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    model = tiny_llama()
    res = generate(model, Tok(), "abcdefgh" * 5, KVzip(size=10), max_new_tokens=5)
    assert res.cache_lengths == [14, 14] and len(res.token_ids) == 5
    assert repeat_prompts(Tok()).suffix == [12 + 10]
    ids = torch.randint(12, 128, (1, 12))
    from kvpolicy import H2O

    with pytest.raises(ValueError, match="not scored by a context reconstruction"):
        reconstruct(model, _prefilled(model, H2O(heavy=4, recent=4), ids), ids, PROMPTS)
    cache = _prefilled(model, KVzip(size=5), ids)
    with pytest.raises(ValueError, match="exactly the prompt"):
        reconstruct(model, cache, ids[:, :10], PROMPTS)


@pytest.mark.slow
def test_embedded_model_scores_and_kept_tokens() -> None:
    """SmolLM2-135M (embedded): the reconstruction's scores equal the eager attention maps', and
    kvzip_headwise at ratio 0.5 keeps per layer exactly what the reference keeps given them."""
    from kvpolicy_tools.models import load

    model, tok = load("smollm2-135m")
    text = " ".join(f"Note {i}: the crate in bay {i} holds {i * 7 % 13} blue boxes." for i in range(12))
    ids = tok(text, return_tensors="pt")["input_ids"]
    prompts = repeat_prompts(tok)
    policy = prefill_only(AdaKV(KVzip(size=5), alpha_safeguard=0.0), 0.5)
    scores = score_context(model, _prefilled(model, policy, ids), ids, prompts)
    for layer, expected in zip(scores, _eager_scores(model, ids, RepeatPrompts(prompts.first, prompts.part, prompts.suffix))):
        np.testing.assert_allclose(layer.numpy(), expected, rtol=1e-3, atol=1e-5)
    cache = _prefilled(model, policy, ids)
    reconstruct(model, cache, ids, prompts)
    n, heads = ids.shape[1], model.config.num_key_value_heads
    for layer, s in zip(cache.layers, scores):
        expected = kvpolicy_numpy.replay(policy, np.zeros((n, heads, n)), n, reconstruction=s[0].numpy()).kept[n - 1]
        got = np.sort(layer.store.positions[0].numpy(), axis=-1)
        width = int((expected >= 0).sum(-1).max())
        assert got[:, got.shape[-1] - width:].tolist() == expected[:, expected.shape[-1] - width:].tolist()


def test_the_forward_under_reconstruction_attention_is_the_models() -> None:
    """A reconstruction forward's output is the model's own (SDPA's) whether its attention comes
    from the scoring probabilities (one chunk from the first token) or from SDPA beside them."""
    from kvpolicy_integrations import reconstruction

    model = tiny_llama()
    ids = torch.randint(12, 128, (2, 20), generator=torch.Generator().manual_seed(2))
    cache = _prefilled(model, KVzip(size=8), ids)
    repeat = torch.cat([torch.tensor([PROMPTS.first + PROMPTS.suffix]).expand(2, -1), ids], dim=1)

    def forward(recorder):
        copy = DynamicCache(config=model.config)
        for j, layer in enumerate(cache.layers):
            copy.update(layer.keys, layer.values, j)
        saved = model.config._attn_implementation
        model.set_attn_implementation(reconstruction.RECONSTRUCTION_ATTENTION)
        try:
            with torch.no_grad():
                extra = {} if recorder is None else {reconstruction.RECORDER_KWARG: recorder}
                return model(repeat, position_ids=torch.arange(20, 20 + repeat.shape[1])[None], **cache_kwargs(model, copy), **extra).logits
        finally:
            model.set_attn_implementation(saved)

    plain = forward(None)
    for lo, hi in ((0, 20), (5, 12)):  # every key scored (one attention), and a later chunk (SDPA beside)
        recorder = reconstruction._Recorder(2, 2, [2, 2], 20, lo, hi, [4, 4], torch.device("cpu"))
        torch.testing.assert_close(forward(recorder), plain, rtol=1e-5, atol=1e-5)
        assert bool((recorder.scores[0][..., lo:hi] > 0).all()) and bool((recorder.scores[0][..., hi:] == 0).all())
