"""XSum 0-shot prompts (the H2O paper's file): the paper's summarisation data."""

from __future__ import annotations

import os
from pathlib import Path

from .common import SummaryExample, read_records, require_file, select_rows, shared_file

__all__ = ["XSUM_PROMPT", "load_xsum", "format_summary_prompt"]


XSUM_PROMPT = "###\nArticle: {article}\n\nSummarize the above article in {n} sentence{s}.\n"


def load_xsum(
    path: str | os.PathLike[str] | None = None,
    *,
    limit: int | None = None,
    seed: int | None = None,
) -> list[SummaryExample]:
    """XSum test examples.

    The H2O ``xsum_0shot.jsonl`` (``article`` already holds the 0-shot prompt,
    ``summary_gt`` the reference) is read from ``path`` or :func:`~kvpolicy_tools.eval.data.common.shared_data_dir`.
    Without it, falls back to ``datasets.load_dataset("EdinburghNLP/xsum", split="test")``
    (bare articles; wrap them with :func:`format_summary_prompt`).
    """
    p: Path | None
    if path is not None:
        p = require_file(path, "XSum jsonl")
    else:
        p = shared_file("xsum_0shot.jsonl")
    out: list[SummaryExample] = []
    if p is not None:
        rows = read_records(p)
        for i in select_rows(len(rows), limit, seed):
            line, r = rows[i]
            if "article" not in r or "summary_gt" not in r:
                raise ValueError(f"{p}:{line}: the record lacks 'article'/'summary_gt' (keys: {sorted(r)})")
            if not (isinstance(r["article"], str) and isinstance(r["summary_gt"], str)):
                raise ValueError(f"{p}:{line}: 'article' and 'summary_gt' must be strings")
            if not r["article"].strip():  # an empty prompt surfaced later as a budget error naming no row
                raise ValueError(f"{p}:{line}: 'article' is empty")
            gen = {k: r[k] for k in ("max_tokens", "temperature", "top_p", "stop", "n") if k in r}
            out.append(
                SummaryExample(
                    id=f"xsum-{i}",
                    prompt_or_article=r["article"],
                    reference=r["summary_gt"],
                    references=(r["summary_gt"],),
                    is_prompt=True,
                    meta={"row": i, "source": str(p), **gen},
                )
            )
        return out
    try:
        import datasets  # type: ignore[import-not-found]
    except ImportError as exc:
        raise FileNotFoundError(
            "XSum not found: pass path=... (H2O xsum_0shot.jsonl), set $KVPOLICY_DATA to a folder "
            "holding it, or pip install datasets for the hub copy (EdinburghNLP/xsum)"
        ) from exc
    ds = datasets.load_dataset("EdinburghNLP/xsum", split="test")
    for i in select_rows(len(ds), limit, seed):
        r = ds[i]
        out.append(
            SummaryExample(
                id=f"xsum-{r.get('id', i)}",
                prompt_or_article=r["document"],
                reference=r["summary"],
                references=(r["summary"],),
                is_prompt=False,
                meta={"row": i, "source": "EdinburghNLP/xsum"},
            )
        )
    return out


def format_summary_prompt(example: SummaryExample, n_sentences: int = 1) -> str:
    """The prompt to generate from: as-is for 0-shot prompt rows, else H2O's XSum template."""
    if example.is_prompt:
        return example.prompt_or_article
    return XSUM_PROMPT.format(
        article=example.prompt_or_article.strip(), n=n_sentences, s="" if n_sentences == 1 else "s"
    )
