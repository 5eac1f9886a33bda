"""benchmarks/same_memory.py: how many sequences a policy decodes in the KV memory of full caches,
on a tiny random-weight Llama standing in for the embedded model (wiring, not speed): the batch
that fits allocates within the budget, one more sequence would not fit; bad flags are refused."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def same_memory(benchmark_module):
    return benchmark_module("same_memory")


def test_the_sequences_that_fit_allocate_within_the_full_caches_memory(same_memory, tiny_model_text):
    row = same_memory.run("h2o", 0.25, 64, 4, 2, tiny_model_text, max_batch=16)
    # two full caches of 68 tokens; H2O keeps ~25% of 64: several sequences fit, not all 16
    assert 2 <= row["sequences"] < 16
    assert row["sequences"] * row["per_sequence_bytes"] <= row["memory_bytes"] < (row["sequences"] + 1) * row["per_sequence_bytes"]
    assert row["batch_held_bytes"] <= row["batch_allocated_bytes"] <= row["memory_bytes"]
    assert row["prompt_peak_bytes"] > row["per_sequence_bytes"]  # the one-shot prompt, before its eviction
    assert row["tokens_per_second"] > 0 and row["full_tokens_per_second"] > 0


@pytest.mark.parametrize("flags, name", [(["--steps", "0"], "--steps"), (["--full-batch", "0"], "--full-batch"),
                                         (["--budget", "0"], "--budget"), (["--prompt", "1"], "--prompt")])
def test_bad_flags_are_refused_before_any_run(same_memory, flags, name):
    with pytest.raises(ValueError, match=name):
        same_memory.main(flags)
