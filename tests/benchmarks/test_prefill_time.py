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


def test_kvzip_forward_includes_its_reconstruction(prefill_time, tiny_model_text):
    # (a tiny random-weight Llama and a one-id-per-character tokenizer stand in for the model)
    from kvpolicy_integrations.reconstruction import repeat_prompts
    from kvpolicy_tools.models import load

    model, tok = load()
    ids = prefill_time.prompt_ids(tok, tiny_model_text, 96)
    make = prefill_time.makers(model, ["kvzip"], 96, 0.25)
    with pytest.raises(ValueError, match="prompts"):
        prefill_time.forward(model, ids, make["kvzip"](), None)
    cache = make["kvzip"]()
    assert prefill_time.forward(model, ids, cache, None, repeat_prompts(tok)) > 0
    assert cache.layers[0].store.slot_positions.ge(0).sum(-1).max() < 96  # evicted after the reconstruction
