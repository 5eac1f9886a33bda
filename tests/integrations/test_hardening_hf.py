"""The transformers cache refuses what it cannot serve exactly, or serves it exactly (issue 28,
item 3 and 4): ``use_cache=False``, a new prompt without ``reset()``, a layer index it was not
built for, one cache in two forwards at once; copies (pickle, deepcopy, ``torch.save``) continue
token for token; allocation is bounded by what the run can need. The model is
``kvpolicy_tools.models.tiny_llama`` (random weights, 2 layers, GQA)."""

from __future__ import annotations

import copy
import io
import pickle
import threading
import warnings

import pytest
import torch

from kvpolicy import BUZZ, H2O, TOVA, FullCache, StreamingLLM, make_policy
from kvpolicy.hf import EvictingCache, cache_kwargs, greedy_decode
from kvpolicy_tools.models import tiny_llama
from tiny_eval import CallTokenizer

pytestmark = [pytest.mark.hf, pytest.mark.torch]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=5)


def _ids(model, n: int = 40) -> torch.Tensor:
    return torch.randint(3, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(1))


def test_use_cache_false_is_refused(model):
    cache = EvictingCache(H2O(8, 8), model)
    with pytest.raises(ValueError, match="use_cache=False"):
        model.generate(_ids(model), max_new_tokens=3, do_sample=False, use_cache=False, **cache_kwargs(model, cache))


def test_output_attentions_is_refused_before_anything_is_appended():
    """An EvictingCache has no per-position attention maps (it attends over kept slots): asked for
    them, a forward says so (it returned none before, with transformers blaming SDPA), and the
    cache is left as it was: the same forward without them then runs."""
    eager = tiny_llama(seed=5, attn_implementation="eager")
    cache = EvictingCache(FullCache(), eager)
    with torch.no_grad(), pytest.raises(ValueError, match="output_attentions=True"):
        eager(_ids(eager, 10), output_attentions=True, **cache_kwargs(eager, cache))
    assert cache.lengths() == [0, 0]
    with pytest.raises(ValueError, match="output_attentions=True"):
        eager.generate(_ids(eager, 10), max_new_tokens=2, do_sample=False, output_attentions=True,
                       return_dict_in_generate=True, **cache_kwargs(eager, cache))
    with torch.no_grad():
        eager(_ids(eager, 10), **cache_kwargs(eager, cache))
    assert cache.lengths() == [10, 10]


def test_a_new_prompt_without_reset_is_refused_and_reset_serves_it(model):
    """A forward whose 2-D mask does not cover what the cache has seen plus its new tokens is a new
    sequence: refused, naming reset(). (generate() drops an all-ones mask; a left-padded batch keeps
    it. See test_a_new_prompt_through_generate_without_reset_is_refused for a forward without a mask.)"""
    ids = _ids(model)
    mask = torch.ones_like(ids)
    cache = EvictingCache(H2O(8, 8), model)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, **cache_kwargs(model, cache))
        model(input_ids=ids[:, :1], attention_mask=torch.ones(1, 41, dtype=torch.long), **cache_kwargs(model, cache))
        with pytest.raises(ValueError, match=r"has seen 41 columns.*cache.reset\(\)"):
            model(input_ids=ids[:, :30], attention_mask=mask[:, :30], **cache_kwargs(model, cache))
    cache.reset()
    again = greedy_decode(model, ids[:, :30], cache, 4, attention_mask=mask[:, :30])
    assert torch.equal(again, greedy_decode(model, ids[:, :30], EvictingCache(H2O(8, 8), model), 4, attention_mask=mask[:, :30]))


def test_a_new_prompt_through_generate_without_reset_is_refused(model):
    """generate() drops an all-ones mask and, given a used cache, feeds the model only the new
    prompt's "tail" at positions below what the cache has seen: refused, naming reset(). A chunk
    that continues where the cache stopped is served, as one prompt would be."""
    ids = _ids(model, 60)
    cache = EvictingCache(H2O(8, 8), model)
    model.generate(ids[:, :40], max_new_tokens=3, do_sample=False, **cache_kwargs(model, cache))
    for prompt in (ids[:, :30], ids[:, 19:60]):
        with pytest.raises(ValueError, match=r"has seen 42 tokens in row 0.*new prompt.*cache.reset\(\)"):
            model.generate(prompt, max_new_tokens=3, do_sample=False, **cache_kwargs(model, cache))
    with pytest.raises(ValueError, match=r"no new tokens.*has seen 42.*cache.reset\(\)"):  # shorter than it has seen
        model.generate(ids[:, 40:], max_new_tokens=3, do_sample=False, **cache_kwargs(model, cache))
    cache.reset()
    fresh = EvictingCache(H2O(8, 8), model)
    assert torch.equal(model.generate(ids[:, :30], max_new_tokens=3, do_sample=False, **cache_kwargs(model, cache)),
                       model.generate(ids[:, :30], max_new_tokens=3, do_sample=False, **cache_kwargs(model, fresh)))
    chunked, whole = EvictingCache(FullCache(), model), EvictingCache(FullCache(), model)
    with torch.no_grad():
        model(input_ids=ids[:, :25], position_ids=torch.arange(25)[None], **cache_kwargs(model, chunked))
        a = model(input_ids=ids[:, 25:], position_ids=torch.arange(25, 60)[None], **cache_kwargs(model, chunked)).logits
        b = model(input_ids=ids, **cache_kwargs(model, whole)).logits[:, 25:]
    torch.testing.assert_close(a, b)


def test_a_layer_it_was_not_built_for_is_refused(model):
    """transformers' ``Cache.update`` hands each call to the cache's layer of that index: a cache of
    2 layers has no layer 2 (IndexError, nothing appended), and a layer called by hand is refused."""
    cache = EvictingCache(H2O(8, 8), model)
    k = torch.zeros(1, 2, 3, 16)
    with pytest.raises(IndexError):
        cache.update(k, k, 2)
    with pytest.raises(RuntimeError, match="layer 1: update\\(\\) was called by hand"):
        cache.update(k, k, 1)
    assert not any(layer.store.is_initialized for layer in cache.layers)


def test_one_cache_in_two_forwards_at_once_is_refused(model):
    cache = EvictingCache(H2O(8, 8), model)
    cache.enter()  # what the first forward's hook does, still running
    errors = []

    def second():
        try:
            with torch.no_grad():
                model(_ids(model), **cache_kwargs(model, cache))
        except RuntimeError as exc:
            errors.append(str(exc))

    worker = threading.Thread(target=second)
    worker.start()
    worker.join()
    cache.leave()
    assert errors and "another forward" in errors[0]
    with torch.no_grad():  # free again
        model(_ids(model), **cache_kwargs(model, cache))


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("policy", [H2O(8, 8), BUZZ(sink=2, window=8, stride=3), FullCache(), StreamingLLM(4, 12),
                                    TOVA(size=16)], ids=repr)
def test_copies_continue_token_for_token(model, policy, static):
    """pickle, deepcopy and torch.save of a cache in the middle of generation: each copy decodes
    what the original decodes (an H2O copy keeps its layers' state in its group's tensors)."""
    cache = EvictingCache(policy, model, static_shapes=static, max_tokens=100)
    greedy_decode(model, _ids(model), cache, 10)
    buffer = io.BytesIO()
    torch.save(cache, buffer)
    buffer.seek(0)
    copies = [pickle.loads(pickle.dumps(cache)), copy.deepcopy(cache), torch.load(buffer, weights_only=False)]
    runs = []
    for c in [cache, *copies]:
        token, out = torch.tensor([[5]]), []
        with torch.no_grad():
            for i in range(20):
                logits = model(input_ids=token, position_ids=torch.tensor([[50 + i]]), **cache_kwargs(model, c)).logits
                c.settle()
                token = logits[:, -1:].argmax(-1)
                out.append(token)
        runs.append(torch.cat(out, dim=1))
    assert all(torch.equal(runs[0], r) for r in runs[1:])


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_allocation_is_bounded_by_what_the_run_needs(model, static):
    """A policy planned far larger than the run allocates for the run's tokens only, and one sized
    too small for what comes grows (up to its capacity) with the same tokens."""
    ids = _ids(model)
    huge = EvictingCache(H2O(heavy=100_000, recent=100_000), model, max_tokens=48, static_shapes=static)
    greedy_decode(model, ids, huge, 8)
    per_token = huge.kv_bytes / sum(layer.store.length for layer in huge.layers)
    assert huge.allocated_bytes < 2 * 49 * per_token * len(huge.layers)
    small = EvictingCache(H2O(heavy=20, recent=20), model, max_tokens=10, static_shapes=static)
    assert torch.equal(greedy_decode(model, ids, small, 30), greedy_decode(model, ids, EvictingCache(H2O(heavy=20, recent=20), model), 30))


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_a_nonfinite_decode_step_under_log_n_is_reported(static):
    """Issue 28 item 6 in the transformers cache: decode steps whose logits times the log-n scale
    overflow give NaN probabilities (the NaN rule ranks their scores lowest); the layers flag it on
    the device, and the next host read of the cache (here greedy_decode's end) warns
    NonFiniteWarning naming the layers. The same run without log n is finite and silent."""
    from kvpolicy.driver import NonFiniteWarning

    model = tiny_llama(seed=5)
    ids = _ids(model)
    caches = {log_n: EvictingCache(BUZZ(sink=2, window=8, stride=3, log_n=log_n, log_base=1.0000001), model,
                                   static_shapes=static) for log_n in (False, True)}
    with torch.no_grad():
        for cache in caches.values():  # a finite prompt
            model(input_ids=ids, **cache_kwargs(model, cache))
        for layer in model.model.layers:  # then logits near the float32 limit
            layer.self_attn.q_proj.weight.mul_(1e17)
            layer.self_attn.k_proj.weight.mul_(1e17)
    assert caches[True].report_nonfinite() == []
    for log_n, cache in caches.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.no_grad():
                for i in range(3):
                    model(input_ids=ids[:, i : i + 1], position_ids=torch.tensor([[40 + i]]), **cache_kwargs(model, cache))
                    cache.settle()
            lengths = cache.lengths()  # a host read: reports
        found = [w for w in caught if issubclass(w.category, NonFiniteWarning)]
        if log_n:
            assert len(found) == 1 and "layer(s) [0, 1]" in str(found[0].message), [str(w.message) for w in caught]
            assert cache.report_nonfinite() == [0, 1]  # (reported once)
        else:
            assert not found and cache.report_nonfinite() == []
        assert lengths


def test_two_threads_on_one_model_are_refused_not_mixed(model):
    """The attention switch is the model's config, which every thread reads: while one thread's
    forward with an EvictingCache holds it, a forward of the same model in another thread (with
    its own EvictingCache, or any other cache) is refused; the first continues exactly."""
    from transformers import DynamicCache

    ids = _ids(model)
    expected = greedy_decode(model, ids, EvictingCache(H2O(8, 8), model), 6)
    inside, release = threading.Event(), threading.Event()

    def hold(module, args, kwargs):  # the first thread waits inside its forward, after the switch
        if threading.current_thread() is worker and not inside.is_set():
            inside.set()
            release.wait(30)

    handle = model.model.layers[0].register_forward_pre_hook(hold, with_kwargs=True)
    result = {}
    worker = threading.Thread(target=lambda: result.setdefault("out", greedy_decode(model, ids, EvictingCache(H2O(8, 8), model), 6)))
    try:
        worker.start()
        assert inside.wait(30)
        for cache in (EvictingCache(H2O(8, 8), model), DynamicCache(config=model.config)):
            with pytest.raises(RuntimeError, match="another thread.*its own model"), torch.no_grad():
                model(input_ids=ids, **cache_kwargs(model, cache))
    finally:
        release.set()
        worker.join()
        handle.remove()
    assert torch.equal(result["out"], expected)
    assert model.config._attn_implementation == "sdpa"


def test_a_cache_serves_the_model_it_was_built_for(model):
    """A cache holds one model's keys and values: a forward of another model (even of the same
    shape) is refused naming both, and a string is not a model."""
    other = tiny_llama(seed=6, num_layers=4)
    for cache in (EvictingCache(H2O(8, 8), other), EvictingCache(H2O(8, 8), tiny_llama(seed=5))):
        with pytest.raises(ValueError, match=r"built for another model \((LlamaForCausalLM|gone), \d layers\)"), torch.no_grad():
            model(_ids(model), **cache_kwargs(model, cache))
    fresh = tiny_llama(seed=7)  # a model no cache was built for: no hooks, refused at the first update
    with pytest.raises(RuntimeError, match=r"layer 0: a forward that did not go through the hooks of the model .* built for"):
        with torch.no_grad():
            fresh(_ids(fresh), **cache_kwargs(fresh, EvictingCache(H2O(8, 8), model)))
    with pytest.raises(TypeError, match="model must be a transformers model \\(or its config\\), got str"):
        EvictingCache(H2O(8, 8), "llama")
    cache = EvictingCache(H2O(8, 8), model)
    with torch.no_grad():  # its base model is the same model
        model.model(input_ids=_ids(model), **cache_kwargs(model, cache))


def test_a_deep_copy_of_a_model_serves_its_own_caches(model):
    """copy.deepcopy(model) copies the attention-scope hooks with it: the copy is hooked once and
    serves its own caches exactly as the original (what a thread of its own needs)."""
    ids = _ids(model)
    expected = greedy_decode(model, ids, EvictingCache(H2O(8, 8), model), 6)
    twin = copy.deepcopy(model)
    assert torch.equal(greedy_decode(twin, ids, EvictingCache(H2O(8, 8), twin), 6), expected)
    assert twin.config._attn_implementation == model.config._attn_implementation == "sdpa"


# ---------------------------------------------------------------------------- issue 44


def test_generate_refuses_what_a_policy_object_would_ignore(model):
    """Issue 44 class 4: generate(..., H2O(...), heavy=2) ignored heavy, and budget=7.0 with a policy
    object passed without a word. Overrides and budget plan a registered name: with an object they
    are refused by name; an out-of-range budget is refused with a name or an object; a name takes both."""
    from kvpolicy.hf import generate

    prompt = "abcdefghij" * 4
    obj = H2O(heavy=4, recent=4)
    with pytest.raises(ValueError, match=r"^heavy=2: budget and parameter overrides plan a registered policy name, and "
                                         r"policy H2O\(heavy=4, recent=4\) is an object, used as it is: .* \('h2o'\)"):
        generate(model, CallTokenizer(), prompt, obj, heavy=2, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"^budget=0\.5: budget and parameter overrides plan a registered policy name"):
        generate(model, CallTokenizer(), prompt, obj, budget=0.5, max_new_tokens=2)
    for policy in (obj, "h2o"):
        with pytest.raises(ValueError, match=r"^budget must be in \(0\.0, 1\.0\], got 7\.0"):
            generate(model, CallTokenizer(), prompt, policy, budget=7.0, max_new_tokens=2)
    assert generate(model, CallTokenizer(), prompt, obj, max_new_tokens=2).policy == obj
    assert generate(model, CallTokenizer(), prompt, "h2o", budget=0.5, recent=3, max_new_tokens=2).policy.recent == 3
    assert generate(model, CallTokenizer(), prompt, "h2o", max_new_tokens=2).policy == make_policy(
        "h2o", 0.3, context_length=len(prompt) + 2, prompt_length=len(prompt), layers=2)  # the default budget


def test_a_model_in_training_mode_is_told_to_call_eval():
    """Issue 44 class 16: a model in train() mode (attention dropout) was refused listing
    position_ids and use_cache as what the attention got; now the dropout is named, with model.eval()."""
    model = tiny_llama(seed=5, attention_dropout=0.1).train()
    cache = EvictingCache(H2O(heavy=4, recent=4), model)
    with pytest.raises(ValueError, match=r"takes no dropout, softcap or position bias; got attention dropout 0\.1 \(the "
                                         r"model is in training mode: call model\.eval\(\) before decoding\)$"):
        with torch.no_grad():
            model.generate(_ids(model, 20), max_new_tokens=2, do_sample=False, **cache_kwargs(model, cache))
