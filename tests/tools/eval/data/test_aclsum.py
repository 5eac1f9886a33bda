"""kvpolicy_tools/eval/data/aclsum.py: the packaged ACLSum summaries, when the package is installed."""

from __future__ import annotations

import pytest

from kvpolicy_tools.eval import data as D
from eval_files import need_dist


def test_aclsum() -> None:
    need_dist("aclsum", "0.1.2")
    sizes = {s: len(D.load_aclsum(s)) for s in ("train", "val", "test")}
    assert sizes == {"train": 100, "val": 50, "test": 100}
    ex = D.load_aclsum("test", limit=5)
    for e in ex:
        assert len(e.references) == 3 and all(e.references)
        assert e.reference == " ".join(e.references)
        assert len(e.prompt_or_article.split()) > 1000 and not e.is_prompt
    assert D.load_aclsum("test", limit=2, aspect="outcome")[0].reference == ex[0].references[2]
    with pytest.raises(ValueError):
        D.load_aclsum("dev")
