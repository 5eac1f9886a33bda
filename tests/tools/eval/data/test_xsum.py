"""kvpolicy_tools/eval/data/xsum.py: XSum loading and the summary prompt, on tiny files and the real shared file when present."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpolicy_tools.eval.data import SummaryExample, format_summary_prompt, load_xsum
from eval_files import shared, write_jsonl


def test_load_xsum_tiny(tmp_path: Path) -> None:
    rows = [
        {"article": f"###\nArticle: story {i}\n\nSummarize the above article in 1 sentence.\n", "summary_gt": f"sum {i}",
         "max_tokens": 64, "temperature": 0.3, "stop": ["###"]}
        for i in range(10)
    ]
    p = write_jsonl(tmp_path / "x.jsonl", rows)
    ex = load_xsum(p)
    assert len(ex) == 10 and all(isinstance(e, SummaryExample) for e in ex)
    assert ex[3].reference == "sum 3" and ex[3].is_prompt and ex[3].meta["max_tokens"] == 64
    assert format_summary_prompt(ex[3]) == rows[3]["article"]
    # seeded subsets are deterministic, sorted, and not just the head
    a, b = load_xsum(p, limit=4, seed=1), load_xsum(p, limit=4, seed=1)
    assert a == b
    rows_a = [e.meta["row"] for e in a]
    assert rows_a == sorted(rows_a)
    assert [e.meta["row"] for e in load_xsum(p, limit=4)] == [0, 1, 2, 3]
    assert {tuple(e.meta["row"] for e in load_xsum(p, limit=4, seed=s)) for s in range(5)} != {(0, 1, 2, 3)}
    with pytest.raises(ValueError, match="summary_gt"):
        load_xsum(write_jsonl(tmp_path / "bad.jsonl", [{"article": "x"}]))


def test_format_summary_prompt_wraps_bare_articles() -> None:
    ex = SummaryExample(id="a", prompt_or_article="Some article text.", reference="r")
    assert format_summary_prompt(ex) == "###\nArticle: Some article text.\n\nSummarize the above article in 1 sentence.\n"
    assert format_summary_prompt(ex, n_sentences=3).endswith("in 3 sentences.\n")


def test_real_xsum() -> None:
    p = shared("xsum_0shot.jsonl")
    ex = load_xsum(p)
    assert len(ex) == 1000
    assert all(e.is_prompt and e.prompt_or_article.rstrip().endswith("Summarize the above article in 1 sentence.") for e in ex)
    assert all(e.reference for e in ex)


def test_an_empty_article_is_refused_naming_file_and_line(tmp_path: Path) -> None:
    """Issue 44's re-probe: an empty `article` loaded, and `compare` later blamed the budget ("below
    the smallest h2o reaches on a 2-token run"), naming neither file nor row."""
    import json

    p = tmp_path / "xsum_0shot.jsonl"
    p.write_text(json.dumps({"article": "x", "summary_gt": "y"}) + "\n" + json.dumps({"article": "  ", "summary_gt": "y"}) + "\n")
    with pytest.raises(ValueError, match=r"xsum_0shot.jsonl:2: 'article' is empty"):
        load_xsum(p)
