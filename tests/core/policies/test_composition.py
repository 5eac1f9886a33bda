"""kvpolicy/policies/composition.py, compose(prefill=..., decode=...): the NumPy reference against the
literal oracle and the torch replay, the conformance kit, planning (the snapkv_* presets), and its
refusals."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

import kvpolicy_numpy
from kvpolicy import BUZZ, H2O, TOVA, Composed, LocalWindow, SnapKV, StreamingLLM, compose, get_policy, make_policy, plan_policy
from kvpolicy.testing import check_policy
from oracle import oracle
from strategies import buzz_policies, h2o_policies, replay_cases, selections, streaming_policies, tova_policies

torch = pytest.importorskip("torch")

import kvpolicy_torch  # noqa: E402


@st.composite
def composed_policies(draw: st.DrawFn) -> Composed:
    """SnapKV (window 1-4, size window + 1 to window + 10, kernel 1-5) then any bounded decode
    policy (BUZZ, log n included, H2O, TOVA, StreamingLLM), both with the same selection."""
    selection = draw(selections)
    decode = draw(
        st.one_of(
            buzz_policies(selection=selection, max_window=4, max_threshold=10),
            h2o_policies(selection=selection),
            tova_policies(selection=selection),
            streaming_policies(),
        )
    )
    if decode.selection != selection:  # StreamingLLM's strategy draws no selection
        decode = StreamingLLM(sink=decode.sink, window=decode.window, selection=selection)
    window = draw(st.integers(1, 4))
    prefill = SnapKV(size=draw(st.integers(window + 1, window + 10)), window=window,
                     kernel=draw(st.sampled_from([1, 3, 5])), selection=selection)
    return compose(prefill=prefill, decode=decode)


def _kept(trace) -> list:
    return [None if k is None else k.tolist() for k in trace.kept]


@given(replay_cases(composed_policies(), max_steps=40))
@example((compose(prefill=SnapKV(size=4, window=2, kernel=3), decode=H2O(heavy=3, recent=2)), np.zeros((16, 2, 16)), 12))
@example((compose(prefill=SnapKV(size=7, window=2), decode=BUZZ(sink=1, window=2, stride=3, threshold=6)),
          np.random.default_rng(0).normal(size=(40, 1, 40)), 20))
def test_composed_matches_oracle_and_torch(case) -> None:
    policy, logits, prompt_len = case
    ref = kvpolicy_numpy.replay(policy, logits, prompt_len)
    want = oracle(policy, logits, prompt_len)
    assert _kept(ref) == want.kept
    assert ref.evictions == want.evictions
    got = kvpolicy_torch.replay(policy, logits, prompt_len)
    assert _kept(got) == want.kept
    assert got.evictions == ref.evictions


def test_composed_keeps_the_contract() -> None:
    """The conformance kit, every property (torch included), on drawn compositions."""
    report = check_policy(composed_policies())
    assert report.passed == ["replay", "sizes", "full_cache", "backends", "stateful"]


def test_prefill_policy_runs_only_after_a_prompt() -> None:
    """SnapKV decides right after the prompt, the decode policy afterwards: the composition
    equals SnapKV after the prompt (then the decode policy's own rule) and H2O in decode."""
    logits = np.random.default_rng(5).normal(size=(30, 2, 30)) * 3
    p = compose(prefill=SnapKV(size=6, window=2, kernel=3), decode=H2O(heavy=3, recent=4))
    trace = kvpolicy_numpy.replay(p, logits, 20)
    snap = kvpolicy_numpy.replay(SnapKV(size=6, window=2, kernel=3), logits, 20)
    assert trace.kept[19].tolist() == snap.kept[19].tolist()  # 6 <= H2O's 7: H2O keeps them all
    assert trace.evictions[0] == (19, 20, 6) and all(b - a == 1 for t, b, a in trace.evictions[1:])
    assert trace.sizes.max() == p.capacity == 8
    # a short prompt (<= capacity - 1) is not SnapKV's to cut: everything stays, then H2O's sizes
    short = kvpolicy_numpy.replay(p, logits, 7)
    assert short.kept[6].tolist() == [list(range(7))] * 2
    assert short.sizes.tolist() == kvpolicy_numpy.replay(H2O(heavy=3, recent=4), logits, 7).sizes.tolist()


def test_presets_plan_like_any_policy() -> None:
    plan = plan_policy("snapkv_buzz", 0.3, context_length=1024, prompt_length=512)
    assert abs(plan.realised_budget - 0.3) < 0.01
    p = plan.policy
    assert isinstance(p.decode, BUZZ) and p.prefill == SnapKV(size=p.decode.capacity - 1, window=32)
    h = make_policy("snapkv_h2o", 0.25, context_length=1024, prompt_length=512, prefill_window=8, prefill_kernel=3)
    assert h.prefill == SnapKV(size=h.capacity - 1, window=8, kernel=3) and isinstance(h.decode, H2O)
    assert isinstance(make_policy("snapkv_tova", 0.25, context_length=512, prompt_length=256).decode, TOVA)
    assert p.decode_eviction is None and h.decode_eviction == h.decode.decode_eviction


def test_composed_reads_like_its_parts() -> None:
    p = compose(prefill=SnapKV(size=40, window=8, selection="shared"), decode=TOVA(size=20))  # TOVA: shared by default
    assert (p.score_statistic, p.prompt_rows, p.capacity, p.uses_scores) == ("latest", 8, 21, True)
    q = compose(prefill=SnapKV(size=40, window=8), decode=BUZZ(sink=2, window=8, stride=3, threshold=9, log_n=True))
    assert q.log_n == q.decode.log_n and q.init_state() == {"decode.n_old": 0}
    assert compose(prefill=SnapKV(size=9, window=2), decode=LocalWindow(8)).default_positions == "original"
    assert p == compose(prefill=SnapKV(size=40, window=8, selection="shared"), decode=TOVA(size=20)) and len({p, q}) == 2
    assert repr(p) == ("Composed(prefill=SnapKV(size=40, window=8, kernel=5, pooling='avg', selection='shared'), "
                       "decode=TOVA(size=20, recent=0, selection='shared'))")
    import json

    assert json.loads(json.dumps(p.params())) == {
        "prefill": {"policy": "snapkv", "size": 40, "window": 8, "kernel": 5, "pooling": "avg", "selection": "shared"},
        "decode": {"policy": "tova", "size": 20, "recent": 0, "selection": "shared"},
    }
    assert p != compose(prefill=SnapKV(size=40, window=8, selection="shared"), decode=TOVA(size=21)) and p != p.decode
    with pytest.raises(ValueError, match="the same selection, got 'per_head' and 'shared'"):
        compose(prefill=SnapKV(size=40, window=8), decode=TOVA(size=20))


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: compose(prefill="snapkv", decode=H2O(4, 4)), "EvictionPolicy instance"),
        (lambda: compose(prefill=SnapKV(8, 2), decode=H2O(4, 4, selection="shared")), "same selection"),
        (lambda: get_policy("snapkv_buzz")(), "EvictionPolicy instance"),
        (lambda: make_policy("compose", 0.3, context_length=512), "registry names"),
    ],
)
def test_composed_refusals(make, match) -> None:
    with pytest.raises(ValueError, match=match):
        make()


def test_doc_worked_example() -> None:
    """docs/policies.md's composition example: the evicted tokens and the caches it names are the
    reference's and the oracle's."""
    import re

    from worked_examples import DOC, section, setup

    text = DOC.read_text(encoding="utf-8")
    logits = setup(text, "snapkv-setup")["logits"]
    p = compose(prefill=SnapKV(size=6, window=2, kernel=3, pooling="max"), decode=H2O(heavy=3, recent=3))
    assert "`compose(prefill=SnapKV(size=6, window=2, kernel=3,\npooling=\"max\"), decode=H2O(heavy=3, recent=3))` (capacity 7)" in text
    assert p.capacity == 7
    trace = kvpolicy_numpy.replay(p, logits, 12)
    assert _kept(trace) == oracle(p, logits, 12).kept
    kept = [trace.kept[t][0].tolist() for t in (11, 12, 13)]
    body = text[text.index("### compose\n\nThe SnapKV example"):]
    body = body[: body.index("## 7.")]
    lists = [[int(x) for x in m.split()] for m in re.findall(r"`([\d ]+)`", body)]
    assert lists == [kept[0], sorted(set(kept[0]) - set(kept[1])), sorted(set(kept[1]) - set(kept[2])), kept[2]]
    assert [t for t, _, _ in trace.evictions] == [11, 12, 13] and section(text, "snapkv-setup")


# ============================================================================ the score the prefill policy ranks
def _shrinking_norms_case() -> tuple[np.ndarray, np.ndarray]:
    """Issue 41's case: 10 steps, one head; keys whose norms shrink with position (not strictly),
    a sink at token 0 (the smallest norm); the attention favours token 6 and, by accumulation
    over the prompt's rows, the earliest tokens (so ranking by attention keeps 0, 1, 2, 6)."""
    norms = np.array([0.1, 8, 7, 6, 3, 5, 2, 1, 4, 0.5])
    keys = np.zeros((10, 1, 2))
    keys[:, 0, 0] = norms
    logits = np.zeros((10, 1, 10))
    logits[:, :, 6] = 2.0
    return logits, keys


def test_a_prefill_policy_ranks_by_its_own_statistic_when_the_decode_policy_reads_no_scores() -> None:
    """Issue 41: ``compose(prefill=Knorm(size=4), decode=FullCache())`` took FullCache's
    statistic, so no backend computed key norms and Knorm ranked recorded attention totals
    (it kept [0, 1, 2, 6]); now it keeps Knorm's own [0, 4, 6, 7] after the 8-token prompt, then
    every later token."""
    from kvpolicy import FullCache, Knorm

    logits, keys = _shrinking_norms_case()
    alone = kvpolicy_numpy.replay(Knorm(size=4), logits, 8, keys=keys)
    p = compose(prefill=Knorm(size=4), decode=FullCache())
    assert (p.scorer, p.score_statistic, p.captures_attention) == (Knorm(size=4), "key_norm", False)
    trace = kvpolicy_numpy.replay(p, logits, 8, keys=keys)
    assert alone.kept[7].tolist() == trace.kept[7].tolist() == [[0, 4, 6, 7]]
    assert trace.kept[9].tolist() == [[0, 4, 6, 7, 8, 9]]
    got = kvpolicy_torch.replay(p, logits, 8, keys=keys)
    assert _kept(got) == _kept(trace)
    # the same with the other decode policies that read no scores
    streaming = compose(prefill=Knorm(size=4), decode=StreamingLLM(sink=1, window=6))
    assert kvpolicy_numpy.replay(streaming, logits, 8, keys=keys).kept[7].tolist() == [[0, 4, 6, 7]]
    assert compose(prefill=Knorm(size=4), decode=LocalWindow(7)).score_statistic == "key_norm"


@given(st.integers(0, 2**32 - 1), st.integers(2, 24), st.sampled_from(["knorm", "keydiff", "tova", "h2o"]),
       st.sampled_from(["full", "streaming", "local"]))
def test_numpy_and_torch_follow_the_prefill_policy_statistic(seed, prompt_len, prefill_name, decode_name) -> None:
    """Drawn prefill policies (key norms, KeyDiff, TOVA's latest row, H2O) composed with a decode
    policy that reads no scores: the NumPy reference and the torch replay keep the same tokens
    at every step, and after a prompt longer than the decode policy's ``capacity - 1`` the
    prefill policy's own choice (the 3 tokens it keeps fit the decode policy)."""
    from kvpolicy import FullCache, H2O, KeyDiff, Knorm

    rng = np.random.default_rng(seed)
    steps, heads = prompt_len + 6, 2
    logits = rng.normal(size=(steps, heads, steps)) * 2
    keys = rng.normal(size=(steps, heads, 4))
    prefill = {"knorm": Knorm(size=3), "keydiff": KeyDiff(size=3, recent=1, refresh=1), "tova": TOVA(size=3, selection="per_head"),
               "h2o": H2O(heavy=2, recent=1)}[prefill_name]
    decode = {"full": FullCache(), "streaming": StreamingLLM(sink=1, window=2), "local": LocalWindow(3)}[decode_name]
    p = compose(prefill=prefill, decode=decode)
    assert p.score_statistic == prefill.score_statistic and p.key_recent == prefill.key_recent
    ref = kvpolicy_numpy.replay(p, logits, prompt_len, keys=keys)
    assert _kept(kvpolicy_torch.replay(p, logits, prompt_len, keys=keys)) == _kept(ref)
    if decode.capacity is None or prompt_len > decode.capacity - 1:
        alone = kvpolicy_numpy.replay(prefill, logits, prompt_len, keys=keys)
        assert ref.kept[prompt_len - 1].tolist() == alone.kept[prompt_len - 1].tolist()


def test_the_transformers_cache_computes_key_norms_for_the_composition() -> None:
    """A tiny random-weight Llama (float64, 2 layers, 4 KV heads): layer 0 of
    ``EvictingCache(compose(prefill=Knorm(size=6), decode=FullCache()))`` after a 16-token
    prompt and 4 greedy tokens keeps what kvpolicy_numpy.replay keeps on layer 0's logits and
    keys: Knorm's own choice after the prompt, then every new token."""
    pytest.importorskip("transformers")
    from kvpolicy import FullCache, Knorm
    from kvpolicy.hf import EvictingCache
    from kvpolicy_tools.models import tiny_llama
    from layer0 import greedy_tokens, layer0_logits_and_keys

    model = tiny_llama(num_layers=2, heads=4, kv_heads=4, head_dim=8, vocab=96, seed=3).double()
    ids = torch.randint(3, 96, (1, 16), generator=torch.Generator().manual_seed(5))
    p = compose(prefill=Knorm(size=6), decode=FullCache())
    cache = EvictingCache(p, model)
    tokens = greedy_tokens(model, cache, ids, 4)
    logits, keys = layer0_logits_and_keys(model, tokens)
    trace = kvpolicy_numpy.replay(p, logits, prompt_len=16, keys=keys)
    alone = kvpolicy_numpy.replay(Knorm(size=6), logits, prompt_len=16, keys=keys)
    assert trace.kept[15].tolist() == alone.kept[15].tolist()
    np.testing.assert_array_equal(cache.layers[0].store.positions[0].numpy(), trace.kept[-1])


def test_pairs_one_score_cannot_serve_are_refused_by_name() -> None:
    from kvpolicy import AdaKV, FullCache, KeyDiff, Knorm, Scissorhands

    with pytest.raises(ValueError, match="same kind of score"):
        compose(prefill=Knorm(size=4), decode=H2O(heavy=2, recent=2))
    with pytest.raises(ValueError, match="key_recent"):
        compose(prefill=KeyDiff(size=8, recent=1), decode=KeyDiff(size=8, recent=3))
    with pytest.raises(ValueError, match="score_history"):
        compose(prefill=Scissorhands(size=8, history=2, recent=2), decode=Scissorhands(size=8, history=4, recent=2))
    with pytest.raises(ValueError, match="AdaKV is supported as the decode policy"):
        compose(prefill=AdaKV(SnapKV(size=12, window=4)), decode=H2O(heavy=5, recent=6))
    assert compose(prefill=KeyDiff(size=8, recent=2), decode=KeyDiff(size=6, recent=2)).key_recent == 2
    with pytest.raises(ValueError, match="same number of tokens on every head"):
        compose(prefill=AdaKV(H2O(4, 2)), decode=FullCache())


def test_the_kit_fails_a_composition_that_ranks_by_the_wrong_statistic() -> None:
    """The conformance kit's replay property holds a composition's prefill decision to its
    prefill policy's own: a composition computing the decode policy's statistic (the bug of
    issue 41) is caught; the fixed one passes."""
    from hypothesis import settings

    from kvpolicy import FullCache, Knorm
    from kvpolicy.testing import ContractViolation, check_prefill_decision

    class DecodeStatistic(Composed):
        """The old rule: the scores are always the decode policy's (FullCache's: attention)."""

        @property
        def score_statistic(self):
            return self.decode.score_statistic

    logits, _ = _shrinking_norms_case()
    wrong = DecodeStatistic(prefill=Knorm(size=4), decode=FullCache())
    with pytest.raises(ContractViolation, match="not its choice"):
        check_prefill_decision(wrong, logits, 8)
    check_prefill_decision(compose(prefill=Knorm(size=4), decode=FullCache()), logits, 8)
    with pytest.raises(ContractViolation, match="prefill policy"):
        check_policy(st.just(wrong), checks=["replay"], torch=False,
                     settings=settings(max_examples=50, database=None, derandomize=True))
    report = check_policy(st.just(compose(prefill=Knorm(size=4), decode=FullCache())), checks=["replay"], torch=False,
                          settings=settings(max_examples=50, database=None))
    assert report.passed == ["replay"]


# ============================================================================ head-wise decode policies (issue 44, class 10)
def test_adakv_as_the_decode_policy_runs_in_torch_and_as_the_prefill_policy_is_refused() -> None:
    """AdaKV after SnapKV: the torch replay keeps the reference's tokens (holes included); the
    torch cache allocates for the decode policy's widest head (``head_capacity``, once an
    AttributeError). A head-wise prefill policy is refused by name."""
    from kvpolicy import AdaKV

    rng = np.random.default_rng(3)
    logits = rng.normal(size=(30, 3, 30))
    p = compose(prefill=SnapKV(size=12, window=4), decode=AdaKV(H2O(heavy=5, recent=6), 0.2))
    assert p.ragged_heads and p.head_capacity(3) == p.decode.head_capacity(3)
    assert compose(prefill=SnapKV(size=12, window=4), decode=H2O(heavy=5, recent=6)).head_capacity(3) is None
    ref = kvpolicy_numpy.replay(p, logits, 20)
    assert _kept(kvpolicy_torch.replay(p, logits, 20)) == _kept(ref)
    with pytest.raises(ValueError, match="same number of tokens on every head"):
        compose(prefill=AdaKV(SnapKV(size=12, window=4)), decode=AdaKV(H2O(heavy=5, recent=6)))
