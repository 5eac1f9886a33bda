"""The `kvpolicy` command line, run in-process through `main(argv)`."""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from kvpolicy import BUZZ, available_policies, plan_policy  # noqa: E402
from kvpolicy_tools.cli import VERBS, main, synthetic_logits, synthetic_vectors  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, "not a PNG"
    assert data[12:16] == b"IHDR"
    assert data[-8:-4] == b"IEND", "truncated PNG"
    return struct.unpack(">II", data[16:24])


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# ---------------------------------------------------------------------------- policies
def test_policies_lists_every_registered_policy(capsys) -> None:
    rc, out, _ = run(capsys, "policies")
    assert rc == 0
    for name in available_policies():
        assert any(line.startswith(name + " ") for line in out.splitlines()), name
    assert "sink=4, window=64, stride=5, threshold=None" in out  # BUZZ defaults
    assert "heavy, recent, selection='per_head'" in out  # H2O: required parameters bare
    assert "log_n=True" in out  # the buzz_logn preset


def test_policies_json(capsys) -> None:
    rc, out, _ = run(capsys, "policies", "--json")
    rows = {r["name"]: r for r in json.loads(out)}
    assert rc == 0 and set(rows) == set(available_policies())
    params = {p["name"]: p for p in rows["h2o"]["params"]}
    assert params["heavy"]["required"] and not params["selection"]["required"]
    assert rows["buzz"]["budgets"] and rows["full"]["budgets"]


# ---------------------------------------------------------------------------- plan
def test_plan_prints_the_resolved_plan(capsys) -> None:
    rc, out, err = run(capsys, "plan", "buzz", "--budget", "0.3", "--context", "4096")
    assert rc == 0, err
    plan = plan_policy("buzz", 0.3, context_length=4096)
    assert str(plan) in out
    assert repr(plan.policy) in out
    assert f"capacity          {plan.capacity} tokens" in out


def test_plan_per_layer_budgets_over_the_layers(capsys) -> None:
    rc, out, err = run(capsys, "plan", "pyramid_h2o", "--budget", "0.5", "--context", "30", "--prompt", "20",
                       "--layers", "2", "--json")
    assert rc == 0, err
    d = json.loads(out)
    assert d["layers"] == 2
    assert d["realised_budget"] == plan_policy("pyramid_h2o", 0.5, context_length=30, prompt_length=20, layers=2).realised_budget


def test_plan_json_with_prompt_and_overrides(capsys) -> None:
    rc, out, err = run(
        capsys, "plan", "BUZZ", "--budget", "0.4", "--context", "2048", "--prompt", "512",
        "--set", "stride=4", "--set", "sink=2", "--json",
    )
    assert rc == 0, err
    d = json.loads(out)
    assert d["policy"] == "buzz" and d["params"]["stride"] == 4 and d["params"]["sink"] == 2
    assert d["prompt_length"] == 512 and abs(d["realised_budget"] - 0.4) <= 0.05


@pytest.mark.parametrize(
    "argv, message",
    [
        (["plan", "buzz", "--budget", "1.5", "--context", "100"], "budget must be in (0.0, 1.0]"),
        (["plan", "buzz", "--budget", "0", "--context", "100"], "budget must be in (0.0, 1.0]"),
        (["plan", "nope", "--context", "100"], "unknown policy 'nope'"),
        (["plan", "buzz", "--context", "0"], "context_length must be >= 1"),
        (["plan", "buzz", "--context", "100", "--set", "stride=2"], "stride must be >= 3"),
        (["plan", "buzz", "--context", "100", "--set", "strid=4"], "unknown parameter strid for policy 'buzz'"),
        (["plan", "buzz", "--context", "100", "--set", "stride"], "--set expects key=value"),
        (["plan", "full", "--budget", "0.5", "--context", "100"], "budget for the 'full' policy must be 1.0"),
        (["trace", "h2o", "--set", "heavy=0", "--set", "recent=2"], "heavy must be >= 1"),
        (["trace", "buzz", "--steps", "0"], "steps must be >= 1"),
        (["trace", "buzz", "--steps", "50", "--prompt", "50"], "prompt must be >= 0 and < steps"),
    ],
)
def test_library_errors_exit_2_without_traceback(capsys, argv, message) -> None:
    rc, out, err = run(capsys, *argv)
    assert rc == 2
    assert err.startswith("kvpolicy: error: ") and message in err
    assert "Traceback" not in err and out == ""


def test_usage_errors_exit_2(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["plan", "buzz"])  # --context is required
    assert exc.value.code == 2
    assert "--context" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2


def test_verbs_are_registered_in_one_place(capsys) -> None:
    names = [v.name for v in VERBS]
    assert names[:3] == ["policies", "plan", "trace"]  # later verbs (compare, bench) append
    assert len(set(names)) == len(names)
    for v in VERBS:
        assert v.run.__name__ == f"_cmd_{v.name}"
    # the parser offers exactly these verbs, in this order (argparse's own error lists its choices)
    with pytest.raises(SystemExit) as exc:
        main(["no-such-verb"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    choices = re.search(r"choose from (.*)\)", err)
    assert choices is not None, err
    assert re.findall(r"[a-z_]+", choices.group(1)) == names


# ---------------------------------------------------------------------------- trace
def test_trace_writes_a_png(capsys, tmp_path) -> None:
    out = tmp_path / "sub" / "trace.png"
    rc, text, err = run(capsys, "trace", "buzz", "--budget", "0.3", "--steps", "120", "--out", str(out))
    assert rc == 0, err
    assert out.exists() and 5_000 < out.stat().st_size < 2_000_000
    w, h = png_size(out)
    assert 400 <= w <= 3000 and 250 <= h <= 3000
    assert f"wrote {out}" in text and "BUZZ(" in text


def test_trace_one_panel_per_head(capsys, tmp_path) -> None:
    one, two = tmp_path / "one.png", tmp_path / "two.png"
    assert run(capsys, "trace", "h2o", "--steps", "80", "--out", str(one))[0] == 0
    assert run(capsys, "trace", "h2o", "--steps", "80", "--heads", "2", "--prompt", "20", "--out", str(two))[0] == 0
    (w1, h1), (w2, h2) = png_size(one), png_size(two)
    assert w1 == w2 and h2 > 1.6 * h1  # a second panel below the first


def test_trace_with_explicit_parameters_and_given_logits(capsys, tmp_path) -> None:
    logits = np.random.default_rng(0).normal(size=(60, 2, 60))
    path = tmp_path / "logits.npy"
    np.save(path, logits)
    out = tmp_path / "t.png"
    rc, text, err = run(
        capsys, "trace", "buzz", "--set", "sink=1", "--set", "window=4", "--set", "stride=3",
        "--set", "threshold=6", "--logits", str(path), "--out", str(out),
    )
    assert rc == 0, err
    assert "BUZZ(sink=1, window=4, stride=3, threshold=6)" in text
    assert png_size(out)[0] > 0
    # the evictions printed are the replay's
    from kvpolicy_numpy import replay

    n = len(replay(BUZZ(sink=1, window=4, stride=3, threshold=6), logits).evictions)
    assert f": {n} evictions" in text


def test_trace_2d_logits_and_bad_file(capsys, tmp_path) -> None:
    path = tmp_path / "l2.npy"
    np.save(path, np.zeros((30, 30)))
    rc, _, err = run(capsys, "trace", "local", "--set", "window=5", "--logits", str(path), "--out", str(tmp_path / "x.png"))
    assert rc == 0, err
    np.save(path, np.zeros((30, 29)))
    rc, _, err = run(capsys, "trace", "local", "--set", "window=5", "--logits", str(path), "--out", str(tmp_path / "y.png"))
    assert rc == 2 and "logits must have shape [steps, heads, steps]" in err
    rc, _, err = run(capsys, "trace", "local", "--logits", str(tmp_path / "missing.npy"))
    assert rc == 2 and "cannot read logits" in err



@pytest.mark.parametrize("name,prompt", [("knorm", 0), ("keydiff", 0), ("expected_attention", 40)])
def test_trace_runs_the_policies_that_score_from_keys(capsys, tmp_path, name, prompt) -> None:
    """Issue 44 class 12: `kvpolicy trace knorm` stopped with "pass keys=[steps, heads, head_dim]" (a
    Python argument). The trace supplies synthetic keys (and Expected Attention's queries and values),
    says so, and replays exactly what replay() gives with them."""
    from kvpolicy import make_policy
    from kvpolicy_numpy import replay

    out = tmp_path / "t.png"
    rc, text, err = run(capsys, "trace", name, "--steps", "120", "--heads", "2", "--prompt", str(prompt), "--seed", "3",
                        "--out", str(out))
    assert rc == 0, err
    assert png_size(out)[0] > 0 and "synthetic (seed 3; --keys" in text
    policy = make_policy(name, 0.3, context_length=120, prompt_length=prompt)
    keys, queries, values = synthetic_vectors(120, 2, seed=3)
    extra = {"queries": queries, "values": values} if name == "expected_attention" else {}
    trace = replay(policy, synthetic_logits(120, 2, seed=3), prompt, keys=keys, **extra)
    assert f"{policy!r}: {len(trace.evictions)} evictions" in text and trace.evictions


def test_trace_with_given_logits_reads_keys_from_a_file(capsys, tmp_path) -> None:
    """With --logits, the keys of a key-scoring policy come from --keys (refused by name without it);
    --keys for a policy that reads none is refused rather than ignored."""
    from kvpolicy import Knorm
    from kvpolicy_numpy import replay

    rng = np.random.default_rng(0)
    logits, keys = rng.normal(size=(60, 1, 60)), rng.normal(size=(60, 1, 8))
    np.save(tmp_path / "l.npy", logits)
    np.save(tmp_path / "k.npy", keys)
    base = ("trace", "knorm", "--set", "size=10", "--logits", str(tmp_path / "l.npy"), "--out", str(tmp_path / "t.png"))
    rc, _, err = run(capsys, *base)
    assert rc == 2 and "--keys: Knorm(size=10, recent=0) scores tokens from their keys; with --logits give --keys FILE.npy" in err
    rc, text, err = run(capsys, *base, "--keys", str(tmp_path / "k.npy"))
    assert rc == 0, err
    assert f": {len(replay(Knorm(size=10), logits, keys=keys).evictions)} evictions" in text and "synthetic" not in text
    rc, _, err = run(capsys, "trace", "h2o", "--keys", str(tmp_path / "k.npy"), "--out", str(tmp_path / "h.png"))
    assert rc == 2 and "--keys: H2O(heavy=16, recent=16) does not read keys" in err


def test_synthetic_logits_have_heavy_hitters_and_recency() -> None:
    logits = synthetic_logits(200, heads=2, seed=1)
    assert logits.shape == (200, 2, 200)
    col_mean = logits[100:, 0, :100].mean(axis=0)
    assert col_mean.argmax() == 0  # the sink column
    assert logits[150, 0, 140:150].mean() > logits[150, 0, 50:60].mean()  # recency
    assert not np.array_equal(logits[:, 0], logits[:, 1])
    np.testing.assert_array_equal(logits, synthetic_logits(200, heads=2, seed=1))


# ---------------------------------------------------------------------------- entry points
def test_python_dash_m(tmp_path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "integrations")])}
    res = subprocess.run(
        [sys.executable, "-m", "kvpolicy", "plan", "h2o", "--budget", "0.25", "--context", "1024"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert "H2O(heavy=68, recent=68)" in res.stdout
    res = subprocess.run(
        [sys.executable, "-m", "kvpolicy", "plan", "h2o", "--budget", "2", "--context", "1024"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )
    assert res.returncode == 2 and res.stderr.startswith("kvpolicy: error: budget must be in")


def test_console_script_is_declared() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    assert 'kvpolicy = "kvpolicy_tools.cli:main"' in text


def test_plan_threshold_ratio(capsys) -> None:
    rc, out, _ = run(capsys, "plan", "buzz", "--budget", "0.3", "--context", "2048", "--threshold-ratio", "2.5", "--json")
    plan = json.loads(out)
    assert rc == 0 and plan["threshold_ratio"] == 2.5
    assert plan["params"]["threshold"] == round(2.5 * plan["params"]["window"])
    rc, _, err = run(capsys, "plan", "h2o", "--budget", "0.3", "--context", "2048", "--threshold-ratio", "2.5")
    assert rc == 2 and "applies to BUZZ" in err
    rc, _, err = run(capsys, "plan", "buzz", "--budget", "0.3", "--context", "2048", "--threshold-ratio", "-1")
    assert rc == 2 and "threshold_ratio must be in" in err
