"""kvpolicy_tools/eval/data/kv_retrieval.py: key-value retrieval records and prompt, tiny and real."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpolicy_tools.eval.data import RetrievalExample, format_kv_prompt, load_kv_retrieval
from eval_files import shared, write_jsonl


def test_kv_retrieval_tiny_and_prompt(tmp_path: Path) -> None:
    rows = [{"ordered_kv_records": [["test key1", "test value1"], ["test key2", "test value2"], ["test key3", "test value3"]],
             "key": "test key2", "value": "test value2"}]
    p = write_jsonl(tmp_path / "kv.jsonl.gz", rows, gz=True)
    (ex,) = load_kv_retrieval(p)
    assert isinstance(ex, RetrievalExample) and ex.key == "test key2" and ex.value == "test value2"
    assert ex.meta["gold_index"] == 1
    # matches lost-in-the-middle's own test of get_kv_retrieval_prompt
    assert format_kv_prompt(ex) == "\n".join([
        "Extract the value corresponding to the specified key in the JSON object below.",
        "",
        "JSON data:",
        '{"test key1": "test value1",',
        ' "test key2": "test value2",',
        ' "test key3": "test value3"}',
        "",
        'Key: "test key2"',
        "Corresponding value:",
    ])
    (moved,) = load_kv_retrieval(p, gold_index=2)
    assert moved.context.endswith('"test key2": "test value2"}') and moved.meta["gold_index"] == 2
    with pytest.raises(ValueError):
        load_kv_retrieval(p, gold_index=3)


def test_real_kv_retrieval() -> None:
    p = shared("kv-retrieval-75_keys.jsonl.gz")
    ex = load_kv_retrieval(p)
    assert len(ex) == 500
    for e in ex[:50]:
        assert e.meta["n_pairs"] == 75
        assert f'"{e.key}": "{e.value}"' in e.context
        assert format_kv_prompt(e).endswith(f'Key: "{e.key}"\nCorresponding value:')
    assert [e.meta["gold_index"] for e in load_kv_retrieval(p, limit=5, gold_index=0)] == [0] * 5


@pytest.mark.parametrize("value,message", [
    ("zzz", "value 'zzz' is not the value of key 'a' in ordered_kv_records ('b')"),
    (["b"], "'value' must be a string, got list ['b']"),
])
def test_a_row_whose_answer_is_not_its_keys_value_is_refused(tmp_path: Path, value, message) -> None:
    """Issue 44's re-probe: a row whose `value` is not what the context gives its key (or a list,
    read as its repr) was accepted, so a correct generation scored 0."""
    p = write_jsonl(tmp_path / "kv.jsonl", [{"ordered_kv_records": [["a", "b"], ["c", "d"]], "key": "a", "value": value}])
    with pytest.raises(ValueError, match="kv.jsonl:1: ") as e:
        load_kv_retrieval(p)
    assert message in str(e.value)
