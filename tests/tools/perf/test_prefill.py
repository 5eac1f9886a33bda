"""kvpolicy_tools/perf/prefill.py (``kvpolicy bench --what prefill``) on a tiny random model: every
candidate timed each round, the ratio to the plain forward, and a chunked prefill's peak bytes
at the storage plus one chunk, below the one-shot peak."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvpolicy_tools.models import tiny_llama  # noqa: E402
from kvpolicy_tools.perf.decode import PolicySpec  # noqa: E402
from kvpolicy_tools.perf.prefill import measure_prefill, prefill_report  # noqa: E402


def test_measure_prefill_rows_and_peaks():
    model = tiny_llama(num_layers=2, heads=4, kv_heads=2, head_dim=16)
    steps = []
    rows = measure_prefill(model, [96], [PolicySpec.named("h2o"), PolicySpec.named("streaming_llm")], chunk=16, rounds=2,
                           on_step=steps.append)
    assert [(r["label"], r["mode"]) for r in rows] == [
        ("DynamicCache", "one-shot"), ("H2O", "one-shot"), ("H2O", "chunked"), ("StreamingLLM", "one-shot"), ("StreamingLLM", "chunked")]
    assert len(steps) == 2 * 5 and all(len(r["seconds"]) == 2 for r in rows)
    plain = rows[0]
    assert plain["x_plain"] == 1.0 and plain["peak_bytes"] is None
    for one_shot, chunked in (rows[1:3], rows[3:5]):
        assert one_shot["x_plain"] == pytest.approx(min(one_shot["seconds"]) / min(plain["seconds"]))
        assert chunked["peak_bytes"] < one_shot["peak_bytes"]
    report = "\n".join(prefill_report(rows, 16, 0.25))
    assert "### Prompt 96 tokens" in report and "| H2O | chunked |" in report
    with pytest.raises(ValueError, match="chunk"):
        measure_prefill(model, [96], [], chunk=0)


def test_bench_what_prefill(tmp_path, capsys):
    from kvpolicy_tools.perf.bench import main

    out = tmp_path / "bench"
    assert main(["--what", "prefill", "--out", str(out), "--no-progress", "--model", "tiny-llama", "--contexts", "40",
                 "--decode-rounds", "1", "--budgets", "0.1,0.3", "--policy", "buzz", "--no-plots"]) == 0
    assert "## Prefill (time to first token)" in (out / "report.md").read_text()
    data = json.loads((out / "results.json").read_text())
    assert data["prefill"]["budget"] == 0.3 and {r["mode"] for r in data["prefill"]["rows"]} == {"one-shot", "chunked"}
    assert main(["--what", "prefil", "--out", str(out)]) != 0
    assert "--what takes complexity, decode, breakdown, prefill; got prefil" in capsys.readouterr().err
