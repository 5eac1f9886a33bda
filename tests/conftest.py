"""Shared test configuration. Keep module-level imports light (no torch, no transformers)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# --------------------------------------------------------------------------- worker threads
# Under pytest-xdist (`make test` runs `-n auto`), each worker process takes its share of the cores
# for torch's threads, set before anything imports torch: N workers each running a thread per core
# would oversubscribe the cores N times. An OMP_NUM_THREADS the caller set is kept.
_WORKERS = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
if _WORKERS and "OMP_NUM_THREADS" not in os.environ:
    _CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    os.environ["OMP_NUM_THREADS"] = str(max(1, _CORES // int(_WORKERS)))

# --------------------------------------------------------------------------- hypothesis profiles
# The kit's profiles (kvpolicy/testing/profiles.py); KVPOLICY_HYPOTHESIS_PROFILE selects one of:
#   dev       fast local runs, ~30 examples per property (the default)
#   ci        >= 200 examples per property, reproducible (derandomize), no deadline (the default
#             when the environment has CI=true)
#   thorough  1000 examples per property, for occasional long runs
# e.g. `KVPOLICY_HYPOTHESIS_PROFILE=ci pytest tests`.
from kvpolicy.testing.profiles import load_profile

HYPOTHESIS_PROFILE = load_profile()

# Test helpers (oracle.py, strategies.py) live next to this file.
sys.path.insert(0, str(Path(__file__).resolve().parent))
# --------------------------------------------------------------------------- end hypothesis profiles


def pytest_configure(config) -> None:
    # The kit's pytest plugin (kvpolicy_contract, kvpolicy_benchmark) comes from kvpolicy's pytest11
    # entry point; an editable install made before that entry point existed lacks it, so load it here
    # then (test_contract.py checks that the installed metadata declares it).
    if not config.pluginmanager.has_plugin("kvpolicy") and not config.pluginmanager.has_plugin("kvpolicy.testing.plugin"):
        config.pluginmanager.import_plugin("kvpolicy.testing.plugin")


@pytest.fixture
def no_score_capture(monkeypatch):
    """The transformers cache must not capture attention (a policy scoring from the cache: Knorm,
    KeyDiff, Expected Attention): ``received_attention`` raises if it is called (patched where the
    cache layer calls it, kvpolicy_integrations.hf.layer)."""
    import kvpolicy_integrations.hf.layer as hf

    def refuse(*args, **kwargs):
        raise AssertionError("a policy scoring from the cache must not capture attention")

    monkeypatch.setattr(hf, "received_attention", refuse)


@pytest.fixture(autouse=True)
def _isolated_policy_registry():
    """Every test's policy registrations (a docstring example's, docs/extending.md's, a test's own
    policy) end with the test: the tests that walk every registered policy (display names, `bench
    --policy all`) must see the library's, whatever ran before them."""
    from kvpolicy.registry import isolated_registry

    with isolated_registry():
        yield
