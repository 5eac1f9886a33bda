"""RULER's generators and metric (kvpolicy_tools/eval/ruler_data.py): deterministic, seeded, fitting the
length, needles in the context, the answers of every subtask, and refusals naming the parameter.
The task (options, the end-to-end run) is tests/tools/eval/tasks/test_ruler.py."""

from __future__ import annotations

import collections
import re

import pytest

from kvpolicy_tools.eval import ruler_data as R
from ruler_texts import QA_ROWS, TEXTS

RES = R.RulerResources(words=R.essay_words(TEXTS), vocab=R.vocabulary(TEXTS), qa_rows=QA_ROWS)


def words(e: R.RulerExample) -> int:
    """A stand-in token count: whitespace-separated pieces plus one per line."""
    return len(e.text.split()) + e.text.count("\n")


def make(subtask: str, index: int = 0, *, length: int = 1500, seed: int = 0) -> R.RulerExample:
    return R.make_example(subtask, index, length=length, count_tokens=words, seed=seed, resources=RES)


@pytest.mark.parametrize("subtask", list(R.SUBTASKS))
def test_generators_are_deterministic_and_seeded(subtask):
    a, b = make(subtask, 1), make(subtask, 1)
    assert a == b and a.text == b.text
    assert make(subtask, 2).text != a.text  # another index, another example
    assert make(subtask, 1, seed=5).text != a.text  # another seed too


@pytest.mark.parametrize("subtask", list(R.SUBTASKS))
def test_prompt_fits_the_length_and_is_the_largest_that_does(subtask):
    for length in (900, 1500):
        ex = make(subtask, 0, length=length)
        assert words(ex) + ex.tokens_to_generate <= length
        # RULER's rule: the haystack is the largest that fits (to within one bisection step: one
        # noise line, 25 essay words, 10 coded words, one document)
        margin = 200 if R.SUBTASKS[subtask].family == "qa" else 100
        assert words(ex) + ex.tokens_to_generate > length - margin, (subtask, words(ex))
    assert make(subtask, 0, length=1500).size > make(subtask, 0, length=900).size


@pytest.mark.parametrize("subtask", [s for s, v in R.SUBTASKS.items() if v.family == "niah"])
def test_needles_are_in_the_context_and_asked_for(subtask):
    spec = R.SUBTASKS[subtask]
    for i in range(3):
        ex = make(subtask, i)
        assert len(ex.answers) == spec.n_values * spec.n_queries
        found = []
        for key in ex.meta["keys"]:
            assert key in ex.question and key in ex.answer_prefix
            found += re.findall(rf"A special magic \w+ for {re.escape(key)} is: (\S+)\.(?:\s|$)", ex.context)
        assert sorted(found) == sorted(ex.answers)  # every value of every asked key, nothing else
        for a in ex.answers:
            assert a in ex.context and a not in ex.question
        assert ex.metric == "all" and ex.tokens_to_generate == 128
        if spec.value == "uuids":
            assert all(re.fullmatch(r"[0-9a-f-]{36}", a) for a in ex.answers)
        else:
            assert all(re.fullmatch(r"\d{7}", a) for a in ex.answers)


def test_variable_tracking_chain_resolves_to_the_answers():
    for i in range(3):
        ex = make("vt", i)
        task = ex.context[ex.context.rindex("Track the chains"):]  # after the solved example
        value = ex.meta["value"]
        assigned = dict(re.findall(r"VAR (\w+) = (VAR \w+|\d+)", task))
        resolved = set()
        for var in assigned:
            v = assigned[var]
            while v.startswith("VAR "):
                v = assigned[v[4:]]
            if v == value:
                resolved.add(var)
        assert resolved == set(ex.answers) and len(ex.answers) == 5
        assert value in ex.question and "5 variables" in ex.answer_prefix


def test_common_words_are_the_ten_most_frequent():
    for length, (common, rare) in ((1500, (6, 1)), (4200, (30, 3))):
        ex = make("cwe", 0, length=length)
        listed = re.findall(r"\d+\. (\w+)", ex.context[ex.context.rindex("Below is a numbered list"):])
        counts = collections.Counter(listed)
        assert {w for w, _ in counts.most_common(10)} == set(ex.answers)
        assert {counts[w] for w in ex.answers} == {common} and set(counts.values()) == {common, rare}


def test_frequent_words_are_the_three_most_frequent_coded_words():
    ex = make("fwe", 0)
    body = ex.context.split("most often. ", 1)[1].split()
    counts = collections.Counter(w for w in body if w != "...")
    assert [w for w, _ in counts.most_common(3)] == list(ex.answers)
    assert collections.Counter(body).most_common(1)[0][0] == "..."  # the noise "word" leads, as in RULER
    assert counts[ex.answers[0]] > counts[ex.answers[1]] > counts[ex.answers[2]]


def test_qa_has_the_gold_document_and_part_metric():
    for i in range(3):
        ex = make("qa", i)
        row = QA_ROWS[i]
        assert row["question"] in ex.question and row["text"] in ex.context
        assert ex.metric == "part" and ex.answers == tuple(row["answers"])
        assert ex.meta["documents"] > 3  # the documents fill the length
        others = ex.context.replace(row["text"], "")
        assert not any(a in others for a in ex.answers)  # distractors never hold an answer


def test_metric_on_hand_made_outputs():
    refs = ["1234567", "7654321", "AbCdE", "zzz"]
    assert R.string_match("The numbers are 1234567 and 7654321.", refs, "all") == 0.5
    assert R.string_match("abcde 1234567 7654321 ZZZ", refs, "all") == 1.0
    assert R.string_match("nothing here", refs, "all") == 0.0
    assert R.string_match("It is zzz.", refs, "part") == 1.0
    assert R.string_match("none", refs, "part") == 0.0
    # RULER's postprocess_pred makes each control character a newline (it does not delete them)
    assert R.string_match("123\x004567", ["1234567"], "all") == 0.0
    assert R.string_match("\x001234567\n", ["1234567"], "all") == 1.0
    with pytest.raises(ValueError, match="metric must be 'all' or 'part'"):
        R.string_match("x", refs, "any")
    with pytest.raises(ValueError, match="references must not be empty"):
        R.string_match_all("x", [])


def test_bad_arguments_name_the_parameter():
    with pytest.raises(ValueError, match="subtask must be one of"):
        make("niah_single_9")
    with pytest.raises(ValueError, match="index must be an integer >= 0"):
        make("vt", -1)
    with pytest.raises(ValueError, match="too short for RULER's niah_single_1"):
        make("niah_single_1", length=140)
    with pytest.raises(ValueError, match="the qa subtask needs question-answer data"):
        R.make_example("qa", 0, length=900, count_tokens=words, resources=R.RulerResources(words=RES.words, vocab=RES.vocab))
