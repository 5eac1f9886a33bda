"""kvpolicy_tools/perf/eviction.py: each benchmarked policy evicts at the size asked for, and the
eviction workloads run on both backends."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvpolicy_tools.perf.eviction import POLICIES, policy_at_size, workload  # noqa: E402


@pytest.mark.parametrize("name", POLICIES)
def test_policy_at_size_evicts_at_size(name) -> None:
    """The largest of its kind within the size, from the registry and from_size: exactly the size
    for a one-token policy, a few tokens less at most for BUZZ (its capacity grows in steps)."""
    from kvpolicy.budget import fit_capacity

    p = policy_at_size(name, 300)
    if not p.evicts:
        assert p.capacity is None
        return
    assert p == fit_capacity(name, 300) and 295 <= p.capacity <= 300
    assert p.capacity == 300 or p.decode_eviction is None


@pytest.mark.parametrize("backend", ["torch", "numpy"])
@pytest.mark.parametrize("name", POLICIES)
def test_eviction_workloads(backend, name) -> None:
    w = workload(backend, name, 200, batch=2, heads=2, head_dim=4)
    length = (lambda: w.layer.length) if backend == "torch" else (lambda: w.length)
    assert w.size <= 200
    for _ in range(2):  # resets make rounds repeatable
        w.reset_before_eviction()
        assert length() == w.size
        w.one_eviction()
        assert (length() == w.size) if name == "full" else (length() < w.size)
        w.reset_after_eviction()
        start = length()
        w.decode_round()
        assert length() == (start + w.period if name == "full" else start)
    if name == "buzz":
        assert w.period > 50  # a whole cycle: the middle refills from its steady size to the threshold
