"""``ppl``: perplexity of each text window, token by token through the evicting cache."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from .. import data as D
from .. import metrics as M
from ..display import Panel, policy_name, row
from .base import CacheConfig, Sample, Task, TokenizerAdapter, describe_file, hub_only, is_reference, parse_ints, register_task, sample_order


def _document_samples(docs: Sequence[Any], tok: Any, need: int, prompt: int, m: int, *, n_samples: int, seed: int) -> list[Sample]:
    """The first ``need`` tokens of each document (in the seeded order) that has them, as
    perplexity samples: ``prompt`` prefilled, ``m`` scored; at most ``n_samples``."""
    out: list[Sample] = []
    for i in sample_order(len(docs), seed):
        d = docs[i]
        text = " ".join(d.text.split(" ")[: 2 * need + 64])  # enough words for `need` tokens, cheap to encode
        ids = tok.encode(text, special=True)
        if len(ids) < need:
            continue
        out.append(Sample(id=d.id, kind="ppl", input_ids=ids[:need], prompt_length=prompt, n_score=m,
                          target={"title": d.title}))
        if len(out) == n_samples:
            break
    return out


@dataclass
class PerplexityOptions:
    """``ppl``'s settings: tokens scored after the prefill, and fixed cache sizes run besides the budgets."""

    ppl_tokens: int = 24
    cache_sizes: tuple[int, ...] = ()


@register_task
class PerplexityTask(Task):
    """Perplexity of the last ``--ppl-tokens`` tokens of each text window, fed one token at a time
    through the evicting cache after an evicting prefill of the first ``--context`` tokens."""

    name = "ppl"
    title = "Perplexity (token by token through the evicting cache)"
    kind = "ppl"
    metric = "ppl"
    metrics = ("ppl",)
    higher_is_better = False
    default_samples = 8
    default_context = 448
    help = ("perplexity, token by token through the evicting cache (embedded: Wikipedia articles from gensim; "
            "--data-dir: wikitext-2 test); add fixed cache sizes with --cache-sizes (the paper's table: 50,100)")
    Options = PerplexityOptions

    #: The BUZZ paper's own numbers (the report's separate section; never mixed into the tables).
    paper_table = {
        "rank": 1,
    "caption": "Paper, perplexity table (Llama-2-7B, wikitext) at fixed cache sizes",
    "decimals": 3,
    "columns": ["BUZZ", "BUZZ (log n)", "H2O", "StreamingLLM", "Local", "Full"],
    "rows": {
        "cache 50": [9.394, 12.322, 9.987, 11.722, 194.803, 7.382],
        "cache 100": [8.037, 10.318, 8.881, 9.330, 35.979, 7.382],
    },
    }

    @classmethod
    def budget_panels(cls, task: dict[str, Any]) -> list[Any]:
        """Every policy on a log axis, and a linear zoom without the policy whose perplexity
        dwarfs the others' (its worst more than twice the next policy's worst: the local window at
        small budgets), chosen from the values, not by name."""
        metric = task["metric"]
        worst: dict[str, float] = {}
        for c in task["cells"]:
            v = c["metrics"].get(metric)
            if v is not None:
                worst[row(c)] = max(worst.get(row(c), v), v)
        ranked = sorted(worst, key=worst.__getitem__, reverse=True)
        panels = [Panel(metric, task["cells"], "all policies (log scale)")]
        if len(ranked) > 2 and worst[ranked[0]] > 2 * worst[ranked[1]]:
            panels.append(Panel(metric, [c for c in task["cells"] if row(c) != ranked[0]],
                                f"zoom: {policy_name(ranked[0])} left out", linear=True))
        else:
            panels.append(Panel(metric, task["cells"], "all policies (linear scale)", linear=True))
        return panels

    def run_flags(self, cache_sizes: Sequence[int] | None) -> list[str]:
        """``--context`` always (the tokens prefilled before scoring), no ``--max-new-tokens``."""
        return ["--context", str(self.opt.context or self.default_context)]

    def command_cache_sizes(self) -> Sequence[int] | None:
        """The run's ``--cache-sizes``."""
        return list(self.options.cache_sizes)

    @classmethod
    def add_arguments(cls, group: Any) -> None:
        group.add_argument("--cache-sizes", default=None,
                           help="ppl and stream: also run every policy at these fixed cache sizes in tokens (the paper's "
                           "perplexity table: 50,100); for ppl a size is an average number of keys per decode step, the "
                           "same for every policy (default: none); for stream see --equalise (default: 50,100)")
        group.add_argument("--ppl-tokens", type=int, default=24,
                           help="ppl: tokens fed one at a time and scored after the prefill (default %(default)s)")

    @classmethod
    def options_from_args(cls, args: Any) -> PerplexityOptions:
        sizes = tuple(parse_ints(getattr(args, "cache_sizes", None) or "none", "--cache-sizes"))
        if any(z < 1 for z in sizes):  # (it was read as a budget of 0 and blamed the budget, after the model loaded)
            raise ValueError(f"--cache-sizes must be >= 1 token, got {', '.join(str(z) for z in sizes if z < 1)}")
        return PerplexityOptions(ppl_tokens=getattr(args, "ppl_tokens", 24), cache_sizes=sizes)

    def check(self, policies: Sequence[str], budgets: Sequence[float]) -> None:
        if not budgets and not self.options.cache_sizes and not all(is_reference(p) for p in policies):
            raise ValueError("ppl: nothing to run: give --budgets or --cache-sizes")

    def configs(self, policies: Sequence[str], budgets: Sequence[float]) -> list[CacheConfig]:
        out = super().configs(policies, budgets)
        for size in self.options.cache_sizes:
            out.extend(CacheConfig(p, size=int(size)) for p in policies if not is_reference(p))
        return out

    def _docs(self) -> list[D.TextDoc]:
        if self.src.ppl_docs is not None:
            self.data_note = f"{len(self.src.ppl_docs)} in-memory documents"
            return list(self.src.ppl_docs)
        if self.src.hub:
            with hub_only():
                docs = D.load_wikitext()
            self.data_note = "wikitext-2-raw-v1 test split from the Hugging Face hub (articles)"
            return docs
        if self.src.paper:
            p = self.src.file("wikitext-2-raw-test.txt")
            self.data_note = f"wikitext-2-raw-v1 test, {describe_file(p)}, split into its {{n}} articles"
            return D.load_wikitext(p)
        self.data_note = "Wikipedia articles from gensim 4.4.0's test dump (site-packages; markup stripped)"
        return D.load_wiki_articles(min_words=1000)

    def _prefilled_then_scored(self, tok: TokenizerAdapter, prompt: int, m: int, how: str) -> list[Sample]:
        """Samples of ``prompt`` tokens prefilled then ``m`` scored one at a time (``how``: the
        note's words on the streamed part), with the note that says so."""
        need = prompt + m + 1
        out = self._document_samples(tok, need, prompt, m)
        self.notes.append(f"each sample: the first {need} tokens of a document (raw text, no chat template); {prompt} "
                          f"prefilled at once{how}")
        return out

    def _document_samples(self, tok: TokenizerAdapter, need: int, prompt: int, m: int) -> list[Sample]:
        """:func:`_document_samples` over this task's documents, with the data and shortage notes."""
        docs = self._docs()
        self.data_note = self.data_note.replace("{n}", str(len(docs)))
        out = _document_samples(docs, tok, need, prompt, m, n_samples=self.n_samples, seed=self.opt.seed)
        if len(out) < self.n_samples:
            self.notes.append(f"only {len(out)} documents have the {need} tokens needed")
        return out

    def samples(self, tok: TokenizerAdapter) -> list[Sample]:
        m = self.options.ppl_tokens
        return self._prefilled_then_scored(
            tok, self.opt.context or self.default_context, m,
            f" (the policy evicts after the prefill), then {m} tokens fed one at a time, each next-token prediction scored",
        )

    def score(self, sample: Sample, output: dict[str, Any]) -> dict[str, float]:
        return {"nll": float(output["nll"]), "tokens": float(output["tokens"]),
                "ppl": M.perplexity_from_nll(float(output["nll"]), int(output["tokens"]))}

    def aggregate(self, scores: Sequence[dict[str, float]]) -> dict[str, float]:
        if not scores:
            return {}
        nll = sum(s["nll"] for s in scores)
        n = int(sum(s["tokens"] for s in scores))
        return {"ppl": M.perplexity_from_nll(nll, n), "tokens": float(n)}

    def cli_flags(self) -> list[str]:
        flags = [f"--ppl-tokens {self.options.ppl_tokens}"]
        return flags
