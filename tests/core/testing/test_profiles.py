"""kvpolicy/testing/profiles.py: the hypothesis profiles (dev, ci, thorough) and how one is selected."""

from __future__ import annotations

import pytest
from hypothesis import settings

from kvpolicy.testing.profiles import load_profile, profile_name, selected_settings


def test_profiles() -> None:
    assert profile_name({}) == "dev"
    assert profile_name({"CI": "true"}) == "ci"
    assert profile_name({"CI": "true", "KVPOLICY_HYPOTHESIS_PROFILE": "thorough"}) == "thorough"
    with pytest.raises(ValueError, match="must be one of"):
        profile_name({"KVPOLICY_HYPOTHESIS_PROFILE": "fast"})
    ci = selected_settings("ci")
    assert ci.max_examples >= 200 and ci.deadline is None and ci.derandomize
    assert selected_settings("dev").max_examples < ci.max_examples < selected_settings("thorough").max_examples
    # tests/conftest.py loaded the selected profile through the kit
    assert settings.default.max_examples == selected_settings().max_examples
    assert load_profile(profile_name()) == profile_name()
