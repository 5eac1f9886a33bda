"""The transformers cache refuses what it cannot serve exactly, or serves it exactly (issue 28,
item 3 and 4): ``use_cache=False``, a new prompt without ``reset()``, a layer index it was not
built for, one cache in two forwards at once; copies (pickle, deepcopy, ``torch.save``) continue
token for token; allocation is bounded by what the run can need. The model is
``kvpolicy.models.tiny_llama`` (random weights, 2 layers, GQA)."""

from __future__ import annotations

import copy
import io
import pickle
import threading

import pytest
import torch

from kvpolicy import BUZZ, H2O, TOVA, FullCache, StreamingLLM
from kvpolicy.hf import EvictingCache, cache_kwargs, greedy_decode
from kvpolicy.models import tiny_llama

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


def test_a_new_prompt_without_reset_is_refused_and_reset_serves_it(model):
    """A forward whose 2-D mask does not cover what the cache has seen plus its new tokens is a new
    sequence: refused, naming reset(). (generate() drops an all-ones mask; a left-padded batch keeps
    it. Without any mask a new prompt cannot be told from a continuation: see docs/design.md.)"""
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


def test_a_layer_it_was_not_built_for_is_refused(model):
    cache = EvictingCache(H2O(8, 8), model)
    k = torch.zeros(1, 2, 3, 16)
    with pytest.raises(ValueError, match="layer_idx 2 is out of range.*2 layers"):
        cache.update(k, k, 2)


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
