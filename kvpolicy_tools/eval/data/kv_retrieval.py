"""Lost-in-the-middle key-value retrieval (75 keys): a JSON object, one key asked."""

from __future__ import annotations

import os
from collections.abc import Sequence

from .common import RetrievalExample, given_or_shared, read_records, record_errors, select_rows

__all__ = ["KV_INSTRUCTION", "format_kv_records", "load_kv_retrieval", "format_kv_prompt"]


KV_INSTRUCTION = "Extract the value corresponding to the specified key in the JSON object below."


def format_kv_records(records: Sequence[Sequence[str]]) -> str:
    """The JSON-object context of the key-value retrieval task, one ``"key": "value"`` pair a line.

    Example:
        >>> print(format_kv_records([("a", "1"), ("b", "2")]))
        {"a": "1",
         "b": "2"}
    """
    parts = []
    for k, (key, value) in enumerate(records):
        start = "{" if k == 0 else " "
        end = ",\n" if k != len(records) - 1 else "}"
        parts.append(f'{start}"{key}": "{value}"{end}')
    return "".join(parts)


def load_kv_retrieval(
    path: str | os.PathLike[str] | None = None,
    limit: int | None = None,
    *,
    seed: int | None = None,
    gold_index: int | None = None,
) -> list[RetrievalExample]:
    """Lost-in-the-middle KV retrieval (``kv-retrieval-75_keys.jsonl.gz``).

    ``context`` is the JSON-dict text of ``ordered_kv_records``; with ``gold_index`` the
    queried pair is moved to that position first (as in the paper's position sweeps).
    """
    p = given_or_shared(path, "kv-retrieval-75_keys.jsonl.gz", "KV-retrieval jsonl",
                        "https://github.com/nelson-liu/lost-in-the-middle (kv_retrieval_data/)")
    rows = read_records(p)
    out: list[RetrievalExample] = []
    for i in select_rows(len(rows), limit, seed):
        line, r = rows[i]
        with record_errors(p, line):
            for field in ("key", "value"):  # a list or a number would become its repr: an answer nobody writes
                if not isinstance(r[field], str):
                    raise ValueError(f"{field!r} must be a string, got {type(r[field]).__name__} {r[field]!r}")
            records = [(str(k), str(v)) for k, v in r["ordered_kv_records"]]
        keys = [k for k, _ in records]
        if r["key"] not in keys:
            raise ValueError(f"{p}:{line}: key {r['key']!r} is not among the record's ordered_kv_records")
        pos = keys.index(r["key"])
        if records[pos][1] != r["value"]:  # the gold answer is the value the context gives the key
            raise ValueError(
                f"{p}:{line}: value {r['value']!r} is not the value of key {r['key']!r} in ordered_kv_records "
                f"({records[pos][1]!r})"
            )
        if gold_index is not None:
            if not 0 <= gold_index < len(records):
                raise ValueError(f"gold_index {gold_index} outside [0, {len(records)})")
            records.insert(gold_index, records.pop(pos))
            pos = gold_index
        out.append(
            RetrievalExample(
                id=f"kv-{i}",
                context=format_kv_records(records),
                question=str(r["key"]),
                answer=str(r["value"]),
                kind="kv",
                meta={"row": i, "gold_index": pos, "n_pairs": len(records)},
            )
        )
    return out


def format_kv_prompt(example: RetrievalExample) -> str:
    """Lost-in-the-middle ``kv_retrieval.prompt`` text."""
    return f'{KV_INSTRUCTION}\n\nJSON data:\n{example.context}\n\nKey: "{example.key}"\nCorresponding value:'
