"""docs/design.md's "Where things live" names paths that exist, and says where a new policy, model
family and eval task go."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _layout() -> tuple[str, str]:
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("### Where things live", 1)[1]
    block = section.split("```", 2)[1]
    return block, section.split("```", 2)[2].split("\n\n", 2)[1]


def test_every_path_in_the_layout_exists() -> None:
    block, _ = _layout()
    parent = ""
    checked = 0
    for line in block.splitlines():
        names = re.split(r"\s{2,}", line.strip())[0]
        if not names:
            continue
        indented = line.startswith(" ")
        for name in (n.strip() for n in names.split(",")):
            path = (parent if indented else "") + name.replace("<name>", "buzz")
            assert (ROOT / path).exists(), f"docs/design.md names {path}, which does not exist"
            checked += 1
        if not indented:
            parent = names
    assert checked >= 15


def test_where_new_things_go() -> None:
    _, bullets = _layout()
    for what, path in (("new policy", "kvpolicy/policies/"), ("new model family", "integrations/kvpolicy_integrations/hf/"),
                       ("new eval task", "kvpolicy_tools/eval/")):
        line = next((b for b in bullets.splitlines() if b.startswith(f"* A {what}")), None)
        assert line is not None and path in line, what
        assert all((ROOT / p).exists() for p in re.findall(r"`((?:kvpolicy|integrations)[\w/.]*\.py)`", line)), line
