"""kvpolicy_integrations/hf/generation.py: ``generate``, ``greedy_decode`` and ``compile_decode_step`` on tiny
random Llama models (fast, CPU): chunked prefills against the NumPy reference and a one-shot prefill,
generate()'s sizes, and the compiled decode step in a serving loop (issue 44, class 8).

This file's tiny models (`kvpolicy_tools.models.tiny_llama`) have random weights: they check wiring and
numerics, not language quality. The issue 44 edge tests use a model of their own seed; their compiled steps use dynamo's
``"eager"`` backend: it traces and guards exactly as inductor does (recompiles and their limit
included) without inductor's code generation.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import numpy as np  # noqa: E402
from transformers import DynamicCache  # noqa: E402

import kvpolicy_numpy  # noqa: E402
from kvpolicy import BUZZ, H2O, TOVA, AdaKV, FullCache, LocalWindow, Scissorhands, SnapKV, StreamingLLM, compose, make_policy  # noqa: E402
from kvpolicy_tools.models import tiny_llama  # noqa: E402
from tiny_eval import CallTokenizer  # noqa: E402
from kvpolicy_integrations.hf import EvictingCache, cache_kwargs, compile_decode_step, generate, greedy_decode  # noqa: E402

from hf_cases import token_ids as _ids, edge_ids as _edge_ids  # noqa: E402
from layer0 import layer0_logits as _layer0_logits  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.torch]


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



@pytest.mark.parametrize(
    "policy",
    [BUZZ(2, 5, 3, 8), BUZZ(2, 6, 4, 12, log_n=True, log_base=8.0), H2O(6, 6), StreamingLLM(2, 9), LocalWindow(9),
     TOVA(12), SnapKV(12, window=4), compose(prefill=SnapKV(12, window=3), decode=H2O(5, 6)),
     Scissorhands(12, history=5, drop=0.25, recent=2),
     AdaKV(H2O(6, 6)), AdaKV(TOVA(12, selection="per_head")), AdaKV(SnapKV(12, window=4))],
    ids=repr,
)
@pytest.mark.parametrize("chunk", [7, 16])
def test_chunked_prefill_keeps_what_the_numpy_replay_keeps(policy, chunk):
    """Differential: a prompt prefilled in chunks (greedy_decode's prefill_chunk) keeps, in layer 0,
    what the reference keeps for the same chunking (kvpolicy_numpy.replay's prompt_chunk), through
    the decode steps that follow (float64 tiny random model, as above). AdaKV's chunks after the
    first attend through a mask per KV head (its heads hold different tokens after a head-wise
    eviction: the AdaKV + TOVA cases end with heads of different lengths); they raised
    NotImplementedError before, so generate()'s default chunked prefill failed on AdaKV prompts."""
    model = tiny_llama(num_layers=2, heads=4, kv_heads=4, head_dim=8, vocab=96, seed=3).double()
    ids = _ids(batch=1, length=37, seed=5) % 96
    cache = EvictingCache(policy, model, prefill_chunk=chunk)
    new = greedy_decode(model, ids, cache, 12, prefill_chunk=chunk)
    seq = torch.cat([ids, new[:, :-1]], dim=1)  # the last generated token never enters the cache
    trace = kvpolicy_numpy.replay(policy, _layer0_logits(model, seq), prompt_len=ids.shape[1], prompt_chunk=chunk)
    np.testing.assert_array_equal(cache.layers[0].store.positions[0].numpy(), trace.kept[-1])
    assert cache.layers[0].store.evictions > 0
    if isinstance(policy, AdaKV) and isinstance(policy.scorer, TOVA):  # the per-KV-head masks were exercised
        held = (cache.layers[0].store.positions[0] >= 0).sum(-1)
        assert int(held.max()) > int(held.min()), held

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

# --------------------------------------------------------------------------- issue 44, class 8: the compiled path in real use
def test_generate_compiled_serves_a_loop_of_prompt_lengths(edge_model, eager_backend):
    """A serving loop: 12 prompts of different lengths through generate(compile=True), each with a
    policy planned for its own length (so capacities and storage sizes differ), gives eager's
    tokens (was: FailOnRecompileLimitHit at the ninth new length)."""
    for i, n in enumerate(range(9, 33, 2)):
        prompt = "".join(chr(97 + (5 * j + 3 * i) % 26) for j in range(n))
        compiled = generate(edge_model, CallTokenizer(), prompt, "h2o", budget=0.5, max_new_tokens=4, compile=True)
        eager = generate(edge_model, CallTokenizer(), prompt, "h2o", budget=0.5, max_new_tokens=4)
        assert compiled.token_ids == eager.token_ids, (n, compiled.token_ids, eager.token_ids)

@pytest.mark.slow
def test_one_compiled_step_serves_caches_of_many_capacities(edge_model):
    """One compile_decode_step reused across caches of nine capacities (as its docstring
    recommends) gives each cache eager's tokens (was: FailOnRecompileLimitHit at the ninth)."""
    torch.compiler.reset()
    step = compile_decode_step(edge_model, backend="eager")
    for capacity in range(4, 22, 2):
        policy = H2O(capacity // 2, capacity - capacity // 2)
        ids = _edge_ids(capacity + 3, seed=capacity)
        got = greedy_decode(edge_model, ids, EvictingCache(policy, edge_model, static_shapes=True, max_tokens=capacity + 8), 5,
                            step=step)
        assert torch.equal(got, greedy_decode(edge_model, ids, EvictingCache(policy, edge_model), 5)), capacity
    torch.compiler.reset()

def test_a_compiled_step_refuses_a_cache_without_static_shapes(edge_model):
    """A cache built without static_shapes=True is refused by name before anything compiles (its
    host bookkeeping would compile a graph a step, up to the recompile limit)."""
    from torch._dynamo.utils import counters

    torch.compiler.reset()
    counters.clear()
    step = compile_decode_step(edge_model, backend="eager")
    cache = EvictingCache(StreamingLLM(sink=2, window=6), edge_model)
    ids = _edge_ids(12)
    with torch.no_grad():
        edge_model(ids, use_cache=True, **cache_kwargs(edge_model, cache))
        for kw in ("cache", "past_key_values"):
            with pytest.raises(ValueError, match=r"^cache: compile_decode_step serves an EvictingCache built with "
                                                 r"static_shapes=True .*static_shapes=False"):
                step(input_ids=ids[:, -1:], position_ids=torch.tensor([[12]]), use_cache=True, **{kw: cache})
    assert counters["stats"]["unique_graphs"] == 0
    assert cache.layers[0].store.seen == [12]  # nothing was appended

@pytest.mark.parametrize("dynamic", [False, None])
def test_the_recompile_limit_is_refused_by_name(edge_model, dynamic):
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
            step = compile_decode_step(edge_model, backend="eager", dynamic=dynamic)
            for policy in policies:
                ids = _edge_ids(9, seed=len(repr(policy)))
                greedy_decode(edge_model, ids, EvictingCache(policy, edge_model, static_shapes=True, max_tokens=16), 3, step=step)
    finally:
        torch.compiler.reset()
    assert type(caught.value.__cause__).__name__ == "FailOnRecompileLimitHit"
