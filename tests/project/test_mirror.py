"""Tests mirror the packages: the test of a module is found from its name (tests/README.md).

The rule: the tests of ``<package>/<sub>/<mod>.py`` are in ``tests/<mirror>/<sub>/test_<mod>.py``, where
``<mirror>`` is the package's folder under tests/ (:data:`MIRROR`). A private module ``_mod.py`` is
tested in ``test_mod.py``. pytest imports test files by their base name (no ``__init__.py`` under
tests/), so base names are unique over tests/: where two modules share a name, each test file takes
the name of the folder it is in, ``test_<folder>_<mod>.py`` (``tests/numpy/test_numpy_replay.py``,
``tests/torch/test_torch_replay.py``).

Checked both ways: every module with code (a top-level function or class) has its test file or is an
:data:`EXCEPTIONS` entry saying where it is tested and why it has no file of its own; every test file
under a mirror folder names a module or is a :data:`CROSS_CUTTING` suite, which says in its module
docstring what it covers.
"""

from __future__ import annotations

import ast
import sys
from collections import Counter
from pathlib import Path

import pytest

from packages import PACKAGES, ROOT, module_files

TESTS = ROOT / "tests"

#: Each package's mirror folder under tests/.
MIRROR = {
    "kvpolicy": "core",
    "kvpolicy_numpy": "numpy",
    "kvpolicy_torch": "torch",
    "kvpolicy_integrations": "integrations",
    "kvpolicy_tools": "tools",
}

#: Modules with code but no test file of their own: where they are tested instead, and why.
#: A module in this list that gets its own test file must leave the list (checked below).
EXCEPTIONS = {
    # kvpolicy_torch: the parts of LayerCache. Each is exercised through the layer (tests/torch/test_layer.py
    # and the differential suites); the refactoring that split them out of layer.py gives each its own file.
    "kvpolicy_torch.general": "through LayerCache's general eviction: tests/torch/test_layer.py, the differential suites",
    "kvpolicy_torch.reads": "through LayerCache's reads: tests/torch/test_layer.py, tests/torch/test_victims.py",
    "kvpolicy_torch.rows": "through LayerCache and left-padded batches: tests/integrations/test_ragged.py",
    "kvpolicy_torch.checks": "the hardening suite tests/torch/test_hardening_torch.py",
    # kvpolicy: policies whose rule is one line of a base class, held by the cross-cutting suites.
    "kvpolicy.policies.full": "tests/core/test_policy.py (full cache keeps everything), its doctests",
    "kvpolicy.policies.local": "tests/core/test_policy.py (score-free policies), tests/torch/test_layer.py (the ring)",
    "kvpolicy.policies.streaming": "tests/core/test_policy.py (score-free policies), tests/torch/test_layer.py (the ring)",
    "kvpolicy.policies.knorm": "tests/core/test_statistics.py (key_norm on every backend)",
    "kvpolicy.policies.lowest": "the base of H2O/TOVA/Scissorhands: their files and tests/core/test_policy.py",
    # kvpolicy.testing: the kit, held as one by its contract tests.
    "kvpolicy.testing._driver": "tests/core/testing/test_contract.py (the kit's drivers)",
    "kvpolicy.testing._format": "tests/core/testing/test_contract.py (the printed reproducers)",
    "kvpolicy.testing._util": "tests/core/testing/test_contract.py",
    "kvpolicy.testing.stateful": "tests/core/testing/test_contract.py (the state machine)",
    "kvpolicy.testing.timing": "tests/core/testing/test_contract.py (benchmark_policy), tests/project/test_third_party.py",
    # kvpolicy_tools: the command's verbs and the eval pipeline, run end to end.
    "kvpolicy_tools.command": "tests/tools/test_cli.py (the verbs, registered in one place)",
    "kvpolicy_tools.eval.display": "tests/tools/eval/test_compare.py (the console tables and verdicts)",
    "kvpolicy_tools.eval.engine": "tests/tools/eval/test_compare.py (shared prefills, forks), tests/tools/eval/tasks/test_base.py",
    "kvpolicy_tools.eval.report": "tests/tools/eval/test_compare.py (report.md, plots, per-cell commands)",
    "kvpolicy_tools.eval.results": "tests/tools/eval/tasks/test_base.py (typed results), tests/tools/eval/test_compare.py",
    "kvpolicy_tools.eval.tasks.kv": "tests/tools/eval/test_compare.py (every task kind end to end)",
    "kvpolicy_tools.eval.tasks.needle": "tests/tools/eval/test_compare.py (every task kind end to end)",
    "kvpolicy_tools.eval.tasks.passkey": "tests/tools/eval/test_compare.py (every task kind end to end)",
    "kvpolicy_tools.eval.tasks.ppl": "tests/tools/eval/test_compare.py (every task kind end to end)",
    "kvpolicy_tools.eval.tasks.qa": "tests/tools/eval/test_compare.py (every task kind end to end)",
    "kvpolicy_tools.eval.tasks.summ": "tests/tools/eval/test_compare.py (every task kind end to end, the paper's data files)",
    "kvpolicy_tools.eval.tasks.tw": "tests/tools/eval/test_compare.py (the tw sweep holds the cache size)",
}

#: Test files under a mirror folder that name no module: suites across modules, by design.
CROSS_CUTTING = {
    "tests/core/test_declared_score.py": "a score kind the library does not ship, declared in the test file alone, on every backend",
    "tests/core/test_hardening_policies.py": "issue 28 hardening of the policy surface",
    "tests/core/test_shared_selection.py": "selection='shared' across every built-in policy",
    "tests/core/policies/test_adakv_sharded.py": "AdaKV over heads split across processes (HeadExchange)",
    "tests/core/testing/test_hardening_kit.py": "issue 28 hardening of the conformance kit",
    "tests/numpy/test_hardening_reference.py": "issue 28 hardening of the NumPy reference and the driver",
    "tests/torch/test_hardening_torch.py": "issue 28 hardening of the torch backend and generate",
    "tests/torch/test_sync.py": "no host-device sync in the decode path, every built-in policy",
    "tests/integrations/test_deepspeed_multi.py": "DeepSpeed AutoTP on 2 CPU ranks (slow, multi-process)",
    "tests/integrations/test_families.py": "the family matrix of transformers model types",
    "tests/integrations/test_hardening_hf.py": "issue 28 hardening of the transformers cache",
    "tests/integrations/test_hf_real_model.py": "the transformers cache on the embedded SmolLM2 (slow)",
    "tests/integrations/test_ragged.py": "left-padded batches, every built-in policy, torch and transformers",
    "tests/tools/test_hardening_cli.py": "issue 28 hardening of the command line and data loaders",
}

#: Folders under tests/ that mirror no package: the repository as a whole, and benchmarks/.
NOT_MIRRORED = {"project", "benchmarks"}


def has_code(path: Path) -> bool:
    """A module with a top-level function or class (a lazy re-export hook is not code of its own)."""
    tree = ast.parse(path.read_text())
    return any(
        isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name not in ("__getattr__", "__dir__")
        for node in tree.body
    )


def mirror_folder(module: str) -> Path:
    """The folder under tests/ of ``module``'s tests, relative to tests/ (a package's own folder for its ``__init__``)."""
    package, *parts = module.split(".")
    return Path(MIRROR[package], *parts[:-1]) if parts else Path(MIRROR[package])


def expected_names(module: str, is_package: bool) -> list[str]:
    """The test file names ``module`` may have: ``test_<mod>.py``, or ``test_<folder>_<mod>.py``."""
    package, *parts = module.split(".")
    folder = mirror_folder(module)
    if is_package:  # a package's __init__: test_<package>.py in the package's own mirror folder
        folder = folder / parts[-1] if parts else folder
    name = (parts[-1] if parts else package).lstrip("_")
    return [str(folder / f"test_{name}.py"), str(folder / f"test_{folder.name}_{name}.py")]


def missing_tests(modules: dict[str, Path], test_files: set[str], exceptions: dict[str, str]) -> list[str]:
    """Modules with code that have neither a test file (``test_files``: paths relative to tests/) nor an exception."""
    out = []
    for module, path in sorted(modules.items()):
        if module in exceptions or not has_code(path):
            continue
        if not any(name in test_files for name in expected_names(module, path.name == "__init__.py")):
            out.append(f"{module} ({path.relative_to(ROOT)}): no {' or '.join(expected_names(module, path.name == '__init__.py'))}")
    return out


def orphan_tests(modules: dict[str, Path], test_files: set[str], cross_cutting: set[str]) -> list[str]:
    """Test files under a mirror folder that name no module and are not listed as cross-cutting."""
    named = {name for module, path in modules.items() for name in expected_names(module, path.name == "__init__.py")}
    return sorted(f for f in test_files if f.split("/")[0] not in NOT_MIRRORED and f not in named and f"tests/{f}" not in cross_cutting)


def mirror_test_files() -> set[str]:
    """Every test file, relative to tests/."""
    return {str(p.relative_to(TESTS)) for p in TESTS.rglob("test_*.py")}


def test_every_module_with_code_has_its_test_file() -> None:
    missing = missing_tests(module_files(), mirror_test_files(), EXCEPTIONS)
    assert not missing, "modules without their test file (tests/README.md; or list one in EXCEPTIONS, with why):\n" + "\n".join(missing)


def test_every_test_file_names_a_module_or_is_a_listed_suite() -> None:
    orphans = orphan_tests(module_files(), mirror_test_files(), set(CROSS_CUTTING))
    assert not orphans, "test files that name no module (rename to test_<module>.py, or list as CROSS_CUTTING):\n" + "\n".join(orphans)


def test_the_lists_name_what_exists() -> None:
    """An exception names a module with code and no test file; a suite exists and says what it covers."""
    modules, files = module_files(), mirror_test_files()
    for module in EXCEPTIONS:
        assert module in modules, f"EXCEPTIONS names {module}, which is not a module"
        path = modules[module]
        assert has_code(path), f"{module} has no code: it needs no exception"
        assert not any(n in files for n in expected_names(module, path.name == "__init__.py")), f"{module} has its test file: drop it from EXCEPTIONS"
    for suite in CROSS_CUTTING:
        path = ROOT / suite
        assert path.is_file(), f"CROSS_CUTTING names {suite}, which does not exist"
        assert ast.get_docstring(ast.parse(path.read_text())), f"{suite} must say in its docstring what it covers"


def test_test_file_names_are_unique() -> None:
    """pytest imports test files by base name (no __init__.py under tests/): two with one name cannot both run."""
    counts = Counter(Path(f).name for f in mirror_test_files())
    assert not [name for name, n in counts.items() if n > 1]


def test_mirror_folders_are_the_packages() -> None:
    assert set(MIRROR) == set(PACKAGES)
    for folder in {*MIRROR.values(), *NOT_MIRRORED}:
        assert (TESTS / folder).is_dir(), folder


# ---------------------------------------------------------------------------- the check can fail
def _tree(root: Path, files: dict[str, str]) -> dict[str, Path]:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return {name.removesuffix(".py").replace("/", "."): root / name for name in files}


@pytest.fixture
def fake_modules(tmp_path, monkeypatch) -> dict[str, Path]:
    """A temporary tree shaped like ours: a policy, a private module, a re-export and two modules of one name."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    return _tree(
        tmp_path,
        {
            "kvpolicy/policies/h2o.py": "class H2O: ...\n",
            "kvpolicy/validation.py": "def check(x): ...\n",
            "kvpolicy/hf.py": "from kvpolicy_integrations.hf import *\n",
            "kvpolicy_tools/eval/data/needle.py": "def make_needle_example(): ...\n",
            "kvpolicy_tools/eval/tasks/needle.py": "class NeedleTask: ...\n",
        },
    )


FAKE_TESTS = {
    "core/policies/test_h2o.py": "kvpolicy.policies.h2o",
    "core/test_validation.py": "kvpolicy.validation",
    "tools/eval/data/test_data_needle.py": "kvpolicy_tools.eval.data.needle",
    "tools/eval/tasks/test_tasks_needle.py": "kvpolicy_tools.eval.tasks.needle",
}


def test_a_module_without_its_test_file_is_reported(fake_modules) -> None:
    tests = set(FAKE_TESTS)
    assert missing_tests(fake_modules, tests, {}) == []  # the re-export (no code) needs none
    for gone, module in FAKE_TESTS.items():
        report = missing_tests(fake_modules, tests - {gone}, {})
        assert len(report) == 1 and report[0].startswith(f"{module} "), (gone, report)
    # a test file in the wrong folder does not count
    moved = tests - {"core/policies/test_h2o.py"} | {"core/test_h2o.py"}
    assert [r.split()[0] for r in missing_tests(fake_modules, moved, {})] == ["kvpolicy.policies.h2o"]
    # an exception silences exactly its module
    assert missing_tests(fake_modules, moved, {"kvpolicy.policies.h2o": "why"}) == []


def test_a_test_file_naming_no_module_is_reported(fake_modules) -> None:
    tests = {*FAKE_TESTS, "core/test_everything.py", "project/test_docs.py"}
    assert orphan_tests(fake_modules, tests, set()) == ["core/test_everything.py"]
    assert orphan_tests(fake_modules, tests, {"tests/core/test_everything.py"}) == []


def test_removing_a_real_test_file_is_reported() -> None:
    """On the real tree: without tests/torch/test_layer.py, LayerCache's module is reported."""
    report = missing_tests(module_files(), mirror_test_files() - {"torch/test_layer.py"}, EXCEPTIONS)
    assert [r.split()[0] for r in report] == ["kvpolicy_torch.layer"]
