"""Shared test configuration. Keep module-level imports light (no torch, no transformers)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# --------------------------------------------------------------------------- hypothesis profiles
# KVPOLICY_HYPOTHESIS_PROFILE selects one of:
#   dev       fast local runs, ~30 examples per property (the default)
#   ci        >= 200 examples per property, reproducible (derandomize), no deadline (the default
#             when the environment has CI=true)
#   thorough  1000 examples per property, for occasional long runs
# e.g. `KVPOLICY_HYPOTHESIS_PROFILE=ci pytest tests`.
from hypothesis import HealthCheck, settings

_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile("dev", max_examples=30, deadline=None, suppress_health_check=_SLOW_OK)
settings.register_profile(
    "ci",
    max_examples=200,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=_SLOW_OK,
)
settings.register_profile(
    "thorough", max_examples=1000, deadline=None, print_blob=True, suppress_health_check=_SLOW_OK
)
_default_profile = "ci" if os.environ.get("CI", "").lower() == "true" else "dev"
settings.load_profile(os.environ.get("KVPOLICY_HYPOTHESIS_PROFILE", _default_profile))

# Test helpers (oracle.py, strategies.py) live next to this file.
sys.path.insert(0, str(Path(__file__).resolve().parent))
# --------------------------------------------------------------------------- end hypothesis profiles
