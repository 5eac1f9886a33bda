"""Wikipedia articles from gensim's test dump (the embedded perplexity text), with a small
wiki-markup stripper."""

from __future__ import annotations

import bz2
import html
import os
import re
import xml.etree.ElementTree as ET
from collections.abc import Callable

from kvpolicy.validation import check_bool

from .common import TextDoc, package_path, require_file

__all__ = ["strip_wiki_markup", "GENSIM_WIKI_FILE", "load_wiki_articles"]


def _remove_nested(text: str, pattern: re.Pattern[str], repl: str | Callable[[re.Match[str]], str] = "") -> str:
    """Apply an innermost-match substitution until a fixed point (handles nesting)."""
    for _ in range(50):
        new = pattern.sub(repl, text)
        if new == text:
            return new
        text = new
    return text


_RE_COMMENT = re.compile(r"<!--.*?-->", re.S)
_RE_REF_SELF = re.compile(r"<ref[^>/]*/>", re.I)
_RE_REF = re.compile(r"<ref[^>]*?>.*?</ref\s*>", re.I | re.S)
_RE_DROP_TAGS = re.compile(
    r"<(math|gallery|timeline|score|syntaxhighlight|source|imagemap|chem|hiero)\b[^>]*>.*?</\1\s*>",
    re.I | re.S,
)
_RE_TEMPLATE = re.compile(r"\{\{[^{}]*\}\}")
_RE_TABLE = re.compile(r"\{\|(?:(?!\{\|).)*?\|\}", re.S)
_RE_LINK = re.compile(r"\[\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\]")  # allows single [..] inside
_RE_EXTLINK = re.compile(r"\[(?:https?:|ftp:)?//[^\s\]]*\s*([^\]]*)\]")
_RE_BARE_URL = re.compile(r"https?://\S+")
_RE_HEADING = re.compile(r"^(={2,6})\s*(.*?)\s*\1\s*$", re.M)
_RE_TAG = re.compile(r"</?[a-zA-Z][^>]*>")
_RE_QUOTES = re.compile(r"'{2,5}")
_RE_MAGIC = re.compile(r"__[A-Z]+__")
_DROP_LINK_NS = re.compile(r"^\s*:?\s*(file|image|category|media|wikipedia|wp|[a-z]{2,3}(-[a-z]+)?)\s*:", re.I)
_TAIL_SECTIONS = {
    "references", "external links", "further reading", "see also", "notes", "bibliography",
    "sources", "citations", "footnotes", "notes and references", "references and notes",
}


def _link_repl(m: re.Match[str]) -> str:
    inner = m.group(1)
    if _DROP_LINK_NS.match(inner):
        return ""
    return inner.rsplit("|", 1)[-1] if "|" in inner else inner


def strip_wiki_markup(text: str) -> str:
    """Reduce MediaWiki markup to plain prose.

    Drops comments, ``<ref>`` citations, templates ``{{...}}`` (nested), tables ``{|...|}``,
    file/category/interwiki links and the trailing References/External-links sections;
    turns ``[[target|label]]`` into ``label``, ``[url label]`` into ``label``, headings
    ``== H ==`` into a plain ``H`` line, and removes bold/italic quotes and HTML tags.

    >>> strip_wiki_markup("'''Foo''' is a [[bar (x)|bar]].<ref>cite</ref>{{cn}}\\n== History ==\\nOld.")
    'Foo is a bar.\\n\\nHistory\\n\\nOld.'
    """
    t = html.unescape(text)
    t = _RE_COMMENT.sub("", t)
    t = _RE_REF_SELF.sub("", t)
    t = _RE_REF.sub("", t)
    t = _RE_DROP_TAGS.sub("", t)
    t = _remove_nested(t, _RE_TEMPLATE)
    t = _remove_nested(t, _RE_TABLE)
    t = t.replace("{{", "").replace("}}", "")
    t = _remove_nested(t, _RE_LINK, _link_repl)
    t = _RE_EXTLINK.sub(lambda m: m.group(1), t)
    t = _RE_BARE_URL.sub("", t)
    # cut the trailing reference-like sections
    for m in _RE_HEADING.finditer(t):
        if m.group(2).strip().lower() in _TAIL_SECTIONS:
            t = t[: m.start()]
            break
    t = _RE_HEADING.sub(lambda m: "\n" + m.group(2).strip() + "\n", t)
    t = _RE_QUOTES.sub("", t)
    t = _RE_TAG.sub("", t)
    t = _RE_MAGIC.sub("", t)
    t = html.unescape(t).replace("\xa0", " ")
    lines: list[str] = []
    for ln in t.split("\n"):
        ln = ln.strip()
        if ln.startswith(("|", "!", "{|", "|}")):
            continue  # stray table rows
        ln = re.sub(r"^[*#:;]+\s*", "", ln)
        ln = re.sub(r"[ \t]+", " ", ln)
        ln = re.sub(r"\(\s*[,;]?\s*\)", "", ln)  # "( )" left by removed templates
        ln = re.sub(r" +([,.;:])", r"\1", ln)
        lines.append(ln.strip())
    out = "\n".join(lines)
    out = re.sub(r"\n{3,}", "\n\n", out)
    return out.strip()


GENSIM_WIKI_FILE = "test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"


def load_wiki_articles(
    min_words: int = 0,
    *,
    path: str | os.PathLike[str] | None = None,
    limit: int | None = None,
    include_disambiguation: bool = False,
) -> list[TextDoc]:
    """Full Wikipedia articles (markup stripped) from gensim's shipped test dump.

    The dump is found via the installed ``gensim`` distribution's files (gensim itself is
    never imported): ``pip install --no-deps gensim==4.4.0``. ``path`` reads another
    MediaWiki XML export (``.bz2`` or plain). Redirects, non-article namespaces and (by
    default) disambiguation pages are skipped; articles shorter than ``min_words`` words
    after stripping are dropped. Returned in dump order.
    """
    include_disambiguation = check_bool("include_disambiguation", include_disambiguation)
    if path is not None:
        p = require_file(path, "Wikipedia XML dump")
    else:
        p = package_path("gensim", "gensim", GENSIM_WIKI_FILE)
    with open(p, "rb") as fh:
        is_bz2 = fh.read(3) == b"BZh"
    docs: list[TextDoc] = []
    with (bz2.open(p, "rb") if is_bz2 else open(p, "rb")) as fh:
        for _event, el in ET.iterparse(fh, events=("end",)):
            if el.tag.rsplit("}", 1)[-1] != "page":
                continue
            title = el.findtext("{*}title") or ""
            ns = (el.findtext("{*}ns") or "0").strip()
            redirect = el.find("{*}redirect") is not None
            raw = el.findtext("{*}revision/{*}text") or ""
            page_id = (el.findtext("{*}id") or str(len(docs))).strip()
            el.clear()
            if ns != "0" or redirect or raw.lstrip().upper().startswith("#REDIRECT"):
                continue
            if not include_disambiguation and (
                "(disambiguation)" in title.lower() or re.search(r"\{\{\s*disambig", raw, re.I)
            ):
                continue
            text = strip_wiki_markup(raw)
            doc = TextDoc(id=f"enwiki-{page_id}", text=text, title=title, source="gensim-enwiki")
            if doc.n_words >= min_words:
                docs.append(doc)
                if limit is not None and len(docs) >= limit:
                    break
    return docs
