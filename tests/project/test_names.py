"""No policy or task name is switched on outside the registries.

What is particular to a policy is a declared property of its class (``evicts``, a preset's fixed
parameters, its base class; :func:`kvpolicy_tools.eval.tasks.policy_class`), and what is particular
to a task is a :class:`~kvpolicy_tools.eval.tasks.Task` hook. So the planner (``kvpolicy/budget.py``)
and every module of the tools (``kvpolicy_tools``) hold no comparison of a value with a registered
policy name (``== "buzz"``, ``in ("full", ...)``, ``.startswith("buzz_")``, a ``case "h2o":``), and
``compare.py`` and ``report.py`` hold no task name at all. Read from the source with ``ast``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvpolicy import available_policies
from kvpolicy_tools.eval.tasks import task_registry

ROOT = Path(__file__).resolve().parents[2]
CHECKED = [ROOT / "kvpolicy" / "budget.py", *sorted((ROOT / "kvpolicy_tools").rglob("*.py"))]


def _strings(node: ast.AST) -> list[str]:
    """The string constants ``node`` is, or holds directly (a tuple, list or set of them)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return []


def switches(source: str, names: set[str]) -> list[tuple[int, str]]:
    """``(line, name)`` of every test of a value against one of ``names`` in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops):
            found += [(node.lineno, s) for side in (node.left, *node.comparators) for s in _strings(side) if s in names]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("startswith", "endswith", "removeprefix", "removesuffix")):
            # a prefix test on a name, or on a name's variants ("buzz_tw...")
            found += [(node.lineno, s) for arg in node.args for s in _strings(arg)
                      if s in names or any(s.startswith(n + "_") for n in names)]
        elif isinstance(node, ast.match_case):
            found += [(node.pattern.lineno, s) for sub in ast.walk(node.pattern) if isinstance(sub, ast.MatchValue)
                      for s in _strings(sub.value) if s in names]
    return sorted(set(found))


POLICY_NAMES = set(available_policies())


def test_the_names_are_the_registrys() -> None:
    assert {"full", "local", "streaming_llm", "h2o", "tova", "buzz", "buzz_logn", "snapkv_h2o", "pyramid_h2o"} <= POLICY_NAMES
    assert len(CHECKED) > 30


@pytest.mark.parametrize("path", CHECKED, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_policy_name_is_switched_on(path: Path) -> None:
    found = switches(path.read_text(), POLICY_NAMES)
    assert not found, f"{path.relative_to(ROOT)} switches on policy names (line, name): {found}"


@pytest.mark.parametrize("rel", ["kvpolicy_tools/eval/compare.py", "kvpolicy_tools/eval/report.py"])
def test_no_task_is_named_in_compare_or_the_report(rel: str) -> None:
    """Adding a task is one file: compare.py and report.py hold no string equal to a registered
    task's name (its commands, captions, verdicts, plots and paper table come from its hooks)."""
    names = set(task_registry())
    assert {"ppl", "tw", "stream", "summ", "needle", "ruler", "qa", "kv", "passkey"} <= names
    tree = ast.parse((ROOT / rel).read_text())
    named = sorted({(node.lineno, node.value) for node in ast.walk(tree)
                    if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.strip().lower() in names})
    assert not named, f"{rel} names tasks (line, name): {named}"


@pytest.mark.parametrize(
    "line",
    ['if name == "buzz":\n    pass', 'x = p in ("full", "h2o")', 'ok = "local" != row(c)', 'r.startswith("buzz_logn")',
     'match name:\n    case "tova":\n        pass'],
)
def test_a_switch_is_caught(line: str) -> None:
    assert switches(line, POLICY_NAMES), line


def test_a_table_keyed_by_name_is_not_a_switch() -> None:
    assert switches('NAMES = {"buzz": "BUZZ"}\nDEFAULT = ("full", "h2o")\nf(policy="h2o")', POLICY_NAMES) == []
