"""Read the worked examples of docs/policies.md (``<!-- worked-example:NAME -->`` blocks) for the
tests that recompute them: the setup code block and the table rows."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

DOC = Path(__file__).resolve().parents[1] / "docs" / "policies.md"


def section(text: str, marker: str) -> str:
    """The text from ``<!-- worked-example:marker -->`` to the next HTML comment."""
    start = text.index(f"<!-- worked-example:{marker} -->")
    end = text.find("<!--", start + 10)
    return text[start:end]


def setup(text: str, marker: str) -> dict[str, Any]:
    """Run the section's python code block; return its namespace."""
    code = re.search(r"```python\n(.*?)```", section(text, marker), re.S).group(1)
    namespace: dict[str, Any] = {}
    exec(code, namespace)  # the doc's own code block
    return namespace


def table(text: str, marker: str) -> list[list[str]]:
    """The section's table rows (header and rule dropped), as lists of stripped cells."""
    rows = [line for line in section(text, marker).splitlines() if line.startswith("|")]
    rows = [r for r in rows if not re.fullmatch(r"\|[-| ]+\|", r)][1:]
    assert rows, f"no table rows under {marker}"
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]


def ints(cell: str) -> list[int]:
    return [int(x) for x in re.findall(r"-?\d+", cell)]


def floats(cell: str) -> list[float]:
    return [float(x) for x in re.findall(r"-?\d+\.\d+", cell)]
