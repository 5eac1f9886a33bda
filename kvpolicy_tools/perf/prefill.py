"""Time to first token: a prompt's prefill through an ``EvictingCache`` against a plain one
(``kvpolicy bench --what prefill``).

Per prompt length, a random prompt goes through the model (``logits_to_keep=1``, as ``generate``
asks for the first token) with transformers' ``DynamicCache`` and SDPA (``plain``), then with an
``EvictingCache`` of each policy in one forward (``one-shot``) and in chunks of ``chunk`` tokens
(``chunked``, what :func:`kvpolicy.hf.generate` does with a longer prompt). The candidates are
interleaved round by round and each keeps its fastest round (load on a shared machine only adds
time); ``x plain`` is its time over the plain forward's. Each policy's peak cache bytes are
:attr:`kvpolicy_torch.LayerCache.peak_bytes` summed over the layers (a chunked prefill's peak is
its storage: the capacity, spare slots and one chunk).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import torch
from transformers import DynamicCache

from kvpolicy.hf import PREFILL_CHUNK, EvictingCache, cache_kwargs
from kvpolicy.validation import check_int

from .decode import PolicySpec
from .report import markdown_table

__all__ = ["PrefillTime", "measure_prefill", "prefill_report"]


@dataclass
class PrefillTime:
    """One candidate's prefill at one prompt length."""

    context: int
    label: str
    mode: str  #: ``"one-shot"`` or ``"chunked"`` (``plain``: one-shot)
    seconds: list[float] = field(default_factory=list)  #: one per round
    peak_bytes: int | None = None  #: the most the cache held (``None`` for the plain cache)

    @property
    def best(self) -> float:
        """The fastest round's seconds."""
        return min(self.seconds)

    def as_dict(self, plain: "PrefillTime") -> dict[str, Any]:
        """The row ``results.json`` holds, with ``x_plain``: the fastest round over ``plain``'s."""
        return {**asdict(self), "best": self.best, "x_plain": self.best / plain.best}


def _forward(model: Any, ids: torch.Tensor, cache: Any, chunk: int) -> float:
    n = ids.shape[1]
    start = time.perf_counter()
    with torch.no_grad():
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            model(input_ids=ids[:, lo:hi], position_ids=torch.arange(lo, hi, device=ids.device)[None], use_cache=True,
                  logits_to_keep=1, **cache_kwargs(model, cache))
    if ids.device.type == "cuda":
        torch.cuda.synchronize(ids.device)
    return time.perf_counter() - start


def measure_prefill(
    model: Any,
    contexts: Sequence[int],
    policies: Sequence[PolicySpec],
    *,
    budget: float = 0.25,
    rounds: int = 2,
    chunk: int = PREFILL_CHUNK,
    seed: int = 0,
    on_step: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """The prefill of a random prompt of each length in ``contexts``: plain, and each policy
    (planned for ``budget`` of the prompt) one-shot and in chunks of ``chunk`` tokens, interleaved
    over ``rounds``; ``on_step(label)`` after each forward. Returns one row per candidate and
    length (:meth:`PrefillTime.as_dict`).

    Example:
        >>> from kvpolicy_tools.models import tiny_llama
        >>> rows = measure_prefill(tiny_llama(), [24], [PolicySpec.named("h2o")], chunk=8, rounds=1)
        >>> [(r["label"], r["mode"]) for r in rows]
        [('DynamicCache', 'one-shot'), ('H2O', 'one-shot'), ('H2O', 'chunked')]
    """
    rounds = check_int("rounds", rounds, minimum=1)
    chunk = check_int("chunk", chunk, minimum=1)
    vocab = int(model.config.vocab_size)
    device = next(model.parameters()).device
    rows: list[dict[str, Any]] = []
    for n in contexts:
        n = check_int("context", n, minimum=2)
        g = torch.Generator().manual_seed(seed + n)
        ids = torch.randint(min(3, vocab - 1), vocab, (1, n), generator=g).to(device)
        plain = PrefillTime(n, "DynamicCache", "one-shot")
        made: list[tuple[PrefillTime, Callable[[], Any], int]] = [(plain, lambda: DynamicCache(config=model.config), n)]
        for spec in policies:
            policy = spec.planner(budget, n + 1, n)
            for mode, size in (("one-shot", n), ("chunked", chunk)):
                room = size if mode == "chunked" else None  # (one-shot: no room for a chunk)
                made.append((PrefillTime(n, spec.label, mode), lambda p=policy, r=room: EvictingCache(p, model, prefill_chunk=r), size))
        _forward(model, ids[:, : min(n, 64)], DynamicCache(config=model.config), n)  # (warm-up)
        for _ in range(rounds):
            for entry, make, size in made:
                cache = make()
                entry.seconds.append(_forward(model, ids, cache, size))
                if isinstance(cache, EvictingCache):
                    entry.peak_bytes = sum(layer.store.peak_bytes for layer in cache.layers)
                del cache
                if on_step is not None:
                    on_step(f"prefill {n}: {entry.label} {entry.mode}")
        rows += [entry.as_dict(plain) for entry, _, _ in made]
    return rows


def prefill_report(rows: Sequence[dict[str, Any]], chunk: int, budget: float) -> list[str]:
    """Markdown lines: a table per prompt length (seconds, ``x plain``, peak cache MiB).

    Example:
        >>> row = {"context": 8, "label": "DynamicCache", "mode": "one-shot", "best": 0.5, "x_plain": 1.0, "peak_bytes": None}
        >>> prefill_report([row], 4, 0.25)[-2].splitlines()[-1]
        '| DynamicCache | one-shot | 0.500 | 1.00x | - |'
    """
    lines = [
        f"A random prompt's prefill (`logits_to_keep=1`), plain `DynamicCache` SDPA against each policy at "
        f"{budget:.0%} of the prompt, one forward (one-shot) and in chunks of {chunk} tokens (chunked); fastest of "
        "the interleaved rounds; peak: the most the cache held (all layers, bookkeeping included).",
        "",
    ]
    for n in sorted({r["context"] for r in rows}):
        table = [
            [r["label"], r["mode"], f"{r['best']:.3f}", f"{r['x_plain']:.2f}x",
             "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**20:.1f}"]
            for r in rows if r["context"] == n
        ]
        lines += [f"### Prompt {n:,} tokens", "",
                  markdown_table(["cache", "prefill", "seconds", "x plain", "peak cache MiB"], table, "llrrr"), ""]
    return lines
