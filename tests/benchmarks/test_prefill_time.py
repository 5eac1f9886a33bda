"""benchmarks/prefill_time.py: its memory mode measures what docs/performance.md quotes (a chunked
prefill peaks at the storage plus one chunk, a one-shot one at the storage plus the prompt), on a
short prompt and two layers (no model)."""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def prefill_time(benchmark_module):
    return benchmark_module("prefill_time")


def test_memory_mode_peaks(prefill_time, capsys):
    rows = prefill_time.memory([700], ["full", "streaming_llm", "h2o"], 0.25, 64, layers=2)
    assert [r["policy"] for r in rows] == ["streaming_llm", "h2o"]  # (the full cache has no budget)
    for row in rows:
        per_slot = row["storage_plus_chunk"] // (2 * (row["storage_slots"] + 64))
        assert row["chunked"] == row["storage_plus_chunk"]
        assert row["one-shot"] == 2 * per_slot * (row["storage_slots"] + 700)  # the whole prompt beside the storage
        assert row["storage_slots"] >= row["capacity"]
    assert "| 700 | h2o |" in capsys.readouterr().out
