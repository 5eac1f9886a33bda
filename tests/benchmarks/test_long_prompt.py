"""benchmarks/long_prompt.py: one candidate's prefill and its memory, on a tiny random-weight Llama
standing in for the embedded model (wiring, not speed): a chunked prefill's cache peaks at its
storage plus one chunk, under the full cache a plain forward holds; bad flags are refused."""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def long_prompt(benchmark_module):
    return benchmark_module("long_prompt")


def test_a_chunked_prefill_peaks_at_its_storage_and_one_chunk(long_prompt, tiny_model_text):
    plain = long_prompt.run_one("plain", 300, 0.25, 32, tiny_model_text)
    h2o = long_prompt.run_one("h2o", 300, 0.25, 32, tiny_model_text)
    assert plain["cache_peak_mib"] == plain["full_kv_mib"] == h2o["full_kv_mib"]  # the same 300 tokens
    per_token = plain["full_kv_mib"] / 300
    # the policy's capacity (76 tokens at 25% of 301) plus spare slots plus one chunk of 32, far under 300
    assert 76 * per_token <= h2o["cache_peak_mib"] <= (76 + 16 + 32) * per_token * 1.2
    assert h2o["kv_held_mib"] < h2o["cache_peak_mib"] < plain["cache_peak_mib"]
    assert h2o["peak_rss_mib"] > 0 and h2o["cpu_seconds"] > 0


@pytest.mark.parametrize("flags, name", [(["--chunk", "0"], "--chunk"), (["--lengths", "1"], "--lengths"),
                                         (["--budget", "1.5"], "--budget")])
def test_bad_flags_are_refused_before_any_run(long_prompt, monkeypatch, flags, name):
    monkeypatch.setattr(sys, "argv", ["long_prompt.py", *flags])
    with pytest.raises(ValueError, match=name):
        long_prompt.main()


def test_a_policy_that_keeps_every_token_is_planned_whole(long_prompt, tiny_model_text):
    # `full` refuses a 25% budget: its row is planned at 1.0 and holds the whole prompt, as a plain cache
    full = long_prompt.run_one("full", 100, 0.25, 32, tiny_model_text)
    assert full["budget"] == 1.0
    assert full["kv_held_mib"] == pytest.approx(full["full_kv_mib"], rel=0.02)


def test_kvzip_is_timed_with_its_context_reconstruction(long_prompt, tiny_model_text):
    # KVzip scores the prompt by a reconstruction pass, which greedy_decode runs before the first
    # token: without it the benchmark raised; with it the cache ends at the policy's size
    row = long_prompt.run_one("kvzip", 120, 0.25, 32, tiny_model_text)
    assert row["kv_held_mib"] < 0.5 * row["full_kv_mib"]
