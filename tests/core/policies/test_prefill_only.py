"""kvpolicy/policies/prefill_only.py, prefill_only(policy, compression_ratio): kvpress's protocol
(the context compressed once to int(n (1 - r)) tokens per head, every later token kept) on the
NumPy reference and the torch replay, against each scorer's own choice at that size, the
conformance kit, and its refusals."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvpolicy_numpy
from kvpolicy import BUZZ, H2O, TOVA, AdaKV, KeyDiff, Knorm, LocalWindow, PrefillOnly, SnapKV, StreamingLLM, prefill_only
from kvpolicy.testing import check_policy

torch = pytest.importorskip("torch")

import kvpolicy_torch  # noqa: E402

RATIOS = st.sampled_from([0.0, 0.25, 0.5, 0.75, 0.875, 0.9])


def _scorer_at(name: str, k: int):
    """The scorer planned to keep ``k`` tokens a head after a prompt (its own rule), and the same
    scorer at an arbitrary size (what prefill_only wraps: only its ranking matters)."""
    if name == "knorm":
        return Knorm(size=k), Knorm(size=1)
    if name == "keydiff":
        return KeyDiff(size=max(k, 2), recent=1), KeyDiff(size=2, recent=1, refresh=1)
    if name == "h2o":
        return H2O(heavy=max(k - 1, 0), recent=1), H2O(heavy=3, recent=1)
    if name == "tova":
        return TOVA(size=k, selection="per_head"), TOVA(size=1, selection="per_head")
    return SnapKV(size=max(k, 3), window=2, kernel=3), SnapKV(size=3, window=2, kernel=3)


@given(st.integers(0, 2**32 - 1), st.integers(4, 30), RATIOS, st.sampled_from(["knorm", "keydiff", "h2o", "tova", "snapkv"]))
@settings(max_examples=60, deadline=None)
def test_the_context_is_compressed_once_to_the_scorers_own_choice(seed, prompt_len, ratio, name) -> None:
    """After the prompt every head keeps k = int(n (1 - r)) tokens: the ones the scorer itself
    keeps when planned at k (Knorm(size=k), SnapKV(size=k), ...); then every new token is kept
    and nothing is evicted again. The torch replay keeps the same tokens at every step."""
    rng = np.random.default_rng(seed)
    steps, heads = prompt_len + 5, 2
    logits = rng.normal(size=(steps, heads, steps)) * 2
    keys = rng.normal(size=(steps, heads, 4))
    k = max(1, int(prompt_len * (1 - ratio)))
    if k < {"keydiff": 2, "h2o": 2, "snapkv": 3}.get(name, 1):
        return  # the scorer planned at k would keep more than k (its recent / window): no reference
    own, wrapped = _scorer_at(name, k)
    p = prefill_only(wrapped, ratio)
    trace = kvpolicy_numpy.replay(p, logits, prompt_len, keys=keys)
    after = trace.kept[prompt_len - 1]
    assert after.shape == (heads, min(k, prompt_len))
    if k < prompt_len:
        assert after.tolist() == kvpolicy_numpy.replay(own, logits, prompt_len, keys=keys).kept[prompt_len - 1].tolist()
    for t in range(prompt_len, steps):
        assert trace.kept[t].tolist() == np.concatenate([after, np.broadcast_to(np.arange(prompt_len, t + 1), (heads, t + 1 - prompt_len))], axis=1).tolist()
    got = kvpolicy_torch.replay(p, logits, prompt_len, keys=keys)
    assert [None if x is None else x.tolist() for x in got.kept] == [None if x is None else x.tolist() for x in trace.kept]


def test_shared_selection_and_adakv() -> None:
    """TOVA's shared selection keeps the same k tokens on every head; over AdaKV the layer keeps
    heads x k tokens, every head at least AdaKV's floor of k, and the torch replay agrees."""
    rng = np.random.default_rng(7)
    logits = rng.normal(size=(26, 3, 26)) * 2
    trace = kvpolicy_numpy.replay(prefill_only(TOVA(size=1), 0.5), logits, 20)
    assert trace.kept[19].shape == (3, 10) and (trace.kept[19] == trace.kept[19][0]).all()
    ada = prefill_only(AdaKV(SnapKV(size=8, window=4), alpha_safeguard=0.5), 0.75)
    assert ada.ragged_heads
    trace = kvpolicy_numpy.replay(ada, logits, 20)
    held = (trace.kept[19] >= 0).sum(axis=1)
    assert held.sum() == 3 * 5 and held.min() >= 2 and held.max() > held.min()
    assert [(k >= 0).sum() for k in trace.kept[20:]] == [3 * (5 + i) for i in range(1, 7)]
    got = kvpolicy_torch.replay(ada, logits, 20)
    assert all(np.array_equal(a, b) for a, b in zip(got.kept[19:], trace.kept[19:]))


def test_keeps_the_contract() -> None:
    """The conformance kit, every property (torch included), on drawn scorers and ratios."""
    scorers = st.one_of(st.builds(Knorm, size=st.integers(1, 4), recent=st.integers(0, 0)),
                        st.builds(H2O, heavy=st.integers(1, 3), recent=st.integers(1, 3)),
                        st.builds(SnapKV, size=st.integers(3, 6), window=st.integers(1, 2)),
                        st.builds(TOVA, size=st.integers(1, 4)))
    report = check_policy(st.builds(PrefillOnly, scorers, st.sampled_from([0.0, 0.3, 0.5, 0.8])))
    assert report.passed == ["replay", "sizes", "full_cache", "backends", "stateful"]


@pytest.mark.parametrize("sink,ratio", [(2, 0.5), (4, 0.25), (3, 0.8), (0, 0.5)])
def test_a_positional_policy_keeps_its_sinks_and_the_newest_as_kvpress_streamingllm_press(sink: int, ratio: float) -> None:
    """StreamingLLM (and the local window, ``sink=0``) under kvpress's protocol: the first ``sink``
    and the newest ``int(n (1 - ratio)) - sink`` context tokens, as kvpress's StreamingLLMPress
    keeps them; the question and the answer after it are never evicted."""
    n, steps = 20, 26
    policy = prefill_only(StreamingLLM(sink=sink, window=4) if sink else LocalWindow(window=4), ratio)
    trace = kvpolicy_numpy.replay(policy, np.zeros((steps, 1, steps)), n)
    k = max(1, int(n * (1 - ratio)))
    first = min(sink, k)
    want = list(range(first)) + list(range(n - (k - first), n))
    assert trace.kept[n - 1][0].tolist() == want
    assert trace.kept[-1][0].tolist() == want + list(range(n, steps))
    assert policy.default_positions == "original"  # kvpress's pipeline re-rotates no key


def test_reads_like_its_scorer_and_refuses_what_it_cannot_run() -> None:
    p = prefill_only(SnapKV(size=64, window=16, kernel=5), 0.5)
    assert (p.prompt_rows, p.score_statistic, p.capacity, p.selection, p.kept_tokens(1000)) == (16, "accumulate", None, "per_head", 500)
    assert p == prefill_only(SnapKV(size=64, window=16, kernel=5), 0.5) != prefill_only(SnapKV(size=64, window=16), 0.25)
    assert p.params() == {"policy": {"policy": "snapkv", "size": 64, "window": 16, "kernel": 5, "pooling": "avg",
                                     "selection": "per_head"}, "compression_ratio": 0.5}
    assert prefill_only(Knorm(size=1), 0.9).kept_tokens(5) == 1  # at least one token a head
    with pytest.raises(ValueError, match="rank tokens by a score"):
        prefill_only(BUZZ(sink=1, window=4, stride=3), 0.5)
    with pytest.raises(ValueError, match=r"compression_ratio must be in \[0.0, 1.0\)"):
        prefill_only(Knorm(size=1), 1.0)
    with pytest.raises(ValueError, match="EvictionPolicy instance"):
        prefill_only("knorm", 0.5)  # type: ignore[arg-type]


@pytest.mark.slow
def test_real_model_compresses_every_layer_once_as_the_scorer_would() -> None:
    """SmolLM2-135M (real weights, 30 layers, 3 KV heads, float32), a 200-token prompt at ratio
    0.75: after the prompt every layer of ``prefill_only(Knorm, 0.75)`` keeps the 50 tokens a head
    that ``Knorm(size=50)`` keeps there (the prompt's attention does not depend on the eviction that
    follows it); after 6 greedy tokens it still holds those 50 plus every new token, where Knorm alone
    stays at 50."""
    pytest.importorskip("transformers")
    from kvpolicy import models
    from kvpolicy.hf import EvictingCache, cache_kwargs

    model, tok = models.load("smollm2-135m")
    text = " ".join(f"Note {i}: the crate in bay {i} holds {i * 7 % 13} blue boxes." for i in range(30))
    ids = tok(text, return_tensors="pt")["input_ids"][:, :200]

    def run(policy, steps):
        cache = EvictingCache(policy, model)
        with torch.no_grad():
            out = model(ids, **cache_kwargs(model, cache))
            after = [layer.store.positions[0].clone() for layer in cache.layers]
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            for _ in range(steps):
                nxt = model(nxt, **cache_kwargs(model, cache)).logits[:, -1].argmax(-1, keepdim=True)
        return after, [layer.store.positions[0].clone() for layer in cache.layers]

    press_after, press_end = run(prefill_only(Knorm(size=1), 0.75), 6)
    knorm_after, knorm_end = run(Knorm(size=50), 6)
    assert len(press_after) == 30
    for a, b, end, alone in zip(press_after, knorm_after, press_end, knorm_end):
        assert a.shape == (3, 50) and torch.equal(a, b)
        assert torch.equal(end, torch.cat([a, torch.arange(200, 206).expand(3, 6)], dim=1))
        assert alone.shape[-1] == 50
