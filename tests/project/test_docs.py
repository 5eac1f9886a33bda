"""docs/policies.md's worked example is recomputed here, so the page cannot drift from the code."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from kvpolicy import BUZZ
from kvpolicy_numpy import replay, softmax
from oracle import buzz_round, oracle, oracle_params

DOC = Path(__file__).resolve().parents[2] / "docs" / "policies.md"


def _section(text: str, marker: str) -> str:
    start = text.index(f"<!-- worked-example:{marker} -->")
    end = text.find("<!--", start + 10)
    return text[start:end]


def _setup(text: str) -> tuple[BUZZ, np.ndarray]:
    code = re.search(r"```python\n(.*?)```", _section(text, "setup"), re.S).group(1)
    namespace: dict = {}
    exec(code, namespace)  # the doc's own code block
    return namespace["policy"], namespace["logits"]


def _table(text: str, marker: str) -> list[list[str]]:
    body = _section(text, marker)
    end = body.index("<!-- /worked-example -->") if "<!-- /worked-example -->" in body else len(body)
    rows = [line for line in body.splitlines() if line.startswith("|")]
    rows = [r for r in rows if not re.fullmatch(r"\|[-| ]+\|", r)][1:]  # drop header and rule
    assert rows, f"no table rows under {marker}"
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]


def _ints(cell: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", cell)]


def _groups(cell: str) -> list[list[int]]:
    return [_ints(g) for g in re.findall(r"\[([\d ]+)\]", cell)]


@pytest.fixture(scope="module")
def doc() -> str:
    return DOC.read_text(encoding="utf-8")


def test_doc_example_setup(doc) -> None:
    policy, logits = _setup(doc)
    assert policy == BUZZ(sink=1, window=2, stride=3, threshold=6)
    assert logits.shape == (24, 1, 24)


def test_doc_decode_table(doc) -> None:
    policy, logits = _setup(doc)
    rows = _table(doc, "decode")
    trace = replay(policy, logits)
    ref = oracle(policy, logits)
    sink, window, s = policy.sink, policy.window, policy.stride
    s_hat = (s + 1) // 2
    # every eviction of the replay has a row, and no other step does
    assert [int(r[0]) for r in rows] == [t for t, _, _ in trace.evictions]
    old: list[int] = []
    for step, before, old_cell, new_cell, after in rows:
        t = int(step)
        cache = trace.kept[t - 1][0].tolist() + [t]
        assert _ints(before) == cache, f"step {t}: cache before"
        middle = cache[sink : len(cache) - window]
        assert _groups(old_cell) == [old[i : i + s_hat] for i in range(0, len(old), s_hat)], f"step {t}: old"
        new = middle[len(old) :]
        assert _groups(new_cell) == [new[i : i + s] for i in range(0, len(new), s)], f"step {t}: new"
        assert _ints(after) == trace.kept[t][0].tolist() == ref.kept[t][0], f"step {t}: kept"
        old = _ints(after)[sink : len(_ints(after)) - window]


def test_doc_prefill_table(doc) -> None:
    policy, logits = _setup(doc)
    rows = _table(doc, "prefill")
    prompt = 20
    assert "prompt_len=20" in doc
    trace = replay(policy, logits, prompt_len=prompt)
    sink, window = policy.sink, policy.window
    # the rounds' sizes are the replay's prefill evictions
    prefill_rounds = [(b, a) for t, b, a in trace.evictions if t == prompt - 1]
    assert len(rows) == len(prefill_rounds)
    # the prompt scores, as the spec defines them: causal softmax per row, summed over rows
    causal = np.tril(np.ones((prompt, prompt), dtype=bool))
    scores = softmax(np.where(causal, logits[:prompt, 0, :prompt], -np.inf)).sum(axis=0)
    params = oracle_params(policy)
    cache = list(range(prompt))
    n_old = 0
    for (rnd, before, old_cell, new_cell, after), (size_before, size_after) in zip(rows, prefill_rounds):
        middle = cache[sink : len(cache) - window]
        assert _ints(before) == middle, f"round {rnd}: middle before"
        assert len(cache) == size_before
        assert sum(_groups(old_cell), []) == middle[:n_old]
        assert sum(_groups(new_cell), []) == middle[n_old:]
        keep = buzz_round(params, cache, [float(scores[p]) for p in cache], n_old)
        cache = [cache[i] for i in keep]
        assert _ints(after) == cache[sink : len(cache) - window], f"round {rnd}: middle after"
        assert len(cache) == size_after
        n_old = len(cache) - sink - window
    assert trace.kept[prompt - 1][0].tolist() == cache
    assert "`0 | 3 7 13 | 18 19`" in doc and cache == [0, 3, 7, 13, 18, 19]


def test_doc_theorem_numbers(doc) -> None:
    from kvpolicy import threshold_ratio

    assert "13/3 = 4.33" in doc and round(threshold_ratio(5), 2) == 4.33
    assert "`ratio(3) = 10/4`" in doc and threshold_ratio(3) == 10 / 4


def test_doc_images_exist(doc) -> None:
    for name in re.findall(r"\]\((trace_[a-z_]+\.png)\)", doc):
        path = DOC.parent / name
        assert path.exists() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
