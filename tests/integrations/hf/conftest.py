"""Fixtures of the transformers-integration tests: the tiny random-weight models of
:mod:`hf_cases`, built once per module."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import hf_cases  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return hf_cases.tiny_model()


@pytest.fixture(scope="module")
def edge_model():
    return hf_cases.edge_model()
