"""RULER (``kvpolicy compare --tasks ruler``): the generators, the metric, the options and a tiny
end-to-end run.

The end-to-end run uses the tiny random-weight Llama (``kvpolicy_tools.models.tiny_llama``) with a
character-level stand-in tokenizer and an in-memory haystack, at 1,000 tokens (characters): it checks the
pipeline (samples, the question fed after the eviction, the report's subtask table and plot), not
scores (random weights score ~0); at 1,000 characters the subtasks with long prompts (vt, cwe) do not
fit and are left to the generator tests. The real-model numbers are in docs/results.md.
"""

from __future__ import annotations

import collections
import json
import random
import re
import string

import pytest

from kvpolicy_tools.eval import ruler_data as R
from kvpolicy_tools.eval.data import QAExample, Passage, TextDoc

# one pseudo-word vocabulary big enough for every generator (cwe draws hundreds of distinct words)
_RNG = random.Random(7)
_VOCAB = sorted({"".join(_RNG.choices(string.ascii_lowercase, k=_RNG.randint(4, 8))) for _ in range(1500)})
_TEXTS = [" ".join(_RNG.choice(_VOCAB) + ("." if _RNG.random() < 0.1 else "") for _ in range(3000)) for _ in range(2)]
_QA_ROWS = [{"question": f"what is item {i}?", "answers": [f"answer{i}x"], "title": f"Item {i}",
             "text": f"Item {i} is known as answer{i}x. " + " ".join(_RNG.choice(_VOCAB) for _ in range(60))}
            for i in range(40)]
RES = R.RulerResources(words=R.essay_words(_TEXTS), vocab=R.vocabulary(_TEXTS), qa_rows=_QA_ROWS)


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
        row = _QA_ROWS[i]
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
    assert R.string_match("123\x004567", ["1234567"], "all") == 1.0  # control characters removed first, as RULER
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


def test_options_and_cli_errors(capsys):
    from kvpolicy_tools.cli import main
    from kvpolicy_tools.eval.tasks import RulerOptions

    for kwargs, message in (({"length": 100}, "--ruler-length must be an integer in [256, 131072]"),
                            ({"question": "before"}, "--ruler-question must be 'after' or 'context'"),
                            ({"subtasks": ("vt", "nope")}, "--ruler-subtasks takes names from")):
        with pytest.raises(ValueError, match=re.escape(message)):
            RulerOptions(**kwargs)
    for argv, message in ((["--ruler-length", "100"], "--ruler-length must be"),
                          (["--compression-ratios", "0.5", "--budgets", "0.5"], "give one"),
                          (["--compression-ratios", "1.2"], "--compression-ratios must lie in (0, 1)"),
                          (["--ruler-subtasks", "qa"], "ruler's qa subtask needs --data-dir")):
        rc = main(["compare", "--tasks", "ruler", "--model", "no-such-model-dir", "--no-progress", *argv])
        err = capsys.readouterr().err
        assert rc == 2 and err.startswith("kvpolicy: error: ") and message in err, err


# =========================================================================== end to end
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("matplotlib")


class CharTokenizer:
    """Character-level stand-in for a Hugging Face tokenizer (no chat template, no EOS)."""

    chat_template = None
    eos_token_id = None
    ALPHA = string.ascii_lowercase + string.digits + " .,?!:;\n-\"'{}()[]#="

    def encode(self, text, add_special_tokens=False):
        return [3 + self.ALPHA.index(c) if c in self.ALPHA else 3 for c in text.lower()]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.ALPHA[i - 3] if 3 <= i < 3 + len(self.ALPHA) else "" for i in ids)


@pytest.fixture(scope="module")
def tiny():
    from kvpolicy_tools.models import tiny_llama

    return tiny_llama(num_layers=2, heads=4, kv_heads=2, head_dim=16, vocab=128, max_position_embeddings=1024)


def _run(tiny, out, *extra):
    from kvpolicy_tools.eval import compare
    from kvpolicy_tools.eval.tasks import DataSources

    qa = [QAExample(id=f"q{i}", question=r["question"], answers=tuple(r["answers"]),
                    documents=(Passage(title=r["title"], text=r["text"], is_gold=True),), gold_index=0)
          for i, r in enumerate(_QA_ROWS)]
    sources = DataSources(haystack=[TextDoc(id=f"t{i}", text=t) for i, t in enumerate(_TEXTS)], qa=qa)
    args = compare.build_parser().parse_args([
        "--model", "tiny-llama", "--tasks", "ruler", "--policies", "full,h2o,snapkv", "--compression-ratios", "0.5",
        "--samples", "1", "--ruler-length", "1000", "--max-new-tokens", "4",
        "--ruler-subtasks", "niah_single_1,niah_multikey_3,niah_multivalue,fwe,qa", "--out", str(out), "--no-progress", *extra])
    assert compare.run(args, model=tiny, tokenizer=CharTokenizer(), sources=sources) == 0
    return json.loads((out / "results.json").read_text())["tasks"]["ruler"]


def test_compare_ruler_end_to_end(tiny, tmp_path):
    after = _run(tiny, tmp_path / "after")
    assert {c["policy"] for c in after["cells"]} == {"full", "h2o", "snapkv"}
    for c in after["cells"]:
        assert set(c["groups"]) == {"niah_single_1", "niah_multikey_3", "niah_multivalue", "fwe", "qa"}
        assert 0.0 <= c["metrics"]["string_match"] <= 1.0
        # the headline is the mean over subtasks (one sample each)
        mean = sum(g["string_match"] for g in c["groups"].values()) / len(c["groups"])
        assert c["metrics"]["string_match"] == pytest.approx(mean)
    assert 900 <= after["prompt_tokens"]["max"] <= 1000 - 30
    assert "--ruler-question after" in after["command"] and "--budgets 0.5" in after["command"]
    report = (tmp_path / "after" / "report.md").read_text()
    assert "| policy | ratio (kvpress) |" in report and "| h2o | 0.50 |" in report
    assert (tmp_path / "after" / "ruler_subtasks.png").stat().st_size > 5000
    # the question fed after the eviction is decode steps: more of them than with the question inside
    inside = _run(tiny, tmp_path / "inside", "--ruler-question", "context", "--policies", "full",
                  "--ruler-subtasks", "niah_single_1")
    assert inside["decode_steps_per_sample"] == 4 - 1 and after["decode_steps_per_sample"] > 4 - 1 + 20
    assert "query_aware=True" in " ".join(inside["notes"]) and "query_aware=False" in " ".join(after["notes"])


def test_question_after_the_eviction_is_not_seen_by_it(tiny):
    """With the question after the eviction, SnapKV (a prefill policy) keeps the same context tokens
    whatever the question; with the question in the prefill, its observation window is the question."""
    from kvpolicy import SnapKV
    from kvpolicy_tools.eval.engine import Engine
    from kvpolicy_tools.eval.tasks import TokenizerAdapter

    tok = TokenizerAdapter(CharTokenizer())
    engine = Engine(tiny, tok)
    ctx = tok.head_ids(" ".join(_TEXTS[0].split()[:80]))
    kept = {}
    for q in ("\nwhat is the first word?", "\nname the last one please?"):
        ids = torch.tensor([ctx + tok.tail_ids(q)])
        for where, n in (("after", len(ctx)), ("inside", ids.shape[1])):
            rec, _ = engine.prefill(ids, n, None, rows=8)
            cache = engine.fork(rec, SnapKV(size=64, window=8))
            if where == "after":
                engine.feed(ids, n, ids.shape[1], cache)
            kept[where, q] = cache.layers[0].store.positions[..., :56].tolist()
    qs = ("\nwhat is the first word?", "\nname the last one please?")
    assert kept["after", qs[0]] == kept["after", qs[1]]
    assert kept["inside", qs[0]] != kept["inside", qs[1]]
