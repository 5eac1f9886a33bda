"""ACL papers with reference summaries (``aclsum``): the embedded summarisation data."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal

from .common import SummaryExample, package_path, read_jsonl, select_rows

__all__ = ["ACLSUM_ASPECTS", "load_aclsum"]


ACLSUM_ASPECTS: tuple[str, str, str] = ("challenge", "approach", "outcome")


def _aclsum_fulltext(paper: Mapping[str, Any]) -> str:
    parse = paper.get("pdf_parse") or {}
    parts: list[str] = []
    title = paper.get("title") or ""
    if title:
        parts.append(title)
    abstract = paper.get("abstract")
    if isinstance(abstract, list):
        abstract = " ".join(a.get("text", "") for a in abstract)
    if not abstract:
        abstract = " ".join(a.get("text", "") for a in parse.get("abstract", []) or [])
    if abstract:
        parts.append("Abstract\n" + abstract.strip())
    section = None
    for para in parse.get("body_text", []) or []:
        sec = (para.get("section") or "").strip()
        if sec and sec != section:
            num = (para.get("sec_num") or "").strip()
            parts.append(f"{num} {sec}".strip())
            section = sec
        txt = (para.get("text") or "").strip()
        if txt:
            parts.append(txt)
    return "\n\n".join(parts)


def load_aclsum(
    split: Literal["train", "val", "test", "all"] = "test",
    limit: int | None = None,
    *,
    aspect: Literal["challenge", "approach", "outcome"] | None = None,
    seed: int | None = None,
) -> list[SummaryExample]:
    """ACLSum papers with reference summaries (``aclsum==0.1.2``, not imported).

    Splits: train 100, val 50, test 100 (``"all"`` = 250). The article is the paper's
    full text (title, abstract, body paragraphs with section headings) from the shipped
    S2ORC parse, falling back to the split file's abstract/introduction/conclusion
    sentences. ``references`` are the three aspect summaries (challenge, approach,
    outcome); ``reference`` is their concatenation, or just ``aspect`` when given.
    """
    splits = ("train", "val", "test") if split == "all" else (split,)
    for s in splits:
        if s not in ("train", "val", "test"):
            raise ValueError(f"unknown ACLSum split {s!r}; use train/val/test/all")
    if aspect is not None and aspect not in ACLSUM_ASPECTS:
        raise ValueError(f"unknown ACLSum aspect {aspect!r}; use one of {ACLSUM_ASPECTS}")
    rows: list[tuple[str, dict[str, Any]]] = []
    for s in splits:
        f = package_path("aclsum", "aclsum", f"dataset/{s}.jsonl")
        rows.extend((s, r) for r in read_jsonl(f))
    out: list[SummaryExample] = []
    for i in select_rows(len(rows), limit, seed):
        s, r = rows[i]
        summaries = r["summary"]
        refs = tuple(summaries[a].strip() for a in ACLSUM_ASPECTS)
        try:
            paper_file = package_path("aclsum", "aclsum", f"dataset/paper_jsons/{r['id']}.json")
            with open(paper_file, encoding="utf-8") as fh:
                article = _aclsum_fulltext(json.load(fh))
        except FileNotFoundError:
            article = ""
        if len(article.split()) < 50:  # parse missing or empty: use the split's sentences
            sents = r.get("sentences", {})
            article = "\n\n".join(" ".join(sents.get(sec, [])) for sec in ("abstract", "introduction", "conclusion"))
        out.append(
            SummaryExample(
                id=str(r["id"]),
                prompt_or_article=article,
                reference=summaries[aspect].strip() if aspect else " ".join(refs),
                references=refs,
                is_prompt=False,
                title=r.get("title", ""),
                meta={"split": s, "aspect": aspect},
            )
        )
    return out
