"""The benchmark scripts the tests in this folder exercise, loaded from benchmarks/ (not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a module (registered in ``sys.modules`` by its file's base name,
    as its dataclasses need; ``name`` may name a subfolder: ``"peers/ruler_kvpress"``)."""
    module_name = Path(name).name
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def benchmark_module():
    """``benchmark_module("gpu_decode")``: a benchmark script as a module (:func:`load_benchmark`)."""
    return load_benchmark
