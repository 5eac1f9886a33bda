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


@pytest.fixture
def tiny_model_text(monkeypatch, tmp_path):
    """A benchmark's model made a tiny random-weight Llama (``kvpolicy_tools.models.load`` patched
    to return it, 2 layers, with a tokenizer of one token per character) standing in for the
    embedded one (wiring, not speed), and a short prompt text file: its path."""
    torch = pytest.importorskip("torch")  # noqa: F841 - (the model needs it)
    pytest.importorskip("transformers")
    import kvpolicy_tools.models
    from kvpolicy_tools.models import tiny_llama
    from tiny_eval import CallTokenizer

    model = tiny_llama(num_layers=2, vocab=128)
    monkeypatch.setattr(kvpolicy_tools.models, "load", lambda *a, **k: (model, CallTokenizer()))
    text = tmp_path / "prompt.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40, encoding="utf-8")
    return text
