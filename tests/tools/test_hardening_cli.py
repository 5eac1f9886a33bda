"""Issue 28, the ``kvpolicy`` command and its data loaders: no Python traceback for a bad flag,
path, device, model name or data file; ``kvpolicy: error: ...`` (naming the file and line where a
data file is at fault) and exit status 2."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from kvpolicy_tools.cli import main  # noqa: E402
from kvpolicy_tools.eval import data as D  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def run(capsys, *argv: str) -> tuple[int, str]:
    rc = main(list(argv))
    err = capsys.readouterr().err
    return rc, err


def refused(capsys, *argv: str) -> str:
    """The command's one-line error (status 2), which must not be a traceback."""
    rc, err = run(capsys, *argv)
    assert rc == 2, err
    assert err.startswith("kvpolicy: error: ") and "Traceback" not in err, err
    return err


# ---------------------------------------------------------------------------- flags and paths
def test_trace_out_where_nothing_can_be_written(capsys, tmp_path) -> None:
    err = refused(capsys, "trace", "buzz", "--steps", "40", "--out", "/proc/x.png")
    assert "--out /proc/x.png: cannot write there" in err


def test_trace_out_below_a_file(capsys, tmp_path) -> None:
    (tmp_path / "file").write_text("x")
    err = refused(capsys, "trace", "buzz", "--steps", "40", "--out", str(tmp_path / "file" / "t.png"))
    assert f"{tmp_path / 'file'} is a file, not a folder" in err


def test_trace_out_is_a_folder(capsys, tmp_path) -> None:
    err = refused(capsys, "trace", "buzz", "--steps", "40", "--out", str(tmp_path))
    assert "is a folder; give a file name" in err
    rc, err = run(capsys, "trace", "buzz", "--steps", "120", "--out", str(tmp_path / "new" / "t.png"))
    assert rc == 0 and (tmp_path / "new" / "t.png").is_file(), err



def test_trace_out_without_a_suffix_writes_the_path_it_reports(capsys, tmp_path) -> None:
    """Issue 44 class 17: `trace --out noext` printed "wrote noext" and wrote noext.png. The path given
    is the path written (a PNG), and a suffix matplotlib cannot write is refused before the replay."""
    out = tmp_path / "noext"
    rc, err = run(capsys, "trace", "buzz", "--out", str(out))
    assert rc == 0, err
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not (tmp_path / "noext.png").exists()
    rc, err = run(capsys, "trace", "buzz", "--out", str(tmp_path / "t.svg"))
    assert rc == 0 and (tmp_path / "t.svg").read_text().lstrip().startswith("<?xml"), err
    err = refused(capsys, "trace", "buzz", "--out", str(tmp_path / "t.foo"))
    assert f"--out {tmp_path / 't.foo'}: matplotlib writes no .foo images; use one of " in err and "png" in err


def test_compare_out_where_nothing_can_be_written(capsys) -> None:
    """Refused before the model is loaded, not after the whole run."""
    err = refused(capsys, "compare", "--out", "/proc/report", "--no-progress")
    assert "--out /proc/report: cannot write there" in err and "loading" not in err


def test_compare_device_gpu(capsys) -> None:
    err = refused(capsys, "compare", "--device", "gpu", "--no-progress")
    assert "--device 'gpu' is not a torch device: use cpu, cuda" in err


def test_compare_device_cuda_without_cuda(capsys) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    err = refused(capsys, "compare", "--device", "cuda", "--no-progress")
    assert "--device 'cuda'" in err and ("without CUDA" in err or "no CUDA GPU is visible" in err)


def test_compare_data_dir_empty_folder(capsys, tmp_path) -> None:
    err = refused(capsys, "compare", "--data-dir", str(tmp_path), "--no-progress")
    assert f"--data-dir {tmp_path} holds none of the paper's files" in err


def test_compare_model_that_does_not_exist(tmp_path) -> None:
    """Through a real process: what the user sees, offline (so the hub answers at once)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "integrations")])}
    proc = subprocess.run(
        [sys.executable, "-m", "kvpolicy", "compare", "--model", str(tmp_path / "no-such-model"), "--tasks", "ppl",
         "--no-progress", "--out", str(tmp_path / "report")],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert f"kvpolicy: error: model '{tmp_path / 'no-such-model'}' not found" in proc.stderr


# ---------------------------------------------------------------------------- data files
def lines(*records: object) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def test_a_record_missing_a_key_names_file_and_line(tmp_path) -> None:
    p = tmp_path / "xsum_0shot.jsonl"
    p.write_text(lines({"article": "a", "summary_gt": "b"}) + "\n" + lines({"article": "c"}))
    with pytest.raises(ValueError, match=rf"^{p}:3: the record lacks 'article'/'summary_gt'"):
        D.load_xsum(p)


def test_a_kv_record_missing_a_key_names_file_and_line(tmp_path) -> None:
    p = tmp_path / "kv.jsonl"
    p.write_text(lines({"ordered_kv_records": [["k", "v"]], "key": "k", "value": "v"}, {"ordered_kv_records": [["k", "v"]]}))
    with pytest.raises(ValueError, match=rf"^{p}:2: the record has no 'key' key"):
        D.load_kv_retrieval(p)


def test_a_qa_record_of_the_wrong_structure_names_file_and_line(tmp_path) -> None:
    p = tmp_path / "nq.jsonl"
    p.write_text(lines({"question": "q", "answers": "Paris", "ctxs": [{"text": "t", "isgold": True}]}))
    with pytest.raises(ValueError, match=rf"^{p}:1: 'answers' must be a list of strings"):
        D.load_nq_multidoc(p, n_docs=1, gold_positions=(0,))


def test_trace_logits_of_the_wrong_shape(capsys, tmp_path) -> None:
    path = tmp_path / "four.npy"
    np.save(path, np.zeros((5, 2, 3, 4)))
    err = refused(capsys, "trace", "h2o", "--logits", str(path), "--out", str(tmp_path / "t.png"))
    assert "four.npy" in err and "logits must have shape [steps, heads, steps]" in err and "got (5, 2, 3, 4)" in err


def test_a_folder_where_a_data_file_belongs(tmp_path) -> None:
    with pytest.raises(IsADirectoryError, match=rf"XSum jsonl: {tmp_path} is a folder, not a file"):
        D.load_xsum(tmp_path)


@pytest.mark.parametrize("text", ["", "\n  \n"], ids=["empty", "blank"])
def test_a_data_file_without_records(tmp_path, text: str) -> None:
    p = tmp_path / "xsum_0shot.jsonl"
    p.write_text(text)
    with pytest.raises(ValueError, match=rf"^{p}: no records"):
        D.load_xsum(p)


def test_a_kv_pair_of_three_values_names_file_and_line(tmp_path) -> None:
    p = tmp_path / "kv.jsonl"
    p.write_text(lines({"ordered_kv_records": [["k", "v"]], "key": "k", "value": "v"},
                       {"ordered_kv_records": [["k", "v", "w"]], "key": "k", "value": "v"}))
    with pytest.raises(ValueError, match=rf"^{p}:2: the record does not have the expected structure"):
        D.load_kv_retrieval(p)


def test_a_gold_position_outside_the_documents_names_gold_positions(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"gold_positions: gold position 12 is outside \[0, n_docs=10\)"):
        D.load_nq_multidoc(tmp_path / "unused.jsonl", gold_positions=(12,))


def test_a_json_array_where_an_object_belongs(tmp_path) -> None:
    p = tmp_path / "x.jsonl"
    p.write_text(lines({"a": 1}, [1, 2]))
    with pytest.raises(ValueError, match=rf"^{p}:2: expected one JSON object \({{\.\.\.}}\) per line, got a JSON array"):
        list(D.read_jsonl(p))


@pytest.mark.parametrize("damage", ["corrupt", "truncated"])
def test_a_damaged_gz(tmp_path, damage: str) -> None:
    p = tmp_path / "x.jsonl.gz"
    data = gzip.compress(lines(*({"i": i, "text": "word " * 50} for i in range(200))).encode())
    if damage == "truncated":
        data = data[: len(data) // 2]
    else:
        data = data[:20] + bytes(b ^ 0xFF for b in data[20:60]) + data[60:]
    p.write_bytes(data)
    with pytest.raises(ValueError, match=rf"^{p}:\d+: corrupt or truncated gzip data"):
        list(D.read_jsonl(p))


def test_non_utf8_bytes_in_a_jsonl(tmp_path) -> None:
    p = tmp_path / "x.jsonl"
    p.write_bytes(lines({"a": 1}).encode() + b'{"a": "\xff"}\n')
    with pytest.raises(ValueError, match=rf"^{p}:2: not UTF-8 text \(byte 0xff at column 8\)"):
        list(D.read_jsonl(p))


def test_non_utf8_bytes_in_wikitext(tmp_path) -> None:
    p = tmp_path / "wikitext-2-raw-test.txt"
    p.write_bytes(b" = Title = \n\n Some text .\n bad \xc3 byte\n")
    with pytest.raises(ValueError, match=rf"^{p}:4: not UTF-8 text"):
        D.load_wikitext(p)


@pytest.mark.slow
def test_compare_with_a_malformed_data_file_prints_file_and_line(tmp_path) -> None:
    """End to end (loads the embedded model): the user sees the file and line, no traceback."""
    (tmp_path / "xsum_0shot.jsonl").write_text(lines({"article": "a b c", "summary_gt": "x"}, ["not", "an", "object"]))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "integrations")])}
    proc = subprocess.run(
        [sys.executable, "-m", "kvpolicy", "compare", "--data-dir", str(tmp_path), "--tasks", "summ", "--no-progress",
         "--out", str(tmp_path / "report")],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"kvpolicy: error: {tmp_path / 'xsum_0shot.jsonl'}:2: expected one JSON object" in proc.stderr


# ---------------------------------------------------------------------------- issue 44: values that vanish
@pytest.mark.parametrize("argv,message", [
    (["--compression-ratios", ""], "--compression-ratios '' names no ratio: give ratios in (0, 1)"),
    (["--compression-ratios", "none"], "--compression-ratios 'none' names no ratio"),
    (["--budgets", ""], "--budgets '' is empty: give budgets in (0, 1)"),
    (["--samples", "neddle=4"], "--samples: 'neddle' in 'neddle=4' is not a task; tasks: kv, needle, "),
    (["--samples", "ppl=2,sum=3"], "--samples: 'sum' in 'ppl=2,sum=3' is not a task"),
    (["--max-new-tokens", "sumary=8"], "--max-new-tokens: 'sumary' in 'sumary=8' is not a task"),
    (["--context", ","], "--context is empty: give N or TASK=N"),
    (["--threads", "0"], "--threads must be >= 1, got 0"),
], ids=["ratios empty", "ratios none", "budgets empty", "samples misspelt", "samples one misspelt", "new tokens misspelt",
        "context empty", "threads 0"])
def test_compare_refuses_a_value_that_would_vanish(capsys, tmp_path, argv, message) -> None:
    """Issue 44 class 6: `compare --compression-ratios ''` ran no cell and exited 0; a misspelt task in
    `--samples task=N` was ignored. Each is refused naming the flag, before the model loads (the model
    named here does not exist: reaching it would be another error)."""
    err = refused(capsys, "compare", "--model", str(tmp_path / "no-model"), "--no-progress", "--out", str(tmp_path / "r"), *argv)
    assert message in err and "loading" not in err, err


# ---------------------------------------------------------------------------- issue 44: the re-probe's new inputs
@pytest.mark.parametrize("argv,message", [
    (["--tasks", ","], "--tasks names no task (','); leave it out for the default set"),
    (["--tasks", "needle", "--needle-depths=-0.5,1.5"], "--needle-depths must be in [0, 1] (a fraction of the haystack), got -0.5, 1.5"),
    (["--tasks", "needle", "--needle-lengths", "0"], "--needle-lengths must be >= 1 token, got 0"),
    (["--tasks", "kv", "--kv-pairs", "0"], "--kv-pairs must be >= 1 (the gold pair included), got 0"),
    (["--tasks", "ppl", "--cache-sizes", "0", "--budgets", "none"], "--cache-sizes must be >= 1 token, got 0"),
    (["--tasks", "stream", "--cache-sizes", "-5"], "--cache-sizes must be >= 1 token, got -5"),
], ids=["tasks empty", "needle depths outside", "needle length 0", "kv pairs 0", "ppl cache size 0", "stream cache size -5"])
def test_compare_refuses_values_found_by_the_re_probe(capsys, tmp_path, argv, message) -> None:
    """Issue 44's re-probe: `--tasks ,` exited 0 with an empty report; `--needle-depths=-0.5,1.5` put
    the needle at 50% and at the end under labels -50% and 150%; `--kv-pairs 0` ran all 75 pairs;
    `--cache-sizes 0` blamed the budget after the model loaded. Each is refused naming the flag,
    before the model loads (the model named here does not exist)."""
    if "kv" in argv:  # (the kv task needs its data folder before it reads its flags)
        from eval_files import shared

        argv = ["--data-dir", str(shared("kv-retrieval-75_keys.jsonl.gz").parent), *argv]
    err = refused(capsys, "compare", "--model", str(tmp_path / "no-model"), "--no-progress", "--out", str(tmp_path / "r"), *argv)
    assert message in err and "loading" not in err, err


def test_trace_refuses_steps_or_heads_beside_logits(capsys, tmp_path) -> None:
    """Issue 44's re-probe: `trace --logits L.npy --steps 50` replayed the logits' 30 steps without a word."""
    path = tmp_path / "L.npy"
    np.save(path, np.zeros((30, 2, 30)))
    err = refused(capsys, "trace", "h2o", "--logits", str(path), "--steps", "50", "--out", str(tmp_path / "t.png"))
    assert "--steps 50: --logits gives the steps and heads (its shape); leave them out" in err, err


def test_bench_complexity_refuses_a_policy_scoring_from_queries(tmp_path) -> None:
    """Issue 44's re-probe: `bench --what complexity --policy expected_attention` was a raw
    RuntimeError traceback from the backend; it is refused by name, pointing to --what decode."""
    from kvpolicy_tools.perf.bench import main as bench

    assert bench(["--what", "complexity", "--sizes", "64", "--configs", "1x1", "--rounds", "1", "--backends", "numpy",
                  "--no-plots", "--no-progress", "--out", str(tmp_path), "--policy", "expected_attention"]) == 2


def test_plan_set_hands_an_adakv_presets_scorer_its_parameters(capsys) -> None:
    """Issue 44's re-probe: `plan adakv_tova --set recent=2` was refused as an unknown parameter
    while make_policy("adakv_tova", ..., recent=2) plans it (the scorer's); a parameter the scorer
    does not take either is still refused by name."""
    rc, _ = run(capsys, "plan", "adakv_tova", "--context", "100", "--budget", "0.3", "--set", "recent=2")
    assert rc == 0
    err = refused(capsys, "plan", "adakv_tova", "--context", "100", "--budget", "0.3", "--set", "bogus=2")
    assert "unknown parameter bogus for TOVA" in err, err
