"""Metric values against hand-computed references."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpolicy_tools.eval.metrics import corpus_rouge, exact_match, exact_match_strict, normalize_answer
from kvpolicy_tools.eval.metrics import perplexity_from_nll, rouge, rouge_mean

# ----------------------------------------------------------------------------- ROUGE


def test_rouge_identical_is_one() -> None:
    s = "Prison Link Cymru said some ex-offenders were living rough for up to a year."
    assert rouge(s, s) == {"rouge1": 1.0, "rouge2": 1.0, "rougeL": 1.0}


def test_rouge_disjoint_is_zero() -> None:
    assert rouge("alpha beta gamma", "delta epsilon zeta") == {"rouge1": 0.0, "rouge2": 0.0, "rougeL": 0.0}


def test_rouge_hand_computed() -> None:
    # reference: 6 tokens, 5 bigrams; prediction: 7 tokens, 6 bigrams.
    ref = "the cat was under the bed"
    pred = "the cat was found under the bed"
    s = rouge(pred, ref)
    # ROUGE-1: overlap 6 -> P = 6/7, R = 6/6 -> F = 2PR/(P+R) = 12/13
    assert s["rouge1"] == pytest.approx(12 / 13)
    # ROUGE-2: overlap {the cat, cat was, under the, the bed} = 4 -> P = 4/6, R = 4/5 -> F = 8/11
    assert s["rouge2"] == pytest.approx(8 / 11)
    # ROUGE-L: LCS = the cat was under the bed = 6 -> same as ROUGE-1
    assert s["rougeL"] == pytest.approx(12 / 13)


def test_rouge_partial_prefix() -> None:
    # "the cat" vs 6-token reference: P = 1, R = 2/6 -> F = 0.5; one bigram of 5 -> F = 2*(1)(1/5)/(6/5) = 1/3
    s = rouge("the cat", "the cat sat on the mat")
    assert s["rouge1"] == pytest.approx(0.5)
    assert s["rouge2"] == pytest.approx(1 / 3)


def test_rouge_uses_stemming_and_lowercase() -> None:
    assert rouge("Cats RUNNING", "cat runs")["rouge1"] == pytest.approx(1.0)


def test_rouge_multiple_references_takes_max() -> None:
    s = rouge("the cat sat", ["dogs bark", "the cat sat"])
    assert s["rouge1"] == 1.0
    with pytest.raises(ValueError):
        rouge("x", [])


def test_rouge_mean_is_geometric() -> None:
    scores = {"rouge1": 0.5, "rouge2": 0.125, "rougeL": 0.5}
    assert rouge_mean(scores) == pytest.approx((0.5 * 0.125 * 0.5) ** (1 / 3))
    assert rouge_mean(scores) < (0.5 + 0.125 + 0.5) / 3  # AM-GM
    assert rouge_mean({"rouge1": 0.3, "rouge2": 0.0, "rougeL": 0.2}) == 0.0
    assert rouge_mean({"rouge1": 1.0, "rouge2": 1.0, "rougeL": 1.0}) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        rouge_mean({"rouge1": -0.1, "rouge2": 0.1, "rougeL": 0.1})


def test_corpus_rouge_averages() -> None:
    out = corpus_rouge(["the cat was found under the bed", "alpha"], ["the cat was under the bed", "beta"])
    assert out["rouge1"] == pytest.approx((12 / 13 + 0) / 2)
    assert out["rouge2"] == pytest.approx((8 / 11) / 2)
    assert out["mean"] == pytest.approx(rouge_mean(out))
    with pytest.raises(ValueError):
        corpus_rouge([], [])


# ----------------------------------------------------------------------------- answers


@pytest.mark.parametrize(
    ("raw", "norm"),
    [
        ("The Beatles", "beatles"),
        ("  An   apple, a day!! ", "apple day"),
        ("Wilhelm Conrad Röntgen.", "wilhelm conrad röntgen"),
        ("U.S.A.", "usa"),
        ("the", ""),
        ("theatre", "theatre"),  # articles only as whole words
        ("Category\xa04", "category 4"),
    ],
)
def test_normalize_answer(raw: str, norm: str) -> None:
    assert normalize_answer(raw) == norm


def test_exact_match_subspan() -> None:
    assert exact_match("The first prize went to Wilhelm Conrad Röntgen in 1901.", ["Wilhelm Conrad Röntgen"]) == 1.0
    assert exact_match("röntgen", ["Wilhelm Conrad Röntgen", "Röntgen"]) == 1.0
    assert exact_match("Marie Curie", ["Wilhelm Conrad Röntgen"]) == 0.0
    assert exact_match("It was THE BEATLES!", "beatles") == 1.0  # a single answer string works
    assert exact_match("anything at all", ["the"]) == 0.0  # empty normalised answer never matches
    assert exact_match("", ["x"]) == 0.0


def test_exact_match_strict() -> None:
    assert exact_match_strict("The Beatles.", ["beatles"]) == 1.0
    assert exact_match_strict("It was the Beatles", ["Beatles"]) == 0.0
    assert exact_match("It was the Beatles", ["Beatles"]) == 1.0


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=40), st.lists(st.text(max_size=15), min_size=1, max_size=3))
def test_em_properties(pred: str, answers: list[str]) -> None:
    assert normalize_answer(normalize_answer(pred)) == normalize_answer(pred)
    strict, loose = exact_match_strict(pred, answers), exact_match(pred, answers)
    assert loose in (0.0, 1.0) and strict in (0.0, 1.0)
    if strict and normalize_answer(pred):
        assert loose == 1.0
    if normalize_answer(pred):
        assert exact_match(pred, [pred]) == 1.0


# ----------------------------------------------------------------------------- perplexity


@pytest.mark.parametrize("vocab", [2, 50, 32000])
def test_perplexity_uniform_equals_vocab(vocab: int) -> None:
    n = 17
    # NLL of a uniform distribution computed the way an eval loop does it (log-softmax of equal logits)
    logits = np.zeros(vocab)
    logp = logits - np.log(np.exp(logits).sum())
    total_nll = float(-logp[1] * n)
    assert total_nll == pytest.approx(n * math.log(vocab))
    assert perplexity_from_nll(total_nll, n) == pytest.approx(vocab)


def test_perplexity_basic_and_errors() -> None:
    assert perplexity_from_nll(0.0, 5) == 1.0
    assert perplexity_from_nll(2.0, 2) == pytest.approx(math.e)
    with pytest.raises(ValueError):
        perplexity_from_nll(1.0, 0)
    with pytest.raises(ValueError):
        perplexity_from_nll(float("nan"), 3)


# ----------------------------------------------------------------------------- hygiene


def test_eval_modules_do_not_import_torch() -> None:
    root = Path(__file__).resolve().parents[3] / "kvpolicy_tools" / "eval"
    names = ["__init__.py", "metrics.py", "display.py"] + [f"data/{p.name}" for p in sorted((root / "data").glob("*.py"))]
    assert "data/common.py" in names
    for name in names:
        tree = ast.parse((root / name).read_text())
        for node in ast.walk(tree):
            mods: list[str] = []
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:  # .aclsum is ours
                mods = [node.module]
            for m in mods:
                assert m.split(".")[0] not in {"torch", "transformers", "gensim", "aclsum", "needlehaystack"}, (
                    f"{name} imports {m}"
                )
