"""The transformers integration at its edges (issue 44, classes 8, 9, 19 and 20): the compiled decode
step in a serving loop (prompts of many lengths, caches of many capacities), Ctrl-C in the middle
of a forward, the keys of a left-padded batch, and ``cache.update()`` called by hand.

The model is ``kvpolicy_tools.models.tiny_llama`` (random weights, 2 layers, GQA). Compiled steps
use dynamo's ``"eager"`` backend: it traces and guards exactly as inductor does (recompiles and
their limit included) without inductor's code generation.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvpolicy import H2O, FullCache, StreamingLLM
from kvpolicy.hf import EvictingCache, cache_kwargs, compile_decode_step, generate, greedy_decode
from kvpolicy_tools.models import tiny_llama
from tiny_eval import CallTokenizer

pytestmark = [pytest.mark.hf, pytest.mark.torch]

SEED = 11


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=SEED)


def _ids(n: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (batch, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def eager_backend():
    """torch.compile's default backend set to dynamo's "eager" for the test (generate() compiles
    with the default), then put back."""
    before = torch.compiler.get_default_backend()
    torch.compiler.set_default_backend("eager")
    torch.compiler.reset()  # (a fresh recompile count for the model's forward)
    yield
    torch.compiler.set_default_backend(before)
    torch.compiler.reset()


# --------------------------------------------------------------------------- class 8: the compiled path in real use
def test_generate_compiled_serves_a_loop_of_prompt_lengths(model, eager_backend):
    """A serving loop: 12 prompts of different lengths through generate(compile=True), each with a
    policy planned for its own length (so capacities and storage sizes differ), gives eager's
    tokens (was: FailOnRecompileLimitHit at the ninth new length)."""
    for i, n in enumerate(range(9, 33, 2)):
        prompt = "".join(chr(97 + (5 * j + 3 * i) % 26) for j in range(n))
        compiled = generate(model, CallTokenizer(), prompt, "h2o", budget=0.5, max_new_tokens=4, compile=True)
        eager = generate(model, CallTokenizer(), prompt, "h2o", budget=0.5, max_new_tokens=4)
        assert compiled.token_ids == eager.token_ids, (n, compiled.token_ids, eager.token_ids)


@pytest.mark.slow
def test_one_compiled_step_serves_caches_of_many_capacities(model):
    """One compile_decode_step reused across caches of nine capacities (as its docstring
    recommends) gives each cache eager's tokens (was: FailOnRecompileLimitHit at the ninth)."""
    torch.compiler.reset()
    step = compile_decode_step(model, backend="eager")
    for capacity in range(4, 22, 2):
        policy = H2O(capacity // 2, capacity - capacity // 2)
        ids = _ids(capacity + 3, seed=capacity)
        got = greedy_decode(model, ids, EvictingCache(policy, model, static_shapes=True, max_tokens=capacity + 8), 5,
                            step=step)
        assert torch.equal(got, greedy_decode(model, ids, EvictingCache(policy, model), 5)), capacity
    torch.compiler.reset()


def test_a_compiled_step_refuses_a_cache_without_static_shapes(model):
    """A cache built without static_shapes=True is refused by name before anything compiles (its
    host bookkeeping would compile a graph a step, up to the recompile limit)."""
    from torch._dynamo.utils import counters

    torch.compiler.reset()
    counters.clear()
    step = compile_decode_step(model, backend="eager")
    cache = EvictingCache(StreamingLLM(sink=2, window=6), model)
    ids = _ids(12)
    with torch.no_grad():
        model(ids, use_cache=True, **cache_kwargs(model, cache))
        for kw in ("cache", "past_key_values"):
            with pytest.raises(ValueError, match=r"^cache: compile_decode_step serves an EvictingCache built with "
                                                 r"static_shapes=True .*static_shapes=False"):
                step(input_ids=ids[:, -1:], position_ids=torch.tensor([[12]]), use_cache=True, **{kw: cache})
    assert counters["stats"]["unique_graphs"] == 0
    assert cache.layers[0].store.seen == [12]  # nothing was appended


@pytest.mark.parametrize("dynamic", [False, None])
def test_the_recompile_limit_is_refused_by_name(model, dynamic):
    """A compiled step past torch's recompile limit (lowered here to 2: the default 8 compiles
    eight graphs first) raises a ValueError naming compile_decode_step's parameter and what to do
    (was: torch's raw FailOnRecompileLimitHit, 'Hard failure due to fullgraph=True'). With
    dynamic=False each cache size is a graph; with the default, each policy kind's decode step."""
    if dynamic is False:  # one policy, caches of three capacities
        policies = [H2O(c // 2, c - c // 2) for c in (4, 6, 8)]
        message = (r"^dynamic=False: compile_decode_step compiles a graph per cache size, and this cache would be graph 3, "
                   r"past torch's recompile limit \(torch.compiler.config.recompile_limit = 2\): .*dynamic=None")
    else:  # caches of one size, three policy kinds (each kind's decode step is other code)
        policies = [H2O(3, 3), StreamingLLM(sink=2, window=4), FullCache()]
        message = (r"^compile_decode_step: torch's recompile limit \(torch.compiler.config.recompile_limit = 2\) .* "
                   r"compile a copy of the model per policy kind")
    torch.compiler.reset()
    try:
        with torch.compiler.config.patch(recompile_limit=2), pytest.raises(ValueError, match=message) as caught:
            step = compile_decode_step(model, backend="eager", dynamic=dynamic)
            for policy in policies:
                ids = _ids(9, seed=len(repr(policy)))
                greedy_decode(model, ids, EvictingCache(policy, model, static_shapes=True, max_tokens=16), 3, step=step)
    finally:
        torch.compiler.reset()
    assert type(caught.value.__cause__).__name__ == "FailOnRecompileLimitHit"


# --------------------------------------------------------------------------- class 9: Ctrl-C mid-forward
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
    ids = _ids(16)
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


# --------------------------------------------------------------------------- class 19: keys of a left-padded batch
@pytest.mark.parametrize("policy", [FullCache(), H2O(5, 5), StreamingLLM(sink=2, window=6)], ids=repr)
def test_keys_of_a_left_padded_batch_in_transformers_shape(model, policy):
    """After a left-padded prompt (and decode steps) rows keep different numbers of tokens;
    layer.keys / .values are [batch, kv_heads, longest, head_dim] with each row's kept tokens in
    position order at the end and zeros in front, and layer.kept_mask says which are kept (was: a
    ValueError 'rows differ in kept tokens'). For the full cache they equal DynamicCache's keys at
    the real columns, pads where DynamicCache has its pad columns."""
    ids = _ids(14, batch=3, seed=2)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    mask[2, :2] = 0
    cache = EvictingCache(policy, model)
    greedy_decode(model, ids, cache, 3, attention_mask=mask)
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
        full = DynamicCache(config=model.config)
        fresh = EvictingCache(FullCache(), model)
        with torch.no_grad():
            model(ids, attention_mask=mask, position_ids=positions, cache=full)
            model(ids, attention_mask=mask, position_ids=positions, **cache_kwargs(model, fresh))
        for ours, theirs in zip(fresh.layers, full.layers):
            assert ours.keys.shape == theirs.keys.shape
            real = mask.bool()[:, None, :].expand(-1, 2, -1)
            assert torch.equal(ours.kept_mask, real)
            torch.testing.assert_close(ours.keys[real], theirs.keys[real])
            torch.testing.assert_close(ours.values[real], theirs.values[real])


# --------------------------------------------------------------------------- class 20: update() by hand
@pytest.mark.parametrize("built_from", ["model", "config"])
def test_update_outside_a_forward_is_refused_plainly(model, built_from):
    """cache.update(k, v, layer) called by hand, outside a model's forward, is refused saying so
    (was: advice to pass the model rather than its config, or about another model's hooks), and
    the cache is left untouched."""
    cache = EvictingCache(FullCache(), model if built_from == "model" else model.config)
    k = torch.randn(1, 2, 3, 16)
    with pytest.raises(RuntimeError, match=r"layer 0: EvictingCache.update\(\) was called outside a model's forward, "
                                           r"which is not supported"):
        cache.update(k, k, 0)
    assert not cache.layers[0].store.is_initialized
    with torch.no_grad():  # and the cache still serves a forward
        model(_ids(8), **cache_kwargs(model, cache))
    assert cache.layers[0].store.seen == [8]


@pytest.mark.parametrize("policy", [StreamingLLM(sink=2, window=4), H2O(3, 3)], ids=repr)
def test_a_layer_updated_by_hand_is_refused_at_the_first_call(model, policy):
    """cache.layers[i].update(k, v) called by hand is refused at once, saying so (was: the first
    call appended all 10 keys past the capacity of 7 and evicted nothing, the next call blamed
    the model's attention switch), and leaves the layer untouched: the cache still serves a
    forward. A model whose attention hands no kwargs to cache.update (GPT-NeoX) is still served
    (tests/integrations/test_families.py)."""
    cache = EvictingCache(policy, model)
    k = torch.randn(1, 2, 10, 16)
    with pytest.raises(RuntimeError, match=r"^layer 1: EvictingLayer.update\(\) was called by hand, outside a model's "
                                           r"forward, which is not supported: .*DynamicCache"):
        cache.layers[1].update(k, k)
    assert not cache.layers[1].store.is_initialized and not cache.layers[1].is_initialized
    with torch.no_grad():
        model(_ids(12), **cache_kwargs(model, cache))
    assert cache.layers[1].store.seen == [12] and cache.layers[1].store.length <= policy.capacity
