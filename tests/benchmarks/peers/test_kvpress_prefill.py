"""benchmarks/peers/kvpress_prefill.py (kvpress's side of the time to first token, issue 40): what
can be checked without kvpress's venv (benchmarks/peers/setup_kvpress.sh), which is not run here:
its presses are the kvpolicy policies of the same name, its prompt is prefill_time.py's, and bad
flags stop it before kvpress is imported."""

from __future__ import annotations

import pytest

from kvpolicy import get_policy


@pytest.fixture(scope="module")
def kvpress_prefill(benchmark_module):
    return benchmark_module("peers/kvpress_prefill")  # (tests/benchmarks/conftest.py)


def test_every_press_is_a_registered_policy_and_an_unknown_one_is_refused(kvpress_prefill) -> None:
    for name in kvpress_prefill.PRESSES:
        assert get_policy(name).name == name
    with pytest.raises(ValueError, match="press must be one of"):
        kvpress_prefill.build_press("h2o", 0.5)


@pytest.mark.parametrize("flags, message", [
    (["--compression", "1.0"], "--compression must be in"),
    (["--repeats", "0"], "must be >= 1"),
    (["--presses", "knorm,h2o"], "unknown h2o"),
])
def test_bad_flags_stop_before_kvpress(kvpress_prefill, flags, message) -> None:
    with pytest.raises(SystemExit, match=message):
        kvpress_prefill.main(["--model-dir", "unused", *flags])


def test_the_prompt_is_prefill_times(kvpress_prefill, benchmark_module, tmp_path) -> None:
    """The same text through the same tokenizer gives prefill_time.py's ids (repeated when short);
    a character tokenizer stands in for the model's."""
    torch = pytest.importorskip("torch")

    def tokenizer(text, return_tensors):
        return {"input_ids": torch.tensor([[ord(c) for c in text]])}

    path = tmp_path / "text.txt"
    path.write_text("abcde", encoding="utf-8")
    ours = benchmark_module("prefill_time").prompt_ids(tokenizer, path, 12)
    theirs = kvpress_prefill.prompt_ids(tokenizer, path, 12)
    assert torch.equal(ours, theirs) and theirs.tolist() == [[97, 98, 99, 100, 101] * 2 + [97, 98]]
