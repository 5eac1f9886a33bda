"""Hypothesis profiles of the kit (and of kvpolicy's own test suite).

* ``dev``: fast local runs, 30 examples per property (the default);
* ``ci``: at least 200 examples per property, no deadline, derandomised (the same examples on
  every run, so CI is reproducible), the failing example's blob printed; the default when the
  environment has ``CI=true``;
* ``thorough``: 1000 examples per property, for occasional long runs.

``KVPOLICY_HYPOTHESIS_PROFILE=ci`` (or ``dev``, ``thorough``) selects one explicitly.

:func:`~kvpolicy.testing.check_policy` runs under the selected profile unless given ``settings=``;
:func:`load_profile` makes it hypothesis's default for every test (kvpolicy's own
``tests/conftest.py`` does that). Registering the profiles never changes anyone's settings.

Example:
    >>> import os
    >>> from kvpolicy.testing.profiles import profile_name
    >>> profile_name({"CI": "true"}), profile_name({"KVPOLICY_HYPOTHESIS_PROFILE": "thorough", "CI": "true"})
    ('ci', 'thorough')
"""

from __future__ import annotations

import os
from typing import Mapping

from hypothesis import HealthCheck, settings
from hypothesis.errors import InvalidArgument

from kvpolicy.validation import check_bool

__all__ = ["ENV_VAR", "PROFILES", "load_profile", "profile_name", "register_profiles", "selected_settings"]

ENV_VAR = "KVPOLICY_HYPOTHESIS_PROFILE"
PROFILES = ("dev", "ci", "thorough")
_PREFIX = "kvpolicy-"  # registered under both "dev" and "kvpolicy-dev" (the latter cannot clash)

#: Health checks a policy suite trips for no fault of the policy (long replays, big logits).
SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large]


def _profiles() -> dict[str, settings]:
    return {
        "dev": settings(max_examples=30, deadline=None, suppress_health_check=SLOW_OK),
        "ci": settings(max_examples=200, deadline=None, derandomize=True, print_blob=True, suppress_health_check=SLOW_OK),
        "thorough": settings(max_examples=1000, deadline=None, print_blob=True, suppress_health_check=SLOW_OK),
    }


def _registered(name: str) -> bool:
    """Whether hypothesis has a profile called ``name`` (through its public ``get_profile``)."""
    try:
        settings.get_profile(name)
    except InvalidArgument:
        return False
    return True


def register_profiles(*, plain_names: bool = True) -> None:
    """Register ``kvpolicy-dev`` / ``kvpolicy-ci`` / ``kvpolicy-thorough`` and, unless
    ``plain_names=False``, ``dev`` / ``ci`` / ``thorough`` too (only names not already taken)."""
    plain_names = check_bool("plain_names", plain_names)
    existing = {name for name in PROFILES if _registered(name)}
    for name, profile in _profiles().items():
        settings.register_profile(_PREFIX + name, profile)
        if plain_names and name not in existing:
            settings.register_profile(name, profile)


def profile_name(environ: Mapping[str, str] | None = None) -> str:
    """The selected profile: ``$KVPOLICY_HYPOTHESIS_PROFILE``, else ``ci`` when ``CI=true``, else ``dev``."""
    env = os.environ if environ is None else environ
    name = env.get(ENV_VAR, "").strip()
    if name:
        if name not in PROFILES:
            raise ValueError(f"{ENV_VAR} must be one of {', '.join(PROFILES)}, got {name!r}")
        return name
    return "ci" if env.get("CI", "").strip().lower() == "true" else "dev"


def selected_settings(name: str | None = None) -> settings:
    """The kit's settings for profile ``name`` (default: :func:`profile_name`)."""
    return _profiles()[name or profile_name()]


def load_profile(name: str | None = None) -> str:
    """Register the profiles and make ``name`` (default: the selected one) hypothesis's default
    settings; returns the name loaded."""
    register_profiles()
    name = name or profile_name()
    settings.load_profile(_PREFIX + name)
    return name
