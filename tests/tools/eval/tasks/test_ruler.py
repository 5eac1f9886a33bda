"""RULER (``kvpolicy compare --tasks ruler``, kvpolicy_tools/eval/tasks/ruler.py): the options and a tiny
end-to-end run (the generators and the metric: tests/tools/eval/test_ruler_data.py).

The end-to-end run uses the tiny random-weight Llama (``kvpolicy_tools.models.tiny_llama``) with a
character-level stand-in tokenizer and an in-memory haystack, at 1,000 tokens (characters): it checks the
pipeline (samples, the question fed after the eviction, the report's subtask table and plot), not
scores (random weights score ~0); at 1,000 characters the subtasks with long prompts (vt, cwe) do not
fit and are left to the generator tests. The real-model numbers are in docs/results.md.
"""

from __future__ import annotations

import json
import re
import string

import pytest

from kvpolicy_tools.eval.data import QAExample, Passage, TextDoc
from ruler_texts import QA_ROWS, TEXTS


def test_options_and_cli_errors(capsys):
    from kvpolicy_tools.cli import main
    from kvpolicy_tools.eval.tasks import RulerOptions

    for kwargs, message in (({"length": 100}, "--ruler-length must be an integer in [256, 131072]"),
                            ({"question": "before"}, "--ruler-question must be 'after' or 'context'"),
                            ({"subtasks": ("vt", "nope")}, "--ruler-subtasks takes names from"),
                            ({"protocol": "press"}, "--ruler-protocol must be one of decode, kvpress")):
        with pytest.raises(ValueError, match=re.escape(message)):
            RulerOptions(**kwargs)
    for argv, message in ((["--ruler-length", "100"], "--ruler-length must be"),
                          (["--compression-ratios", "0.5", "--budgets", "0.5"], "give one"),
                          (["--compression-ratios", "1.2"], "--compression-ratios must lie in (0, 1)"),
                          (["--ruler-subtasks", "qa"], "ruler's qa subtask needs --data-dir"),
                          (["--ruler-protocol", "kvpress", "--policies", "full,knorm,buzz", "--ruler-subtasks", "vt"],
                           "policy 'buzz' cannot run under kvpress's protocol (--ruler-protocol kvpress): policy must rank "
                           "tokens by a score")):
        rc = main(["compare", "--tasks", "ruler", "--model", "no-such-model-dir", "--no-progress", *argv])
        err = capsys.readouterr().err
        assert rc == 2 and err.startswith("kvpolicy: error: ") and message in err, err



def _qa_samples(data_dir):
    """The ruler task's qa samples from ``data_dir`` (no model: the samples are built before it runs)."""
    from tiny_eval import CharTokenizer as TinyTokenizer
    from kvpolicy_tools.eval.tasks import DataSources, RulerOptions, TaskOptions, TokenizerAdapter, make_tasks

    task, = make_tasks(["ruler"], TaskOptions(samples=1), DataSources(data_dir=str(data_dir)),
                       {"ruler": RulerOptions(length=1000, subtasks=("qa",))})
    return task.samples(TokenizerAdapter(TinyTokenizer()))


@pytest.mark.parametrize("bad", [{"answers": "Paris"}, {"ctxs": [{"title": "France", "isgold": True}]}, "no question"],
                         ids=["string answers", "gold without text", "no question"])
def test_ruler_qa_refuses_a_malformed_nq_row_naming_file_and_line(tmp_path, bad):
    """Issue 44 class 5: --ruler-subtasks qa split string answers into letters (a random model scored
    100%); class 12: a missing key or a context without text gave a traceback naming neither file nor
    row. Each is refused with the file, the line and what is wrong."""
    from eval_files import write_jsonl

    good = {"question": QA_ROWS[0]["question"], "answers": list(QA_ROWS[0]["answers"]),
            "ctxs": [{"title": QA_ROWS[0]["title"], "text": QA_ROWS[0]["text"], "isgold": True}]}
    row = {k: v for k, v in good.items() if k != "question"} if bad == "no question" else {**good, **bad}
    p = write_jsonl(tmp_path / "nq-open-oracle.jsonl.gz", [good, row], gz=True)
    message = {"string answers": "'answers' must be a list of strings (e.g. ['Paris']), got the string 'Paris'",
               "gold without text": "the gold passage (ctxs[0]) must have a non-empty 'text', got None",
               "no question": "the record has no 'question' key"}
    key = "no question" if bad == "no question" else "string answers" if "answers" in bad else "gold without text"
    with pytest.raises(ValueError, match="^" + re.escape(f"{p}:2: {message[key]}")):
        _qa_samples(tmp_path)
    write_jsonl(p, [good], gz=True)
    assert len(_qa_samples(tmp_path)) == 1  # the well-formed file serves


def test_ruler_qa_with_an_empty_data_file_names_it(tmp_path):
    """Issue 44 class 12: an empty nq-open-oracle.jsonl.gz said "pass --data-dir" although it was passed."""
    from eval_files import write_jsonl

    p = write_jsonl(tmp_path / "nq-open-oracle.jsonl.gz", [], gz=True)
    with pytest.raises(ValueError, match="^" + re.escape(f"{p}: no records (the file is empty or blank)")):
        _qa_samples(tmp_path)


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
          for i, r in enumerate(QA_ROWS)]
    sources = DataSources(haystack=[TextDoc(id=f"t{i}", text=t) for i, t in enumerate(TEXTS)], qa=qa)
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
    assert "| policy | ratio (decode) |" in report and "| h2o | 0.50 |" in report
    assert "under kvpolicy's decode-time protocol" in report and after["protocol"] == "decode"
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
    ctx = tok.head_ids(" ".join(TEXTS[0].split()[:80]))
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


def test_kvpress_protocol_compresses_the_context_once_and_keeps_the_question_and_answer(tiny, tmp_path):
    """``--ruler-protocol kvpress``: each policy runs as kvpolicy.prefill_only at ratio r, so every
    layer keeps int(n (1 - r)) of the n context tokens per head and then every question and answer
    token: the average cache over the decode steps is that plus the steps' own tokens, exactly; the
    report names the protocol and defines the ratio as kvpress does."""
    res = _run(tiny, tmp_path / "kvpress", "--ruler-protocol", "kvpress", "--policies", "full,knorm,snapkv,adakv_keydiff",
               "--ruler-subtasks", "niah_single_1")
    assert res["protocol"] == "kvpress" and "compression_ratio" in res["ratio_definition"]
    assert "--ruler-protocol kvpress" in res["command"]
    steps = res["decode_steps_per_sample"]
    for c in res["cells"]:
        if c["policy"] == "full":
            continue
        (plan,) = c["plans"]
        n = plan["prompt_length"]
        k = int(n * 0.5)
        assert (plan["protocol"], plan["compression_ratio"], plan["kept_context_tokens"], plan["capacity"]) == ("kvpress", 0.5, k, None)
        assert plan["policy"] == "prefill_only" and c["label"] == "ratio 0.5"
        # decode step i attends the k kept tokens, the i earlier steps' tokens and its own
        assert c["average_cache"] == pytest.approx(k + (steps + 1) / 2)
    report = (tmp_path / "kvpress" / "report.md").read_text()
    assert "| policy | ratio (kvpress) |" in report and "under kvpress's protocol" in report


def test_kvzip_runs_its_reconstruction_under_kvpress_protocol(tiny, tmp_path):
    """``--policies kvzip,kvzip_headwise --ruler-protocol kvpress``: after the context's prefill each
    runs its context reconstruction, then keeps int(n (1 - r)) tokens per head (on average over the
    heads for the head-wise one) and every question and answer token."""
    res = _run(tiny, tmp_path / "kvzip", "--ruler-protocol", "kvpress", "--policies", "full,kvzip,kvzip_headwise",
               "--ruler-subtasks", "niah_single_1")
    steps = res["decode_steps_per_sample"]
    ran = set()
    for c in res["cells"]:
        if c["policy"] == "full":
            continue
        (plan,) = c["plans"]
        k = int(plan["prompt_length"] * 0.5)
        assert plan["kept_context_tokens"] == k and plan["capacity"] is None
        assert c["average_cache"] == pytest.approx(k + (steps + 1) / 2)
        ran.add(c["policy"])
    assert ran == {"kvzip", "kvzip_headwise"}
