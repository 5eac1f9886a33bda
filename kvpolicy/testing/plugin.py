"""pytest plugin of the kit, registered as ``kvpolicy`` in the ``pytest11`` entry-point group (so
it is active wherever kvpolicy is installed). It imports nothing heavy until a fixture is used.

Fixtures:

``kvpolicy_contract``
    A test that asks for it runs once per contract property (``replay``, ``sizes``,
    ``full_cache``, ``backends``, ``stateful``: the test ids say which), and the fixture is
    :func:`~kvpolicy.testing.check_policy` restricted to that property::

        from hypothesis import strategies as st
        from my_package.policies import EveryKth

        def test_every_kth(kvpolicy_contract):
            kvpolicy_contract(EveryKth, {"k": st.integers(2, 5), "window": st.integers(1, 6), "limit": st.integers(2, 12)})

    It runs under the kit's hypothesis profile (``KVPOLICY_HYPOTHESIS_PROFILE``, or ``ci`` when
    ``CI=true``, else ``dev``) unless given ``settings=``.

``kvpolicy_benchmark``
    With pytest-benchmark installed: ``kvpolicy_benchmark(factory, size, measure="one_eviction" |
    "per_token", backend="numpy" | "torch")`` times one point of
    :func:`~kvpolicy.testing.benchmark_policy` with pytest-benchmark's ``benchmark`` fixture
    (``per_token`` rounds time ``period`` decoded tokens; ``extra_info`` records the period).
"""

from __future__ import annotations

from typing import Any

import pytest

#: The contract properties (kept equal to ``kvpolicy.testing.contract.PROPERTIES`` by a test;
#: spelled out so that loading the plugin does not import hypothesis).
PROPERTIES = ("replay", "sizes", "full_cache", "backends", "stateful", "ranking", "head_ties")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "kvpolicy_contract" in metafunc.fixturenames:
        metafunc.parametrize("kvpolicy_contract", PROPERTIES, indirect=True, ids=[f"contract-{p}" for p in PROPERTIES])


@pytest.fixture
def kvpolicy_contract(request: pytest.FixtureRequest) -> Any:
    """``check(policy_factory, params=None, **check_policy_kwargs)``: one contract property per test."""
    prop = getattr(request, "param", None)

    def check(policy_factory: Any = None, params: Any = None, **kwargs: Any) -> Any:
        # here: the plugin loads in every pytest session where kvpolicy is installed; hypothesis (the
        # testing extra) only when a test uses the fixture
        from kvpolicy.testing.contract import check_policy

        if prop is not None:
            wanted = kwargs.pop("checks", None)
            if wanted is not None and prop not in wanted:
                pytest.skip(f"contract property {prop!r} not in checks={list(wanted)}")
            kwargs["checks"] = [prop]
        report = check_policy(policy_factory, params, **kwargs)
        if prop is not None and report.results.get(prop, "").startswith("skipped"):
            pytest.skip(f"contract property {prop!r} {report.results[prop]}")  # (e.g. 'ranking' of a policy that ranks no tokens)
        return report

    return check


@pytest.fixture
def kvpolicy_benchmark(request: pytest.FixtureRequest) -> Any:
    """``run(policy_factory, size=1024, *, measure="one_eviction", backend="numpy", rounds=5, **workload_kwargs)``."""

    def run(
        policy_factory: Any,
        size: int = 1024,
        *,
        measure: str = "one_eviction",
        backend: str = "numpy",
        rounds: int = 5,
        **workload_kwargs: Any,
    ) -> Any:
        from kvpolicy.testing.timing import policy_workload  # here: as check_policy above

        benchmark = request.getfixturevalue("benchmark")  # pytest-benchmark
        w = policy_workload(policy_factory, size, backend, **workload_kwargs)
        if measure == "one_eviction":
            fn, setup = w.one_eviction, w.reset_before_eviction
        elif measure == "per_token":
            fn, setup = w.decode_round, w.reset_after_eviction
        else:
            raise ValueError(f"measure must be 'one_eviction' or 'per_token', got {measure!r}")
        benchmark.extra_info.update(
            policy=w.name, backend=backend, measure=measure, size=size, cache_size=w.steady.size, period=w.period,
            tokens_per_round=w.period if measure == "per_token" else 1,
        )
        benchmark.pedantic(fn, setup=setup, rounds=rounds, warmup_rounds=1)
        return w

    return run
