"""Synthetic needle-in-a-haystack and passkey examples, built from any haystack text at a
given depth."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Protocol

from kvpolicy.validation import check_bool

from .common import RetrievalExample, TextDoc

__all__ = [
    "DEFAULT_NEEDLE", "DEFAULT_NEEDLE_QUESTION", "DEFAULT_NEEDLE_ANSWER", "Codec", "CharCodec",
    "make_needle_example", "make_passkey_example", "format_needle_prompt",
]


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
