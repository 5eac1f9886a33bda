"""benchmarks/decode_calls.py: the counts of one decode step's project calls (issue 43), on tiny
random-weight Llamas. A ratchet: the eager and the static step may not wander further than they
did when the count was last taken (2026-11-27 20:30: H2O eager 49 calls in 14 modules a layer, static
32 in 7); lower them when a change takes calls out. The modules rose by 2 everywhere, the calls by
none, when hf.py became the package hf/ by role (issue 43, item 2): the layer's 8 integration calls
are the same functions, now in three files (EvictingCache.update in hf/cache.py, the layer's in
hf/layer.py, the attention function in hf/attention.py) where they were in one. 2026-11-28 14:45:
H2O eager 20 calls in 13 modules, static 18 in 6; Knorm 26 in 17 and 21 in 9, 25 in 16 and 20 in 8
once its declared score was its own three ops (the checks a step
repeats answered by one tuple comparison, accessors read as attributes, synced() and the group's
generators inlined where they had nothing to do, the settle answer kept per storage). 2026-11-29
09:20: H2O eager 17 calls in 5 modules, static 17 in 4; Knorm 22 in 8 and 19 in 6, once
transformers' own ``Cache.update`` handed each call to the layer (``EvictingCache.update`` and its
module left the step; the layer tells a forward's call from one by hand, ``ForwardScope``).
2026-11-29 14:20: H2O eager 15 calls in 5 modules, static 15 in 4; Knorm 20 in 8 and 18 in 6, once
the group cleared each layer's deferred flag itself (no callback a layer), a one-row write
answered needs_bias inline, the static fold called fold_received directly and the transformers
layer kept what its update learnt (``device_step``) for its attention."""

from __future__ import annotations

import pytest

#: The most calls and modules one layer's decode step may take (today's counts).
CEILINGS = {("h2o", False): (15, 5), ("h2o", True): (15, 4), ("knorm", False): (20, 8), ("knorm", True): (18, 6)}


@pytest.mark.parametrize("policy,static", sorted(CEILINGS))
def test_one_layers_decode_step_stays_within_its_count(benchmark_module, policy: str, static: bool) -> None:
    row = benchmark_module("decode_calls").count(policy, static=static)
    calls, modules = CEILINGS[(policy, static)]
    assert 0 < row["calls_per_layer"] <= calls, row["layer_calls"]
    assert 0 < row["modules_per_layer"] <= modules, row["modules"]
    # the layer's segment is its own: its update first (transformers' Cache.update hands it the
    # call: no project code between), its eviction's work inside
    assert row["layer_calls"][:2] == ["update", "append"]


def test_the_script_prints_a_row_per_policy_and_layout(benchmark_module, capsys: pytest.CaptureFixture[str]) -> None:
    rows = benchmark_module("decode_calls").main(["--policies", "streaming_llm"])
    assert [(r["policy"], r["static_shapes"]) for r in rows] == [("streaming_llm", False), ("streaming_llm", True)]
    assert "streaming_llm" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="unknown"):
        benchmark_module("decode_calls").main(["--policies", "nope"])
