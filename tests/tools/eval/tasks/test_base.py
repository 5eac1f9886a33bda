"""kvpolicy_tools/eval/tasks/base.py: ``Task``, the registry and ``tw_window``.

Eval tasks as plug-ins (issue 12): a task defined outside the package, registered with
``register_task`` or through the ``kvpolicy.tasks`` entry point group, contributes its flags and
runs through ``kvpolicy compare`` like the built-ins; results are typed; a fixed seed gives the
same results twice. Uses a tiny random-weight Llama and a character tokenizer (fast)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvpolicy_tools.eval import compare  # noqa: E402
from kvpolicy_tools.eval.results import CellResult, TaskResult  # noqa: E402
from kvpolicy_tools.eval.tasks import Sample, Task, TaskOptions, register_task, task_registry, unregister_task  # noqa: E402
from tiny_eval import CharTokenizer, tiny_sources  # noqa: E402


class WordCountTask(Task):
    """A toy task from outside the package: one prompt of ``--toy-words`` words; the score is how
    many words the model's answer has."""

    name = "toy_words"
    title = "Toy: words answered"
    metric = "words"
    metrics = ("words",)
    default_samples = 1
    default_max_new_tokens = 4
    help = "toy (tests): a prompt of --toy-words words, scored by the answer's word count"

    @dataclass
    class Options:
        words: int = 30

    @classmethod
    def add_arguments(cls, group: Any) -> None:
        group.add_argument("--toy-words", type=int, default=30, help="toy_words: words in the prompt")

    @classmethod
    def options_from_args(cls, args: Any) -> Any:
        return cls.Options(words=args.toy_words)

    def samples(self, tok):
        ids = tok.prompt_ids(" ".join(["cat"] * self.options.words))
        return [Sample(id="toy-0", kind="gen", input_ids=ids, prompt_length=len(ids),
                       max_new_tokens=self.max_new_tokens, target={})]

    def score(self, sample, output):
        return {"words": float(len(output["text"].split()))}


@pytest.fixture()
def registered():
    register_task(WordCountTask)
    yield WordCountTask
    unregister_task("toy_words")


def _run(tmp_path, *extra, model) -> dict[str, Any]:
    args = compare.build_parser().parse_args(["--model", "tiny-llama", "--policies", "full,h2o", "--budgets", "0.5",
                                              "--out", str(tmp_path), "--no-progress", *extra])
    assert compare.run(args, model=model, tokenizer=CharTokenizer(), sources=tiny_sources()) == 0
    return json.loads((tmp_path / "results.json").read_text())


@pytest.fixture(scope="module")
def model():
    from kvpolicy_tools.models import tiny_llama

    return tiny_llama(num_layers=2, heads=4, kv_heads=2, head_dim=16, vocab=128, max_position_embeddings=1024)


def test_a_task_from_outside_runs_through_compare(registered, model, tmp_path) -> None:
    help_text = compare.build_parser().format_help()
    assert "toy_words" in help_text and "--toy-words" in help_text  # listed, and its flag contributed
    res = _run(tmp_path, "--tasks", "toy_words", "--toy-words", "12", model=model)
    task = res["tasks"]["toy_words"]
    assert task["title"] == "Toy: words answered" and task["n_samples"] == 1
    assert {c["policy"] for c in task["cells"]} == {"full", "h2o"}
    assert all("words" in c["metrics"] for c in task["cells"])
    from kvpolicy_tools.eval.tasks import TokenizerAdapter

    want = len(TokenizerAdapter(CharTokenizer()).prompt_ids(" ".join(["cat"] * 12)))
    assert task["prompt_tokens"]["max"] == want  # its own option (--toy-words 12) reached it


def test_a_task_from_an_entry_point(model, tmp_path, monkeypatch) -> None:
    import importlib.metadata

    class FakeEntryPoint:
        name = "toy_words"

        def load(self):
            return WordCountTask

    real = importlib.metadata.entry_points
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda **kw: [FakeEntryPoint()] if kw.get("group") == "kvpolicy.tasks" else real(**kw))
    try:
        assert "toy_words" in task_registry(reload_entry_points=True)
        res = _run(tmp_path, "--tasks", "toy_words", model=model)
        assert "toy_words" in res["tasks"]
    finally:
        unregister_task("toy_words")


@pytest.mark.parametrize("target, message", [(None, "failed to load: ImportError"), (len, "not a Task subclass")])
def test_a_broken_entry_point_is_named(monkeypatch, target, message) -> None:
    """A plug-in that does not import, or names something other than a task, is a ValueError
    naming the entry point (the user may not know which package brought it)."""
    import importlib.metadata

    class BrokenEntryPoint:
        name, value = "broken", "somepkg.tasks:Broken"

        def load(self):
            if target is None:
                raise ImportError("no module named somepkg")
            return target

    real = importlib.metadata.entry_points
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda **kw: [BrokenEntryPoint()] if kw.get("group") == "kvpolicy.tasks" else real(**kw))
    with pytest.raises(ValueError, match=rf"kvpolicy.tasks entry point 'broken' \(somepkg.tasks:Broken\) .*{message}"):
        task_registry(reload_entry_points=True)
    monkeypatch.undo()
    assert "broken" not in task_registry(reload_entry_points=True)


def test_task_specific_checks_and_flags_live_in_the_task(tmp_path) -> None:
    """compare names no task: ppl's "nothing to run" check is PerplexityTask.check, and qa's
    --qa-distractors is QATask's own option (and in its rerun command)."""
    from kvpolicy_tools.eval.tasks import DataSources, QATask, make_tasks

    args = compare.build_parser().parse_args(["--tasks", "ppl", "--policies", "h2o", "--budgets", "none",
                                              "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="ppl: nothing to run: give --budgets or --cache-sizes"):
        compare.run(args, model=object(), tokenizer=CharTokenizer(), sources=tiny_sources())
    args = compare.build_parser().parse_args(["--tasks", "qa", "--qa-distractors", "my pool.json"])
    options = QATask.options_from_args(args)
    assert options.distractors == "my pool.json"
    (task,) = make_tasks(["qa"], TaskOptions(), DataSources(data_dir=str(tmp_path)), {"qa": options})
    assert "--qa-distractors 'my pool.json'" in task.cli_flags()


def test_registration_errors() -> None:
    with pytest.raises(ValueError, match="Task subclass with a name"):
        register_task(object)  # type: ignore[arg-type]

    class Other(Task):
        name = "ppl"

    with pytest.raises(ValueError, match="task name 'ppl' is taken"):
        register_task(Other)
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        unregister_task("nope")


def test_results_are_typed_and_a_fixed_seed_repeats_them(model, tmp_path) -> None:
    """evaluate() returns TaskResult / CellResult; two runs with the same seed write the same
    results (every number and command; only timings differ)."""
    from kvpolicy_tools.eval.engine import evaluate
    from kvpolicy_tools.eval.tasks import TokenizerAdapter, make_tasks

    tasks = make_tasks(["ppl"], TaskOptions(samples=1, context=48), tiny_sources())
    out = evaluate(model, TokenizerAdapter(CharTokenizer()), tasks, ["full", "h2o"], [0.5], progress=False)
    assert isinstance(out["ppl"], TaskResult) and all(isinstance(c, CellResult) for c in out["ppl"].cells)

    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in ("seconds", "meta")}
        return [strip(v) for v in x] if isinstance(x, list) else x

    a = _run(tmp_path / "a", "--tasks", "ppl,needle", "--samples", "ppl=2,needle=1", "--context", "ppl=64",
             "--ppl-tokens", "8", "--needle-lengths", "400", "--needle-depths", "0.5", "--seed", "3", model=model)
    b = _run(tmp_path / "b", "--tasks", "ppl,needle", "--samples", "ppl=2,needle=1", "--context", "ppl=64",
             "--ppl-tokens", "8", "--needle-lengths", "400", "--needle-depths", "0.5", "--seed", "3", model=model)
    assert strip(a["tasks"]) == strip(b["tasks"])


# ---------------------------------------------------------------------------- tw_window: the window that holds a cache size in the long run
from kvpolicy import BUZZ  # noqa: E402
from kvpolicy_tools.eval.tasks import tw_window  # noqa: E402


def test_tw_window_gives_the_long_run_cache_size():
    import numpy as np

    from kvpolicy.budget import simulate_sizes

    for ratio in (1.5, 4.33, 6.5):
        w = tw_window(ratio, 200)
        p = BUZZ(sink=4, window=w, stride=5, threshold=max(3, round(ratio * w)))
        assert abs(np.mean(simulate_sizes(p, 6000, 0)[2000:]) - 200) < 5  # streaming, long after the start


def test_kvpress_policy_takes_the_press_defaults_where_the_preset_differs() -> None:
    """Under kvpress's protocol SnapKV runs as ``SnapKVPress()`` does: an observation window of 64
    and a kernel of 5 (the registry preset plans at most 32); every other parameter is planned."""
    from kvpolicy_tools.eval.tasks.base import kvpress_policy

    snap = kvpress_policy("snapkv", 0.5, 1000).policy
    assert (snap.size, snap.window, snap.kernel) == (500, 64, 5)
    assert kvpress_policy("knorm", 0.25, 1000).policy.size == 750
    # AdaKVPress(SnapKVPress()): its scorer's window and kernel likewise (5 of 12 RULER answers
    # were kvpress's with the preset's window)
    scorer = kvpress_policy("adakv_snapkv", 0.5, 1000).policy.scorer
    assert (scorer.size, scorer.window, scorer.kernel) == (500, 64, 5)
