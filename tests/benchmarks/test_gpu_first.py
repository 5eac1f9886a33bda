"""benchmarks/gpu_first.py, the prepared GPU run of issue 42: on CPU, its exactness phase holds
(layer 0 of a greedy generation through EvictingCache keeps what the float64 NumPy reference
keeps, in float32 and bfloat16: a tiny random-weight Llama) and a whole run writes every phase's
file even when the deadline leaves no decode row time to run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.mark.slow
def test_exactness_phase_holds_on_cpu(benchmark_module) -> None:
    rows = benchmark_module("gpu_first").exactness("cpu", ("float32", "bfloat16"))
    assert len(rows) == 2 * len(benchmark_module("gpu_first").EXACTNESS_POLICIES)
    bad = [r for r in rows if r.get("same") is not True]
    assert not bad, bad


@pytest.mark.slow
def test_a_run_past_its_deadline_still_writes_every_phase(tmp_path: Path, monkeypatch, benchmark_module) -> None:
    first = benchmark_module("gpu_first")
    monkeypatch.setattr(first, "EXACTNESS_POLICIES", first.EXACTNESS_POLICIES[:1])
    assert first.main(["--tiny", "--device", "cpu", "--out", str(tmp_path), "--deadline", "0.001"]) == 0
    status = json.loads((tmp_path / "status.json").read_text())
    assert all(status[k].startswith("ok") for k in ("env", "exactness", "decode")), status
    assert json.loads((tmp_path / "env.json").read_text())["copy_bandwidth_bytes_per_s"] > 0
    rows = json.loads((tmp_path / "decode" / "results.json").read_text())["rows"]
    # (the decode phase gets at least a second: a row may start in it; the rest are recorded as not run)
    assert any(r.get("skipped", "").startswith("not run: past the") for r in rows)
    assert all("tokens_per_s" in r or r["skipped"].startswith("not run: past the") for r in rows), rows


def test_order_is_parsed_and_checked(benchmark_module) -> None:
    decode = benchmark_module("gpu_decode")
    assert decode.parse(["--order", "1x2048,8x32768c"]).order == [(1, 2048, False), (8, 32768, True)]
    with pytest.raises(SystemExit):
        decode.parse(["--order", "1x0"])
    with pytest.raises(ValueError, match="--deadline must be > 0"):
        benchmark_module("gpu_first").main(["--deadline", "0"])
