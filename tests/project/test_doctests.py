"""One doctest sweep: the docstring examples of every module of kvpolicy, kvpolicy_numpy,
kvpolicy_torch, the integrations and the tools run here, module by module (a new module is
collected without being listed). An example that cannot run is fixed, not skipped; only what needs
a download or a GPU is marked ``# doctest: +SKIP`` in the docstring itself."""

from __future__ import annotations

import doctest
import importlib
import io
import warnings
import pytest
from hypothesis.errors import NonInteractiveExampleWarning
from packages import module_files

MODULES = sorted(module_files())


def run_examples(name: str) -> doctest.TestResults:
    """Run the examples of ``name`` (its own objects, not what it imports); the report of any failure
    is in the assertion message."""
    module = importlib.import_module(name)
    out = io.StringIO()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NonInteractiveExampleWarning)  # the kit's `.example()` calls
        for test in doctest.DocTestFinder().find(module, name):
            runner.run(test, out=out.write)
    results = runner.summarize(verbose=False)
    assert not results.failed, out.getvalue()
    return results


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    run_examples(name)


def test_the_sweep_runs_examples() -> None:
    """Not a vacuous sweep: the modules a reader starts from have examples, and they ran."""
    for name in ("kvpolicy.policy", "kvpolicy.budget", "kvpolicy.registry", "kvpolicy.policies.h2o", "kvpolicy_numpy.replay",
                 "kvpolicy_integrations.hf.layer", "kvpolicy_integrations.hf.cache",
                 "kvpolicy_integrations.hf.generation", "kvpolicy_tools.eval.tasks.base"):
        assert name in MODULES
        assert run_examples(name).attempted > 0, name
