"""Run Python code in a child process where importing torch or transformers fails (the import-light
checks of tests/project/test_import_light.py and the kit's own in tests/core/testing/test_contract.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Installed first in the child: any import of torch or transformers (or a submodule) fails.
BLOCK = textwrap.dedent(
    """
    import sys
    class _Block:
        BLOCKED = ("torch", "transformers")
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in self.BLOCKED:
                raise ImportError(f"{name} is blocked in this test")
            return None
    sys.meta_path.insert(0, _Block())
    """
)


def run_blocked(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` (dedented) in a fresh interpreter at the repository root with torch and transformers blocked."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "integrations")])}
    env.pop("PYTHONSTARTUP", None)
    return subprocess.run(
        [sys.executable, "-c", BLOCK + textwrap.dedent(code)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
