"""kvpolicy_tools/eval/data/wiki_articles.py: wiki markup stripping and articles from a tiny dump and the packaged one."""

from __future__ import annotations

from pathlib import Path
import bz2
import re

from kvpolicy_tools.eval import data as D
from kvpolicy_tools.eval.data import strip_wiki_markup
from eval_files import need_dist


def test_strip_wiki_markup_cases() -> None:
    raw = (
        "{{Infobox thing|name={{lang|en|X}}|size=3}}\n"
        "'''Anarchism''' is a [[political philosophy]] that advocates [[self-governance|self-governed]] "
        "societies.<ref name=\"a\">Cite {{cite web|url=x}}</ref><ref name=b/> It is ''old''.<!-- hidden -->\n"
        "[[File:Flag.svg|thumb|A [[flag]] with [stars] shown]]\n"
        "{| class=\"wikitable\"\n|-\n| a || b\n|}\n"
        "== History ==\n"
        "See [http://example.com the site] and &amp; more.[[Category:Philosophy]]\n"
        "* a list item\n"
        "== References ==\n"
        "{{reflist}} lots of citations\n"
    )
    out = strip_wiki_markup(raw)
    assert out.startswith("Anarchism is a political philosophy that advocates self-governed societies. It is old.")
    assert "History" in out and "See the site and & more." in out and "a list item" in out
    for junk in ("{{", "}}", "[[", "]]", "'''", "<ref", "hidden", "wikitable", "flag", "Category", "citations", "=="):
        assert junk not in out, junk


def test_load_wiki_articles_from_tiny_dump(tmp_path: Path) -> None:
    xml = """<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/">
  <page><title>Redir</title><ns>0</ns><id>1</id><redirect title="X"/><revision><text>#REDIRECT [[X]]</text></revision></page>
  <page><title>Talk:Thing</title><ns>1</ns><id>2</id><revision><text>talk talk</text></revision></page>
  <page><title>Thing</title><ns>0</ns><id>3</id><revision><text>'''Thing''' is a [[stuff|thing]] with many words here.&lt;ref&gt;x&lt;/ref&gt;</text></revision></page>
  <page><title>Thing (disambiguation)</title><ns>0</ns><id>4</id><revision><text>Thing may be: a, b</text></revision></page>
</mediawiki>"""
    p = tmp_path / "dump.xml.bz2"
    p.write_bytes(bz2.compress(xml.encode()))
    docs = D.load_wiki_articles(path=p)
    assert [(d.id, d.title, d.text) for d in docs] == [("enwiki-3", "Thing", "Thing is a thing with many words here.")]
    assert len(D.load_wiki_articles(path=p, include_disambiguation=True)) == 2
    assert D.load_wiki_articles(min_words=100, path=p) == []


def test_wiki_articles_from_gensim() -> None:
    need_dist("gensim", "4.4.0")
    docs = D.load_wiki_articles(min_words=500)
    assert len(docs) >= 80
    assert sum(d.n_words >= 6000 for d in docs) >= 25
    assert any(d.title == "Anarchism" for d in docs)
    for d in docs:
        assert not re.search(r"\{\{|\}\}|\[\[|\]\]|<ref|'''|\{\|", d.text), d.title
