"""``summ``: summarisation, scored with ROUGE."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from kvpolicy.validation import check_bool

from .. import data as D, metrics as M
from ..display import Panel, metric_name
from .base import Sample, Task, TokenizerAdapter, describe_file, hub_only, register_task, sample_order

SUMMARY_HEAD = "Read the beginning of a scientific paper.\n\nPaper:\n"
SUMMARY_TAIL = (
    "\n\nSummarize the paper above in three sentences: the problem it addresses, its approach, and its outcome."
)


@dataclass
class SummarizationOptions:
    """``summ``'s settings."""

    equal_prompts: bool = False  # --data-dir: only prompts of at least --context tokens, cut to exactly it

    def __post_init__(self) -> None:
        check_bool("equal_prompts", self.equal_prompts)


@register_task
class SummarizationTask(Task):
    """ROUGE-1/2/L (F, stemmed) and their geometric mean (the BUZZ paper's "mean") of greedy
    summaries. Embedded: ACLSum papers (abstract removed, cut to exactly ``--context`` tokens, three
    reference sentences joined). ``--data-dir``: XSum 0-shot prompts of the H2O paper (as is)."""

    name = "summ"
    title = "Summarisation (ROUGE)"
    metric = "mean"
    metrics = ("rouge1", "rouge2", "rougeL", "mean")
    default_samples = 2
    default_context = 512
    default_max_new_tokens = 32
    help = "summarisation, ROUGE-1/2/L + geometric mean (embedded: ACLSum papers; --data-dir: XSum 0-shot)"
    Options = SummarizationOptions

    #: The BUZZ paper's own numbers (the report's separate section; never mixed into the tables).
    paper_table = {
        "rank": 0,
    "caption": "Paper, Table 2 (Llama-2-7B, XSum): mean ROUGE (geometric mean of R-1/2/L), %",
    "decimals": 1,
    "columns": ["60%", "50%", "40%", "30%", "20%", "10%"],
    "rows": {
        "BUZZ": [11.9, 12.1, 12.3, 11.9, 11.3, 10.9],
        "BUZZ (log n)": [12.3, 12.0, 12.0, 11.6, 11.6, 10.4],
        "H2O": [11.5, 11.4, 11.6, 11.4, 11.8, 10.2],
        "StreamingLLM": [11.9, 11.1, 11.2, 10.8, 10.0, 3.8],
        "Local": [7.6, 4.4, 2.9, 1.8, 1.4, 0.1],
    },
    }

    @classmethod
    def budget_panels(cls, task: dict[str, Any]) -> list[Any]:
        """One panel per ROUGE metric and their mean."""
        return [Panel(m, task["cells"], metric_name(m)) for m in task["metrics"]]

    @classmethod
    def add_arguments(cls, group: Any) -> None:
        group.add_argument("--equal-prompts", action="store_true",
                           help="summ/tw with --data-dir: keep only XSum prompts of at least --context tokens and cut each "
                           "to exactly --context, so they decode in batches (several times faster on CPU; changes which "
                           "articles are used, and how much of each)")

    @classmethod
    def options_from_args(cls, args: Any) -> SummarizationOptions:
        return SummarizationOptions(equal_prompts=getattr(args, "equal_prompts", False))

    def _examples(self) -> tuple[list[D.SummaryExample], bool]:
        if self.src.summaries is not None:
            self.data_note = f"{len(self.src.summaries)} in-memory summarisation examples"
            return list(self.src.summaries), any(e.is_prompt for e in self.src.summaries)
        if self.src.hub:
            with hub_only():
                ex = D.load_xsum()
            self.data_note = "XSum test split from the Hugging Face hub (EdinburghNLP/xsum), H2O's 0-shot template"
            return ex, True
        if self.src.paper:
            p = self.src.file("xsum_0shot.jsonl")
            self.data_note = f"XSum 0-shot prompts of the H2O paper, {describe_file(p)}"
            return D.load_xsum(p), True
        self.data_note = "ACLSum 0.1.2 test split (site-packages): paper text without its abstract; reference = the 3 aspect summaries joined"
        return D.load_aclsum("test"), False

    def samples(self, tok: TokenizerAdapter) -> list[Sample]:
        examples, paper = self._examples()
        out: list[Sample] = []
        if paper:
            limit = self.opt.context  # XSum: natural prompts, only cut when longer than --context
            equal = self.options.equal_prompts
            if equal and not limit:
                raise ValueError("--equal-prompts needs --context (the common prompt length)")
            cut = 0
            for i in sample_order(len(examples), self.opt.seed):
                ex = examples[i]
                text = D.format_summary_prompt(ex)
                ids = tok.prompt_ids(text)
                if equal and len(ids) < limit:
                    continue
                if limit and len(ids) > limit:
                    ids = self._cut_xsum(tok, text, limit)
                    cut += 1
                if equal and len(ids) != limit:
                    continue
                out.append(Sample(id=ex.id, kind="gen", input_ids=ids, prompt_length=len(ids),
                                  max_new_tokens=self.max_new_tokens, target={"references": [ex.reference]}))
                if len(out) == self.n_samples:
                    break
            lengths = [s.prompt_length for s in out] or [0]
            if equal:
                self.notes.append(
                    f"--equal-prompts: only prompts of at least {limit} tokens, each article cut so the prompt is exactly "
                    f"{limit} tokens (instruction kept), so they decode in batches; chat template applied: {tok.chat}"
                )
            else:
                self.notes.append(
                    f"prompts as in the file (chat template applied: {tok.chat}), {min(lengths)}-{max(lengths)} tokens "
                    f"(median {int(np.median(lengths))})" + (f"; {cut} articles cut to {limit} tokens" if cut else "")
                )
            return out
        length = self.opt.context or self.default_context
        head, tail = tok.head_ids(SUMMARY_HEAD), tok.tail_ids(SUMMARY_TAIL)
        room = length - len(head) - len(tail)
        if room < 16:
            raise ValueError(f"--context {length} leaves no room for the paper text (template takes {length - room})")
        for i in sample_order(len(examples), self.opt.seed):
            ex = examples[i]
            body = tok.encode(_drop_abstract(ex.prompt_or_article))
            if len(body) < room:
                continue
            out.append(Sample(id=ex.id, kind="gen", input_ids=head + body[:room] + tail, prompt_length=length,
                              max_new_tokens=self.max_new_tokens,
                              target={"references": [ex.reference]}))
            if len(out) == self.n_samples:
                break
        self.notes.append(f"each prompt exactly {length} tokens (paper text cut to fit); chat template: {tok.chat}")
        return out

    @staticmethod
    def _cut_xsum(tok: TokenizerAdapter, text: str, limit: int) -> list[int]:
        marker = "\n\nSummarize the above article"
        head, sep, tail = text.partition(marker)
        if not sep:
            return tok.prompt_ids(text)[:limit]
        head_ids = tok.head_ids(head)
        tail_ids = tok.tail_ids(sep + tail)
        keep = max(limit - len(tail_ids), 1)
        return head_ids[:keep] + tail_ids

    def score(self, sample: Sample, output: dict[str, Any]) -> dict[str, float]:
        text = output["text"].split("###")[0].strip()
        r = M.rouge(text, sample.target["references"])
        return {**r, "mean": M.rouge_mean(r)}

    def aggregate(self, scores: Sequence[dict[str, float]]) -> dict[str, float]:
        if not scores:
            return {}
        out = {k: float(np.mean([s[k] for s in scores])) for k in M.ROUGE_KEYS}
        out["mean"] = M.rouge_mean(out)
        return out

    def cli_flags(self) -> list[str]:
        return ["--equal-prompts"] if self.options.equal_prompts and self.src.paper else []


def _drop_abstract(text: str) -> str:
    """ACLSum full text without its abstract paragraph (the references paraphrase it)."""
    parts = text.split("\n\n")
    return "\n\n".join(p for p in parts if not p.startswith("Abstract\n"))
