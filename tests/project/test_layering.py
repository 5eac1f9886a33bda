"""The layers of the code, checked from every module's imports (function-level ones included).

From the bottom up (docs/design.md, "Layout"):

1. ``core``: ``kvpolicy`` - policies, parameters, registry, budgets, the NumPy driver; numpy and
   array-api-compat only.
2. ``backends``: ``kvpolicy_numpy`` (the reference) and ``kvpolicy_torch``.
3. ``integrations``: ``kvpolicy_integrations`` (transformers, DeepSpeed) and its public paths
   ``kvpolicy.hf`` and ``kvpolicy.deepspeed`` (re-exports).
4. ``tools``: ``kvpolicy_tools`` (the command, eval, perf, model loading), the conformance kit
   ``kvpolicy.testing``, ``python -m kvpolicy`` and the old paths ``kvpolicy.cli`` and
   ``kvpolicy.models`` (re-exports).

A module imports its own layer or the ones below, never above; the module graph has no cycle; an
import inside a function is an optional heavy dependency (torch where a path is optional,
transformers, matplotlib, deepspeed, ...) and says why in a comment. The checks run on the source
(``ast``), so a lazy import cannot hide an upward edge.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass

import pytest
from packages import PACKAGES, module_files

#: Layer of a module: the longest prefix listed here (a module, or a package and what is under it).
LAYER_OF = {
    "kvpolicy": 0,
    "kvpolicy_numpy": 1,
    "kvpolicy_torch": 1,
    "kvpolicy_integrations": 2,
    "kvpolicy.hf": 2,
    "kvpolicy.deepspeed": 2,
    "kvpolicy_tools": 3,
    "kvpolicy.testing": 3,
    "kvpolicy.__main__": 3,
    "kvpolicy.cli": 3,
    "kvpolicy.models": 3,
}
LAYER_NAMES = ("core", "backends", "integrations", "tools")

#: The third-party packages each layer may import (besides the standard library), by top-level name.
THIRD_PARTY = {
    0: {"numpy", "array_api_compat"},
    1: {"numpy", "array_api_compat", "torch"},
    2: {"numpy", "torch", "transformers", "deepspeed"},
    3: {"numpy", "torch", "transformers", "hypothesis", "pytest", "matplotlib", "tqdm", "rouge_score", "datasets", "psutil"},
}

#: Imports inside a function that may stay there: heavy dependencies some paths of a module do without.
OPTIONAL = {"torch", "transformers", "deepspeed", "matplotlib", "tqdm", "rouge_score", "datasets", "psutil", "kvpress",
            "kvpolicy_torch", "kvpolicy.hf", "kvpolicy_tools.models", "kvpolicy_tools.perf.decode", "kvpolicy_tools.perf.prefill", "kvpolicy_tools.eval.engine",
            # the kit's pytest plugin loads in every pytest session: hypothesis (the testing extra) and the
            # timing machinery only when a test asks for a fixture
            "kvpolicy.testing.contract", "kvpolicy.testing.timing"}

#: Known exceptions, each with the way out (none today: add one only with the commit that removes it).
ALLOWED_EDGES: set[tuple[str, str]] = set()
PENDING_LAZY: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    in_function: bool
    commented: bool


def layer(module: str) -> int | None:
    """The layer of a first-party module (``None`` for a third-party one)."""
    best = None
    for prefix, level in LAYER_OF.items():
        if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[0])):
            best = (prefix, level)
    return None if best is None else best[1]


def _commented(lines: list[str], node: ast.stmt) -> bool:
    """A comment on the import's lines, or on the line(s) just above its block of imports."""
    if any("#" in line for line in lines[node.lineno - 1 : node.end_lineno]):
        return True
    i = node.lineno - 2
    while i >= 0:
        text = lines[i].strip()
        if text.startswith("#"):
            return True
        if not text or text.startswith(("import ", "from ")):
            i -= 1
            continue
        return False
    return False


def imports(module: str, source: str, is_package: bool, known: set[str]) -> list[Edge]:
    """Every import of ``module``'s source, resolved to the module it names (``from pkg import sub``
    names ``pkg.sub`` when that is a module)."""
    tree = ast.parse(source)
    lines = source.splitlines()
    package = module.split(".") if is_package else module.split(".")[:-1]
    found: list[Edge] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                for alias in child.names:
                    found.append(Edge(module, alias.name, child.lineno, in_function, _commented(lines, child)))
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package[: len(package) - (child.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                if base == "__future__":
                    continue
                for alias in child.names:
                    sub = f"{base}.{alias.name}"
                    found.append(Edge(module, sub if sub in known else base, child.lineno, in_function, _commented(lines, child)))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return found


def read_modules() -> dict[str, tuple[str, bool]]:
    """Every first-party module: name -> (source, is a package)."""
    return {name: (path.read_text(encoding="utf-8"), path.name == "__init__.py") for name, path in module_files().items()}


def violations(modules: dict[str, tuple[str, bool]]) -> list[str]:
    """What breaks the layering in ``modules`` (name -> (source, is a package)), one line each."""
    known = set(modules)
    problems = []
    graph: dict[str, set[str]] = {m: set() for m in modules}
    stdlib = set(sys.stdlib_module_names)
    for module, (source, is_package) in modules.items():
        here = layer(module)
        for e in imports(module, source, is_package, known):
            there = layer(e.target)
            root = e.target.split(".")[0]
            if there is None:
                if root not in stdlib and root not in THIRD_PARTY[here]:
                    problems.append(f"{module}:{e.line}: the {LAYER_NAMES[here]} layer imports {e.target} (allowed: {sorted(THIRD_PARTY[here])})")
            elif (module, e.target) in ALLOWED_EDGES:
                continue
            elif there > here:
                problems.append(f"{module}:{e.line}: imports {e.target}, a layer above ({LAYER_NAMES[here]} -> {LAYER_NAMES[there]})")
            else:
                graph[module].add(e.target if e.target in known else e.target)
            if e.in_function and (module, e.target) not in ALLOWED_EDGES | PENDING_LAZY:
                optional = any(e.target == o or e.target.startswith(o + ".") for o in OPTIONAL)
                if not optional:
                    problems.append(f"{module}:{e.line}: imports {e.target} inside a function; move it to the module's header")
                elif not e.commented:
                    problems.append(f"{module}:{e.line}: imports {e.target} inside a function without a comment saying why")
    problems += [f"import cycle: {' -> '.join(c)}" for c in cycles(graph)]
    return problems


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (or a self-import)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    counter = [0]

    def strongconnect(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return found


MODULES = read_modules()


def test_every_package_is_read() -> None:
    assert {m.split(".")[0] for m in MODULES} == set(PACKAGES)
    assert {"kvpolicy.policy", "kvpolicy_tools.cli", "kvpolicy_integrations.hf", "kvpolicy_torch.layer"} <= set(MODULES)


def test_every_module_has_a_layer() -> None:
    assert [m for m in MODULES if layer(m) is None] == []


def test_the_layering_holds() -> None:
    assert violations(MODULES) == []


@pytest.mark.parametrize(
    ("module", "line", "expected"),
    [
        ("kvpolicy.budget", "from kvpolicy_tools.cli import main", "a layer above (core -> tools)"),
        ("kvpolicy.budget", "def f():\n    from kvpolicy_torch import LayerCache  # lazy", "a layer above (core -> backends)"),
        ("kvpolicy_numpy.replay", "import transformers", "the backends layer imports transformers"),
        ("kvpolicy_integrations.hf", "def f():\n    from kvpolicy.budget import make_policy", "inside a function; move it"),
        ("kvpolicy_tools.cli", "def f():\n    import matplotlib", "without a comment saying why"),
        ("kvpolicy.params", "from .policy import EvictionPolicy", "import cycle"),
    ],
)
def test_a_violation_is_caught(module: str, line: str, expected: str) -> None:
    """The checker itself: an upward import (lazy or not), a heavy dependency in a light layer, a
    lazy import of something light, an unexplained lazy import, and a cycle each fail it."""
    source, is_package = MODULES[module]
    broken = dict(MODULES)
    broken[module] = (source + "\n\n" + line + "\n", is_package)
    found = violations(broken)
    assert any(expected in v and module in v for v in found), found


def test_cycles_are_found() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
