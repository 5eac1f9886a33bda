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
