"""The examples of docs/extending.md run as written, and the policy they define is correct."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

DOC = Path(__file__).resolve().parents[1] / "docs" / "extending.md"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def test_extending_examples_run(capsys):
    namespace: dict = {}
    for block in _blocks():
        exec(compile(block, str(DOC), "exec"), namespace)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "[ 0 33 35 36 37 38 39]"
    assert out[1].startswith("EveryKth(")
    policy = namespace["policy"]
    trace = namespace["trace"]
    # independent check of the rule, step by step with Python lists
    cache: list[int] = []
    for t, kept in enumerate(trace.kept):
        cache.append(t)
        while len(cache) - 4 >= 5:  # window 4, limit 5
            cache = cache[: len(cache) - 4][::3] + cache[len(cache) - 4 :]
        assert kept[0].tolist() == cache and kept[1].tolist() == cache
        assert len(cache) <= policy.capacity - 1


def test_extending_policy_runs_on_torch_backend():
    import pytest

    torch = pytest.importorskip("torch")
    import kvpolicy_numpy
    import kvpolicy_torch

    namespace: dict = {}
    exec(compile(_blocks()[0], str(DOC), "exec"), namespace)
    policy = namespace["EveryKth"](k=3, window=4, limit=5)
    logits = np.random.default_rng(1).normal(size=(50, 3, 50))
    a = kvpolicy_numpy.replay(policy, logits, prompt_len=20)
    b = kvpolicy_torch.replay(policy, torch.as_tensor(logits), prompt_len=20)
    for x, y in zip(a.kept, b.kept):
        assert (x is None and y is None) or np.array_equal(x, y)
