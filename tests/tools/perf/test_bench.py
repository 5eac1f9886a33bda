"""kvpolicy_tools/perf/bench.py (``kvpolicy bench``): third-party policies by ``module:name`` and the
whole command, quick, on a tiny model."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvpolicy import LocalWindow, StreamingLLM  # noqa: E402
from kvpolicy_tools.perf.eviction import POLICIES  # noqa: E402


class HalfWindow(StreamingLLM):
    """A third-party policy for ``kvpolicy bench --policy test_bench:HalfWindow``."""

    name = "half_window_test"


def make_local(budget, context_length, prompt_length):
    return LocalWindow(window=max(1, int(budget * context_length)))


def test_bench_resolves_third_party_policies() -> None:
    from kvpolicy_tools.perf.bench import resolve_policy

    spec = resolve_policy("test_bench:HalfWindow")
    assert spec.budgeted and isinstance(spec.planner(0.25, 400, 300), HalfWindow)
    spec = resolve_policy("test_bench:make_local")
    assert spec.planner(0.25, 400, 300) == LocalWindow(100)
    with pytest.raises(ValueError, match="no attribute"):
        resolve_policy("test_bench:Nope")
    with pytest.raises(ValueError, match="cannot import"):
        resolve_policy("no_such_module_xyz:Thing")


def test_bench_command_quick_on_a_tiny_model(tmp_path) -> None:
    from kvpolicy_tools.perf.bench import main

    out = tmp_path / "bench"
    status = main([
        "--quick", "--out", str(out), "--no-progress", "--sizes", "64,128,256", "--rounds", "1",
        "--model", "tiny-llama", "--contexts", "48,96", "--steps", "2", "--decode-rounds", "2",
        "--policy", "buzz", "--policy", "test_bench:make_local",
    ])
    assert status == 0
    report = (out / "report.md").read_text()
    for needle in ("Log-log slopes", "DynamicCache", "BUZZ 25%", "make_local 25%", "capture only (unfused)", "Breakdown"):
        assert needle in report, needle
    data = json.loads((out / "results.json").read_text())
    assert {r["policy"] for r in data["complexity"]["rows"]} == set(POLICIES)
    assert {r["context"] for r in data["decode"]["results"]} == {48, 96}
    assert sorted(p.name for p in out.glob("*.png")) == ["breakdown_48.png", "breakdown_96.png", "complexity_b1_h8.png", "decode.png"]


def test_bench_progress_bar_ends_at_its_total(tmp_path, capsys) -> None:
    """The progress bar's total counts every timed block (the limit of each budget included), so a
    run ends at 100%, not past its total."""
    import re

    from kvpolicy_tools.perf.bench import main

    assert main([
        "--what", "decode", "--out", str(tmp_path), "--model", "tiny-llama", "--contexts", "48", "--steps", "1",
        "--decode-rounds", "2", "--budgets", "0.25,0.5", "--policy", "h2o", "--policy", "buzz", "--no-unfused",
    ]) == 0
    err = capsys.readouterr().err
    counts = re.findall(r"(\d+)/(\d+) \[", err)
    assert counts, "no progress bar drawn"
    done, total = counts[-1]
    # 1 prefill + 2 rounds x (DynamicCache, FullCache, capture only, 2 limits, 2 policies x 2 budgets)
    assert int(done) == int(total) == 1 + 2 * 9
    # the postfix says which round is timed (every candidate reports at a round's end)
    assert "decode 48: round 2/2" in err

    # with the unfused rows and the breakdown (H2O alone: one unfused row, not the two a BUZZ run has)
    assert main([
        "--what", "decode,breakdown", "--out", str(tmp_path / "b"), "--model", "tiny-llama", "--contexts", "48",
        "--steps", "1", "--decode-rounds", "2", "--budgets", "0.25", "--policy", "h2o",
    ]) == 0
    done, total = re.findall(r"(\d+)/(\d+) \[", capsys.readouterr().err)[-1]
    # 1 prefill + 2 rounds x 6 (DynamicCache, FullCache, capture only and its unfused row, the limit,
    # H2O) + the breakdown's 2 rounds x the same 6
    assert int(done) == int(total) == 1 + 2 * 6 + 2 * 6


# a complexity run small enough to finish in a second where a flag value was dropped (before issue 44)
_TINY = ["--what", "complexity", "--sizes", "64", "--configs", "1x1", "--rounds", "1", "--backends", "numpy", "--no-plots",
         "--no-progress"]


@pytest.mark.parametrize("argv,message", [
    (["--threads", "0"], "--threads must be >= 1, got 0"),
    (["--threads", "-1"], "--threads must be >= 1, got -1"),
    (["--configs", "1x0"], "--configs: batch and KV heads must be >= 1, got '1x0'"),
    (["--contexts", "0", "--what", "decode"], "--contexts values must be >= 1, got 0"),
    (["--sizes", ""], "--sizes is empty"),
    (["--sizes", "8"], "--sizes values must be >= 16, got 8"),
    (["--what", ","], "--what takes complexity, decode, breakdown, prefill; got ','"),
    (["--backends", "cuda"], "--backends takes torch, numpy; got 'cuda'"),
    (["--contexts", "48", "--breakdown-contexts", "64", "--what", "breakdown"], "--breakdown-contexts 64 is not among --contexts (48)"),
], ids=["threads 0", "threads -1", "configs 1x0", "contexts 0", "sizes empty", "sizes 8", "what empty", "backends cuda",
        "breakdown context not run"])
def test_bench_refuses_flag_values_it_would_drop_or_pass_on_raw(tmp_path, capsys, argv, message) -> None:
    """Issue 44 classes 6 and 12: `--threads 0` was ignored, `--threads -1` a raw torch error,
    `--configs 1x0` a NumPy concatenation error, `--contexts 0` blamed the budget; an empty value ran
    the defaults. Each is refused naming the flag."""
    from kvpolicy_tools.perf.bench import main

    assert main([*_TINY, "--out", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvpolicy bench: error: ") and message in err, err


def test_bench_complexity_times_a_registered_policy_outside_its_table(tmp_path) -> None:
    """Issue 44 class 6: `bench --what complexity --policy knorm` measured the built-ins and dropped
    knorm; a registered name outside the built-ins' table is timed like a package.module:Factory."""
    from kvpolicy_tools.perf.bench import main

    assert "knorm" not in POLICIES
    assert main([*_TINY, "--sizes", "64,128", "--out", str(tmp_path), "--policy", "knorm", "--policy", "h2o"]) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    timed, = data["policy_complexity"]  # knorm; h2o is in the main table
    assert timed["spec"] == "knorm" and {r["size"] for r in timed["rows"]} == {64, 128}
    assert {r["policy"] for r in data["complexity"]["rows"]} == set(POLICIES)
    assert "### `knorm` (Knorm)" in (tmp_path / "report.md").read_text()


def test_decoding_policy_names_are_the_registered_policies_that_evict_during_decode() -> None:
    """``--policy all``: every registered name whose planned policy is bounded; left out only the full
    cache, the prompt-only compressions and the generic names that need a scorer or base."""
    from kvpolicy.registry import available_policies
    from kvpolicy_tools.perf.bench import decoding_policy_names

    names = decoding_policy_names()
    left_out = set(available_policies()) - set(names)
    assert left_out == {"full", "snapkv", "pyramidkv", "adakv_snapkv", "kvzip", "kvzip_headwise", "chunkkv", "adakv", "compose",
                        "pyramid"}  # (chunkkv: over SnapKV)
    for name in ("expected_attention", "adakv_expected_attention", "knorm", "keydiff", "scissorhands", "tova", "h2o",
                 "streaming_llm", "local", "buzz", "snapkv_h2o", "pyramid_h2o", "adakv_h2o", "adakv_keydiff",
                 "lagkv", "critical_kv", "critical_expected_attention", "critical_adakv_expected_attention"):
        assert name in names, name


def test_bench_policy_all_measures_every_decoding_policy(tmp_path) -> None:
    """``kvpolicy bench --what decode --policy all`` on the tiny random-weight model (2 layers, one
    step): a row for every registered policy that evicts during decode, Expected Attention
    included (it scores from the queries' moments, which a loaded prefill does not observe: the
    bench gives it placeholder queries), each with a share of its limit, holding fewer than the prompt."""
    from kvpolicy_tools.perf.bench import decoding_policy_names, main

    assert main([
        "--what", "decode", "--out", str(tmp_path), "--model", "tiny-llama", "--contexts", "48", "--steps", "1",
        "--decode-rounds", "1", "--budgets", "0.25", "--policy", "all", "--policy", "h2o", "--no-unfused",
        "--no-progress", "--no-plots",
    ]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["decode"]["results"]
    measured = {r["label"].rsplit(" ", 1)[0]: r for r in rows if r.get("budget") is not None and not r["label"].startswith("limit")}
    from kvpolicy_tools.eval.display import policy_name

    assert set(measured) == {policy_name(n) for n in decoding_policy_names()}  # (h2o named twice: measured once)
    for label, row in measured.items():  # timed against its own limit (BUZZ evicts every stride: none in one step)
        assert row["share_of_limit"] > 0 and row["kept"] < 48, label
