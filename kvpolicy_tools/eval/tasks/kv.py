"""``kv``: lost-in-the-middle key-value retrieval, exact match."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .. import data as D
from .. import metrics as M
from .base import Sample, Task, TokenizerAdapter, describe_file, register_task, sample_order


@dataclass
class KVOptions:
    """``kv``'s settings: key-value pairs kept per example (``None``: all 75)."""

    kv_pairs: int | None = None


@register_task
class KVRetrievalTask(Task):
    """Lost-in-the-middle key-value retrieval (75 UUID pairs per example, or ``--kv-pairs``)."""

    name = "kv"
    title = "Key-value retrieval (exact match)"
    metric = "em"
    metrics = ("em",)
    default_samples = 2
    default_max_new_tokens = 40
    needs_data_dir = True
    data_file = "kv-retrieval-75_keys.jsonl.gz"
    help = "key-value retrieval, exact match (needs --data-dir; --kv-pairs to shorten)"
    Options = KVOptions

    @classmethod
    def add_arguments(cls, group: Any) -> None:
        group.add_argument("--kv-pairs", type=int, default=None,
                           help="kv: keep this many key-value pairs per example, gold included (default: all 75)")

    @classmethod
    def options_from_args(cls, args: Any) -> KVOptions:
        pairs = getattr(args, "kv_pairs", None)
        if pairs is not None and pairs < 1:  # 0 read as "not given" ran all 75 pairs
            raise ValueError(f"--kv-pairs must be >= 1 (the gold pair included), got {pairs}")
        return KVOptions(kv_pairs=pairs)

    def _examples(self) -> list[D.RetrievalExample]:
        if self.src.kv is not None:
            self.data_note = f"{len(self.src.kv)} in-memory KV examples"
            return list(self.src.kv)
        if self.src.hub:
            raise ValueError("the KV-retrieval task has no hub loader: pass --data-dir with " + self.data_file)
        p = self.src.file(self.data_file)
        self.data_note = f"lost-in-the-middle KV retrieval, {describe_file(p)}"
        return D.load_kv_retrieval(p)

    def samples(self, tok: TokenizerAdapter) -> list[Sample]:
        examples = self._examples()
        out: list[Sample] = []
        for i in sample_order(len(examples), self.opt.seed):
            ex = examples[i]
            if self.options.kv_pairs:
                ex = _subsample_kv(ex, self.options.kv_pairs)
            ids = tok.prompt_ids(D.format_kv_prompt(ex))
            out.append(Sample(id=ex.id, kind="gen", input_ids=ids, prompt_length=len(ids),
                              max_new_tokens=self.max_new_tokens, target={"answer": ex.answer}))
            if len(out) == self.n_samples:
                break
        lengths = [s.prompt_length for s in out] or [0]
        pairs = self.options.kv_pairs or "all (75)"
        self.notes.append(f"{pairs} pairs per example (gold kept at its relative position); prompts "
                          f"{min(lengths)}-{max(lengths)} tokens; EM = the value occurs in the generation")
        return out

    def score(self, sample: Sample, output: dict[str, Any]) -> dict[str, float]:
        return {"em": M.exact_match(output["text"], [sample.target["answer"]])}

    def cli_flags(self) -> list[str]:
        return [f"--kv-pairs {self.options.kv_pairs}"] if self.options.kv_pairs else []


_KV_RECORD = re.compile(r'"([^"]+)": "([^"]+)"')


def _subsample_kv(ex: D.RetrievalExample, k: int) -> D.RetrievalExample:
    records = _KV_RECORD.findall(ex.context)
    keys = [a for a, _ in records]
    if k >= len(records) or ex.key not in keys:
        return ex
    gi = keys.index(ex.key)
    others = [r for r in records if r[0] != ex.key][: k - 1]
    pos = int(round(gi * (k - 1) / max(len(records) - 1, 1)))
    others.insert(pos, records[gi])
    return D.RetrievalExample(id=ex.id, context=D.format_kv_records(others), question=ex.question,
                              answer=ex.answer, kind="kv", meta={**dict(ex.meta), "gold_index": pos, "n_pairs": k})
