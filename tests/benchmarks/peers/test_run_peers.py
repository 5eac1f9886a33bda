"""The peer benchmark driver (benchmarks/peers/run_peers.py): skips cleanly without kvpress, and
its kvpolicy side runs on a tiny model (no kvpress needed). With the kvpress venv present
(benchmarks/peers/setup_kvpress.sh), a slow test also runs kvpress's side on the tiny model."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[3]
DRIVER = ROOT / "benchmarks" / "peers" / "run_peers.py"


@pytest.fixture(scope="module")
def run_peers():
    spec = importlib.util.spec_from_file_location("run_peers", DRIVER)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def test_skips_cleanly_without_the_kvpress_venv(run_peers, tmp_path, capsys):
    out = tmp_path / "out"
    code = run_peers.main(["--kvpress-venv", str(tmp_path / "no-venv"), "--out", str(out), "--contexts", "32"])
    assert code == 0
    assert "skipped" in capsys.readouterr().err
    assert not out.exists()  # nothing measured, nothing written, no model loaded


@pytest.mark.parametrize("flag", [["--steps", "0"], ["--rounds", "0"], ["--budget", "1.0"], ["--contexts", "4"]])
def test_bad_arguments_are_refused(run_peers, tmp_path, flag):
    with pytest.raises(SystemExit) as exc:
        run_peers.main([*flag, "--ours-only", "--out", str(tmp_path)])
    assert exc.value.code == 2


def _rows(out: Path) -> tuple[dict, dict]:
    report = json.loads((out / "peers.json").read_text())
    (ctx,) = report["contexts"]
    return report, {(r["side"], r["label"]): r for r in ctx["rows"]}


def test_our_side_on_a_tiny_model(run_peers, tmp_path):
    out = tmp_path / "out"
    steps, rounds, warmup = 2, 2, 2
    code = run_peers.main([
        "--model", "tiny", "--contexts", "32", "--steps", str(steps), "--rounds", str(rounds),
        "--warmup", str(warmup), "--ours-only", "--out", str(out),
    ])
    assert code == 0
    report, rows = _rows(out)
    labels = [label for side, label in rows if side == "kvpolicy"]
    assert labels == ["DynamicCache", "limit 25%", "StreamingLLM 25%", "H2O 25%", "Local window 25%", "BUZZ 25%"]
    assert not any(side == "kvpress" for side, _ in rows)
    decoded = warmup + steps * rounds
    assert report["contexts"][0]["decode_tokens"] == decoded
    dyn, limit = rows["kvpolicy", "DynamicCache"], rows["kvpolicy", "limit 25%"]
    assert (dyn["kept_after_prefill"], dyn["kept_at_end"]) == (32, 32 + decoded)
    assert (limit["kept_after_prefill"], limit["kept_at_end"]) == (8, 8 + decoded)
    assert dyn["ratio_vs_dynamic"] == 1.0 and limit["share_of_limit"] == 1.0
    for side, label in rows:
        r = rows[side, label]
        assert len(r["ms_per_round"]) == rounds and all(ms > 0 for ms in r["ms_per_round"])
        if r["capacity"] is not None:  # the policies: evicted at the prefill and held to capacity
            assert 0 < r["kept_after_prefill"] <= r["capacity"] < 32 and r["kept_at_end"] <= r["capacity"]
    table = (out / "peers.md").read_text()
    assert "| kvpolicy | BUZZ 25% |" in table and "32-token prompt" in table
    prompt = json.loads((out / "prompt-32.json").read_text())  # what the kvpress side would read
    assert len(prompt) == 32 and all(0 <= t < 128 for t in prompt)  # tiny_llama's vocabulary


@pytest.mark.slow
def test_both_sides_on_a_tiny_model(run_peers, tmp_path):
    if run_peers.kvpress_python(run_peers.DEFAULT_VENV) is None:
        pytest.skip(f"no kvpress venv at {run_peers.DEFAULT_VENV} (benchmarks/peers/setup_kvpress.sh)")
    out = tmp_path / "out"
    code = run_peers.main([
        "--model", "tiny", "--contexts", "32", "--steps", "4", "--rounds", "2", "--interval", "4", "--out", str(out),
    ])
    assert code == 0
    report, rows = _rows(out)
    assert "kvpress 0.5.5" in report["kvpress_versions"]
    theirs = {label: rows[side, label] for side, label in rows if side == "kvpress"}
    assert set(theirs) == {"DynamicCache", "StreamingLLMPress", "KnormPress"}
    assert theirs["DynamicCache"]["kept_after_prefill"] == 32
    for press in ("StreamingLLMPress", "KnormPress"):
        # 25% kept at the prefill; the DecodingPress (interval 4) brings it back to 8 every 4 steps
        assert theirs[press]["kept_after_prefill"] == 8
        assert 8 <= theirs[press]["kept_at_end"] < 8 + 4
