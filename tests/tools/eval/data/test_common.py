"""kvpolicy_tools/eval/data/common.py: where the shared data lives, and the message for a missing package."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpolicy_tools.eval import data as D


def test_shared_data_dir_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPOLICY_DATA", str(tmp_path))
    assert D.shared_data_dir() == tmp_path
    monkeypatch.setenv("KVPOLICY_DATA", str(tmp_path / "missing"))
    assert D.shared_data_dir() is None


def test_missing_package_message() -> None:
    with pytest.raises(FileNotFoundError, match="pip install --no-deps"):
        D.package_path("kvpolicy-no-such-dist", "kvpolicy_no_such_pkg", "data.json")
