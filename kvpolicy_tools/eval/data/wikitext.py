"""wikitext-2 (raw test): the perplexity text of the paper's ``--data-dir`` runs."""

from __future__ import annotations

import os
import re

from .common import TextDoc, decode_utf8, require_file, select_rows, shared_file

__all__ = ["parse_wikitext", "load_wikitext"]


_WT_TITLE = re.compile(r"^ = ([^=].*?) = $")


def parse_wikitext(raw: str, source: str = "wikitext") -> list[TextDoc]:
    """Split raw wikitext-2/103 text into articles on the top-level `` = Title = `` lines.

    CRLF / CR line ends are normalised to ``\\n``; sub-headings (`` = = Sub = = ``) stay in
    the article text; blank lines are dropped. Text before the first heading, if any, is
    kept as an untitled document.
    """
    lines = raw.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    docs: list[TextDoc] = []
    title: str | None = None
    buf: list[str] = []

    def flush() -> None:
        body = [ln for ln in buf if ln.strip()]
        if title is not None or body:
            docs.append(
                TextDoc(id=f"{source}-{len(docs)}", text="\n".join(body), title=title or "", source=source)
            )

    for ln in lines:
        m = _WT_TITLE.match(ln)
        if m:
            if title is not None or any(x.strip() for x in buf):
                flush()
            title, buf = m.group(1).strip(), [ln]
        else:
            buf.append(ln)
    flush()
    return docs


def load_wikitext(
    path: str | os.PathLike[str] | None = None,
    *,
    limit: int | None = None,
    seed: int | None = None,
    min_words: int = 0,
) -> list[TextDoc]:
    """wikitext-2-raw-v1 test split as articles (62 in the standard file).

    ``path`` defaults to ``wikitext-2-raw-test.txt`` in :func:`~kvpolicy_tools.eval.data.common.shared_data_dir`; without
    that file it falls back to ``datasets.load_dataset("wikitext", "wikitext-2-raw-v1",
    split="test")`` (needs the ``datasets`` package and hub access). The full standard
    perplexity text is ``"\\n".join(d.text for d in docs)``.
    """
    if path is not None:
        p = require_file(path, "wikitext")
        raw = decode_utf8(p.read_bytes(), p)
    else:
        local = shared_file("wikitext-2-raw-test.txt")
        if local is not None:
            raw = decode_utf8(local.read_bytes(), local)
        else:
            try:
                import datasets  # type: ignore[import-not-found]
            except ImportError as exc:
                raise FileNotFoundError(
                    "wikitext-2 raw test not found: pass path=... (wikitext-2-raw-test.txt), set "
                    "$KVPOLICY_DATA to a folder holding it, or pip install datasets for the hub copy"
                ) from exc
            ds = datasets.load_dataset("wikitext", "wikitext-2-raw-v1", split="test")
            raw = "".join(ds["text"])
    docs = [d for d in parse_wikitext(raw, source="wikitext-2") if d.n_words >= min_words]
    return [docs[i] for i in select_rows(len(docs), limit, seed)]
