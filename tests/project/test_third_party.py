"""A third-party policy package (examples/third_party_policy), installed into a temporary folder
(not into .venv), is found by `kvpolicy policies` through its entry point, passes the kit's
contract through its own one-test file (the `kvpolicy_contract` fixture from kvpolicy's pytest
plugin), and is timed by `kvpolicy bench --policy package.module:Factory`. Offline: pip builds it
with the environment's own setuptools (no build isolation, no index)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "third_party_policy"


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """``(site, env, source)``: the package installed with ``pip --target site``; ``env`` puts
    ``site`` on PYTHONPATH; ``source`` is the copy it was built from (its tests included)."""
    base = tmp_path_factory.mktemp("third_party")
    source = base / "src"
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", ".hypothesis"))
    site = base / "site"
    res = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "-q", "--target", str(site), str(source)],
        capture_output=True, text=True, timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert (site / "kvpolicy_sink_h2o" / "policy.py").exists()
    env = {**os.environ, "PYTHONPATH": str(site)}
    env.pop("PYTHONSTARTUP", None)
    return site, env, source


def run(args: list[str], env: dict, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def test_kvpolicy_policies_finds_it_through_the_entry_point(installed, tmp_path) -> None:
    site, env, _ = installed
    res = run(["-m", "kvpolicy", "policies", "--json"], env, tmp_path)
    assert res.returncode == 0, res.stderr
    rows = {r["name"]: r for r in json.loads(res.stdout)}
    assert rows["sink_h2o"]["class"] == "kvpolicy_sink_h2o.policy.SinkH2O"
    assert [p["name"] for p in rows["sink_h2o"]["params"]] == ["sink", "heavy", "recent", "selection"]
    assert rows["sink_h2o"]["budgets"]  # it has from_size, so budgets plan it
    plan = run(["-m", "kvpolicy", "plan", "sink_h2o", "--budget", "0.3", "--context", "1024"], env, tmp_path)
    assert plan.returncode == 0 and "SinkH2O(" in plan.stdout, plan.stderr
    # .venv itself is untouched: without the folder on the path the policy is unknown
    bare = run(["-m", "kvpolicy", "policies"], {k: v for k, v in env.items() if k != "PYTHONPATH"}, tmp_path)
    assert bare.returncode == 0 and "sink_h2o" not in bare.stdout


def test_its_one_test_file_runs_the_whole_contract(installed) -> None:
    site, env, source = installed
    where = run(["-c", "import kvpolicy_sink_h2o; print(kvpolicy_sink_h2o.__file__)"], env, source)
    assert where.stdout.strip().startswith(str(site)), where.stdout  # the installed copy, not the source
    res = run(["-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "tests/test_sink_h2o.py"], env, source)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert "5 passed" in res.stdout, res.stdout
    collected = run(["-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests/test_sink_h2o.py"], env, source)
    for prop in ("replay", "sizes", "full_cache", "backends", "stateful"):
        assert f"test_sink_h2o_keeps_the_kvpolicy_contract[contract-{prop}]" in collected.stdout


def test_kvpolicy_bench_times_it(installed, tmp_path) -> None:
    _, env, _ = installed
    out = tmp_path / "bench"
    res = run(
        ["-m", "kvpolicy", "bench", "--policy", "kvpolicy_sink_h2o:SinkH2O", "--what", "complexity",
         "--sizes", "64,128,256", "--rounds", "1", "--configs", "1x4", "--out", str(out)],
        env, tmp_path,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "step/s" in res.stderr or "it/s" in res.stderr or "%|" in res.stderr  # the progress bar
    report = (out / "report.md").read_text()
    assert "kvpolicy_sink_h2o:SinkH2O" in report and "one eviction k" in report
    data = json.loads((out / "results.json").read_text())
    (entry,) = data["policy_complexity"]
    assert {r["backend"] for r in entry["rows"]} >= {"numpy"}
    assert sorted({r["size"] for r in entry["rows"]}) == [64, 128, 256]
    png = out / "complexity_SinkH2O.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
