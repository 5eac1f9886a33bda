"""kvpolicy_tools/eval/data/needle.py: needle and passkey examples - character budget, depths, a short
haystack repeated, tokenizers and token ids. (The needle task itself runs end to end in tests/tools/eval/test_compare.py.)"""

from __future__ import annotations

import pytest

from kvpolicy_tools.eval import data as D
from kvpolicy_tools.eval.data import TextDoc, make_needle_example, make_passkey_example


HAY = " ".join(f"Sentence number {i} is here." for i in range(200))


def test_needle_char_budget_and_depths() -> None:
    needle = "The magic number is 4242."
    for depth in (0.0, 0.3, 0.5, 1.0):
        ex = make_needle_example(HAY, depth, needle, "What is the magic number?", "4242", length=1000)
        assert ex.kind == "needle" and needle in ex.context and ex.answer == "4242"
        assert abs(len(ex.context) - 1000) <= 3
        assert abs(ex.meta["actual_depth"] - depth) < 0.06
        i = ex.context.index(needle)
        if 0.0 < depth < 1.0:
            assert ex.context[:i].rstrip().endswith(".")  # snapped to a sentence end
    assert make_needle_example(HAY, 0.0, needle, "q", "a", length=500).context.startswith(needle)
    assert make_needle_example(HAY, 1.0, needle, "q", "a", length=500).context.endswith(needle)


def test_needle_repeats_short_haystack_and_validates() -> None:
    ex = make_needle_example("Short text. Again.", 0.5, "NEEDLE.", "q", "a", length=200)
    assert ex.context.count("Short text.") > 5 and "NEEDLE." in ex.context
    with pytest.raises(ValueError):
        make_needle_example(HAY, 1.5)
    with pytest.raises(ValueError):
        make_needle_example("", 0.5)
    with pytest.raises(ValueError):
        make_needle_example(HAY, 0.5, "a long needle sentence", length=5)


class _WordTokenizer:
    """Whitespace 'tokenizer' with the HF encode/decode signature."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}
        self.inv: list[str] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [] if not add_special_tokens else [-1]  # fake BOS, must not be requested
        for w in text.split():
            if w not in self.vocab:
                self.vocab[w] = len(self.inv)
                self.inv.append(w)
            ids.append(self.vocab[w])
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return " ".join(self.inv[i] for i in ids if i >= 0)


def test_needle_with_tokenizer_and_token_ids() -> None:
    tok = _WordTokenizer()
    ex = make_needle_example(HAY, 0.5, "The code is 77.", "What is the code?", "77", length=300, tokenizer=tok)
    n = len(tok.encode(ex.context, add_special_tokens=False))
    assert abs(n - 300) <= 2 and "The code is 77." in ex.context
    assert 0.4 < ex.meta["actual_depth"] < 0.6
    ids = tok.encode(HAY, add_special_tokens=False)
    ex2 = make_needle_example(ids, 0.5, "The code is 77.", "What is the code?", "77", length=300, tokenizer=tok)
    assert ex2.context == ex.context
    pk = make_passkey_example(HAY, 0.25, 68301, length=800)
    assert pk.answer == "68301" and pk.context.count("68301") == 2
    assert D.format_needle_prompt(pk).endswith("Question: What is the pass key?\nAnswer:")


def test_needle_accepts_docs() -> None:
    docs = [TextDoc("a", "First doc. " * 20), TextDoc("b", "Second doc. " * 20)]
    ex = make_needle_example(docs, 0.5, "NEEDLE.", "q", "a")
    assert "First doc." in ex.context and "Second doc." in ex.context and "NEEDLE." in ex.context
