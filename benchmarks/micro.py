"""Micro-benchmarks behind the before/after figures of docs/performance-history.md ("The first measurements").

Each prints a Markdown-ish table; variants run interleaved round by round in one process, and the
fastest / median of the rounds is reported (on a shared machine noise only adds time)::

    python benchmarks/micro.py score-product     # einsum vs the decode fast path vs fused vs SDPA
    python benchmarks/micro.py gather            # torch.gather vs index_select
    python benchmarks/micro.py compaction        # gather-then-copy vs in-place chunks (LayerCache)
    python benchmarks/micro.py h2o-select        # stable sort vs argmin
    python benchmarks/micro.py pos-shift         # StreamingLLM's key re-rotation, one layer
    python benchmarks/micro.py plan              # plan_policy at 2k and 8k tokens
    python benchmarks/micro.py decode-ops        # the small torch calls of an eager H2O decode step

``--tree PATH`` runs against another checkout (e.g. a ``git worktree`` of an older commit) by
putting it first on ``sys.path``: how the "before" columns of pos-shift and plan were measured.
``--threads`` sets torch's threads (default 1).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]


def _rounds(variants: dict[str, Callable[[], Any]], rounds: int = 30, reps: int = 1) -> dict[str, tuple[float, float]]:
    """``{name: (fastest, median)}`` seconds per call, variants interleaved round by round."""
    for fn in variants.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            t = time.perf_counter()
            for _ in range(reps):
                fn()
            times[name].append((time.perf_counter() - t) / reps)
    return {k: (min(v), statistics.median(v)) for k, v in times.items()}


def _us(x: tuple[float, float]) -> str:
    return f"{x[0] * 1e6:,.0f} / {x[1] * 1e6:,.0f}"


def score_product(args: argparse.Namespace) -> None:
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from test_score_product import received_attention_before

    from kvpolicy_torch import decode_attention, received_attention

    sdpa = torch.nn.functional.scaled_dot_product_attention
    print("| keys | einsum (before) | decode fast path | SDPA | SDPA + fast path | fused |  (us: fastest / median)")
    for n in (512, 2048, 8192, 32768):
        q = torch.randn(1, 9, 1, 64)
        k = torch.randn(1, 3, n + 64, 64)[:, :, :n]  # a view of a larger storage, like a cache's
        v = torch.randn(1, 3, n + 64, 64)[:, :, :n]
        res = _rounds({
            "einsum": lambda: received_attention_before(q, k, 0.125),
            "fast": lambda: received_attention(q, k, 0.125),
            "sdpa": lambda: sdpa(q, k, v, scale=0.125, enable_gqa=True),
            "sdpa+fast": lambda: (sdpa(q, k, v, scale=0.125, enable_gqa=True), received_attention(q, k, 0.125)),
            "fused": lambda: decode_attention(q, k, v, 0.125),
        })
        print(f"| {n:,} | " + " | ".join(_us(res[x]) for x in ("einsum", "fast", "sdpa", "sdpa+fast", "fused")) + " |")


def gather(args: argparse.Namespace) -> None:
    import torch

    print("| batch, heads, tokens | torch.gather | flat index_select |  (us: fastest / median)")
    for b, h, n in ((1, 3, 129), (1, 3, 2048), (1, 8, 4096), (8, 32, 1024)):
        store = torch.randn(b, h, n, 64)
        keep = torch.sort(torch.rand(b, h, n).argsort(-1)[..., : n - 1], -1).values
        kept = keep.shape[-1]
        starts = (torch.arange(b * h) * n).view(b, h, 1)
        flat = store.view(b * h * n, 64)
        res = _rounds({
            "gather": lambda: torch.gather(store, 2, keep[..., None].expand(b, h, kept, 64)),
            "index_select": lambda: flat.index_select(0, (keep + starts).view(-1)),
        }, rounds=20)
        print(f"| {b}, {h}, {n:,} | {_us(res['gather'])} | {_us(res['index_select'])} |")


def compaction(args: argparse.Namespace) -> None:
    from kvpolicy_tools.perf.eviction import workload
    from kvpolicy_torch import LayerCache

    default = LayerCache.compaction_chunk_bytes
    print("| policy | size (1 x 8 heads) | gather, then copy | in place, chunks |  (ms, fastest of 9)")
    for name in ("buzz", "h2o", "streaming_llm"):
        for size in (1024, 8192, 32768, 65536):
            w = workload("torch", name, size, batch=1, heads=8)
            best = {None: float("inf"), default: float("inf")}
            for _ in range(3):
                for mode in best:
                    LayerCache.compaction_chunk_bytes = mode
                    for _ in range(3):
                        w.reset_before_eviction()
                        t = time.perf_counter()
                        w.one_eviction()
                        best[mode] = min(best[mode], time.perf_counter() - t)
            LayerCache.compaction_chunk_bytes = default
            print(f"| {name} | {size:,} | {best[None] * 1e3:.2f} | {best[default] * 1e3:.2f} |")


def h2o_select(args: argparse.Namespace) -> None:
    import torch

    from kvpolicy import H2O
    from kvpolicy.policy import CacheView

    def by_sort(policy: H2O, view: CacheView) -> Any:
        xp, n = view.xp, view.n_cached
        candidates, n_evict = n - policy.recent, n - policy.heavy - policy.recent
        order = xp.argsort(view.scores[..., :candidates], axis=-1, stable=True)
        return view.keep(xp.sort(order[..., n_evict:], axis=-1), view.arange(candidates, n))

    print("| batch x heads, cache | stable sort | argmin |  (us: fastest / median)")
    for b, h, n in ((1, 8, 1024), (1, 8, 16384), (8, 32, 4096)):
        p = H2O((n - 1) // 2, n - 1 - (n - 1) // 2)
        view = CacheView(torch.arange(n).expand(b, h, n), torch.rand(b, h, n), n)
        assert torch.equal(p.select(view), by_sort(p, view))
        res = _rounds({"sort": lambda: by_sort(p, view), "argmin": lambda: p.select(view)}, rounds=50)
        print(f"| {b} x {h}, {n:,} | {_us(res['sort'])} | {_us(res['argmin'])} |")


def pos_shift(args: argparse.Namespace) -> None:
    """StreamingLLM's pos-shift per decode step and layer: today the query rotated back for the
    sinks (LayerCache.shift() is a PrefixShift), against re-rotating every kept key (the general
    rule, which the layout used for every policy before)."""
    import torch

    from kvpolicy_torch import rope_rotate

    inv = 1.0 / (10000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    print("| kept tokens | rotate the query (sinks) | re-rotate every key |  (us: fastest / median)")
    for n in (128, 2048, 8192):
        q = torch.randn(1, 9, 1, 64)
        keys = torch.randn(1, 3, n, 64)
        delta = torch.randint(0, 5000, (1, 3, n))
        row = torch.tensor([4000]).view(-1, 1, 1)
        res = _rounds({"query": lambda: rope_rotate(q, -row, inv), "keys": lambda: rope_rotate(keys, delta, inv)}, rounds=50)
        print(f"| {n:,} | {_us(res['query'])} | {_us(res['keys'])} |")


def plan(args: argparse.Namespace) -> None:
    import kvpolicy
    from kvpolicy import plan_policy

    print(f"{kvpolicy.__file__}\n| policy@L | plan_policy(name, 0.25, context_length=L) ms | plan |")
    for name in ("buzz", "h2o", "streaming_llm", "local"):
        for L in (2048, 8192):
            t = time.perf_counter()
            p = plan_policy(name, 0.25, context_length=L)
            print(f"| {name}@{L} | {(time.perf_counter() - t) * 1e3:,.1f} | `{p.policy!r}` |")


def _after_streaming(fn: Callable[[], Any], stream: Callable[[], Any], trials: int) -> float:
    """Median seconds of one call of ``fn`` made right after ``stream()`` (which evicts the CPU's
    caches, as a model's weights do between two layers' attention)."""
    fn()
    times = []
    for _ in range(trials):
        stream()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def decode_ops(args: argparse.Namespace) -> None:
    """What each small torch call of an eager H2O decode step costs at SmolLM2's shapes (3 KV
    heads, 9 query heads, head_dim 64, ~200 slots), and what folding some of them would save.

    Two columns: the call repeated (warm: what a micro-benchmark usually reports), and the call
    made once right after a matrix-vector product over one SmolLM2 layer's weights (about 14 MB,
    the model's own kind of kernel), as each layer's cache update and attention are made inside the
    model. Between two layers' attention the weights stream through the CPU's caches, so each
    call's code and data are cold again: in the model a small call costs what the second column
    says, not the first."""
    import math

    import torch

    keys = torch.zeros(1, 3, 242, 64)
    token = torch.randn(1, 3, 1, 64)
    positions = torch.full((1, 3, 242), -1, dtype=torch.int64)
    scores = torch.zeros(1, 3, 242)
    probs3 = torch.rand(3, 3, 200)  # [batch * kv_heads, group, slots]
    ones3 = torch.ones(3, 1, 3)
    scores_view, scores3 = scores[:, :, :200], scores.view(3, 1, 242)[:, :, :200]
    q3, k3t, bias3 = torch.randn(3, 3, 64), keys.view(3, 242, 64)[:, :200].transpose(1, 2), torch.zeros(3, 1, 200)
    calls = {
        "token write: narrow + copy_": lambda: keys.narrow(2, 100, 1).copy_(token),
        "position write: select + fill_": lambda: positions.select(2, 100).fill_(7),
        "logits: baddbmm": lambda: torch.baddbmm(bias3, q3, k3t, alpha=0.125),
        "score fold: view + sum + nan_to_num_ + add_ (today)": lambda: scores_view.add_(
            probs3.view(1, 3, 3, 200).sum(dim=2).nan_to_num_(nan=-math.inf, posinf=math.inf, neginf=-math.inf)),
        "score fold as one baddbmm_ (NaN rule elsewhere)": lambda: scores3.baddbmm_(ones3, probs3),
        "a narrow alone": lambda: keys.narrow(2, 100, 1),
        "a view alone": lambda: probs3.view(1, 3, 3, 200),
    }
    res = _rounds(calls, rounds=30, reps=2000)
    layer_weights, hidden = torch.randn(6144, 576), torch.randn(576)  # ~14 MB: one SmolLM2 layer
    cold = {name: _after_streaming(fn, lambda: torch.mv(layer_weights, hidden), trials=300) for name, fn in calls.items()}
    print("| call | warm us (fastest / median of 30 rounds of 2,000) | after streaming one layer's weights, us (median of 300) |")
    print("| --- | ---: | ---: |")
    for name, x in res.items():
        print(f"| {name} | {x[0] * 1e6:.2f} / {x[1] * 1e6:.2f} | {cold[name] * 1e6:.1f} |")


COMMANDS = {
    "score-product": score_product,
    "gather": gather,
    "compaction": compaction,
    "h2o-select": h2o_select,
    "pos-shift": pos_shift,
    "plan": plan,
    "decode-ops": decode_ops,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=sorted(COMMANDS))
    p.add_argument("--tree", type=Path, default=ROOT, help="checkout to import kvpolicy from (default: this one)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    sys.path[:0] = [str(args.tree), str(args.tree / "integrations")]
    import torch

    torch.set_num_threads(args.threads)
    COMMANDS[args.what](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
