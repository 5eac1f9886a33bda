"""kvpolicy/testing/plugin.py: the pytest plugin - its entry point, and its fixture running each property
as a test in a third party's suite."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[3]


def test_plugin_entry_point_and_properties(request) -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    from kvpolicy.testing import PROPERTIES
    from kvpolicy.testing import plugin

    assert plugin.PROPERTIES == PROPERTIES
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["pytest11"]
    assert declared == {"kvpolicy": "kvpolicy.testing.plugin"}
    # pytest loaded it (from the entry point, or conftest's fallback for an older editable install)
    pm = request.config.pluginmanager
    assert pm.has_plugin("kvpolicy") or pm.has_plugin("kvpolicy.testing.plugin")
    # some installed kvpolicy distribution declares it (pytest scans every distribution)
    assert any(
        ep.group == "pytest11" and ep.value == "kvpolicy.testing.plugin"
        for dist in importlib.metadata.distributions()
        if (dist.metadata["Name"] or "").lower() == "kvpolicy"
        for ep in dist.entry_points
    ), "reinstall kvpolicy (pip install -e .) to register the plugin"


def test_plugin_fixture_runs_each_property_as_a_test(tmp_path) -> None:
    (tmp_path / "test_mine.py").write_text(
        textwrap.dedent(
            """
            from hypothesis import strategies as st
            from kvpolicy import LocalWindow

            def test_local(kvpolicy_contract):
                kvpolicy_contract(LocalWindow, {"window": st.integers(1, 3)}, torch=False)

            def test_only_two(kvpolicy_contract):
                kvpolicy_contract(LocalWindow, checks=["replay", "sizes"], torch=False)
            """
        )
    )
    env = {**os.environ, "KVPOLICY_HYPOTHESIS_PROFILE": "dev", "PYTHONPATH": str(ROOT)}
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-rs", "-o", "addopts=", "test_mine.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "7 passed, 7 skipped" in res.stdout, res.stdout  # (LocalWindow: no ranking, no head-wise budgets)
    for prop in ("replay", "sizes", "full_cache", "backends", "stateful"):
        assert f"test_local[contract-{prop}] PASSED" in res.stdout
    assert "test_only_two[contract-stateful] SKIPPED" in res.stdout
