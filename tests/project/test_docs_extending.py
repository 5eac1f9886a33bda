"""The examples of docs/extending.md run as written, and the policy they define is correct."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

DOC = Path(__file__).resolve().parents[2] / "docs" / "extending.md"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def test_extending_examples_run(capsys):
    namespace: dict = {}
    for block in _blocks():
        exec(compile(block, str(DOC), "exec"), namespace)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "[ 0 33 35 36 37 38 39]"
    assert out[1].startswith("EveryKth(")
    policy = namespace["policy"]
    trace = namespace["trace"]
    # independent check of the rule, step by step with Python lists
    cache: list[int] = []
    for t, kept in enumerate(trace.kept):
        cache.append(t)
        while len(cache) - 4 >= 5:  # window 4, limit 5
            cache = cache[: len(cache) - 4][::3] + cache[len(cache) - 4 :]
        assert kept[0].tolist() == cache and kept[1].tolist() == cache
        assert len(cache) <= policy.capacity - 1
    # the conformance-kit section: check_policy passed every property, benchmark_policy timed it
    assert out[2] == "['replay', 'sizes', 'full_cache', 'backends', 'stateful']"
    assert namespace["report"].passed == ["replay", "sizes", "full_cache", "backends", "stateful"]
    result = namespace["result"]
    assert [r["cache_size"] for r in result.rows] == [64, 128, 256, 512]  # from_size(size) evicts at size
    assert "one eviction k" in "\n".join(out[3:])
    assert np.isfinite(namespace["k"])  # a fitted slope (its value is timing: not asserted)
    # the torch-backend section: 16 kept per layer, one group search per step from step 16 on
    assert out[-1] == "[16, 16, 16, 16] 24"


def test_extending_policy_runs_on_torch_backend():
    import pytest

    torch = pytest.importorskip("torch")
    import kvpolicy_numpy
    import kvpolicy_torch

    namespace: dict = {}
    exec(compile(_blocks()[0], str(DOC), "exec"), namespace)
    policy = namespace["EveryKth"](k=3, window=4, limit=5)
    logits = np.random.default_rng(1).normal(size=(50, 3, 50))
    a = kvpolicy_numpy.replay(policy, logits, prompt_len=20)
    b = kvpolicy_torch.replay(policy, torch.as_tensor(logits), prompt_len=20)
    for x, y in zip(a.kept, b.kept):
        assert (x is None and y is None) or np.array_equal(x, y)


# ---------------------------------------------------------------------------- the conformance kit section
def _titled_block(title: str) -> str:
    return re.search(rf'```python title="{re.escape(title)}"\n(.*?)```', DOC.read_text(), flags=re.S).group(1)


def test_extending_kit_test_file_runs_under_pytest(tmp_path) -> None:
    """The page's one-file test suite, with EveryKth as `my_package.policies`, run by pytest:
    the kvpolicy_contract fixture from kvpolicy's plugin runs one test per property."""
    import os
    import subprocess
    import sys

    pkg = tmp_path / "my_package"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "policies.py").write_text(_blocks()[0])
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_every_kth.py").write_text(_titled_block("tests/test_every_kth.py"))
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "KVPOLICY_HYPOTHESIS_PROFILE": "dev"}
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_every_kth.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert "5 passed" in res.stdout


def test_extending_kit_failure_output_is_what_the_page_shows() -> None:
    """The off-by-one the page describes fails the way the page shows (first line and replay
    code; the logits are compared by shape)."""
    import pytest
    from hypothesis import settings
    from hypothesis import strategies as st

    from kvpolicy.testing import ContractViolation, check_policy, keeps_last

    shown = re.search(r"```text\nContractViolation: (.*?)```", DOC.read_text(), flags=re.S).group(1).strip().splitlines()
    namespace: dict = {}
    exec(compile(_blocks()[0].replace("past < self.limit", "past <= self.limit"), str(DOC), "exec"), namespace)
    with pytest.raises(ContractViolation) as exc:
        check_policy(
            namespace["EveryKth"],
            {"k": st.integers(2, 5), "window": st.integers(1, 6), "limit": st.integers(2, 12)},
            invariants=keeps_last("window"),
            checks=["replay"],
            settings=settings(max_examples=30, derandomize=True, database=None),
        )
    got = str(exc.value).strip().splitlines()
    got = [line.replace("# EveryKth was defined in a script or exec'd code: define or import it first",
                        "from my_package.policies import EveryKth") for line in got]
    assert got[0] == shown[0]
    assert len(got) == len(shown)
    for a, b in zip(got[1:], shown[1:]):
        if a.strip().startswith("logits = np.array("):
            assert np.asarray(eval(a.strip()[len("logits = "):], {"np": np})).shape == np.asarray(eval(b.strip()[len("logits = "):], {"np": np})).shape
        else:
            assert a == b
