"""Left-padded (ragged) batches: pads are never attended, scored or kept, each row evicts on its
own schedule, and every row generates exactly what its prompt generates alone.

The fast tests use a tiny random-weight Llama in float64 (wiring and exactness, not language);
the slow ones the embedded SmolLM2-135M-Instruct (real weights, float32).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import DynamicCache  # noqa: E402

from kvpolicy import BUZZ, H2O, AdaKV, TOVA, ExpectedAttention, FullCache, KeyDiff, Knorm, LocalWindow, Scissorhands, SnapKV, StreamingLLM, compose  # noqa: E402
from kvpolicy_tools.models import tiny_llama  # noqa: E402
from kvpolicy_integrations.hf import EvictingCache, cache_kwargs  # noqa: E402
from kvpolicy_torch import LayerCache  # noqa: E402

#: Every built-in policy, sized so that rows evict during the prompt or during decoding.
POLICIES = [
    FullCache(),
    BUZZ(2, 4, 3, 8),
    BUZZ(2, 4, 3, 8, log_n=True, log_base=8.0),
    H2O(6, 6),
    H2O(5, 6, selection="shared"),
    StreamingLLM(2, 10),
    StreamingLLM(3, 9),
    LocalWindow(11),
    TOVA(12),
    TOVA(10, recent=2),
    compose(prefill=SnapKV(12, window=4), decode=H2O(5, 6)),
    Scissorhands(12, history=6, drop=0.25, recent=2),
    Scissorhands(10, history=3, drop=0.5, recent=0),
    Knorm(12),  # scores from keys: no score capture
    KeyDiff(11, recent=2, refresh=1),
    KeyDiff(12, selection="shared", refresh=1),
    KeyDiff(12, refresh=3),  # scored every 3rd step, without query moments
    ExpectedAttention(12, sink=2, future=32, refresh=1),  # scores from keys, values and the queries' running moments
    ExpectedAttention(11, recent=2, selection="shared", refresh=1),
    ExpectedAttention(12, sink=2, future=32, refresh=3),  # scored every 3rd step: the rows' seen differ, the steps not
    AdaKV(ExpectedAttention(11, sink=2, future=16, refresh=4), 0.2),
    AdaKV(H2O(6, 6), 0.2),  # head-wise budgets: heads hold different numbers of tokens
    AdaKV(KeyDiff(11, recent=2, refresh=1), 0.0),
    AdaKV(SnapKV(12, window=4), 0.5),
]
LENGTHS = (9, 14, 20, 27)  # four prompts, all different


def _prompts(vocab: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g) for n in LENGTHS]


def _left_pad(prompts: list[torch.Tensor], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = p
        mask[i, width - len(p) :] = 1
    return ids, mask


def _generate(model, ids, mask, cache, n):
    with torch.no_grad():
        # min_new_tokens: no row stops early at EOS (a batch would pad it, a lone prompt stop)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             **cache_kwargs(model, cache), pad_token_id=0)
    return out[:, ids.shape[1] :]


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(num_layers=2, heads=4, kv_heads=2, head_dim=16, vocab=96, seed=4).double()


@pytest.mark.parametrize("policy", POLICIES, ids=repr)
def test_each_row_generates_what_it_generates_alone(tiny, policy) -> None:
    prompts = _prompts(96)
    ids, mask = _left_pad(prompts)
    batched = _generate(tiny, ids, mask, EvictingCache(policy, tiny), 12)
    for i, p in enumerate(prompts):
        alone = _generate(tiny, p[None], torch.ones(1, len(p), dtype=torch.int64), EvictingCache(policy, tiny), 12)
        assert batched[i].tolist() == alone[0].tolist(), f"row {i} ({len(p)} tokens)"


def test_full_cache_equals_transformers_batched_dynamic_cache(tiny) -> None:
    ids, mask = _left_pad(_prompts(96, seed=1))
    ours = _generate(tiny, ids, mask, EvictingCache(FullCache(), tiny), 12)
    theirs = _generate(tiny, ids, mask, DynamicCache(config=tiny.config), 12)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("policy", [H2O(6, 6), StreamingLLM(2, 10), BUZZ(2, 4, 3, 8)], ids=repr)
def test_manual_loop_with_padding(tiny, policy) -> None:
    """A hand-written loop (position_ids from the mask, as generate() builds them) gives what
    generate() gives, and rows hold only real tokens."""
    prompts = _prompts(96, seed=2)
    ids, mask = _left_pad(prompts)
    want = _generate(tiny, ids, mask, EvictingCache(policy, tiny), 8)
    cache = EvictingCache(policy, tiny)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    got = []
    eos = tiny.generation_config.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    with torch.no_grad():
        logits = tiny(ids, attention_mask=mask, position_ids=pos, **cache_kwargs(tiny, cache)).logits
        for _ in range(8):
            logits[..., eos] = float("-inf")  # as generate(min_new_tokens=...) does
            tok = logits[:, -1:].argmax(-1)
            got.append(tok)
            mask = torch.cat([mask, torch.ones_like(tok)], dim=-1)
            pos = pos[:, -1:] + 1
            logits = tiny(tok, attention_mask=mask, position_ids=pos, **cache_kwargs(tiny, cache)).logits
    assert torch.equal(torch.cat(got, dim=-1), want)
    seen = cache.layers[0].store.seen
    assert seen == [n + 8 for n in LENGTHS]  # pads were never counted
    for row, n in enumerate(seen):  # pads (position -1) were never kept
        positions, _ = cache.layers[0].store.kept(row)
        assert positions.min() >= 0 and positions.max() == n - 1


@pytest.mark.parametrize("policy", [BUZZ(2, 5, 3, 9), H2O(5, 5), StreamingLLM(2, 7), LocalWindow(8), FullCache()], ids=repr)
def test_layer_cache_rows_keep_what_each_row_keeps_alone(policy) -> None:
    """LayerCache directly: rows with different pads evict on their own schedules and each keeps,
    per head, exactly the positions (and scores) of the same row run alone."""
    g = torch.Generator().manual_seed(0)
    pads, width, steps, heads = [0, 3, 7, 12], 16, 25, 2
    rec = torch.rand(steps + 1, 4, heads, width + steps, generator=g, dtype=torch.float64)
    valid = torch.ones(4, width, dtype=torch.bool)
    for r, p in enumerate(pads):
        valid[r, :p] = False

    def run(rows, layer):
        kv = torch.zeros(len(rows), heads, width, 1, dtype=torch.float64)
        layer.append(kv, kv, valid=valid[rows])
        pos = layer.slot_positions
        layer.accumulate(rec[0, rows, :, : pos.shape[-1]] * (pos >= 0))
        layer.evict()
        for t in range(steps):
            kv = torch.zeros(len(rows), heads, 1, 1, dtype=torch.float64)
            layer.append(kv, kv)
            pos = layer.slot_positions
            # a row's received attention depends on its own kept positions only (same for batched / alone)
            rec_t = torch.gather(rec[t + 1, rows], 2, pos.clamp(min=0)) * (pos >= 0)
            layer.accumulate(rec_t)
            layer.evict()
        return layer

    batched = run([0, 1, 2, 3], LayerCache(policy))
    for r in range(4):
        alone = run([r], LayerCache(policy))
        pos_b, sc_b = batched.kept(r)
        pos_a, sc_a = alone.kept(0)
        assert pos_b.tolist() == pos_a.tolist(), (policy, r)
        torch.testing.assert_close(sc_b, sc_a)
        assert batched.seen[r] == width - pads[r] + steps


# ============================================================================ the real model
@pytest.fixture(scope="module")
def smollm():
    from kvpolicy_tools.models import load

    try:
        return load("smollm2-135m")
    except (FileNotFoundError, ImportError) as e:  # pragma: no cover - the model wheel is a test dependency
        pytest.skip(f"embedded SmolLM2 not available: {e}")


REAL_TEXTS = [
    "The capital of France is",
    "Write one sentence about the sea. The sea is wide and",
    "Bees live in hives. A hive has a queen, thousands of workers and a few drones. The workers",
    "In 1969 two astronauts walked on the Moon while a third orbited above them in the command module. "
    "The mission was called",
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "policy",
    [FullCache(), BUZZ(2, 4, 3, 8), BUZZ(2, 4, 3, 8, log_n=True), H2O(8, 8), StreamingLLM(2, 12), LocalWindow(14)],
    ids=repr,
)
def test_real_model_rows_equal_alone(smollm, policy) -> None:
    model, tok = smollm
    prompts = [torch.tensor(tok(t)["input_ids"]) for t in REAL_TEXTS]
    assert len({len(p) for p in prompts}) == 4  # four different lengths
    ids, mask = _left_pad(prompts, pad=tok.pad_token_id or 0)
    cache = EvictingCache(policy, model)
    batched = _generate(model, ids, mask, cache, 10)
    for i, p in enumerate(prompts):
        alone = _generate(model, p[None], torch.ones(1, len(p), dtype=torch.int64), EvictingCache(policy, model), 10)
        assert batched[i].tolist() == alone[0].tolist(), f"row {i}: {REAL_TEXTS[i]!r}"
    if isinstance(policy, FullCache):
        theirs = _generate(model, ids, mask, DynamicCache(config=model.config), 10)
        assert torch.equal(batched, theirs)
    else:  # the rows really evicted, on different schedules
        store = cache.layers[0].store
        assert store.evictions > 0 and max(cache.lengths()) <= policy.capacity
        assert len(set(store.seen)) == 4
