"""A tiny eval world for the tools' tests: a character-level stand-in for a Hugging Face tokenizer and
tiny in-memory data sources for every task kind (used with ``kvpolicy_tools.models.tiny_llama``)."""

from __future__ import annotations

import random
import string

from kvpolicy_tools.eval import data as D
from kvpolicy_tools.eval.tasks import DataSources

ALPHA = string.ascii_lowercase + string.digits + " .,?!:\n-\"'{}()[]#"


class CharTokenizer:
    """Character-level stand-in for a Hugging Face tokenizer (ids 3..; no chat template, no EOS)."""

    chat_template = None
    eos_token_id = None

    def encode(self, text, add_special_tokens=False):
        return [3 + ALPHA.index(c) if c in ALPHA else 3 + ALPHA.index("?") for c in text.lower()]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(ALPHA[i - 3] if 3 <= i < 3 + len(ALPHA) else "" for i in ids)


class CallTokenizer:
    """A stand-in for a Hugging Face tokenizer called as ``tokenizer(text, return_tensors="pt")``
    (what ``kvpolicy.hf.generate`` calls): one id per character, ``3 + ord(c) % 100`` (inside a tiny
    model's vocabulary), no chat template, no end-of-sequence token."""

    chat_template = None
    pad_token_id = 0

    def __call__(self, text, return_tensors=None):
        import torch

        return {"input_ids": torch.tensor([self.encode(text)])}

    def encode(self, text, add_special_tokens=False):
        """The same ids as a list (what KVzip's repeat prompts are built from)."""
        return [3 + ord(c) % 100 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


WORDS = "the cat sat on a mat while dogs bark and birds sing over green hills near old towns".split()


def words(rng, n):
    """``n`` random words from :data:`WORDS` and a full stop."""
    return " ".join(rng.choice(WORDS) for _ in range(n)) + "."


def tiny_sources():
    """Tiny data for every task kind (ppl, summ, haystack, qa, kv), the same on every call."""
    rng = random.Random(0)
    docs = [D.TextDoc(id=f"d{i}", text=" ".join(words(rng, 8) for _ in range(40)), title=f"doc {i}") for i in range(3)]
    summ = [D.SummaryExample(id=f"s{i}", prompt_or_article="\n\n".join(words(rng, 10) for _ in range(30)),
                             reference=words(rng, 12)) for i in range(2)]
    qa = []
    for q in range(2):
        distract = [D.Passage(title="t", text=words(rng, 6)) for _ in range(9)]
        for g in (0, 4, 9):
            d = list(distract)
            d.insert(g, D.Passage(title="t", text="the answer is zebra " + words(rng, 3), is_gold=True))
            qa.append(D.QAExample(id=f"nq-{q}-gold{g}", question="what is it?", answers=("zebra",), documents=tuple(d),
                                  gold_index=g, meta={"row": q, "short_answer": False}))
    kv = [D.RetrievalExample(id=f"kv-{i}", context=D.format_kv_records([(f"k{j}", f"v{j}") for j in range(6)]),
                             question="k2", answer="v2") for i in range(2)]
    return DataSources(ppl_docs=docs, summaries=summ, haystack=docs, qa=qa, kv=kv)
