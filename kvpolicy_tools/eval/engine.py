"""The model side of ``kvpolicy compare``: runs a task's samples through evicting caches on a
transformers model (:class:`Engine`, :func:`evaluate`) and reports what it ran on
(:func:`environment`). Needs the ``hf`` extra (torch, transformers); :mod:`kvpolicy_tools.eval.compare`,
whose parser every ``kvpolicy`` verb builds, imports this module only when it runs."""

from __future__ import annotations

import time
from collections import OrderedDict, defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import transformers

from kvpolicy.validation import check_bool
from kvpolicy.hf import EvictingCache, cache_kwargs, model_layers
from kvpolicy_integrations.reconstruction import RepeatPrompts, reconstruct
from kvpolicy.policy import EvictionPolicy

from ..models import describe
from .results import CellResult, TaskResult
from .tasks import CacheConfig, Sample, Task, TokenizerAdapter, is_reference

__all__ = ["Engine", "environment", "evaluate", "prefill_key", "recorded_history", "task_result"]


class _Recorder:
    """Builds the policy that records a prefill: keeps every token and scores it with the rows
    the forked policies score a prompt with (``prompt_rows``: all, or TOVA's last row)."""

    @staticmethod
    def make(log_n: Any, rows: int | None = None, history: int | None = None) -> Any:
        class PrefillRecorder(EvictionPolicy):
            name = "prefill_recorder"
            uses_scores = True
            # Scissorhands' prompt: the record of its last `history` rows (kvpolicy.statistics)
            score_statistic = "low_history" if history is not None else "accumulate"
            score_history = history

            @property
            def capacity(self) -> None:
                return None

            def select(self, view: Any) -> None:
                return None

            @property
            def prompt_rows(self) -> int | None:
                return rows

        rec = PrefillRecorder()
        rec.log_n = log_n
        return rec


def recorded_history(policy: Any) -> int | None:
    """The history a shared prefill records for ``policy`` (Scissorhands' ``score_history``: its
    prompt is a record of low-attention events, :mod:`kvpolicy.statistics`), else ``None``."""
    return policy.score_history if policy.score_statistic == "low_history" else None


def prefill_key(policy: Any, prompt_length: int) -> Any:
    """Prefills that compute the same thing share a key: log n only changes the prefill where a
    query has seen more tokens than the log base (or when its floor is not 1); a policy whose
    prompt is scored by its last rows only (``prompt_rows``) records its own prompt scores."""
    ln = policy.log_n
    key = None if ln is None or (ln.floor == 1.0 and prompt_length <= ln.base) else (ln.base, ln.floor)
    rows = policy.prompt_rows
    if policy.score_statistic == "low_history":  # records, not sums: shared by equal histories only
        return (key, "history", policy.score_history)
    return key if rows is None or rows >= prompt_length else (key, rows)


class Engine:
    """Runs samples through evicting caches; the model is any Llama-family transformers model."""

    def __init__(self, model: Any, tok: TokenizerAdapter) -> None:
        self.model = model
        self.tok = tok
        self.device = next(model.parameters()).device
        self.eos = sorted(tok.eos_ids(model))

    def forward(self, ids: Any, cache: Any, **kwargs: Any) -> Any:
        """The model on ``ids`` ``[batch, q]`` with ``cache``, handed over under the name the
        installed transformers takes (``kvpolicy.hf.cache_kwargs``)."""
        return self.model(ids, **cache_kwargs(self.model, cache), use_cache=True, **kwargs)

    def prefill(self, ids: Any, prompt_length: int, log_n: Any, rows: int | None = None,
                history: int | None = None) -> tuple[Any, Any]:
        rec = EvictingCache(_Recorder.make(log_n, rows, history), self.model)
        with torch.no_grad():
            out = self.forward(ids[:, :prompt_length], rec, logits_to_keep=1)
        return rec, out.logits[:, -1].float()

    def reconstruct(self, ids: Any, prompt_length: int, cache: Any) -> None:
        """KVzip's context reconstruction of the prefilled ``ids[:, :prompt_length]`` in ``cache``
        (a policy scored by one: ``needs_reconstruction``), then its one eviction: the repeat
        prompts in this tokenizer, the chat template's prefix not repeated (as kvpress)."""
        tok = self.tok
        prompts = RepeatPrompts.from_texts(tok.encode, tok.pre if tok.chat else "", tok.post if tok.chat else "\n")
        context = ids[:, :prompt_length]
        reconstruct(self.model, cache, context, prompts, start=prompts.start(context))

    def prefill_chunked(self, ids: Any, prompt_length: int, policy: Any, chunk: int) -> tuple[Any, Any]:
        """A cache for ``policy`` after prefilling in chunks (the policy evicts after every chunk)."""
        cache = EvictingCache(policy, self.model)
        with torch.no_grad():
            for start in range(0, prompt_length, chunk):
                out = self.forward(ids[:, start : min(start + chunk, prompt_length)], cache, logits_to_keep=1)
        return cache, out.logits[:, -1].float()

    def feed(self, ids: Any, start: int, stop: int, cache: Any) -> tuple[Any, list[float], list[int]]:
        """Feed prompt tokens ``start .. stop - 1`` (a question asked after the prefill's eviction)
        one at a time through ``cache``, as decode steps: the policy evicts as at any decode step.
        Returns the last step's logits and each step's cache size and full-cache size."""
        sizes, fulls = [], []
        with torch.no_grad():
            for t in range(start, stop):
                sizes.append(self._length(cache) + 1)
                fulls.append(t + 1)
                logits = self.forward(ids[:, t : t + 1], cache).logits[:, -1].float()
        return logits, sizes, fulls

    def fork(self, rec: Any, policy: Any) -> Any:
        """A fresh cache for ``policy`` in the state its own prefill would have left it in."""
        if policy.observes_queries:
            raise ValueError(f"{policy!r} scores from the queries it sees, which a recorded prefill does not hold: "
                             "prefill its own cache (prefill_chunked)")

        cache = EvictingCache(policy, self.model)
        for layer, src in zip(cache.layers, rec.layers):
            k, v, s = src.store.keys, src.store.values, src.store.scores
            layer.lazy_initialization(k, v)
            layer.store.append(k, v)
            if policy.uses_scores:
                layer.store.accumulate(s)
            layer.store.evict()
        return cache

    def _length(self, cache: Any) -> float:
        return sum(layer.store.mean_length for layer in cache.layers) / len(cache.layers)

    def run_ppl(self, ids: Any, prompt_length: int, n_score: int, cache: Any,
                on_step: Any = None) -> dict[str, Any]:
        """Feed tokens ``prompt_length .. prompt_length + n_score - 1`` one at a time through
        ``cache``; each step's prediction of the next token is scored (summed NLL per row).
        ``on_step(i)`` is called every 64 steps (progress)."""
        b = ids.shape[0]
        nll = torch.zeros(b, dtype=torch.float64)
        sizes, fulls = [], []
        rows = torch.arange(b)
        with torch.no_grad():
            for t in range(prompt_length, prompt_length + n_score):
                if on_step is not None and (t - prompt_length) % 64 == 0:
                    on_step(t - prompt_length)
                sizes.append(self._length(cache) + 1)
                fulls.append(t + 1)
                # log-softmax in float64 (cheap at one row per sample): NLL sums over 1,000+ tokens
                logits = self.forward(ids[:, t : t + 1], cache).logits[:, -1].double()
                logp = torch.log_softmax(logits, dim=-1)
                nll -= logp[rows, ids[:, t + 1]].double().cpu()
        return {"nll": nll.tolist(), "tokens": [n_score] * b, "sizes": sizes, "fulls": fulls}

    def run_gen(self, ids: Any, first_logits: Any, max_new: int, cache: Any) -> dict[str, Any]:
        b, n = ids.shape
        eos = torch.tensor(self.eos, dtype=torch.long, device=self.device) if self.eos else None
        cur = first_logits.argmax(-1).to(self.device)
        out = [cur]
        done = torch.isin(cur, eos) if eos is not None else torch.zeros(b, dtype=torch.bool, device=self.device)
        sizes, fulls = [], []
        seen = n
        with torch.no_grad():
            for _ in range(max_new - 1):
                if bool(done.all()):
                    break
                sizes.append(self._length(cache) + 1)
                fulls.append(seen + 1)
                logits = self.forward(cur[:, None], cache).logits[:, -1]
                seen += 1
                nxt = logits.argmax(-1)
                if eos is not None:
                    nxt = torch.where(done, eos[0], nxt)
                    done = done | torch.isin(nxt, eos)
                out.append(nxt)
                cur = nxt
        gen = torch.stack(out, dim=1).cpu().tolist()
        texts, n_tokens = [], []
        eos_set = set(self.eos)
        for row in gen:
            cut = next((i for i, t in enumerate(row) if t in eos_set), len(row))
            texts.append(self.tok.decode(row[:cut]))
            n_tokens.append(cut)
        return {"text": texts, "new_tokens": n_tokens, "sizes": sizes, "fulls": fulls}


def batches_of(samples: Sequence[Sample], batch_size: int) -> list[list[Sample]]:
    """Samples of identical shape (kind, length, prompt, steps) share a batch, in first-seen order."""
    groups: OrderedDict[tuple[Any, ...], list[Sample]] = OrderedDict()
    for s in samples:
        groups.setdefault((s.kind, len(s.input_ids), s.prompt_length, s.question_length, s.n_score, s.max_new_tokens),
                          []).append(s)
    out = []
    for g in groups.values():
        for i in range(0, len(g), max(1, batch_size)):
            out.append(g[i : i + batch_size])
    return out


def evaluate(
    model: Any,
    tok: TokenizerAdapter,
    tasks: Sequence[Task],
    policies: Sequence[str],
    budgets: Sequence[float],
    *,
    batch_size: int = 4,
    progress: bool = True,
) -> dict[str, TaskResult]:
    """Run every task's configurations; return each task's :class:`~kvpolicy_tools.eval.results.TaskResult`
    (their ``as_dict()`` is the ``tasks`` part of results.json)."""
    progress = check_bool("progress", progress)

    engine = Engine(model, tok)
    prepared = []
    total = 0
    layers = model_layers(model)  # (per-layer budgets are planned over them)
    for task in tasks:
        t0 = time.perf_counter()
        samples = task.samples(tok)
        if not samples:
            raise ValueError(f"task {task.name!r}: no samples (see the notes: {task.notes})")
        configs = task.configs(policies, budgets)
        batches = batches_of(samples, batch_size)
        plans: dict[tuple[int, int], list[tuple[Any, dict[str, Any]]]] = {}
        for batch in batches:
            s = batch[0]
            key = (s.prefill_length, s.prefill_length + s.decode_steps)
            if key not in plans:
                plans[key] = [c.build(*key, layers=layers) for c in configs]
        units = 0
        for batch in batches:
            s = batch[0]
            built = plans[(s.prefill_length, s.prefill_length + s.decode_steps)]
            shared = {prefill_key(p, s.prefill_length) for (p, _), c in zip(built, configs)
                      if not (c.chunk or p.observes_queries)}
            units += len(shared) + len(configs)
        total += units
        prepared.append((task, samples, configs, batches, plans, time.perf_counter() - t0))

    from tqdm.auto import tqdm  # here: optional (the eval extra); a progress bar only

    bar = tqdm(total=total, desc="kvpolicy compare", unit="run", disable=not progress, dynamic_ncols=True)
    results: dict[str, TaskResult] = {}
    try:
        for task, samples, configs, batches, plans, prep_s in prepared:
            t_task = time.perf_counter()
            acc: dict[int, dict[str, Any]] = {
                i: {"sizes": 0.0, "fulls": 0.0, "steps": 0, "scores": [], "seconds": 0.0, "plans": []}
                for i in range(len(configs))
            }
            for batch in batches:
                s0 = batch[0]
                key = (s0.prefill_length, s0.prefill_length + s0.decode_steps)
                built = plans[key]
                ids = torch.tensor([s.input_ids for s in batch], dtype=torch.long, device=engine.device)
                by_prefill: dict[Any, list[int]] = defaultdict(list)
                for i, (p, _) in enumerate(built):
                    # a policy scored from the queries it sees prefills its own cache: a recording of
                    # keys and scores holds no queries
                    own = configs[i].chunk or p.observes_queries
                    key = ("chunk", i) if own else prefill_key(p, s0.prefill_length)
                    by_prefill[key].append(i)
                for pkey, idxs in by_prefill.items():
                    rec = first_logits = None
                    if not (isinstance(pkey, tuple) and pkey[0] == "chunk"):
                        bar.set_postfix_str(f"{task.name}: prefill {len(batch)}x{s0.prefill_length}", refresh=False)
                        log_n = built[idxs[0]][0].log_n if pkey is not None else None
                        first = built[idxs[0]][0]
                        rec, first_logits = engine.prefill(ids, s0.prefill_length, log_n, first.prompt_rows,
                                                           recorded_history(first))
                        bar.update(1)
                    done: dict[Any, dict[str, Any]] = {}  # identical policies (e.g. both equalisations) run once
                    for i in idxs:
                        policy, plan = built[i]
                        what = f"{task.name}: {configs[i].row} {configs[i].label}"
                        bar.set_postfix_str(what, refresh=False)
                        t0 = time.perf_counter()
                        torch.manual_seed(0)
                        same = (type(policy).__name__, repr(policy), configs[i].chunk)
                        if same in done:
                            out, cache = done[same], None
                        else:
                            if rec is None:
                                cache, first_logits = engine.prefill_chunked(ids, s0.prefill_length, policy,
                                                                             configs[i].chunk or s0.prefill_length)
                            else:
                                cache = engine.fork(rec, policy)
                            if policy.needs_reconstruction:  # KVzip: its second forward, then its eviction
                                engine.reconstruct(ids, s0.prefill_length, cache)
                            asked: tuple[list[float], list[int]] = ([], [])
                            if s0.question_length:  # the question comes after the prefill's eviction
                                first_logits, *asked = engine.feed(ids, s0.prefill_length, s0.prompt_length, cache)
                            if s0.is_perplexity:
                                steps = s0.n_score
                                out = engine.run_ppl(ids, s0.prompt_length, steps, cache, on_step=lambda k, w=what, n=steps: (
                                    bar.set_postfix_str(f"{w} step {k}/{n}")))
                            else:
                                out = engine.run_gen(ids, first_logits, s0.max_new_tokens, cache)
                                out["sizes"], out["fulls"] = asked[0] + out["sizes"], asked[1] + out["fulls"]
                            done[same] = out
                        a = acc[i]
                        a["seconds"] += time.perf_counter() - t0
                        a["sizes"] += float(np.sum(out["sizes"]))
                        a["fulls"] += float(np.sum(out["fulls"]))
                        a["steps"] += len(out["sizes"])
                        if plan not in a["plans"]:
                            a["plans"].append(plan)
                        for r, s in enumerate(batch):
                            row = {k: v[r] for k, v in out.items() if k not in ("sizes", "fulls")}
                            sc = task.score(s, row)
                            entry = {"id": s.id, "group": list(s.group), "scores": sc}
                            if "text" in row:
                                entry["text"] = row["text"]
                            a["scores"].append(entry)
                        del cache
                        bar.update(1)
                    del rec
            results[task.name] = task_result(task, samples, configs, acc, time.perf_counter() - t_task + prep_s)
    finally:
        bar.close()
    return results


def task_result(task: Task, samples: Sequence[Sample], configs: Sequence[CacheConfig], acc: dict[int, dict[str, Any]], seconds: float) -> TaskResult:
    cells = []
    for i, c in enumerate(configs):
        a = acc[i]
        per = [e["scores"] for e in a["scores"]]
        groups: dict[str, dict[str, float]] = {}
        if task.group_names:
            keys = sorted({tuple(e["group"]) for e in a["scores"]})
            for k in keys:
                sub = [e["scores"] for e in a["scores"] if tuple(e["group"]) == k]
                groups[",".join(str(x) for x in k)] = task.aggregate(sub)
        steps = max(a["steps"], 1)
        realised = a["sizes"] / a["fulls"] if a["fulls"] else float("nan")
        main = [p[task.metric] for p in per if task.metric in p]
        caps = [p.get("capacity") for p in a["plans"]]
        cells.append(CellResult(
            policy=c.policy,
            row=c.row,
            equalise=c.equalise if c.show_equalise and c.kind in ("budget", "size") else None,
            variant_ratio=c.variant_ratio,
            capacity=None if not caps or any(x is None for x in caps) else max(caps),
            label=c.label,
            kind=c.kind,
            requested_budget=1.0 if is_reference(c.policy) else c.budget,
            size=c.size,
            ratio=c.ratio,
            realised_budget=1.0 if is_reference(c.policy) else realised,
            average_cache=a["sizes"] / steps,
            full_average_cache=a["fulls"] / steps,
            decode_steps=a["steps"],
            metrics=task.aggregate(per),
            stderr=float(np.std(main, ddof=1) / np.sqrt(len(main))) if len(main) > 1 else None,
            groups=groups,
            plans=a["plans"],
            seconds=a["seconds"],
            samples=a["scores"],
        ))
    lengths = [s.prompt_length for s in samples]
    return TaskResult(
        info=task.describe(),
        n_samples=len(samples),
        prompt_tokens={"min": min(lengths), "median": float(np.median(lengths)), "max": max(lengths)},
        decode_steps_per_sample=int(max(s.decode_steps for s in samples)),
        seconds=seconds,
        cells=cells,
    )


def environment(model: Any) -> dict[str, Any]:
    """What a run ran on: the model's geometry (``model_info``, empty for a stand-in model), its
    device and dtype, torch's threads, and the torch and transformers versions."""
    try:
        info = describe(model)
    except Exception:  # noqa: BLE001 - a stand-in model in tests
        info = {}
    first = next(model.parameters())
    return {
        "model_info": info,
        "device": str(first.device),
        "dtype": str(first.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
