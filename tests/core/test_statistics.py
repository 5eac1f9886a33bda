"""kvpolicy/statistics.py and the policies scoring from it. Scores from keys (``score_statistic``
``"key_norm"`` / ``"key_diff"``): Knorm and KeyDiff on every backend. The NumPy reference (``replay(...,
keys=)``) against a literal per-head oracle written here, the torch replay against the reference, the
transformers cache against the reference on layer 0's keys (the tiny random-weight model
``kvpolicy_tools.models.tiny_llama``: it checks wiring and numerics, not language), no score capture in
attention, and docs/policies.md's worked example. The kit's ``check_policy`` runs them in
tests/core/testing/test_contract.py, left-padded batches in tests/integrations/test_ragged.py,
DeepSpeed's two ranks in tests/integrations/test_deepspeed_multi.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import kvpolicy_numpy
from kvpolicy import KeyDiff, Knorm, compose, SnapKV, make_policy
from kvpolicy.statistics import ANCHOR_EPS, COSINE_GRID, key_scores
from oracle import keep_highest_oracle
from strategies import key_policies, logits_arrays, prompt_lengths

torch = pytest.importorskip("torch")
import kvpolicy_torch  # noqa: E402


# ============================================================================ a literal oracle
def _oracle_scores(policy, keys: np.ndarray, cached: list[int], t: int) -> list[float]:
    """Each cached token's score for one head, by the definitions, one Python float at a time."""
    def norm(k):
        return math.sqrt(sum(x * x for x in k))

    if policy.score_statistic == "key_norm":
        return [-norm(keys[p]) for p in cached]
    units = {p: [x / max(norm(keys[p]), 1e-12) for x in keys[p]] for p in cached}
    candidates = [p for p in cached if p < t + 1 - policy.recent]
    d = keys.shape[-1]
    anchor = [sum(units[p][i] for p in candidates) / max(len(candidates), 1) for i in range(d)]
    size = norm(anchor)
    anchor = [a / size for a in anchor] if size > ANCHOR_EPS else [0.0] * d  # (cancelled unit keys: an anchor of 0)
    return [-round(sum(u * a for u, a in zip(units[p], anchor)) / COSINE_GRID) * COSINE_GRID for p in cached]


def oracle(policy, keys: np.ndarray, prompt_len: int) -> list[list[list[int]] | None]:
    """Kept positions per step and head (:func:`oracle.keep_highest_oracle`) with the literal scores."""
    steps, heads, _ = keys.shape
    return keep_highest_oracle(policy, steps, heads, prompt_len, lambda h, held, t: _oracle_scores(policy, keys[:, h], held, t))


@st.composite
def key_cases(draw):
    """(policy, logits, keys, prompt_len): keys of small integer levels (exact ties: equal and
    parallel keys) or normal draws; the logits do not matter to these policies."""
    policy = draw(st.one_of(key_policies(Knorm), key_policies(KeyDiff)))
    logits = draw(logits_arrays(max_steps=24, max_heads=3))
    steps, heads, _ = logits.shape
    d = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    if draw(st.booleans()):
        keys = rng.integers(-2, 3, size=(steps, heads, d)).astype(np.float64)
    else:
        keys = rng.normal(size=(steps, heads, d)) * draw(st.sampled_from([1e-3, 1.0, 1e3]))
    return policy, logits, keys, draw(prompt_lengths(steps))


@settings(max_examples=150, deadline=None)
@given(key_cases())
@example((KeyDiff(size=1, refresh=1), np.array([[[3.0, 1.0, 0.5]], [[0.0, 0.0, -2.0]], [[-2.0, -2.0, -2.0]]]),
          np.array([[[0.00012573]], [[-0.0001321]], [[0.00064042]]]), 0))  # opposite 1-d keys: an anchor of exactly 0
# candidates whose unit keys cancel in pairs (head 0 at step 12: [2, -2] and [-1, 1], [-2, -1] and
# [2, 1], and a zero key): the mean is 0, and the float rounding the NumPy and torch sums left of
# it (~1e-17, each its own) chose different victims before ANCHOR_EPS (hypothesis, 2026-11-28)
@example((KeyDiff(size=4, refresh=1), np.zeros((13, 3, 13)), np.array(
    [[[2, 1], [0, -1], [-1, -2]], [[-2, -2], [-2, 2], [1, 2]], [[0, 1], [2, 1], [1, 0]], [[0, 2], [-1, 2], [1, -2]],
     [[-1, 2], [0, -2], [1, 1]], [[2, -2], [-2, 2], [-2, 0]], [[-2, -1], [0, 0], [0, -2]], [[-2, -2], [-2, 1], [0, 1]],
     [[-1, 1], [1, -1], [0, 2]], [[2, 2], [-1, 1], [2, 1]], [[2, 1], [1, -1], [2, -2]], [[0, 1], [2, 0], [-1, -1]],
     [[0, 0], [1, 2], [-2, 2]]], dtype=np.float64), 0))
def test_reference_and_torch_equal_the_oracle(case) -> None:
    policy, logits, keys, prompt_len = case
    ref = kvpolicy_numpy.replay(policy, logits, prompt_len, keys=keys)
    lit = oracle(policy, keys, prompt_len)
    fast = kvpolicy_torch.replay(policy, logits, prompt_len, keys=keys)
    for t, want in enumerate(lit):
        if want is None:
            assert ref.kept[t] is None
            continue
        assert ref.kept[t].tolist() == want, f"step {t}"
        assert fast.kept[t].tolist() == want, f"torch, step {t}"


@settings(max_examples=60, deadline=None)
@given(key_cases(), st.lists(st.integers(-3, 3), min_size=1, max_size=24))
def test_keydiff_ignores_key_length_and_knorm_keeps_the_shortest(case, exponents) -> None:
    """KeyDiff reads directions only: scaling every key by a power of two (exact) keeps the same
    tokens. Knorm's kept tokens never have a longer key than an evicted candidate of that step."""
    policy, logits, keys, prompt_len = case
    steps = keys.shape[0]
    scale = 2.0 ** np.resize(np.asarray(exponents, dtype=np.float64), steps)[:, None, None]
    if policy.score_statistic == "key_diff":
        a = kvpolicy_numpy.replay(policy, logits, prompt_len, keys=keys)
        b = kvpolicy_numpy.replay(policy, logits, prompt_len, keys=keys * scale)
        assert all((x is None and y is None) or np.array_equal(x, y) for x, y in zip(a.kept, b.kept))
        return
    trace = kvpolicy_numpy.replay(policy, logits, prompt_len, keys=keys)
    norms = np.linalg.norm(keys, axis=-1)  # [steps, heads]
    for t, before, after in trace.evictions:
        previous = trace.kept[t - 1] if t >= prompt_len and t > 0 and trace.kept[t - 1] is not None else None
        for h in range(keys.shape[1]):
            held = (list(previous[h]) + [t]) if previous is not None else list(range(t + 1))
            gone = set(held) - set(trace.kept[t][h].tolist())
            kept_old = [p for p in trace.kept[t][h].tolist() if p <= t - policy.recent]
            if policy.selection == "per_head" and gone and kept_old:
                assert max(norms[p, h] for p in kept_old) <= min(norms[p, h] for p in gone)


def test_key_scores_refuse_another_statistic_and_the_reference_needs_keys() -> None:
    with pytest.raises(ValueError, match="statistic must be one of key_norm, key_diff"):
        key_scores("accumulate", np.ones((1, 2, 2)), np.arange(2)[None], 2)
    with pytest.raises(ValueError, match="keys are required for KeyDiff"):
        kvpolicy_numpy.replay(KeyDiff(2), np.zeros((4, 1, 4)))
    with pytest.raises(ValueError, match=r"keys must have shape \[steps, heads, head_dim\] = \[4, 1, head_dim >= 1\]"):
        kvpolicy_numpy.replay(Knorm(2), np.zeros((4, 1, 4)), keys=np.zeros((4, 2, 3)))
    with pytest.raises(ValueError, match="recent must be >= 0 and <= 2, got 3"):
        KeyDiff(3, recent=3)
    with pytest.raises(ValueError, match="same kind of score"):
        compose(prefill=SnapKV(8, window=2), decode=Knorm(6))


def test_planned_from_a_budget_and_listed() -> None:
    from kvpolicy import available_policies

    assert {"knorm", "keydiff"} <= set(available_policies())
    p = make_policy("keydiff", 0.25, context_length=400)
    assert isinstance(p, KeyDiff) and p.captures_attention is False and p.capacity == p.size + 1


# ============================================================================ torch LayerCache
def test_layer_cache_ignores_attention_and_scores_from_the_held_keys() -> None:
    """Two LayerCaches fed the same keys, one given large random attention (accumulate and
    accumulate_query), the other none, keep the same tokens with the same scores (float64); a
    Knorm score is minus the held key's norm."""
    g = torch.Generator().manual_seed(0)
    for policy in (Knorm(5, recent=1), KeyDiff(5, recent=2, refresh=1), KeyDiff(4, selection="shared", refresh=1)):
        fed, plain = kvpolicy_torch.LayerCache(policy), kvpolicy_torch.LayerCache(policy)
        for step in range(8):
            q = 9 if step == 0 else 1
            k, v = torch.randn(2, 3, q, 4, generator=g), torch.randn(2, 3, q, 4, generator=g)
            fed.append(k, v)
            plain.append(k, v)
            if q == 1:
                fed.accumulate_query(torch.rand(fed.slot_positions.shape, generator=g) * 100, group=1)
            else:
                fed.accumulate(torch.rand(fed.slot_positions.shape, generator=g) * 100)
            fed.evict()
            plain.evict()
            assert torch.equal(fed.positions, plain.positions) and torch.equal(fed.scores, plain.scores)
            assert fed.length == policy.size and fed.scores.dtype == torch.float64
            if policy.score_statistic == "key_norm":
                torch.testing.assert_close(fed.scores, -fed.keys.double().norm(dim=-1), rtol=1e-15, atol=0)


# ============================================================================ transformers
transformers = pytest.importorskip("transformers")
from kvpolicy_tools.models import tiny_llama  # noqa: E402
from kvpolicy_integrations.hf import EvictingCache, cache_kwargs  # noqa: E402


def _layer0(model, tokens):
    """Layer 0's pre-softmax logits ``[steps, heads, steps]`` and RoPE'd keys ``[steps, kv_heads,
    head_dim]`` in a full forward (layer 0 sees only token embeddings, so they are reproducible)."""
    from layer0 import layer0_states
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q, k, _, (cos, sin) = layer0_states(model, tokens)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    logits = torch.einsum("bhqd,bhkd->bqhk", q, k) * model.model.layers[0].self_attn.scaling
    return logits[0].detach().double().numpy(), k[0].transpose(0, 1).detach().double().numpy()


def _greedy(model, ids, cache, n):
    """``ids`` then ``n`` greedy tokens, each fed through the cache."""
    with torch.no_grad():
        out = model(ids, **cache_kwargs(model, cache))
        tokens = [ids]
        for _ in range(n):
            tok = out.logits[:, -1:].argmax(-1)
            tokens.append(tok)
            out = model(tok, **cache_kwargs(model, cache))
    return torch.cat(tokens, dim=1)


@pytest.mark.parametrize(
    "policy", [Knorm(12), Knorm(9, recent=2, selection="shared"), KeyDiff(12, refresh=1), KeyDiff(10, recent=3, refresh=1), KeyDiff(11, selection="shared", refresh=1)],
    ids=repr,
)
def test_evicting_cache_keeps_what_the_reference_keeps_on_layer0_keys(policy, no_score_capture) -> None:
    """Differential: layer 0 of an evicting greedy generation (prefill of 30, 20 decode steps)
    keeps what kvpolicy_numpy.replay keeps on layer 0's keys; and the attention captures nothing
    (received_attention is never called: prefill and decode take plain attention)."""
    model = tiny_llama(num_layers=2, heads=4, kv_heads=4, head_dim=8, vocab=96, seed=3).double()
    ids = torch.randint(3, 96, (1, 30), generator=torch.Generator().manual_seed(5))
    cache = EvictingCache(policy, model)
    out = _greedy(model, ids, cache, n=20)
    logits, keys = _layer0(model, out)  # every token entered the cache (_greedy feeds each one)
    trace = kvpolicy_numpy.replay(policy, logits, prompt_len=ids.shape[1], keys=keys)
    np.testing.assert_array_equal(cache.layers[0].store.positions[0].numpy(), trace.kept[-1])
    assert all(layer.store.length == policy.size for layer in cache.layers)


# ============================================================================ the docs' worked example
def test_docs_worked_example() -> None:
    from worked_examples import DOC, floats, ints, setup, table

    text = DOC.read_text(encoding="utf-8")
    ns = setup(text, "keydiff-setup")
    policy, keys, logits = ns["policy"], ns["keys"], ns["logits"]
    assert policy == KeyDiff(size=3, refresh=1) and keys.shape == (7, 1, 2)
    trace = kvpolicy_numpy.replay(policy, logits, keys=keys)
    knorm = kvpolicy_numpy.replay(Knorm(size=3), logits, keys=keys)
    lit = oracle(policy, keys, 0)
    rows = table(text, "keydiff-decode")
    assert [int(r[0]) for r in rows] == [t for t, _, _ in trace.evictions]
    for step, before, cosines, evicted, after, norms, knorm_after in rows:
        t = int(step)
        cache = trace.kept[t - 1][0].tolist() + [t]
        assert ints(before) == cache, f"step {t}: cache before"
        want = -key_scores("key_diff", keys[cache].transpose(1, 0, 2)[None], np.asarray(cache)[None, None], t + 1)[0, 0]
        np.testing.assert_allclose(floats(cosines), want, atol=0.005, err_msg=f"step {t}: cosines")
        assert ints(after) == trace.kept[t][0].tolist() == lit[t][0], f"step {t}: kept"
        assert ints(evicted) == sorted(set(cache) - set(ints(after))), f"step {t}: evicted"
        k_cache = knorm.kept[t - 1][0].tolist() + [t]
        np.testing.assert_allclose(floats(norms), np.linalg.norm(keys[k_cache, 0], axis=-1), atol=0.005)
        assert ints(knorm_after) == knorm.kept[t][0].tolist(), f"step {t}: Knorm"
    prefill = kvpolicy_numpy.replay(policy, logits, prompt_len=5, keys=keys)
    assert "cache holds `" + " ".join(map(str, prefill.kept[4][0].tolist())) + "`" in text
    assert "Knorm keeps `" + " ".join(map(str, kvpolicy_numpy.replay(Knorm(size=3), logits, prompt_len=5, keys=keys).kept[4][0].tolist())) + "`" in text


@given(st.integers(0, 2**32 - 1), st.integers(1, 6), st.integers(1, 5), st.integers(1, 3))
@settings(max_examples=40, deadline=None)
def test_reconstruction_scores_are_the_most_attention_any_query_pays(seed, context, rows, group) -> None:
    """KVzip's statistic: of the reconstruction rows' attention probabilities, the maximum over the
    rows and the query heads of a KV head, per context token; the same on NumPy and torch."""
    from kvpolicy.statistics import reconstruction_scores

    rng = np.random.default_rng(seed)
    probs = rng.dirichlet(np.ones(context + rows), size=(2, group, rows))  # [2, group, rows, m]
    expected = np.zeros((2, context))
    for h in range(2):
        for g in range(group):
            for i in range(rows):
                expected[h] = np.maximum(expected[h], probs[h, g, i, :context])
    assert reconstruction_scores(probs, context).tolist() == expected.tolist()
    assert reconstruction_scores(torch.tensor(probs), context).numpy().tolist() == expected.tolist()
