"""kvpolicy.testing: a conformance kit for eviction policies (yours and ours).

* :func:`check_policy`: the eviction-policy contract as hypothesis properties (capacity during
  attention, sorted unique positions, determinism, FullCache within capacity, host-int
  decisions, NumPy == torch on every example, batch rows independent, your invariants) and a
  stateful machine; a failure prints code that replays the shrunk example.
* :mod:`kvpolicy.testing.strategies`: hypothesis strategies for policy parameters, logits with
  controllable ties and extremes, prompt lengths, GQA shapes and padded batches.
* :mod:`kvpolicy.testing.invariants`: ``keeps_first("sink")``, ``keeps_last("window")``, ...
* :mod:`kvpolicy.testing.profiles`: the ``dev`` / ``ci`` / ``thorough`` hypothesis profiles,
  selected by ``KVPOLICY_HYPOTHESIS_PROFILE`` (``CI=true`` -> ``ci``).
* :func:`benchmark_policy`: the cost of one eviction and per decoded token across cache sizes,
  with the fitted log-log slope (:mod:`kvpolicy.testing.timing`).
* A pytest plugin (:mod:`kvpolicy.testing.plugin`, registered as ``kvpolicy`` under
  ``pytest11``): the ``kvpolicy_contract`` and ``kvpolicy_benchmark`` fixtures.

Needs hypothesis (``pip install kvpolicy[testing]``); torch only for the torch comparisons and
torch timings, imported when used. This package imports its submodules on first use, so the
pytest plugin loads nothing heavy.

Example:
    >>> from hypothesis import settings, strategies as st
    >>> from kvpolicy import StreamingLLM
    >>> from kvpolicy.testing import check_policy, keeps_first, keeps_last
    >>> check_policy(StreamingLLM, {"sink": st.integers(1, 3)}, invariants=[keeps_first("sink"), keeps_last("window")],
    ...              torch=False, settings=settings(max_examples=5)).passed
    ['replay', 'sizes', 'full_cache', 'backends', 'stateful']
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "PROPERTIES",
    "ComplexityResult",
    "ContractReport",
    "ContractViolation",
    "PolicyMachine",
    "benchmark_policy",
    "builtin_invariants",
    "check_candidate_sum",
    "check_full_cache",
    "follows_builtin_rules",
    "check_policy",
    "check_prefill_decision",
    "check_replay",
    "check_sizes",
    "compare_backends",
    "example_inputs",
    "example_keys",
    "keeps_everything",
    "keeps_first",
    "keeps_last",
    "load_profile",
    "make_logits",
    "params_strategy",
    "policies",
    "policy_machine",
    "policy_workload",
    "replay_events",
]

_WHERE = {
    "PROPERTIES": "contract",
    "ContractReport": "contract",
    "ContractViolation": "contract",
    "check_full_cache": "contract",
    "check_policy": "contract",
    "check_prefill_decision": "contract",
    "check_replay": "contract",
    "check_sizes": "contract",
    "compare_backends": "contract",
    "check_candidate_sum": "_driver",
    "example_inputs": "_driver",
    "example_keys": "_driver",
    "PolicyMachine": "stateful",
    "policy_machine": "stateful",
    "replay_events": "stateful",
    "builtin_invariants": "invariants",
    "follows_builtin_rules": "invariants",
    "keeps_everything": "invariants",
    "keeps_first": "invariants",
    "keeps_last": "invariants",
    "load_profile": "profiles",
    "make_logits": "strategies",
    "params_strategy": "strategies",
    "policies": "strategies",
    "ComplexityResult": "timing",
    "benchmark_policy": "timing",
    "policy_workload": "timing",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'kvpolicy.testing' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
