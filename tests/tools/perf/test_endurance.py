"""kvpolicy_tools/perf/endurance.py (issue 15): a long decode on a small shape, the flatness check
seeing growth, and refusals of what it cannot measure."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvpolicy import FullCache  # noqa: E402
from kvpolicy_tools.perf.endurance import CacheShape, EnduranceResult, EnduranceSample, endurance_policy, markdown, run_endurance, work_line  # noqa: E402


@pytest.mark.parametrize("name", ["buzz", "h2o", "streaming_llm"])
def test_endurance_run_on_a_small_shape(name) -> None:
    policy = endurance_policy(name, 24)
    shape = CacheShape(layers=2, kv_heads=2, head_dim=8)
    seen = []
    result = run_endurance(policy, 300, shape=shape, samples=30, warmup=60, on_sample=seen.append)
    assert len(result.samples) == 30 and seen == result.samples
    assert [s.token for s in result.samples] == list(range(10, 301, 10))
    assert all(s.cached_tokens < policy.capacity for s in result.samples)
    # the storage is allocated once: the same bytes at every sample, at least two layers' keys,
    # values (fp32), positions (int64) and scores (fp32) for `capacity` slots
    per_layer = 2 * policy.capacity * (2 * 8 * 4 + 8 + 4)
    assert len({s.allocated_bytes for s in result.samples}) == 1
    assert result.samples[0].allocated_bytes >= 2 * per_layer
    assert result.flatness()["allocated_bytes"] == 1.0
    # the fastest token of each sample is never slower than its median or its mean
    assert all(0 < s.min_seconds_per_token <= min(s.seconds_per_token, s.mean_seconds_per_token) for s in result.samples)
    assert len(result.measured()) == 24  # samples after token 60
    assert "| " + repr(policy) in markdown([result])


def _fake(metric_values: list[float]) -> EnduranceResult:
    r = EnduranceResult("x", "h2o", {}, CacheShape(1, 1, 1), tokens=100 * len(metric_values), warmup=0, device="cpu")
    r.samples = [
        EnduranceSample(100 * (i + 1), 1000, 10_000, v, min_seconds_per_token=v) for i, v in enumerate(metric_values)
    ]
    return r


def test_endurance_flatness_sees_growth() -> None:
    """The measure can fail: a per-token time that grows with the stream is not flat."""
    flat, growing = _fake([1.0] * 40), _fake([1.0 + i / 10 for i in range(40)])
    assert flat.is_flat() and flat.flatness()["seconds_per_token"] == 1.0
    assert not growing.is_flat()
    # first decile: samples 0-3 (median 1.15), last: 36-39 (median 4.75)
    assert growing.deciles("seconds_per_token") == (pytest.approx(1.15), pytest.approx(4.75))
    assert growing.flatness()["min_seconds_per_token"] == pytest.approx(4.75 / 1.15)
    assert growing.is_flat(metrics=["allocated_bytes", "rss_bytes"])


@pytest.mark.parametrize("name", ["buzz", "h2o", "streaming_llm"])
def test_endurance_counted_work_does_not_grow(name) -> None:
    """Counted work is deterministic: every token's step makes calls and returns tensors, and the
    costliest token of each half after the warm-up is the same (BUZZ's periodic evictions included)."""
    result = run_endurance(endurance_policy(name, 24), 400, shape=CacheShape(2, 2, 8), samples=20, warmup=100, count_work=True)
    assert len(result.torch_calls) == len(result.tensor_bytes) == 400
    assert min(result.torch_calls) > 0 and min(result.tensor_bytes) > 0
    assert result.work_growth() == {"torch_calls": 1.0, "tensor_bytes": 1.0}
    assert result.as_dict()["work_growth"] == result.work_growth()
    assert "torch_calls" in work_line(result)


def test_endurance_work_growth_sees_growth() -> None:
    """The work check can fail: a step that makes one more call every 100 tokens grows."""
    r = _fake([1.0] * 10)
    r.warmup = 0
    r.torch_calls = [50 + t // 100 for t in range(r.tokens)]
    r.tensor_bytes = [4096] * r.tokens
    assert r.work_peaks() == {"torch_calls": (54, 59), "tensor_bytes": (4096, 4096)}
    assert r.work_growth() == {"torch_calls": pytest.approx(59 / 54), "tensor_bytes": 1.0}
    with pytest.raises(ValueError, match="work was not counted"):
        _fake([1.0] * 10).work_growth()


def test_endurance_refuses_what_it_cannot_measure() -> None:
    with pytest.raises(ValueError, match="policy must bound the cache"):
        run_endurance(FullCache(), 100)
    with pytest.raises(ValueError, match="^policy must be an EvictionPolicy instance"):
        run_endurance("h2o", 100)
    with pytest.raises(ValueError, match=r"^samples must be >= 2 and <= 100, got 101$"):
        run_endurance(endurance_policy("h2o", 16), 100, samples=101)
    with pytest.raises(ValueError, match="need at least 2 samples after the warm-up"):
        _fake([1.0]).deciles("rss_bytes")
