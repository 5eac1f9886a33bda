"""No module of the product code reads or writes another module's private names.

The product code is what ships: ``kvpolicy``, ``kvpolicy_numpy``, ``kvpolicy_torch``,
``integrations/kvpolicy_integrations`` and ``kvpolicy_tools``. A private name starts with one underscore (dunders such as
``__name__`` are Python's protocol, not private). The walk flags

* ``from m import _name`` and ``import m._name`` where ``m`` is a module outside this distribution
  or ``_name`` is a private name inside a module (a private *module* of this distribution, such as
  ``kvpolicy_tools.eval.tasks._helpers`` would be, is its shared internal code and may be imported by the five packages:
  the names it exports are public);
* ``obj._name`` where ``obj`` is not ``self`` or ``cls`` (reads, writes and calls alike);
* ``getattr``/``setattr``/``hasattr``/``delattr`` with a literal private name.

Where something private is really needed it becomes a small public, documented function; what
cannot (a library that offers no public way) is in ``ALLOWED`` with its reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("kvpolicy", "kvpolicy_numpy", "kvpolicy_torch", "integrations/kvpolicy_integrations", "kvpolicy_tools")
OURS = ("kvpolicy", "kvpolicy_numpy", "kvpolicy_torch", "kvpolicy_integrations", "kvpolicy_tools")

# (file relative to the repository root, the private name): why it stays.
ALLOWED: dict[tuple[str, str], str] = {
    ("kvpolicy_tools/perf/decode.py", "_attn_implementation"): (
        "transformers has no public getter for a config's attention implementation "
        "(only the setter model.set_attn_implementation)"
    ),
    ("kvpolicy_tools/models.py", "_attn_implementation"): (
        "transformers has no public getter for a config's attention implementation; read for the model card"
    ),
    ("integrations/kvpolicy_integrations/hf/attention.py", "_attn_implementation"): (
        "transformers has no public getter for a config's attention implementation; use_kvpolicy_attention "
        "checks whether kvpolicy_sdpa is the one in use"
    ),
    ("integrations/kvpolicy_integrations/hf/cache.py", "_attn_implementation"): (
        "transformers has no public getter (and no traceable setter) for a config's attention implementation; "
        "the forward hooks of scope_attention read it and switch it (_switch_attention, docs/design.md, "
        "\"The attention switch\")"
    ),
    ("integrations/kvpolicy_integrations/reconstruction.py", "_attn_implementation"): (
        "transformers has no public getter for a config's attention implementation; KVzip's reconstruction "
        "forward switches to its own and puts the model's back"
    ),
    ("kvpolicy_torch/storage.py", "_dynamo"): (
        "torch._dynamo.mark_static_address is torch's documented way to give a compiled step's state "
        "fixed addresses (CUDA graphs); torch.compiler has no public alias (transformers' StaticCache uses it too)"
    ),
    ("kvpolicy_tools/models.py", "_is_quantized"): (
        "transformers marks a GGUF-dequantised config as quantised with this flag and offers no public "
        "way to clear it; the model is saved as a plain float checkpoint"
    ),
}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _ours(module: str | None, level: int) -> bool:
    return level > 0 or (module is not None and module.split(".")[0] in OURS)


def violations(path: Path) -> list[tuple[int, str, str]]:
    """``(line, private name, source)`` of every private access in one file."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: list[tuple[int, str, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            parts = (node.module or "").split(".")
            if not _ours(node.module, node.level) and any(_private(p) for p in parts if p):
                found.append((node.lineno, node.module or "", ast.unparse(node)))
            for alias in node.names:
                # `from . import _format` imports one of our private modules: allowed (see above)
                is_our_module = node.module is None and node.level == 1 and (path.parent / f"{alias.name}.py").exists()
                if _private(alias.name) and not is_our_module:
                    found.append((node.lineno, alias.name, ast.unparse(node)))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] not in OURS and any(_private(p) for p in parts):
                    found.append((node.lineno, alias.name, ast.unparse(node)))
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append((node.lineno, node.attr, ast.unparse(node)))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
        ):
            found.append((node.lineno, node.args[1].value, ast.unparse(node)))
    return found


def product_files() -> list[Path]:
    return sorted(p for root in PRODUCT for p in (ROOT / root).rglob("*.py"))


def test_no_private_access_across_modules() -> None:
    bad = []
    for path in product_files():
        rel = path.relative_to(ROOT).as_posix()
        for line, name, source in violations(path):
            if (rel, name) not in ALLOWED:
                bad.append(f"{rel}:{line}: {source}")
    assert not bad, "private names used across modules (make them public, or allow-list with a reason):\n" + "\n".join(bad)


def test_allow_list_entries_are_still_needed() -> None:
    used = {(p.relative_to(ROOT).as_posix(), name) for p in product_files() for _, name, _ in violations(p)}
    stale = sorted(set(ALLOWED) - used)
    assert not stale, f"allow-list entries no longer needed: {stale}"


@pytest.mark.parametrize(
    ("source", "flagged"),
    [
        ("from kvpolicy.policies.buzz import _min_threshold", ["_min_threshold"]),
        ("from torch._C import Graph", ["torch._C"]),
        ("import torch._dynamo", ["torch._dynamo"]),
        ("layer._scores = 1", ["_scores"]),
        ("x = other._keys", ["_keys"]),
        ("getattr(cfg, '_flag', None)", ["_flag"]),
        ("self._x = 1\ncls._y = 2\nobj.__name__\nfrom . import _format\nfrom kvpolicy.validation import check_int", []),
    ],
)
def test_the_walk_finds_what_it_claims(tmp_path: Path, source: str, flagged: list[str]) -> None:
    """Negative and positive controls, so the walk cannot pass by finding nothing."""
    (tmp_path / "_format.py").write_text("")  # a private module next to it: `from . import _format` is ours
    f = tmp_path / "m.py"
    f.write_text(source)
    assert [name for _, name, _ in violations(f)] == flagged
