"""The ``stream`` task of ``kvpolicy compare`` (the paper's perplexity protocol) on a tiny
random-weight Llama (float64) with a character-level stand-in tokenizer: wiring and numerics, not
language quality (the real-model numbers are in docs/results.md)."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from kvpolicy import create_policy  # noqa: E402
from kvpolicy_tools.eval import compare  # noqa: E402
from kvpolicy_tools.eval.tasks import StreamTask, TaskOptions  # noqa: E402
from kvpolicy_tools.models import tiny_llama  # noqa: E402
from tiny_eval import CharTokenizer, tiny_sources  # noqa: E402

POLICIES = ["full", "local", "streaming_llm", "h2o", "buzz", "buzz_logn"]
TOKENS, PREFILL, SIZE, BUDGET = 96, 32, 24, 0.3


@pytest.fixture(scope="module")
def model():
    return tiny_llama(num_layers=2, heads=4, kv_heads=2, head_dim=16, vocab=128, seed=1,
                      max_position_embeddings=1024).double()


@pytest.fixture(scope="module")
def stream(model, tmp_path_factory):
    out = tmp_path_factory.mktemp("stream")
    args = compare.build_parser().parse_args([
        "--model", "tiny-llama", "--tasks", "stream", "--policies", ",".join(POLICIES), "--budgets", str(BUDGET),
        "--cache-sizes", str(SIZE), "--samples", "2", "--stream-tokens", str(TOKENS), "--out", str(out),
        "--no-progress",
    ])
    assert compare.run(args, model=model, tokenizer=CharTokenizer(), sources=tiny_sources()) == 0
    return out, json.loads((out / "results.json").read_text())


def _hand_nll(model, ids, policy):
    """The protocol written out: prefill PREFILL tokens into a fresh evicting cache, then feed
    the next TOKENS tokens one at a time, each scoring the token after it (float64)."""
    from kvpolicy.hf import EvictingCache, cache_kwargs

    cache = EvictingCache(policy, model)
    nll = 0.0
    with torch.no_grad():
        model(ids[:, :PREFILL], **cache_kwargs(model, cache), use_cache=True)
        for t in range(PREFILL, PREFILL + TOKENS):
            logits = model(ids[:, t : t + 1], **cache_kwargs(model, cache), use_cache=True).logits[0, -1].double()
            nll -= float(torch.log_softmax(logits, dim=-1)[ids[0, t + 1]])
    return nll


def test_stream_perplexity_equals_a_hand_loop(model, stream):
    """Every cell's per-document negative log-likelihood equals a hand loop over the same tokens
    with the same (planned) cache, to 1e-6; the engine starts from a shared recorded prefill, the
    hand loop from the policy's own."""
    from kvpolicy_tools.eval.tasks import TokenizerAdapter

    _, res = stream
    task = res["tasks"]["stream"]
    tok = TokenizerAdapter(CharTokenizer())
    docs = {d.id: d for d in tiny_sources().ppl_docs}
    checked = 0
    for cell in task["cells"]:
        params = cell["plans"][0]["params"]
        for entry in cell["samples"]:
            text = docs[entry["id"]].text
            ids = torch.tensor([tok.encode(text, special=True)[: PREFILL + TOKENS + 1]])
            policy = create_policy(cell["policy"], **params)
            hand = _hand_nll(model, ids, policy)
            assert entry["scores"]["tokens"] == TOKENS
            assert entry["scores"]["nll"] == pytest.approx(hand, abs=1e-6), (cell["row"], cell["label"])
            assert entry["scores"]["ppl"] == pytest.approx(np.exp(hand / TOKENS), rel=1e-6)
            checked += 1
    assert checked == 2 * len(task["cells"])


def test_stream_cells_both_equalisations_side_by_side(stream):
    out, res = stream
    task = res["tasks"]["stream"]
    rows = {"local", "streaming_llm", "h2o", "buzz", "buzz_logn", "buzz_tw2.5"}
    labels = {f"size {SIZE}, equal mean", f"size {SIZE}, equal capacity", f"{BUDGET:.0%}, equal mean",
              f"{BUDGET:.0%}, equal capacity"}
    cells = {(c["row"], c["label"]): c for c in task["cells"]}
    assert ("full", "full") in cells
    assert {(r, lab) for r in rows for lab in labels} <= set(cells)
    full_avg = cells[("full", "full")]["average_cache"]
    for (row, label), c in cells.items():
        if row == "full":
            continue
        target = SIZE if label.startswith("size") else round(BUDGET * full_avg)
        assert c["decode_steps"] == TOKENS  # steps of the batch (both documents at once)
        if c["equalise"] == "capacity":
            assert c["capacity"] <= target
            assert c["average_cache"] <= c["capacity"]
        else:
            assert abs(c["average_cache"] - target) <= 0.1 * target + 1, (row, label)
        if row == "buzz_tw2.5":
            p = c["plans"][0]["params"]
            assert p["threshold"] == max(3, round(2.5 * p["window"]))
        if row == "buzz_logn":
            assert c["plans"][0]["params"]["log_floor"] == 0.0  # log n as written
        assert "--equalise " + c["equalise"] in c["command"]
        assert c["command"].startswith("kvpolicy compare --model tiny-llama --tasks stream --policies ")
    # equal capacity gives BUZZ a smaller average than equal mean (its cache cycles below its peak)
    assert (cells[("buzz", f"size {SIZE}, equal capacity")]["average_cache"]
            < cells[("buzz", f"size {SIZE}, equal mean")]["average_cache"])
    text = (out / "report.md").read_text()
    assert "(stream_stream.png)" in text and (out / "stream_stream.png").stat().st_size > 1000
    assert f"size {SIZE}, equal mean | size {SIZE}, equal capacity" in text  # side by side
    assert "cap " in text and "avg " in text
    assert "BUZZ (T/w 2.5)" in text and "Verdict (computed from the cells above)" in text
    assert "--stream-tokens 96 --stream-prefill 32 --equalise both --tw-ratios 2.5" in task["command"]


def test_stream_verdicts_say_losses_plainly(stream):
    from kvpolicy_tools.eval.report import verdicts

    _, res = stream
    fake = json.loads(json.dumps(res["tasks"]["stream"]))
    for c in fake["cells"]:
        c["metrics"]["ppl"] = {"buzz": 20.0, "h2o": 10.0}.get(c["row"], 30.0)
    lines = verdicts(fake)
    assert any(line.startswith("BUZZ beats every baseline at 0 of 4") and f"LOSES at size {SIZE}, equal mean (to H2O"
               in line for line in lines)


def test_default_run_carries_a_short_stream_task():
    assert "stream" in compare.task_names(None)
    args = compare.build_parser().parse_args([])
    args.default_run = True
    t = StreamTask(compare.task_options(args, "stream"), None, StreamTask.options_from_args(args))
    assert (t.n_samples, t.tokens, t.sizes, t.ratios) == (4, 128, (50,), ())
    assert {c.budget for c in t.configs(POLICIES, [0.1, 0.3])} == {None}
    full = StreamTask(TaskOptions(), None)  # --tasks stream: the full protocol
    assert (full.n_samples, full.tokens, full.sizes, full.ratios) == (16, 1024, (50, 100), (2.5,))
    labels = {c.label for c in full.configs(POLICIES, [0.1])}
    assert {"size 50, equal mean", "size 50, equal capacity", "10%, equal mean", "10%, equal capacity"} <= labels


def test_stream_argument_errors(model, tmp_path):
    for extra, message in ((["--stream-tokens", "0"], "--stream-tokens must be"),
                           (["--stream-prefill", "0"], "--stream-prefill must be")):
        args = compare.build_parser().parse_args(["--model", "tiny-llama", "--tasks", "stream", "--samples", "1",
                                                  "--out", str(tmp_path), "--no-progress", *extra])
        with pytest.raises(ValueError, match=message):
            compare.run(args, model=model, tokenizer=CharTokenizer(), sources=tiny_sources())
