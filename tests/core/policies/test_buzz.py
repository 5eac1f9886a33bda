"""BUZZ with log n as the paper writes it (section 3.5): logits times ``log_512(n)``, ``n`` the
number of keys the query attends to (the entries of its softmax), no floor by default.

Checked on the NumPy reference (against the formula written out by hand), the torch replay and
the transformers path (a tiny random-weight float64 Llama: wiring and numerics, not language),
below and above 512 keys, and against each other.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvpolicy_numpy
from kvpolicy import BUZZ, LogNScaling, create_policy
from kvpolicy_numpy.replay import softmax


@given(st.integers(1, 5000), st.sampled_from([8.0, 64.0, 512.0]))
def test_scale_is_log_base_n_without_floor(n, base):
    s = LogNScaling(base=base)
    assert s.scale(n) == pytest.approx(math.log(n) / math.log(base), rel=1e-12, abs=1e-15)
    assert float(s.scales(np.asarray([n]))[0]) == pytest.approx(s.scale(n), rel=1e-12, abs=1e-15)
    floored = LogNScaling(base=base, floor=1.0)
    assert floored.scale(n) == max(s.scale(n), 1.0)


def test_buzz_logn_is_the_formula_as_written():
    p = create_policy("buzz_logn", sink=4, window=8, stride=5, threshold=35)
    assert p.log_n == LogNScaling(512.0, 0.0)
    assert p.log_n.scale(512) == 1.0
    assert p.log_n.scale(64) == pytest.approx(2 / 3)  # softer below 512 keys
    assert p.log_n.scale(4096) == pytest.approx(4 / 3)  # sharper above
    assert BUZZ(log_n=True, log_floor=1.0).log_n.scale(64) == 1.0  # the earlier variant, still available


def _rows(steps, heads=2, d=3, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(steps, heads, steps)) * 2.0, rng.normal(size=(steps, heads, d))


@pytest.mark.parametrize("prompt_len", [0, 7])
def test_buzz_logn_differs_from_buzz_exactly_by_the_scale_below_512(prompt_len):
    """No eviction in this run (capacity above its length), so both policies attend to the same
    keys: BUZZ's outputs are softmax(l) V and BUZZ-log-n's softmax(log_512(n) l) V, n = t + 1 keys."""
    steps = 40
    logits, values = _rows(steps)
    plain = BUZZ(sink=4, window=30, stride=5, threshold=20)
    logn = BUZZ(sink=4, window=30, stride=5, threshold=20, log_n=True)
    a = kvpolicy_numpy.replay(plain, logits, prompt_len, values)
    b = kvpolicy_numpy.replay(logn, logits, prompt_len, values)
    assert not a.evictions and not b.evictions
    for t in range(steps):
        n = t + 1  # keys attended: all of 0..t
        expect_plain = np.einsum("hk,khd->hd", softmax(logits[t, :, :n]), values[:n])
        expect_logn = np.einsum("hk,khd->hd", softmax(logits[t, :, :n] * (math.log(n) / math.log(512))), values[:n])
        np.testing.assert_allclose(a.outputs[t], expect_plain, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(b.outputs[t], expect_logn, rtol=1e-12, atol=1e-12)
        if n > 1:
            assert not np.allclose(a.outputs[t], b.outputs[t])
    # with the earlier floor the two coincide below 512 keys
    floored = kvpolicy_numpy.replay(BUZZ(sink=4, window=30, stride=5, threshold=20, log_n=True, log_floor=1.0),
                                    logits, prompt_len, values)
    np.testing.assert_array_equal(floored.outputs, a.outputs)


def _crossing_policy():
    # capacity 564: decode queries attend to 401..564 keys, below and above 512; evictions keep
    # the count of kept keys (not tokens seen) as n
    return BUZZ(sink=4, window=500, stride=5, threshold=60, log_n=True)


def test_reference_scale_counts_kept_keys_after_eviction():
    steps, prompt = 620, 400
    logits, values = _rows(steps, heads=1, d=2, seed=1)
    policy = _crossing_policy()
    trace = kvpolicy_numpy.replay(policy, logits, prompt, values)
    assert trace.evictions  # n (kept keys) and t + 1 (tokens seen) part ways
    assert min(trace.sizes) < 512 < max(trace.sizes)
    for i, t in enumerate(range(prompt, steps)):
        kept = np.concatenate([trace.kept[t - 1][0], [t]])  # what query t attends to
        n = trace.sizes[i]
        assert len(kept) == n
        probs = softmax(logits[t, 0, kept] * (math.log(n) / math.log(512)))
        np.testing.assert_allclose(trace.outputs[t, 0], probs @ values[kept, 0], rtol=1e-11, atol=1e-12)


def test_torch_replay_agrees_with_reference_above_and_below_512():
    torch = pytest.importorskip("torch")
    import kvpolicy_torch

    steps, prompt = 620, 400
    logits, values = _rows(steps, seed=2)
    policy = _crossing_policy()
    a = kvpolicy_numpy.replay(policy, logits, prompt, values)
    b = kvpolicy_torch.replay(policy, torch.as_tensor(logits), prompt, torch.as_tensor(values))
    assert min(a.sizes) < 512 < max(a.sizes)
    np.testing.assert_array_equal(a.sizes, b.sizes)
    for t in range(prompt - 1, steps):
        np.testing.assert_array_equal(a.kept[t], b.kept[t])
    np.testing.assert_allclose(a.outputs, b.outputs, rtol=1e-9, atol=1e-11)


@pytest.mark.slow
def test_transformers_path_agrees_with_reference_above_and_below_512():
    """Layer 0 of a float64 tiny Llama (no GQA) through EvictingCache: its attention outputs,
    prefill rows (n = i + 1) and decode steps (n = kept keys, 401 to 564), equal the NumPy
    reference's on the same logits and values."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from kvpolicy_tools.models import tiny_llama
    from kvpolicy_integrations.hf import EvictingCache, cache_kwargs

    model = tiny_llama(num_layers=1, heads=2, kv_heads=2, head_dim=8, vocab=64, seed=4,
                       max_position_embeddings=1024).double()
    steps, prompt = 600, 400
    ids = torch.randint(3, 64, (1, steps), generator=torch.Generator().manual_seed(0))
    attn = model.model.layers[0].self_attn
    outs = []

    def grab_out(module, args):
        outs.append(args[0].detach())

    policy = _crossing_policy()
    cache = EvictingCache(policy, model)
    h = attn.o_proj.register_forward_pre_hook(grab_out)
    try:
        with torch.no_grad():
            model(ids[:, :prompt], **cache_kwargs(model, cache), use_cache=True)
            for t in range(prompt, steps):
                model(ids[:, t : t + 1], **cache_kwargs(model, cache), use_cache=True)
    finally:
        h.remove()
    got = torch.cat(outs, dim=1)[0].view(steps, 2, 8).numpy()  # [steps, heads, d]

    from layer0 import layer0_inputs

    x, pos = layer0_inputs(model, ids)
    q = attn.q_proj(x).view(1, steps, 2, 8).transpose(1, 2)
    k = attn.k_proj(x).view(1, steps, 2, 8).transpose(1, 2)
    v = attn.v_proj(x).view(1, steps, 2, 8)[0]  # [steps, heads, d]
    q, k = apply_rotary_pos_emb(q, k, *pos)
    logits = (torch.einsum("bhqd,bhkd->bqhk", q, k) * attn.scaling)[0].detach().numpy()
    trace = kvpolicy_numpy.replay(policy, logits, prompt, v.detach().numpy())
    assert trace.evictions and min(trace.sizes) < 512 < max(trace.sizes)
    np.testing.assert_array_equal(cache.layers[0].store.positions[0].numpy(), trace.kept[-1])
    np.testing.assert_allclose(got, trace.outputs, rtol=1e-8, atol=1e-10)


# ---------------------------------------------------------------------------- validation: bad input raises a ValueError naming the parameter
from kvpolicy import estimate_threshold  # noqa: E402
from kvpolicy import make_policy  # noqa: E402
from kvpolicy import threshold_ratio  # noqa: E402
import re  # noqa: E402


@pytest.mark.parametrize("stride", [1, 2])
def test_buzz_stride_below_3(stride) -> None:
    with pytest.raises(ValueError, match=rf"stride must be >= 3, got {stride}"):
        BUZZ(sink=1, window=4, stride=stride, threshold=6)
    with pytest.raises(ValueError, match="stride must be >= 3"):
        threshold_ratio(stride)
    with pytest.raises(ValueError, match="stride must be >= 3"):
        estimate_threshold(stride, 10)


@pytest.mark.parametrize("stride", [3, 4, 5, 8, 17])
@pytest.mark.parametrize("threshold", [1, 2])
def test_buzz_threshold_too_small(stride, threshold) -> None:
    with pytest.raises(ValueError, match=rf"threshold must be >= 3, got {threshold}"):
        BUZZ(sink=1, window=4, stride=stride, threshold=threshold)
    assert BUZZ(sink=1, window=4, stride=stride, threshold=3).threshold == 3


@pytest.mark.parametrize("stride", range(3, 30))
def test_smallest_allowed_threshold_shrinks_the_middle(stride) -> None:
    """With T = 3 every eviction leaves fewer than T middle tokens (so the capacity holds),
    and T = 2 would not: 2 old tokens thinned by s_hat >= 2 keep 1, plus 1 new one."""
    s_hat = (stride + 1) // 2
    for a in range(3):
        assert math.ceil(a / s_hat) + math.ceil((3 - a) / stride) < 3
    assert math.ceil(1 / s_hat) + math.ceil(1 / stride) == 2  # T = 2, a = 1: no shrink


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(log_n=True, log_base=1.0), "log_base"),
        (dict(log_n=True, log_base=0.5), "log_base"),
        (dict(log_n=True, log_floor=-0.1), "log_floor"),
        (dict(interval_keep="middle"), "interval_keep"),
        (dict(selection="per_layer"), "selection"),
    ],
)
def test_buzz_choice_parameters(kwargs, param) -> None:
    with pytest.raises(ValueError, match=rf"^{param} must be"):
        BUZZ(sink=1, window=2, stride=3, threshold=3, **kwargs)


NOT_BOOLS = ["yes", "no", "False", 1, 0, 1.0, None, np.int64(1), [True]]


@pytest.mark.parametrize("bad", NOT_BOOLS, ids=repr)
def test_buzz_log_n_accepts_only_bools(bad) -> None:
    with pytest.raises(ValueError, match=rf"^log_n must be True or False, got {re.escape(repr(bad))}$"):
        BUZZ(sink=1, window=2, stride=3, threshold=3, log_n=bad)
    with pytest.raises(ValueError, match="^log_n must be True or False"):
        make_policy("buzz", 0.3, context_length=100, log_n=bad)


@pytest.mark.parametrize("good, expected", [(True, True), (False, False), (np.True_, True), (np.False_, False)])
def test_buzz_log_n_bools(good, expected) -> None:
    p = BUZZ(sink=1, window=2, stride=3, threshold=3, log_n=good)
    assert (p.log_n is not None) is expected
    assert p.params().get("log_n", False) is expected


def test_buzz_log_parameters_checked_even_without_log_n() -> None:
    with pytest.raises(ValueError, match="^log_base must be"):
        BUZZ(log_base="512")
    with pytest.raises(ValueError, match="^log_floor must be"):
        BUZZ(log_floor=-1.0)
