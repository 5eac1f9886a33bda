"""kvpolicy_torch/static.py, one graph per decode step (issue 25): an ``EvictingCache(...,
static_shapes=True)`` decode step under ``torch.compile(fullgraph=True, dynamic=False)`` traces for every
policy, compiles at most two graphs over 300 steps that cross evictions (and, for BUZZ and Scissorhands,
host evictions between steps), and gives eager's greedy tokens; the model is left as it was found.

The model is ``kvpolicy_tools.models.tiny_llama``: random weights, 2 layers, GQA (fast; compiling the
embedded model takes minutes, see benchmarks/compiled_decode.py). Most cases compile with
dynamo's ``"eager"`` backend, which traces exactly what inductor would get (``fullgraph=True``
fails on any graph break) without inductor's code generation; one case runs inductor itself.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from kvpolicy import BUZZ, H2O, TOVA, AdaKV, ExpectedAttention, FullCache, KeyDiff, Knorm, LocalWindow, SnapKV, StreamingLLM, make_policy
from kvpolicy.hf import EvictingCache, cache_kwargs, compile_decode_step, greedy_decode
from kvpolicy_tools.models import tiny_llama

pytestmark = [pytest.mark.hf, pytest.mark.torch]

PROMPT, STEPS = 48, 300


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=3)


def _prompt(model, batch: int = 1) -> torch.Tensor:
    vocab = model.config.vocab_size
    return torch.randint(3, vocab, (batch, PROMPT), generator=torch.Generator().manual_seed(7))


POLICIES = {
    "full": lambda: FullCache(),
    "h2o": lambda: H2O(heavy=12, recent=12),
    "tova": lambda: TOVA(size=24),
    "tova_shared": lambda: TOVA(size=24, selection="shared"),
    "scissorhands": lambda: make_policy("scissorhands", 0.1, context_length=PROMPT + STEPS),
    "streaming_pos_shift": lambda: StreamingLLM(sink=4, window=20),
    "local": lambda: LocalWindow(window=24),
    "pyramid_h2o": lambda: make_policy("pyramid_h2o", 0.1, context_length=PROMPT + STEPS, layers=2),  # tiny_llama: 2 layers
    "buzz": lambda: BUZZ(sink=2, window=12, stride=3),
    "keydiff": lambda: KeyDiff(size=24, refresh=1),
    "keydiff_refresh": lambda: KeyDiff(size=24, refresh=3),  # a refresh interval without query moments
    "knorm": lambda: Knorm(size=24),  # a token-local score, given when the token is written on the device
    "expected_attention": lambda: ExpectedAttention(size=24, future=64, refresh=1),  # running query moments on the device
    "expected_attention_refresh": lambda: ExpectedAttention(size=24, future=64, refresh=3),  # torch.cond in the graph
    # head-wise budgets: the layer's H lowest outside the floors freed on the device (headwise_victims)
    "adakv_h2o": lambda: AdaKV(H2O(heavy=12, recent=12)),
    "adakv_tova": lambda: AdaKV(TOVA(size=24, selection="per_head"), alpha_safeguard=0.5),
    "adakv_keydiff": lambda: AdaKV(KeyDiff(size=24, refresh=1)),
    "adakv_knorm": lambda: AdaKV(Knorm(size=24)),
    "adakv_expected_attention": lambda: AdaKV(ExpectedAttention(size=24, future=64, refresh=1)),
}


def _compiled_run(model, policy, *, positions=None, batch: int = 1, mask=None, backend: str = "eager"):
    torch._dynamo.reset()
    counters.clear()
    ids = _prompt(model, batch)
    if mask is not None:
        ids = ids.masked_fill(mask == 0, 0)
    cache = EvictingCache(policy, model, positions=positions, static_shapes=True, max_tokens=PROMPT + STEPS + 1)
    step = compile_decode_step(model, backend=backend)
    got = greedy_decode(model, ids, cache, STEPS, attention_mask=mask, step=step)
    graphs = counters["stats"]["unique_graphs"]
    want = greedy_decode(model, ids, EvictingCache(policy, model, positions=positions), STEPS, attention_mask=mask)
    return got, want, graphs, cache


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_compiled_step_is_one_graph_and_equals_eager(model, name):
    policy = POLICIES[name]()
    got, want, graphs, cache = _compiled_run(model, policy)
    assert 1 <= graphs <= 2, graphs
    assert torch.equal(got, want)
    if policy.capacity is not None:  # it did evict, and stays within its capacity
        heads = model.config.num_key_value_heads
        # (head-wise budgets: capacity is per head on average; one head holds up to head_capacity)
        most = max(p.head_capacity(heads) if p.ragged_heads else p.capacity for p in (layer.store.policy for layer in cache.layers))
        assert max(cache.lengths()) <= most
        assert sum(cache.layers[0].store.seen) == PROMPT + STEPS - 1


def _held(cache) -> list:
    """Each layer's, row's and head's held positions, sorted (slots order nothing in a static step)."""
    return [[[sorted(p for p in head if p >= 0) for head in row] for row in layer.store.positions.tolist()] for layer in cache.layers]


@pytest.mark.slow
@pytest.mark.parametrize("make, differ", [(lambda: AdaKV(H2O(heavy=12, recent=4), alpha_safeguard=0.0), False),
                                          (lambda: AdaKV(KeyDiff(size=24, refresh=3)), True),
                                          (lambda: AdaKV(ExpectedAttention(size=24, future=64, refresh=3)), True)],
                         ids=["h2o", "keydiff_refresh", "expected_attention_refresh"])
def test_compiled_headwise_budgets_keep_eagers_tokens_in_every_head(model, make, differ):
    """AdaKV compiled: a left-padded batch of two keeps, in every layer, row and head, the
    positions the eager layout keeps (heads hold different numbers: the widest head's storage,
    each head's victims freed where they stand), and decodes the same tokens in one graph."""
    mask = torch.ones(2, PROMPT, dtype=torch.long)
    mask[1, :9] = 0  # row 1: a left-padded, shorter prompt
    got, want, graphs, cache = _compiled_run(model, make(), batch=2, mask=mask)
    assert graphs <= 2 and torch.equal(got, want)
    ids = _prompt(model, 2).masked_fill(mask == 0, 0)
    eager = EvictingCache(make(), model)
    greedy_decode(model, ids, eager, STEPS, attention_mask=mask)
    assert _held(cache) == _held(eager)
    counts = [[len(h) for h in row] for layer in _held(cache) for row in layer]
    if differ:  # (the heads did come to differ; H2O's stay even on this random-weight model)
        assert any(len(set(row)) > 1 for row in counts), counts


def test_one_compiled_step_serves_a_second_cache_without_a_new_graph(model):
    """The caches' tensors are static inputs without an address guard (``fixed_addresses``): a
    second cache of the same shape through the same compiled step reuses its graph (on a GPU, CUDA
    graphs re-record over the new addresses) and still gives eager's tokens."""
    torch._dynamo.reset()
    counters.clear()
    policy = H2O(heavy=12, recent=12)
    step = compile_decode_step(model, backend="eager")
    ids = _prompt(model)
    runs = []
    for _ in range(2):
        cache = EvictingCache(policy, model, static_shapes=True, max_tokens=PROMPT + 40 + 1)
        runs.append(greedy_decode(model, ids, cache, 40, step=step))
        graphs = counters["stats"]["unique_graphs"]
        assert graphs >= 1
        if len(runs) == 1:
            first = graphs
    assert graphs == first, (first, graphs)
    want = greedy_decode(model, ids, EvictingCache(policy, model), 40)
    assert torch.equal(runs[0], want) and torch.equal(runs[1], want)


@pytest.mark.slow
def test_streaming_original_positions_and_left_padded_batch(model):
    got, want, graphs, _ = _compiled_run(model, StreamingLLM(sink=4, window=20), positions="original")
    assert graphs <= 2 and torch.equal(got, want)
    mask = torch.ones(2, PROMPT, dtype=torch.long)
    mask[1, :9] = 0  # row 1: a left-padded, shorter prompt
    got, want, graphs, cache = _compiled_run(model, H2O(heavy=10, recent=10), batch=2, mask=mask)
    assert graphs <= 2 and torch.equal(got, want)
    assert cache.layers[0].store.seen == [PROMPT + STEPS - 1, PROMPT - 9 + STEPS - 1]


@pytest.mark.slow
def test_inductor_compiled_step_equals_eager(model):
    got, want, graphs, _ = _compiled_run(model, H2O(heavy=12, recent=12), backend="inductor")
    assert graphs <= 2 and torch.equal(got, want)


def test_model_is_left_as_found(model):
    """After an EvictingCache, the model runs transformers' own caches, eager and compiled with
    fullgraph, and an eager model returns attentions."""
    from transformers import DynamicCache, StaticCache

    ids = _prompt(model)[:, :16]
    before = model.config._attn_implementation
    greedy_decode(model, ids, EvictingCache(H2O(4, 4), model), 4)
    assert model.config._attn_implementation == before
    ref = greedy_decode(model, ids, DynamicCache(config=model.config), 6)
    torch._dynamo.reset()
    static = StaticCache(config=model.config, max_cache_len=32)
    got = greedy_decode(model, ids, static, 6, step=compile_decode_step(model, backend="eager"))
    assert torch.equal(got, ref)

    eager = tiny_llama(seed=3)
    eager.set_attn_implementation("eager")
    EvictingCache(H2O(4, 4), eager)
    with torch.no_grad():
        out = eager(ids, output_attentions=True)
    assert len(out.attentions) == eager.config.num_hidden_layers and out.attentions[0] is not None
    with torch.no_grad():  # and the evicting cache still evicts on it
        cache = EvictingCache(H2O(4, 4), eager)
        eager(ids, **cache_kwargs(eager, cache))
    assert max(cache.lengths()) == 8


def test_settle_is_announced_and_a_missed_one_is_an_error(model):
    """A policy whose evictions run on the host (BUZZ) announces them; if the steps ran compiled
    without settle() the cache says so instead of attending past its slots."""
    cache = EvictingCache(BUZZ(sink=2, window=6, stride=3), model, static_shapes=True)
    assert cache.needs_settle and not EvictingCache(H2O(4, 4), model, static_shapes=True).needs_settle
    ids = _prompt(model)[:, :16]
    with torch.no_grad():
        model(ids, **cache_kwargs(model, cache))
        store = cache.layers[0].store
        for t in range(store.slots - store.length + 1):
            # what a compiled step does: the layer's device path without the host's eviction
            for layer in cache.layers:
                k = torch.zeros(1, 2, 1, 16)
                layer.store.append(k, k)
        with pytest.raises(RuntimeError, match="settle"):
            store.lengths  # noqa: B018


@pytest.mark.parametrize("make", [FullCache, lambda: SnapKV(size=4, window=2),
                                  lambda: H2O(heavy=20, recent=20)], ids=["full", "snapkv", "h2o_reserve"])
def test_a_storage_that_may_grow_grows_between_static_steps(make):
    """An unbounded policy (the full cache; SnapKV, unbounded after the prompt) without
    ``reserve``, or a bounded one given a smaller ``reserve`` than it can hold, allocates fewer
    slots than the run needs: with static shapes the storage grows between decode steps, in
    settle() (which an eager static step calls itself), before a row would find no free slot.
    Each step's attention equals the eager layout's (it was silently wrong from the first
    step without a free slot), and the layer announces it (needs_settle)."""
    from kvpolicy_torch import LayerCache

    rng = torch.Generator().manual_seed(0)
    reserve = 8 if isinstance(make(), H2O) else None
    static, eager = LayerCache(make(), static_shapes=True, reserve=reserve), LayerCache(make())
    assert static.needs_settle and not eager.needs_settle
    prompt = torch.randn(1, 2, 6, 4, generator=rng, dtype=torch.float64)
    for layer in (static, eager):
        K, _ = layer.append(prompt, prompt)
        layer.accumulate(torch.rand(1, 2, K.shape[2], generator=torch.Generator().manual_seed(1), dtype=torch.float64))
        layer.evict()
    first = static.unsynced().store.slots
    for t in range(34):
        k, q = torch.randn(1, 2, 1, 4, generator=rng, dtype=torch.float64), torch.randn(1, 4, 1, 4, generator=rng, dtype=torch.float64)
        outs = []
        for layer in (static, eager):
            layer.append(k, k)
            outs.append(layer.attend(q, 0.5))
            layer.evict()
        assert torch.allclose(outs[0], outs[1], atol=1e-12), t
    assert static.positions.tolist() == eager.positions.tolist()
    assert static.unsynced().store.slots > first


def test_compiled_full_cache_without_max_tokens_grows_between_steps(model):
    """The full cache compiled without ``max_tokens``: greedy_decode settles after every step
    (needs_settle), the storage grows there, and the tokens equal eager's."""
    torch._dynamo.reset()
    ids = _prompt(model)[:, :16]
    cache = EvictingCache(FullCache(), model, static_shapes=True)
    assert cache.needs_settle
    got = greedy_decode(model, ids, cache, 40, step=compile_decode_step(model, backend="eager"))
    assert torch.equal(got, greedy_decode(model, ids, EvictingCache(FullCache(), model), 40))
    assert cache.lengths() == [16 + 39] * model.config.num_hidden_layers
