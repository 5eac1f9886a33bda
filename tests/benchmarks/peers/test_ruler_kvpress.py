"""benchmarks/peers/ruler_kvpress.py: the export carries the text parts kvpress's pipeline takes,
and the comparison counts answers identical per (sample, method, ratio). The kvpress side itself
needs its own venv (benchmarks/peers/setup_kvpress.sh) and is not run here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def ruler_kvpress(benchmark_module):
    return benchmark_module("peers/ruler_kvpress")  # (tests/benchmarks/conftest.py)


def test_identical_answers_counts_triples_both_runs_have(ruler_kvpress) -> None:
    cells = [
        {"kind": "budget", "policy": "knorm", "requested_budget": 0.75,
         "samples": [{"id": "a", "text": "x"}, {"id": "b", "text": "y"}, {"id": "c", "text": "z"}]},
        {"kind": "budget", "policy": "h2o", "requested_budget": 0.75, "samples": [{"id": "a", "text": "x"}]},  # no press
        {"kind": "reference", "policy": "full", "samples": [{"id": "a", "text": "x"}]},
    ]
    outputs = [{"id": "a", "press": "knorm", "ratio": 0.25, "text": "x"},
               {"id": "b", "press": "knorm", "ratio": 0.25, "text": "other"},
               {"id": "c", "press": "knorm", "ratio": 0.5, "text": "z"}]  # another ratio: not compared
    same, total, differ = ruler_kvpress.identical_answers(cells, outputs)
    assert (same, total) == (1, 2)
    assert differ == ["b knorm 0.25: kvpolicy 'y', kvpress 'other'"]


@pytest.mark.slow
def test_export_writes_the_text_parts_and_the_ids_kvpolicy_feeds(ruler_kvpress, tmp_path: Path) -> None:
    """The embedded tokenizer; RULER's needle subtask needs no data folder."""
    pytest.importorskip("transformers")
    out = tmp_path / "samples.json"
    assert ruler_kvpress.main(["export", "--out", str(out), "--samples", "1", "--ruler-length", "512",
                               "--ruler-subtasks", "niah_single_1"]) == 0
    (row,) = json.loads(out.read_text())["samples"]
    assert {"context", "question", "answer_prefix", "context_ids", "question_ids"} <= set(row)
    assert row["context"] and row["question"] and len(row["context_ids"]) > len(row["question_ids"]) > 0
