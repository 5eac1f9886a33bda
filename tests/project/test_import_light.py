"""The core imports neither torch nor transformers (checked in a subprocess where both are blocked)."""

from __future__ import annotations

import pytest

from blocked import run_blocked


def test_the_block_works() -> None:
    """The guard itself: importing torch in the child fails (so the next tests can fail)."""
    res = run_blocked(
        """
        try:
            import torch
        except ImportError as e:
            print("blocked:", e)
        else:
            raise SystemExit("torch imported despite the block")
        """
    )
    assert res.returncode == 0, res.stderr
    assert "blocked: torch is blocked" in res.stdout


def test_import_kvpolicy_and_kvpolicy_numpy_without_torch() -> None:
    res = run_blocked(
        """
        import sys
        import kvpolicy, kvpolicy_numpy
        import kvpolicy.budget, kvpolicy.registry, kvpolicy.policies
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers"))
        assert not heavy, heavy
        print("ok", kvpolicy.__version__)
        """
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("ok ")


def test_core_works_without_torch() -> None:
    """Not just the import: plan a budget and replay a policy with torch blocked."""
    res = run_blocked(
        """
        import sys
        import numpy as np
        import kvpolicy
        from kvpolicy_numpy import replay
        p = kvpolicy.make_policy("buzz", 0.3, context_length=256)
        t = replay(p, np.zeros((64, 2, 64)), prompt_len=10)
        assert t.kept[63].shape[0] == 2
        assert "torch" not in sys.modules
        print("ok")
        """
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"


def test_cli_policies_without_torch() -> None:
    pytest.importorskip("kvpolicy_tools.cli")
    res = run_blocked(
        """
        import sys
        from kvpolicy_tools.cli import main
        rc = main(["policies"])
        assert "torch" not in sys.modules
        raise SystemExit(rc)
        """
    )
    assert res.returncode == 0, res.stderr
    assert "buzz" in res.stdout
