"""kvpolicy_tools/eval/data/wikitext.py: wikitext-2 parsing on tiny files, and the real shared file when present."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpolicy_tools.eval.data import load_wikitext, parse_wikitext
from eval_files import shared


WIKI_TINY = (
    " = Alpha Article = \n"
    " Alpha is the first letter . It has @-@ hyphens . \n"
    " = = History = = \n"
    " Alpha was used in Greece . \n"
    " = Beta ( letter ) = \n"
    " Beta comes second . \n"
    " = = = Sub sub = = = \n"
    " More beta text . \n"
)


def test_parse_wikitext_crlf_and_lf_agree(tmp_path: Path) -> None:
    p = tmp_path / "wt.txt"
    p.write_bytes(WIKI_TINY.replace("\n", "\r\n").encode())
    docs = load_wikitext(p)
    assert [d.title for d in docs] == ["Alpha Article", "Beta ( letter )"]
    assert all("\r" not in d.text for d in docs)
    assert docs[0].text.startswith(" = Alpha Article = \n")
    assert " = = History = = " in docs[0].text  # sub-headings stay inside their article
    assert docs[1].text.endswith("More beta text . ")
    assert docs == parse_wikitext(WIKI_TINY, source="wikitext-2")
    assert sum(d.n_words for d in docs) == len(WIKI_TINY.split())


def test_parse_wikitext_blank_lines_and_preamble() -> None:
    docs = parse_wikitext("intro line\n\n = T = \n\n body \n\n")
    assert [d.title for d in docs] == ["", "T"]
    assert docs[1].text == " = T = \n body "


def test_load_wikitext_limit_min_words_missing(tmp_path: Path) -> None:
    p = tmp_path / "wt.txt"
    p.write_text(WIKI_TINY)
    assert [d.title for d in load_wikitext(p, limit=1)] == ["Alpha Article"]
    assert [d.title for d in load_wikitext(p, min_words=25)] == ["Alpha Article"]
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        load_wikitext(tmp_path / "nope.txt")


def test_real_wikitext() -> None:
    p = shared("wikitext-2-raw-test.txt")
    docs = load_wikitext(p)
    assert len(docs) == 62 and docs[0].title == "Robert Boulter"
    assert sum(d.n_words for d in docs) == 241_211
    assert all("\r" not in d.text for d in docs)
    assert load_wikitext() == docs  # default path = shared dir
