"""Source text that rebuilds a failing example: imports, the policy, the logits."""

from __future__ import annotations

from typing import Any

import numpy as np

#: Largest logits array printed literally (``np.array([...])``); larger ones print the
#: :func:`~kvpolicy.testing.make_logits` call that made them.
MAX_LITERAL = 2000


def policy_import(policy: Any) -> str | None:
    """``from module import Class`` for the policy's class, or a comment when it is not importable."""
    cls = type(policy)
    if "<locals>" in cls.__qualname__:
        return f"# {cls.__name__} is defined inside a function of {cls.__module__}: make it importable to replay this"
    if cls.__module__ in ("__main__", "builtins"):
        return f"# {cls.__name__} was defined in a script or exec'd code: define or import it first"
    top = cls.__qualname__.split(".")[0]
    return f"from {cls.__module__} import {top}"


def policy_expr(policy: Any) -> str:
    return repr(policy)


def array_expr(arr: np.ndarray, spec: Any = None) -> str:
    """``np.array([...])`` for small arrays, else ``spec.call()`` when the array came from a spec."""
    arr = np.asarray(arr)
    if arr.size <= MAX_LITERAL or spec is None:
        return f"np.array({arr.tolist()!r})"
    return spec.call()


def invariants_line(invariants: Any) -> str | None:
    """``invariants = [...]`` when every invariant has a replayable repr (the kit's helpers), else a
    placeholder line; ``None`` when there are none."""
    if invariants is None:
        return None
    items = [invariants] if callable(invariants) else list(invariants)
    reprs = [repr(i) for i in items]
    if all(r.startswith("kvpolicy.testing.") for r in reprs):
        return f"invariants = [{', '.join(reprs)}]"
    names = ", ".join(getattr(i, "__name__", repr(i)) for i in items)
    return f"invariants = None  # put the invariants given to check_policy here: {names}"


def indent(lines: list[str], by: str = "    ") -> str:
    return "\n".join(by + line if line else line for line in lines)


def replay_snippet(policy: Any, setup: list[str], call: str, invariants: Any, *,
                   extra_imports: tuple[str, ...] = ()) -> str:
    """The code that replays a failed check: ``setup`` lines, the invariants line (if any), then
    ``call`` (``{inv}`` marks where ``, invariants=invariants`` goes), flagged as raising the error."""
    inv = invariants_line(invariants)
    line = call.format(inv=", invariants=invariants" if inv else "") + "  # raises this error"
    return code_block(policy, [*setup, *([inv] if inv else []), line], extra_imports=extra_imports)


def code_block(policy: Any, body: list[str], *, extra_imports: tuple[str, ...] = ()) -> str:
    imports = ["import numpy as np", *extra_imports]
    if any(line.startswith("invariants = [kvpolicy.testing.") for line in body) and "import kvpolicy.testing" not in imports:
        imports.append("import kvpolicy.testing")
    imp = policy_import(policy)
    if imp:
        imports.append(imp)
    return indent(imports + body)
