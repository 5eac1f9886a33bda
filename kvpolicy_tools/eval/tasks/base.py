"""The base of ``kvpolicy compare``'s evaluation tasks: samples, cache configurations, data
sources, the :class:`Task` base class and the task registry.

A task turns data (package-shipped text by default, the paper's files with ``--data-dir``) into
:class:`Sample` objects (token ids ready for the model) and lists the :class:`CacheConfig` cells to
run (policy x budget, policy x fixed cache size, or BUZZ x T/w). The engine in
:mod:`kvpolicy_tools.eval.compare` prefills each prompt once, runs every configuration's decode through
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
import importlib.metadata
import os
from collections.abc import Iterable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from kvpolicy.budget import PolicyPlan, plan_capacity, plan_policy, simulate_sizes
from kvpolicy.driver import evict_until_done
from kvpolicy.policies import BUZZ, prefill_only
from kvpolicy.policies.buzz import estimate_threshold, window_for_size
from kvpolicy.policy import EvictionPolicy
from kvpolicy.registry import Preset, get_policy

from .. import data as D
from ..display import REFERENCE_KIND, Panel, fmt, metric_name

__all__ = [
    "CacheConfig",
    "budget_label",
    "DEFAULT_TASKS",
    "DataSources",
    "NoOptions",
    "PAPER_TASKS",
    "Sample",
    "TASKS",
    "TASK_ENTRY_POINT_GROUP",
    "Task",
    "TaskOptions",
    "TokenizerAdapter",
    "describe_file",
    "hub_only",
    "is_reference",
    "log_n_variant_of",
    "policy_class",
    "takes_threshold_ratio",
    "kvpress_policy",
    "make_tasks",
    "parse_floats",
    "parse_ints",
    "register_task",
    "replace_flag",
    "sample_order",
    "simulate_chunked_sizes",
    "split_csv",
    "task_registry",
    "tw_window",
    "unregister_task",
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
    #: ``gen``: the last ``question_length`` prompt tokens (the question) are fed after the prefill's
    #: eviction, one at a time, as decode steps, so the eviction after the prefill never sees them
    #: (kvpress's default, ``query_aware=False``); 0: the whole prompt is prefilled and compressed.
    question_length: int = 0

    @property
    def is_perplexity(self) -> bool:
        """A perplexity sample (kind ``"ppl"``): its text is fed token by token after the prefill and
        each next-token prediction scored; otherwise tokens are generated (kind ``"gen"``)."""
        return self.kind == "ppl"

    @property
    def prefill_length(self) -> int:
        """Prompt tokens prefilled before the policy's first eviction."""
        return self.prompt_length - self.question_length

    @property
    def decode_steps(self) -> int:
        """Decode steps (forwards of one token) this sample runs at most, a question fed after the
        prefill's eviction included."""
        return self.n_score if self.is_perplexity else max(self.max_new_tokens - 1, 0) + self.question_length


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
    #: ``"decode"``: the policy planned for the budget over the decode steps (kvpolicy's own
    #: protocol); ``"kvpress"``: the policy run as kvpress runs a press, ``prefill_only(policy,
    #: 1 - budget)``: the prompt compressed once, every later token kept (:func:`kvpress_policy`).
    protocol: str = "decode"

    @property
    def row(self) -> str:
        """The table row: the policy, or ``buzz_tw<r>`` for a BUZZ at another T/w."""
        return self.policy if self.variant_ratio is None else f"{self.policy}_tw{self.variant_ratio:g}"

    @property
    def label(self) -> str:
        if is_reference(self.policy):
            return "full"
        if self.protocol == "kvpress" and self.budget is not None:
            return f"ratio {1 - self.budget:g}"
        if self.ratio is not None:
            return f"T/w={self.ratio:g}"
        if self.size is not None:
            base = f"size {self.size}"
        else:
            base = budget_label(self.budget) if self.budget is not None else "?"
        return f"{base}, equal {self.equalise}" if self.show_equalise else base

    @property
    def kind(self) -> str:
        if is_reference(self.policy):
            return REFERENCE_KIND
        return "ratio" if self.ratio is not None else "size" if self.size is not None else "budget"

    def build(self, prompt_length: int, context_length: int, layers: int | None = None) -> tuple[Any, dict[str, Any]]:
        """``(policy, plan)`` for a run of ``context_length`` tokens of which ``prompt_length``
        are prefilled, on a model of ``layers`` layers (per-layer budgets are planned over them:
        :func:`kvpolicy.plan_policy`); ``plan`` is :meth:`kvpolicy.PolicyPlan.as_dict` (or its equivalent)."""
        full_avg = float(np.mean(np.arange(prompt_length + 1, context_length + 1)))
        if is_reference(self.policy):
            policy = get_policy(self.policy)()
            plan = PolicyPlan(policy, 1.0, 1.0, context_length, prompt_length, full_avg, full_avg).as_dict()
            if self.chunk:
                plan["prefill_chunk"] = self.chunk
            return policy, plan
        if self.protocol == "kvpress" and self.budget is not None:
            policy = kvpress_policy(self.policy, round(1 - self.budget, 12), prompt_length)
            sizes = simulate_sizes(policy, context_length, prompt_length)
            avg = float(np.mean(sizes))
            d = PolicyPlan(policy, self.budget, avg / full_avg, context_length, prompt_length, avg, full_avg).as_dict()
            d.update(protocol="kvpress", compression_ratio=policy.compression_ratio, kept_context_tokens=policy.kept_tokens(prompt_length))
            return policy, d
        extra: dict[str, Any] = {"layers": layers}
        if self.variant_ratio is not None:
            extra["threshold_ratio"] = self.variant_ratio
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


#: Where a kvpress press's default differs from the registry preset's planned parameter: the
#: press's, under kvpress's protocol (``SnapKVPress(window_size=64, kernel_size=5)``; the preset
#: plans a window of at most 32), and AdaKV's over it (``AdaKVPress(SnapKVPress())``). Their RULER
#: answers differed from kvpress's on 6 and 7 of 12 samples with the preset's window,
#: docs/results.md section 10.
KVPRESS_DEFAULTS: dict[str, dict[str, Any]] = {"snapkv": {"window": 64, "kernel": 5},
                                                "adakv_snapkv": {"window": 64, "kernel": 5}}


def kvpress_policy(name: str, compression_ratio: float, context_tokens: int) -> EvictionPolicy:
    """The registered policy ``name`` run as kvpress runs a press on a context of
    ``context_tokens``: :func:`kvpolicy.prefill_only` over the policy planned to keep
    ``int(context_tokens x (1 - compression_ratio))`` tokens (its ranking's parameters are those
    ``from_size`` gives, or the press's default where it differs: :data:`KVPRESS_DEFAULTS`). ``ValueError`` naming the policy when it
    ranks no tokens (kvpress's protocol keeps each head's best by a score).

    Example:
        >>> p = kvpress_policy("knorm", 0.5, 1000)
        >>> p.policy, p.kept_tokens(1000), p.capacity
        (Knorm(size=500, recent=0), 500, None)
    """
    entry = get_policy(name)
    kept = max(int(context_tokens * (1 - compression_ratio)), entry.min_size)
    try:
        return prefill_only(entry.from_size(kept, **KVPRESS_DEFAULTS.get(name, {})), compression_ratio)
    except ValueError as e:
        raise ValueError(f"policy {name!r} cannot run under kvpress's protocol (--ruler-protocol kvpress): {e}") from None


def budget_label(budget: float) -> str:
    """``budget`` as a percent with the decimals it needs (up to three), so that distinct budgets
    get distinct labels (tables and verdicts group cells by label).

    Example:
        >>> budget_label(0.25), budget_label(0.015), budget_label(0.125), budget_label(0.07)
        ('25%', '1.5%', '12.5%', '7%')
    """
    for digits in range(3):
        text = f"{budget:.{digits}%}"
        if abs(float(text[:-1]) / 100 - budget) < 1e-12:
            return text
    return f"{budget:.3%}"


def is_reference(name: str) -> bool:
    """Whether the registered policy ``name`` keeps every token (``evicts = False``, the full
    cache): it runs once per sample, as the reference line, instead of per budget or size.

    Example:
        >>> is_reference("full"), is_reference("h2o")
        (True, False)
    """
    cls = policy_class(name)
    return cls is not None and not cls.evicts


def policy_class(name: str) -> type[EvictionPolicy] | None:
    """The class behind the registered policy ``name`` (a preset's class); ``None`` when ``name`` is
    not registered here (a results.json from a run with a third-party policy).

    Example:
        >>> policy_class("buzz_logn").__name__, policy_class("no such policy")
        ('BUZZ', None)
    """
    try:
        entry = get_policy(name)
    except ValueError:  # not registered: planning it reports that
        return None
    return entry.cls if isinstance(entry, Preset) else entry


def takes_threshold_ratio(name: str) -> bool:
    """Whether the registered policy ``name`` is planned at a chosen T/w (``threshold_ratio``, see
    :func:`kvpolicy.plan_policy`): a BUZZ class under its own name; its presets (log n) are variants
    of their own, not swept.

    Example:
        >>> takes_threshold_ratio("buzz"), takes_threshold_ratio("buzz_logn"), takes_threshold_ratio("h2o")
        (True, False, False)
    """
    try:
        entry = get_policy(name)
    except ValueError:
        return False
    return isinstance(entry, type) and issubclass(entry, BUZZ)


def log_n_variant_of(name: str) -> str | None:
    """The registered name whose log-n variant ``name`` is: a preset that switches log n scaling on
    and fixes nothing else (``buzz_logn`` -> ``buzz``); ``None`` for any other name.

    Example:
        >>> log_n_variant_of("buzz_logn"), log_n_variant_of("buzz")
        ('buzz', None)
    """
    try:
        entry = get_policy(name)
    except ValueError:
        return None
    if isinstance(entry, Preset) and entry.fixed == {"log_n": True}:
        return entry.cls.name
    return None


def simulate_chunked_sizes(policy: Any, prompt_length: int, decode_steps: int, chunk: int) -> np.ndarray:
    """Cache size at each decode step after a prompt prefilled in chunks of ``chunk`` tokens (the
    policy evicts after every chunk, as :class:`~kvpolicy.hf.EvictingCache` does); like
    :func:`kvpolicy.simulate_sizes`, sizes depend on counts only, so placeholder scores are exact."""
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
    return window_for_size(size, stride=stride, sink=sink, ratio=ratio)


# =========================================================================== data sources
#: The paper-faithful files a ``--data-dir`` folder holds (each task reads its own).
PAPER_FILES = ("wikitext-2-raw-test.txt", "xsum_0shot.jsonl", "nq-open-oracle.jsonl.gz", "kv-retrieval-75_keys.jsonl.gz")


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
def hub_only() -> Iterator[None]:
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


def describe_file(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return f"{p} (sha256 {h.hexdigest()[:12]})"


def sample_order(n: int, seed: int) -> list[int]:
    """Row order for sample selection: file order for seed 0, else a seeded permutation. The
    first ``k`` eligible rows are taken, so a larger ``--samples`` extends the smaller set."""
    if seed == 0:
        return list(range(n))
    return [int(i) for i in np.random.default_rng(seed).permutation(n)]


# =========================================================================== options
@dataclass
class TaskOptions:
    """What every task is built with (the shared CLI flags; ``None`` means the task's default).
    A task's own settings are its :attr:`Task.Options` dataclass, set by the flags it adds."""

    samples: int | None = None
    max_new_tokens: int | None = None
    context: int | None = None
    seed: int = 0


@dataclass
class NoOptions:
    """The settings of a task that has none of its own."""


# =========================================================================== tasks
class Task:
    """Base class of an evaluation task: one class in one file under ``kvpolicy_tools/eval/tasks/``,
    registered with :func:`register_task` (or, from another package, the ``kvpolicy.tasks`` entry
    point group). Subclasses set the class attributes and implement :meth:`samples` and
    :meth:`score` (and :meth:`aggregate` when averaging per-sample metrics is not right); a task
    with settings of its own declares them as :attr:`Options` (a dataclass) and adds the flags
    that set them in :meth:`add_arguments` / :meth:`options_from_args`.

    Example (a toy task: one prompt, scored by its length):
        >>> from dataclasses import dataclass
        >>> @register_task
        ... class EchoTask(Task):
        ...     name, title, metric, metrics = "echo_demo", "Echo (demo)", "chars", ("chars",)
        ...     help = "a demo: one prompt, scored by the length of the answer"
        ...     @dataclass
        ...     class Options:
        ...         prompt: str = "hello"
        ...     @classmethod
        ...     def add_arguments(cls, group):
        ...         group.add_argument("--echo-prompt", default="hello", help="echo_demo: the prompt")
        ...     @classmethod
        ...     def options_from_args(cls, args):
        ...         return cls.Options(prompt=args.echo_prompt)
        ...     def samples(self, tok):
        ...         ids = tok.prompt_ids(self.options.prompt)
        ...         return [Sample(id="0", input_ids=ids, prompt_length=len(ids), kind="gen", max_new_tokens=4)]
        ...     def score(self, sample, output):
        ...         return {"chars": float(len(output["text"]))}
        >>> "echo_demo" in task_registry(), unregister_task("echo_demo") is EchoTask
        (True, True)
    """

    name = ""
    title = ""
    kind = "gen"
    metric = ""  # the headline metric (plots, verdicts)
    metrics: tuple[str, ...] = ()
    higher_is_better = True
    default_samples = 2
    default_max_new_tokens = 32
    needs_data_dir = False
    #: The file of ``--data-dir`` a task that needs it reads (named when it is missing).
    data_file = ""
    group_names: tuple[str, ...] = ()
    #: One line for ``kvpolicy compare --help``'s list of tasks.
    help = ""
    #: The task's own settings (a dataclass; its defaults are the task's defaults).
    Options: Any = NoOptions

    def __init__(self, options: TaskOptions, sources: DataSources, task_options: Any = None) -> None:
        self.opt = options
        self.options = task_options if task_options is not None else self.Options()
        self.src = sources
        self.data_note = ""
        self.notes: list[str] = []

    @classmethod
    def add_arguments(cls, group: Any) -> None:
        """Add the flags that set :attr:`Options` to ``group`` (an argparse group; none by
        default). Only the class that defines this method adds them (a subclass inherits them)."""

    @classmethod
    def options_from_args(cls, args: Any) -> Any:
        """:attr:`Options` from parsed flags (default: the defaults)."""
        return cls.Options()

    @property
    def n_samples(self) -> int:
        return self.opt.samples if self.opt.samples is not None else self.default_samples

    @property
    def max_new_tokens(self) -> int:
        return self.opt.max_new_tokens if self.opt.max_new_tokens is not None else self.default_max_new_tokens

    def samples(self, tok: TokenizerAdapter) -> list[Sample]:
        raise NotImplementedError

    def check(self, policies: Sequence[str], budgets: Sequence[float]) -> None:
        """Raise ``ValueError`` (before the model loads) when these policies and budgets leave
        this task nothing to run; by default every combination runs."""

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
        """``value`` of metric ``key`` as the report shows it (:func:`kvpolicy_tools.eval.display.fmt`)."""
        return fmt(key, value)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "title": self.title, "metric": self.metric, "metrics": list(self.metrics),
                "higher_is_better": self.higher_is_better, "data": self.data_note, "notes": list(self.notes),
                "group_names": list(self.group_names)}

    def cli_flags(self) -> list[str]:
        """Task-specific flags that reproduce this task's samples (for the printed commands)."""
        return []

    # ----------------------------------------------------------------- rerun commands
    # ``kvpolicy compare`` prints, for the task and for each of its cells, the command that reruns
    # it; these hooks say what a task's commands hold beyond the shared flags.

    def run_flags(self, cache_sizes: Sequence[int] | None) -> list[str]:
        """The size flags of this task's commands, after ``--samples``: ``--context`` when it was
        given, and ``--max-new-tokens`` for a generating task. ``cache_sizes``: the fixed sizes the
        command states (``None``: none given, ``[]``: explicitly none)."""
        out = ["--context", str(self.opt.context)] if self.opt.context else []
        if self.kind == "gen":
            out += ["--max-new-tokens", str(self.max_new_tokens)]
        return out

    def command_budgets(self, budgets: Sequence[float]) -> Sequence[float] | None:
        """The budgets the task's whole-run command states (``None``: no ``--budgets`` flag)."""
        return budgets

    def command_cache_sizes(self) -> Sequence[int] | None:
        """The fixed cache sizes the task's whole-run command states (``None``: none)."""
        return None

    def cell_command(self, cell: Any, command: Any) -> str:
        """The command that reruns one cell (a :class:`~kvpolicy_tools.eval.results.CellResult`):
        ``command(policies, budgets, cache_sizes=None, flags=None)`` builds it (``flags``: this
        task's own flags, default :meth:`cli_flags`)."""
        if is_reference(cell.policy):
            return command([cell.policy], [])
        if cell.kind == "budget":
            return command([cell.policy], [cell.requested_budget])
        if cell.kind == "size":
            return command([cell.policy], [], cache_sizes=[cell.size])
        return command([cell.policy], None)

    # ----------------------------------------------------------------- the report
    # The report (``kvpolicy_tools.eval.report``) is computed from ``results.json``; these classmethods
    # take a task as ``results.json`` holds it (a dict: ``name``, ``metric``, ``cells``, ...).

    #: The BUZZ paper's own numbers for this task (a dict: ``caption``, ``decimals``, ``columns``,
    #: ``rows``, and ``rank``, its place in the report's separate paper section), or ``None``.
    paper_table: dict[str, Any] | None = None

    @classmethod
    def table_caption(cls, kind: str) -> str | None:
        """The caption of this task's table of ``kind`` cells (``budget``, ``size``, ``ratio``);
        ``None``: the report's own."""
        return None

    @classmethod
    def budget_panels(cls, task: dict[str, Any]) -> list[Any]:
        """The panels of the task's budget plot (quality against the realised budget), each a
        :class:`~kvpolicy_tools.eval.display.Panel`; an empty list: no budget plot. Default: one panel,
        the headline metric."""
        return [Panel(task["metric"], task["cells"], metric_name(task["metric"]))]

    @classmethod
    def report_verdicts(cls, task: dict[str, Any]) -> list[str] | None:
        """Plain-language statements computed from the cells (``None``: the report's BUZZ against
        the baselines)."""
        return None

    @classmethod
    def report_markdown(cls, task: dict[str, Any]) -> list[str]:
        """Markdown lines this task adds to its section of ``report.md``, after its tables,
        computed from ``task`` (the task as ``results.json`` holds it); none by default."""
        return []

    @classmethod
    def report_details(cls, task: dict[str, Any]) -> list[str]:
        """Markdown lines this task adds after the table of every cell (e.g. a table by group);
        none by default."""
        return []

    @classmethod
    def report_plots(cls, task: dict[str, Any], out_dir: Path, model: str) -> list[Path]:
        """PNG plots this task adds to the report, written into ``out_dir`` from ``task`` (as
        ``results.json`` holds it) for ``model``; their paths (none by default)."""
        return []


# =========================================================================== registry
#: Registered tasks by name: the built-ins register on import, others with :func:`register_task`
#: or the ``kvpolicy.tasks`` entry point group (:func:`task_registry` loads it).
TASKS: dict[str, type[Task]] = {}
#: The entry point group third-party packages register tasks in (``name = "module:TaskClass"``).
TASK_ENTRY_POINT_GROUP = "kvpolicy.tasks"
_entry_points_loaded = False


def register_task(cls: type[Task]) -> type[Task]:
    """Register a :class:`Task` subclass under its ``name`` (a class decorator); a name taken by
    another class raises ``ValueError``."""
    if not (isinstance(cls, type) and issubclass(cls, Task)) or not cls.name:
        raise ValueError(f"register_task takes a Task subclass with a name, got {cls!r}")
    key = cls.name.strip().lower()
    if TASKS.get(key, cls) is not cls:
        raise ValueError(f"task name {key!r} is taken by {TASKS[key].__qualname__}")
    TASKS[key] = cls
    return cls


def unregister_task(name: str) -> type[Task]:
    """Remove a registered task (tests, notebooks); return its class."""
    key = name.strip().lower()
    if key not in TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(TASKS)}")
    return TASKS.pop(key)


def task_registry(*, reload_entry_points: bool = False) -> dict[str, type[Task]]:
    """Every registered task, the ``kvpolicy.tasks`` entry points loaded first (once, or again
    with ``reload_entry_points``): an entry point names a :class:`Task` subclass, registered
    under its ``name``."""
    global _entry_points_loaded
    if not _entry_points_loaded or reload_entry_points:
        _entry_points_loaded = True
        for ep in importlib.metadata.entry_points(group=TASK_ENTRY_POINT_GROUP):
            # a broken plug-in is named (its package may be unknown to the user), not a bare traceback
            where = f"{TASK_ENTRY_POINT_GROUP} entry point {ep.name!r} ({getattr(ep, 'value', '?')})"
            try:
                cls = ep.load()
            except Exception as exc:
                _entry_points_loaded = False  # the next call says it again
                raise ValueError(f"{where} failed to load: {exc!r}") from exc
            if not (isinstance(cls, type) and issubclass(cls, Task) and cls.name):
                _entry_points_loaded = False
                raise ValueError(f"{where} names {cls!r}, not a Task subclass with a name")
            if cls.name.strip().lower() not in TASKS:
                register_task(cls)
    return TASKS


#: What ``kvpolicy compare`` runs with no arguments (embedded data).
DEFAULT_TASKS = ("ppl", "summ", "needle", "stream")
#: The paper-faithful set (what ``--data-dir`` selects when ``--tasks`` is not given).
PAPER_TASKS = ("ppl", "stream", "summ", "qa", "needle", "kv", "tw")


def make_tasks(names: Iterable[str], options: TaskOptions, sources: DataSources,
               task_options: dict[str, Any] | None = None) -> list[Task]:
    """The tasks ``names`` built with the shared ``options`` and each one's own settings
    (``task_options[name]``, else its defaults)."""
    registry = task_registry()
    out = []
    for n in names:
        key = n.strip().lower()
        if key not in registry:
            raise ValueError(f"unknown task {n!r}; known tasks: {', '.join(registry)}")
        task = registry[key](options, sources, (task_options or {}).get(key))
        if task.needs_data_dir and not sources.paper and getattr(sources, key, None) is None:
            raise ValueError(f"task {key!r} needs the paper's data: pass --data-dir DIR (a folder with {task.data_file})")
        out.append(task)
    return out


# =========================================================================== flag values
def parse_floats(text: str, flag: str) -> list[float]:
    """Comma-separated numbers of a flag (``"none"`` or empty: none), or ``ValueError`` naming it."""
    return _parse_list(text, flag, float, "numbers")


def parse_ints(text: str, flag: str) -> list[int]:
    """Comma-separated integers of a flag (``"none"`` or empty: none), or ``ValueError`` naming it."""
    return _parse_list(text, flag, int, "integers")


def replace_flag(flags: Sequence[str], name: str, value: str) -> list[str]:
    """``flags`` (``"--flag value"`` strings, as :meth:`Task.cli_flags` returns them) with ``name``
    set to ``value`` instead, moved last.

    Example:
        >>> replace_flag(["--tw-ratios 2.5", "--stream-tokens 128"], "--tw-ratios", "none")
        ['--stream-tokens 128', '--tw-ratios none']
    """
    return [f for f in flags if not f.startswith(name)] + [f"{name} {value}"]


def split_csv(text: str) -> list[str]:
    """The non-empty, stripped items of a comma-separated flag value.

    Example:
        >>> split_csv(" ppl, summ,,")
        ['ppl', 'summ']
    """
    return [t.strip() for t in str(text).split(",") if t.strip()]


def _parse_list(text: str, flag: str, convert: Any, what: str) -> list[Any]:
    if str(text).strip().lower() in ("none", ""):
        return []
    try:
        return [convert(x) for x in split_csv(text)]
    except ValueError:
        raise ValueError(f"{flag} expects comma-separated {what}, got {text!r}") from None
