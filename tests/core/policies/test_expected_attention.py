"""Expected Attention (``score_statistic = "expected_attention"``) on every backend.

* the NumPy reference (``replay(..., keys=, values=, queries=, rope=)``) against an oracle that
  follows kvpress's ``ExpectedAttentionPress`` procedure literally (centred covariance, RoPE's
  average as a full ``d x d`` matrix from ``cat(freqs, freqs)`` cosines and sines, the group's mean
  of the softmaxes), re-estimated from every query seen at each eviction;
* the torch backend (running moments, ``kvpolicy_torch.replay``) against the reference, bit for
  bit in the kept positions, with GQA groups and every RoPE layout (half, interleaved, partial);
* the transformers cache against the reference on layer 0 of the tiny random-weight model
  ``kvpolicy_tools.models.tiny_llama`` (wiring and numerics, not language): the queries the layer sees,
  rotated back to before RoPE, make the same statistics; no score capture in attention;
* docs/policies.md's worked example.

The kit's ``check_policy`` runs it in tests/core/testing/test_contract.py, left-padded batches in
tests/integrations/test_ragged.py, the compiled step in tests/torch/test_static.py, DeepSpeed's two ranks in
tests/integrations/test_deepspeed_multi.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvpolicy_numpy
from kvpolicy import ExpectedAttention, compose, make_policy
from kvpolicy.statistics import SCORE_BITS, UNSCORED, QueryMoments, Rotary, average_rotation, expected_attention, query_moments, refresh_interval
from oracle import keep_highest_oracle, refresh_oracle as literal_refresh
from strategies import expected_attention_policies, logits_arrays, prompt_lengths

torch = pytest.importorskip("torch")
import kvpolicy_torch  # noqa: E402


# ============================================================================ kvpress's procedure, literally
def _kvpress_rotation(inv_freq: np.ndarray, start: int, future: int) -> np.ndarray:
    """kvpress's ``apply_avg_rope`` matrix: the mean over the next ``future`` positions of
    ``cos * I + sin * P`` with transformers' ``cat(freqs, freqs)`` layout (half-split RoPE)."""
    d = 2 * inv_freq.shape[0]
    t = np.arange(start, start + future, dtype=np.float32)
    angles = (t[:, None] * inv_freq.astype(np.float32)[None]).astype(np.float64)
    cos = np.concatenate([np.cos(angles)] * 2, axis=-1)  # [future, d]
    sin = np.concatenate([np.sin(angles)] * 2, axis=-1)
    eye = np.eye(d)
    p = np.zeros((d, d))
    p[d // 2 :, : d // 2], p[: d // 2, d // 2 :] = np.eye(d // 2), -np.eye(d // 2)
    return (cos[:, None, :] * eye + sin[:, None, :] * p).mean(axis=0)


def kvpress_scores(policy, keys, values, queries, held: list[int], t: int, inv_freq) -> list[float]:
    """One head's scores of the ``held`` positions after token ``t``: queries ``[steps, group, d]``
    of positions ``sink..t``, mean and centred covariance (divided by the count), rotated by RoPE's
    average, ``z = k mu / sqrt(d) + k cov k / 2d``, softmax over the non-sink held tokens per query
    head, mean over the group, ``(p + epsilon) * |v|``, rounded to ``SCORE_BITS`` significant bits
    (the reference's one declared departure: a near tie, which saturated softmaxes of a group make
    at ``0.5 +- 1e-14``, is a tie that goes to the earliest on every backend); sinks ``+inf``."""
    d = keys.shape[-1]
    seen = queries[policy.sink : t + 1]  # [c, group, d]
    if len(seen):
        mu = seen.mean(axis=0)
        centred = seen - mu
        cov = np.einsum("crd,cre->rde", centred, centred) / len(seen)
    else:
        mu, cov = np.zeros(queries.shape[1:]), np.zeros((queries.shape[1], d, d))
    if inv_freq is not None:
        r = _kvpress_rotation(inv_freq, t + 1, policy.future)
        mu = mu @ r.T
        cov = r @ cov @ r.T
    cand = [p for p in held if p >= policy.sink]
    k = keys[cand]  # [n, d]
    z = k @ mu.T / math.sqrt(d)  # [n, group]
    if policy.covariance:
        z = z + np.einsum("nd,rde,ne->nr", k, cov, k) / d / 2
    z = np.exp(z - z.max(axis=0)) if len(cand) else z
    probs = (z / z.sum(axis=0)).mean(axis=1) if len(cand) else z[:, 0]
    if policy.value_norm:
        probs = (probs + policy.epsilon) * np.linalg.norm(values[cand], axis=-1)
    by_position = dict(zip(cand, round_bits(probs, SCORE_BITS).tolist()))
    return [by_position.get(p, math.inf) for p in held]


def round_bits(x: np.ndarray, bits: int) -> np.ndarray:
    """Positive ``x`` to ``bits`` significant bits (``x = m 2**e``, ``m`` in ``[0.5, 1)``: a
    multiple of ``2**(e - 1 - bits)``, halves to even)."""
    m, e = np.frexp(np.asarray(x, dtype=np.float64))
    return np.where(m > 0, np.ldexp(np.round(np.ldexp(m, bits + 1)), e - 1 - bits), x)


def oracle(policy, keys, values, queries, prompt_len: int, inv_freq=None) -> list[list[list[int]] | None]:
    """Kept positions per step and head (:func:`oracle.keep_highest_oracle`) with kvpress's scores."""
    steps, heads, _ = keys.shape
    return keep_highest_oracle(
        policy, steps, heads, prompt_len,
        lambda h, held, t: kvpress_scores(policy, keys[:, h], values[:, h], queries[:, h], held, t, inv_freq),
    )


@st.composite
def cases(draw, integer_levels: bool = True, **fixed):
    """(policy, logits, keys, values, queries [steps, heads, group, d], prompt_len, rope): keys,
    values and queries of small integer levels (exact ties) or normal draws; RoPE none, half-split,
    interleaved or partial, with frequencies spanning slow and fast."""
    fixed = {k: draw(v) if isinstance(v, st.SearchStrategy) else v for k, v in fixed.items()}  # (a value or a strategy)
    policy = draw(expected_attention_policies(**fixed))
    logits = draw(logits_arrays(max_steps=20, max_heads=3))
    steps, heads, _ = logits.shape
    d = draw(st.sampled_from([2, 4, 6, 8]))
    group = draw(st.integers(1, 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if integer_levels and draw(st.booleans()):
        def draw_array(*shape):
            return rng.integers(-2, 3, size=shape).astype(np.float64)
    else:
        scale = draw(st.sampled_from([0.3, 1.0, 3.0]))

        def draw_array(*shape):
            return rng.normal(size=shape) * scale
    keys, values, queries = draw_array(steps, heads, d), draw_array(steps, heads, 3), draw_array(steps, heads, group, d)
    kind = draw(st.sampled_from(["none", "half", "interleaved", "partial"]))
    rope = None
    if kind != "none":
        dim = d if kind != "partial" else max(2, d - 2)
        freq = 1.0 / draw(st.sampled_from([2.0, 100.0, 10000.0])) ** (np.arange(0, dim, 2) / dim)
        rope = Rotary(freq, "interleaved" if kind == "interleaved" else "half", dim)
    return policy, logits, keys, values, queries, draw(prompt_lengths(steps)), rope


@settings(max_examples=120, deadline=None)
@given(cases(integer_levels=False, refresh=1))
def test_reference_equals_kvpress_procedure(case) -> None:
    """The reference's scores, re-estimated at every eviction from every query seen, keep what
    kvpress's procedure keeps (normal draws: no exact ties, which the oracle breaks unrounded)."""
    _reference_keeps_what(oracle, case)


def test_a_near_tie_goes_to_the_earliest() -> None:
    """A group of two query heads whose softmaxes saturate on different tokens scores them
    ``0.5 + 7.8e-15`` and ``0.5 - 7.7e-15`` (kvpress's procedure in float64): a tie at
    ``SCORE_BITS``, so the earlier token goes (hypothesis found it; unrounded, the oracle kept it)."""
    policy = ExpectedAttention(size=1, sink=0, future=1, value_norm=False, refresh=1)
    keys = np.array([[3.2, 5.3], [-7.7, -0.4], [3.0, 4.1]])[:, None]  # [steps, heads, d]
    queries = np.array([[[2.0, 4.5], [0.9, 1.7]], [[0.5, -3.2], [-2.5, 1.1]], [[-1.7, 3.8], [3.9, 5.4]]])[:, None]
    values, logits = np.ones((3, 1, 3)), np.zeros((3, 1, 3))
    first = kvpress_scores(policy, keys[:, 0], values[:, 0], queries[:, 0], [0, 1], 1, None)
    assert first[0] == first[1] == 0.5
    ref = kvpolicy_numpy.replay(policy, logits, 0, values=values, keys=keys, queries=queries)
    assert [k.tolist() for k in ref.kept] == [[[0]], [[1]], [[2]]] == oracle(policy, keys, values, queries, 0)


def _reference_keeps_what(literal, case) -> None:
    """The reference's kept positions equal ``literal``'s (an oracle of this file) at every step,
    with kvpress's RoPE layout where the drawn one differs."""
    policy, logits, keys, values, queries, prompt_len, rope = case
    if rope is not None and (rope.style != "half" or rope.rotary_dim != keys.shape[-1]):
        rope = Rotary(1.0 / 10000.0 ** (np.arange(0, keys.shape[-1], 2) / keys.shape[-1]))  # kvpress's layout
    ref = kvpolicy_numpy.replay(policy, logits, prompt_len, values=values, keys=keys, queries=queries, rope=rope)
    lit = literal(policy, keys, values, queries, prompt_len, None if rope is None else rope.inv_freq)
    for t, want in enumerate(lit):
        assert (ref.kept[t] is None) == (want is None), f"step {t}"
        if want is not None:
            assert ref.kept[t].tolist() == want, f"step {t}"


def refresh_oracle(policy, keys, values, queries, prompt_len: int, inv_freq=None) -> list[list[list[int]] | None]:
    """Kept positions per step and head under a refresh interval, literally: kvpress's scores of
    the held tokens after the prompt and at every ``refresh``-th decode step since the last
    scoring, kept per position in between; a token appended since scores ``UNSCORED`` (a sink
    ``+inf``); then, while more than ``size`` are held, the lowest score outside the newest
    ``recent`` goes (the earliest of a tie; ``"shared"``: scores summed over heads)."""
    steps, heads, _ = keys.shape
    return literal_refresh(
        policy, steps, heads, prompt_len,
        lambda h, held, t: kvpress_scores(policy, keys[:, h], values[:, h], queries[:, h], held, t, inv_freq),
        lambda p: UNSCORED if p >= policy.sink else math.inf,
    )


@settings(max_examples=120, deadline=None)
@given(cases(integer_levels=False, refresh=st.integers(2, 5)))
def test_reference_with_a_refresh_interval_equals_the_literal_rule(case) -> None:
    """``refresh = N``: the reference keeps what the rule says literally (scores from kvpress's
    procedure after the prompt and every N-th decode step, held in between, the new tokens
    ``UNSCORED``); and it differs from ``refresh = 1`` somewhere in these draws (see the last test)."""
    _reference_keeps_what(refresh_oracle, case)


def test_a_refresh_interval_changes_what_is_kept_and_keeps_sinks() -> None:
    """On one sequence (random keys, 40 steps, size 8), ``refresh=4`` keeps other tokens than
    ``refresh=1`` (the scores between scorings are old), yet the sinks always, and when the
    scored tokens run out (``size - sink < refresh``) the earliest unscored one goes."""
    rng = np.random.default_rng(7)
    steps, heads, d = 40, 1, 8
    keys, values, queries = rng.normal(size=(steps, heads, d)), rng.normal(size=(steps, heads, 3)), rng.normal(size=(steps, heads, d))
    kw = dict(values=values, keys=keys, queries=queries)
    logits = np.zeros((steps, heads, steps))
    every = kvpolicy_numpy.replay(ExpectedAttention(size=8, sink=2, refresh=1), logits, 10, **kw)
    sparse = kvpolicy_numpy.replay(ExpectedAttention(size=8, sink=2, refresh=4), logits, 10, **kw)
    assert any(a.tolist() != b.tolist() for a, b in zip(every.kept[10:], sparse.kept[10:]))
    assert all({0, 1} <= set(k[0].tolist()) for k in sparse.kept[9:])
    tight = kvpolicy_numpy.replay(ExpectedAttention(size=3, sink=2, refresh=4), logits, 10, **kw)
    # scored at the prompt (t=9) and at t=13: in between, each step's earlier token is unscored
    assert [tight.kept[t][0].tolist() for t in (10, 11, 12)] == [[0, 1, 10], [0, 1, 11], [0, 1, 12]]


@settings(max_examples=150, deadline=None)
@given(cases())
def test_torch_running_moments_equal_the_reference(case) -> None:
    """Differential: the torch backend (running sums of the queries, updated in place at each
    step) keeps exactly the reference's positions, with GQA groups and every RoPE layout."""
    policy, logits, keys, values, queries, prompt_len, rope = case
    ref = kvpolicy_numpy.replay(policy, logits, prompt_len, values=values, keys=keys, queries=queries, rope=rope)
    fast = kvpolicy_torch.replay(policy, logits, prompt_len, values=values, keys=keys, queries=queries, rope=rope)
    for t, (a, b) in enumerate(zip(ref.kept, fast.kept)):
        assert (a is None) == (b is None), f"step {t}"
        if a is not None:
            assert a.tolist() == b.tolist(), f"step {t}"


def test_statistic_pieces() -> None:
    """The average of RoPE's rotations is the mean of the rotations' matrices; with no query
    counted every candidate is equally likely (score = value norm); sinks, holes and pads +inf."""
    freq = np.array([1.0, 0.1, 0.01])
    cos, sin = average_rotation(Rotary(freq), 5, 7)
    np.testing.assert_allclose(_kvpress_rotation(freq, 5, 7)[:3, :3], np.diag(cos), atol=1e-6)
    np.testing.assert_allclose(_kvpress_rotation(freq, 5, 7)[3:, :3], np.diag(sin), atol=1e-6)
    keys = np.random.default_rng(0).normal(size=(1, 1, 5, 6))
    values = np.random.default_rng(1).normal(size=(1, 1, 5, 2))
    empty = QueryMoments(np.zeros(1), np.zeros((1, 1, 2, 6)), np.zeros((1, 1, 2, 6, 6)))
    positions = np.array([[[0, 1, -1, 3, 4]]])
    s = expected_attention(keys, values, positions, 5, empty, sink=1, future=4, rotary=Rotary(freq))
    want = np.linalg.norm(values[0, 0], axis=-1) / 3
    assert s[0, 0, 0] == s[0, 0, 2] == math.inf
    np.testing.assert_allclose(s[0, 0, [1, 3, 4]], want[[1, 3, 4]], rtol=1e-8)
    m = query_moments(np.ones((2, 1, 1, 3, 2)), np.array([[1, 1, 0], [0, 0, 0]]))
    assert m.count.tolist() == [2.0, 0.0] and m.total[0, 0, 0].tolist() == [2.0, 2.0]


def test_refusals() -> None:
    p = ExpectedAttention(4, sink=1)
    z = np.zeros((6, 1, 6))
    with pytest.raises(ValueError, match="queries are required for ExpectedAttention"):
        kvpolicy_numpy.replay(p, z, keys=np.ones((6, 1, 2)), values=np.ones((6, 1, 2)))
    with pytest.raises(ValueError, match="values are required"):
        kvpolicy_numpy.replay(p, z, keys=np.ones((6, 1, 2)), queries=np.ones((6, 1, 2)))
    with pytest.raises(ValueError, match=r"queries must have shape"):
        kvpolicy_numpy.replay(p, z, keys=np.ones((6, 1, 2)), values=np.ones((6, 1, 2)), queries=np.ones((6, 1, 3)))
    with pytest.raises(ValueError, match="sink must be >= 0 and <= 3, got 4"):
        ExpectedAttention(4, recent=1, sink=4)
    with pytest.raises(ValueError, match="Expected Attention cannot be composed"):
        compose(prefill=ExpectedAttention(8), decode=ExpectedAttention(6))
    layer = kvpolicy_torch.LayerCache(ExpectedAttention(2, sink=0))
    for _ in range(3):
        layer.append(torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4))
    with pytest.raises(RuntimeError, match="no query was observed"):
        layer.evict()


def test_planned_from_a_budget_and_listed() -> None:
    from kvpolicy import available_policies

    assert "expected_attention" in available_policies()
    p = make_policy("expected_attention", 0.25, context_length=400)
    assert isinstance(p, ExpectedAttention) and p.captures_attention is False and p.capacity == p.size + 1


# ============================================================================ transformers
transformers = pytest.importorskip("transformers")
from kvpolicy_tools.models import tiny_llama  # noqa: E402
from kvpolicy_integrations.hf import EvictingCache, cache_kwargs  # noqa: E402


def _layer0(model, tokens):
    """Layer 0 in a full forward: pre-softmax logits ``[steps, heads, steps]``, RoPE'd keys
    ``[steps, kv_heads, d]``, values, and the queries before RoPE ``[steps, kv_heads, group, d]``."""
    from layer0 import layer0_states
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q, k, v, (cos, sin) = layer0_states(model, tokens)
    attn = model.model.layers[0].self_attn
    s, d = q.shape[2], q.shape[3]
    q_rope, k_rope = apply_rotary_pos_emb(q, k, cos, sin)
    kv = k.shape[1]
    group = q.shape[1] // kv
    logits = torch.einsum("bhqd,bhkd->bqhk", q_rope, k_rope.repeat_interleave(group, dim=1)) * attn.scaling
    # (the reference's logits are per KV head; Expected Attention reads none of them)
    logits = logits[0, :, ::group].detach().double().numpy()
    queries = q[0].view(kv, group, s, d).permute(2, 0, 1, 3).detach().double().numpy()
    as_steps = lambda x: x[0].transpose(0, 1).detach().double().numpy()  # noqa: E731
    return logits, as_steps(k_rope), as_steps(v), queries


@pytest.mark.parametrize(
    "policy",
    [ExpectedAttention(12, sink=2, future=16, refresh=1), ExpectedAttention(10, recent=2, selection="shared", refresh=1),
     ExpectedAttention(11, sink=0, epsilon=0.01, covariance=False, refresh=1), ExpectedAttention(12, sink=2, future=16, refresh=5),
     ExpectedAttention(12, sink=2, future=16)],  # (the last: the default refresh interval, 64)
    ids=repr,
)
def test_evicting_cache_keeps_what_the_reference_keeps_on_layer0(policy, no_score_capture) -> None:
    """Differential: layer 0 of an evicting greedy generation (prefill of 30, 20 decode steps;
    GQA, 2 query heads per KV head) keeps, after the prompt and at the end, what
    kvpolicy_numpy.replay keeps from layer 0's keys, values and queries before RoPE with the
    model's RoPE; the attention captures nothing (received_attention is never called)."""
    model = tiny_llama(num_layers=2, heads=4, kv_heads=2, head_dim=8, vocab=96, seed=3).double()
    ids = torch.randint(3, 96, (1, 30), generator=torch.Generator().manual_seed(5))
    prefill = EvictingCache(policy, model)
    with torch.no_grad():
        model(ids, **cache_kwargs(model, prefill))
    cache = EvictingCache(policy, model)
    from layer0 import greedy_tokens

    logits, keys, values, queries = _layer0(model, greedy_tokens(model, cache, ids, 20))
    rope = Rotary(model.model.rotary_emb.inv_freq.double().numpy())
    trace = kvpolicy_numpy.replay(policy, logits, 30, values=values, keys=keys, queries=queries, rope=rope)
    np.testing.assert_array_equal(prefill.layers[0].store.positions[0].numpy(), trace.kept[29])
    np.testing.assert_array_equal(cache.layers[0].store.positions[0].numpy(), trace.kept[-1])
    assert all(layer.store.length == policy.size for layer in cache.layers)
    assert cache.layers[0].store.running_queries.moments.count.tolist() == [50 - policy.sink]


@settings(max_examples=40, deadline=None)
@given(position=st.integers(0, 5000), style=st.sampled_from(["half", "interleaved"]), partial=st.booleans(),
       batch=st.integers(1, 3))
def test_pre_rope_turns_a_decode_query_back(position, style, partial, batch) -> None:
    """kvpolicy_torch.queries.PreRope: a query RoPE rotated by its position comes back (float64,
    up to the float32 rounding of the forward rotation), every layout and row."""
    from kvpolicy_torch.queries import PreRope

    d, rotary = 8, (4 if partial else None)
    freq = torch.tensor([1.0, 0.01]) if partial else torch.tensor([1.0, 0.1, 0.01, 0.001])
    q = torch.randn(batch, 3, 1, d, generator=torch.Generator().manual_seed(position))
    positions = torch.arange(position, position + batch).view(batch, 1)
    rotated = kvpolicy_torch.rope_rotate(q, positions[:, None, :], freq, style=style, rotary_dim=rotary)
    back = PreRope().unrotate(rotated, positions, freq, style=style, rotary_dim=rotary, step=1)
    assert back.dtype == torch.float64
    torch.testing.assert_close(back, q.double(), atol=1e-5, rtol=0)


def test_pre_rope_reuses_a_rotation_inside_one_forward_only() -> None:
    """The rotation is kept for the same positions tensor inside one forward (``step``), never
    across forwards: a tensor advanced in place between steps gets its new rotation."""
    from kvpolicy_torch.queries import PreRope

    pre, freq, q = PreRope(), torch.tensor([1.0, 0.1]), torch.randn(1, 2, 1, 4)
    positions = torch.tensor([[5]])
    at5 = pre.unrotate(kvpolicy_torch.rope_rotate(q, torch.tensor([[[5]]]), freq), positions, freq, step=1)
    positions.fill_(9)  # (in place, as a caller's reused buffer would be)
    at9 = pre.unrotate(kvpolicy_torch.rope_rotate(q, torch.tensor([[[9]]]), freq), positions, freq, step=2)
    torch.testing.assert_close(at5, q.double(), atol=1e-5, rtol=0)
    torch.testing.assert_close(at9, q.double(), atol=1e-5, rtol=0)


def test_a_decode_step_builds_one_rotation_for_every_layer(monkeypatch) -> None:
    """An Expected Attention decode step of a 3-layer tiny random-weight Llama builds the rotation
    of its queries back to before RoPE once, not once a layer (the prompt's are element-wise)."""
    from kvpolicy_torch.queries import PreRope

    model = tiny_llama(num_layers=3, heads=4, kv_heads=2, head_dim=8, vocab=96, seed=3)
    cache = EvictingCache(ExpectedAttention(12, sink=2, future=16), model)
    built = []
    real = PreRope.matrix
    monkeypatch.setattr(PreRope, "matrix", staticmethod(lambda *a: built.append(1) or real(*a)))
    ids = torch.randint(3, 96, (1, 20), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        model(ids, **cache_kwargs(model, cache))
        assert built == []
        for step in range(3):
            model(torch.tensor([[7]]), position_ids=torch.tensor([[20 + step]]), **cache_kwargs(model, cache))
            assert len(built) == step + 1
    assert cache.layers[2].store.running_queries.moments.count.tolist() == [23 - 2]


def test_evicting_cache_needs_the_model() -> None:
    model = tiny_llama(num_layers=1)
    with pytest.raises(ValueError, match="query statistics need the model itself"):
        EvictingCache(ExpectedAttention(8), model.config)


# ============================================================================ the docs' worked example
def test_docs_worked_example() -> None:
    """Every cell of docs/policies.md's Expected Attention table, recomputed: the statistics from
    the queries shown, the logits from the statistics shown (kvpress's formula), the softmax, the
    scores, and the evictions from the reference replay."""
    from worked_examples import DOC, floats, ints, setup, table

    text = DOC.read_text(encoding="utf-8")
    ns = setup(text, "expected-attention-setup")
    policy, keys, values, queries, logits = ns["policy"], ns["keys"], ns["values"], ns["queries"], ns["logits"]
    assert policy == ExpectedAttention(size=3, sink=1, refresh=1) and keys.shape == values.shape == queries.shape == (7, 1, 2)
    inputs = {"keys": keys, "values": values, "queries": queries}
    trace = kvpolicy_numpy.replay(policy, logits, **inputs)
    lit = oracle(policy, keys, values, queries[:, :, None], 0)
    rows = table(text, "expected-attention-decode")
    assert [int(r[0]) for r in rows] == [t for t, _, _ in trace.evictions]
    for step, before, mean, cov, z, p, norms, scores, evicted, after in rows:
        t = int(step)
        cache = trace.kept[t - 1][0].tolist() + [t]
        assert ints(before) == cache, f"step {t}: cache before"
        seen = queries[1 : t + 1, 0]
        mu, centred = seen.mean(axis=0), seen - seen.mean(axis=0)
        sigma = centred.T @ centred / len(seen)
        np.testing.assert_allclose(floats(mean), mu, atol=5e-4, err_msg=f"step {t}: mean")
        np.testing.assert_allclose(floats(cov), sigma.ravel(), atol=5e-4, err_msg=f"step {t}: covariance")
        k = keys[cache[1:], 0]
        want_z = k @ mu / math.sqrt(2) + np.einsum("nd,de,ne->n", k, sigma, k) / 4
        np.testing.assert_allclose(floats(z), want_z, atol=5e-4, err_msg=f"step {t}: logits")
        want_p = np.exp(want_z - want_z.max()) / np.exp(want_z - want_z.max()).sum()
        np.testing.assert_allclose(floats(p), want_p, atol=5e-4, err_msg=f"step {t}: expected attention")
        np.testing.assert_allclose(floats(norms), np.linalg.norm(values[cache[1:], 0], axis=-1), atol=5e-4)
        got = expected_attention(keys[cache, 0][None, None], values[cache, 0][None, None], np.asarray(cache)[None, None], t + 1,
                                 query_moments(queries[: t + 1, 0][None, None, None], (np.arange(t + 1) >= 1)[None]),
                                 sink=1, future=policy.future)[0, 0]
        np.testing.assert_allclose(floats(scores), got[1:], atol=5e-4, err_msg=f"step {t}: scores")
        assert ints(after) == trace.kept[t][0].tolist() == lit[t][0], f"step {t}: kept"
        assert ints(evicted) == sorted(set(cache) - set(ints(after))), f"step {t}: evicted"
    prefill = kvpolicy_numpy.replay(policy, logits, prompt_len=4, **inputs)
    assert "cache holds `" + " ".join(map(str, prefill.kept[3][0].tolist())) + "`" in text.split("### Expected Attention")[1]
    assert queries[:4, 0].mean(axis=0).tolist() == [2.25, 1.75]  # the mean the text says the sink's query would give


@pytest.mark.parametrize("future", [0, 65537, 10**12])
def test_future_is_bounded(future) -> None:
    """Issue 44, class 11: ``future=10**12`` was accepted, then the first eviction tried to hold a
    trillion rotations per row; the documented range is 1 to 65536."""
    with pytest.raises(ValueError, match=rf"future must be >= 1 and <= 65536, got {future}"):
        ExpectedAttention(size=8, future=future)
    assert ExpectedAttention(size=8, future=65536).future == 65536


def test_the_default_scores_every_64th_decode_step_and_keeps_the_sinks() -> None:
    """The default refresh interval is 64 (the every-step rule is ``refresh=1``): on one sequence
    (random keys, 150 steps, size 16) the default keeps what ``refresh=64`` keeps, not what the
    every-step rule keeps, and always the sinks; CriticalKV over it keeps the sinks too (a sink's
    ``+inf`` stays, also once the unscored tokens outrank the first stage)."""
    from kvpolicy import CriticalKV

    assert ExpectedAttention(size=8).refresh == 64 and refresh_interval(ExpectedAttention(size=8)) == 64
    rng = np.random.default_rng(3)
    steps, heads, d = 150, 1, 8
    kw = dict(keys=rng.normal(size=(steps, heads, d)), values=rng.normal(size=(steps, heads, 3)),
              queries=rng.normal(size=(steps, heads, d)))
    logits = np.zeros((steps, heads, steps))
    default = kvpolicy_numpy.replay(ExpectedAttention(size=16, sink=2), logits, 20, **kw)
    same = kvpolicy_numpy.replay(ExpectedAttention(size=16, sink=2, refresh=64), logits, 20, **kw)
    every = kvpolicy_numpy.replay(ExpectedAttention(size=16, sink=2, refresh=1), logits, 20, **kw)
    assert all(a.tolist() == b.tolist() for a, b in zip(default.kept[19:], same.kept[19:]))
    assert any(a.tolist() != b.tolist() for a, b in zip(default.kept[19:], every.kept[19:]))
    assert all({0, 1} <= set(k[0].tolist()) for k in default.kept[19:])
    critical = kvpolicy_numpy.replay(CriticalKV(ExpectedAttention(size=6, sink=2, value_norm=False)), logits, 20, **kw)
    assert all({0, 1} <= set(k[0].tolist()) for k in critical.kept[19:])
