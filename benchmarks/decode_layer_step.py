"""The fixed per-layer cost of a decode step: ``EvictingLayer.update`` plus kvpolicy's attention
function for H2O, StreamingLLM (pos-shift, sinks rotated in the storage), the local window, and
Knorm and KeyDiff (scores recomputed from the held keys at every step that evicts), and Expected
Attention (the query's running moments updated, every held token's score recomputed; with
``refresh=16``, at every 16th step),
over ``--layers`` layers sharing one cache's ``ShiftMatrices`` and ``LayerGroup``, on SmolLM2-135M's shapes (3 KV
heads, 9 query heads, head_dim 64) with ``--keys`` cached keys; against a plain cache (``torch.cat``
of the new key and value, then SDPA). Microseconds per layer and step, one thread; no model, so
the caches stay warm (in a model each figure is about twice as large). Run it at two commits to
compare them (docs/performance.md, section 2).

    .venv/bin/python benchmarks/decode_layer_step.py --keys 128 --steps 300
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvpolicy import H2O, ExpectedAttention, KeyDiff, Knorm, LocalWindow, StreamingLLM
from kvpolicy_integrations.hf import EvictingLayer, ShiftMatrices
from kvpolicy_torch import LayerGroup


class _Module(torch.nn.Module):
    """What attention functions read from the attention module."""

    def __init__(self, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx, self.num_key_value_groups, self.is_causal = layer_idx, 3, True


def _policy_step(policy, keys: int, layers: int, steps: int) -> float:
    inv = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    shared, group = ShiftMatrices(), LayerGroup(layers)
    mode = "cache" if policy.name == "streaming_llm" else "original"
    stack = [EvictingLayer(policy, i, positions=mode, inv_freq=inv, shift_matrices=shared, group=group) for i in range(layers)]
    modules = [_Module(i) for i in range(layers)]
    g = torch.Generator().manual_seed(0)
    for layer in stack:
        k = torch.randn(1, 3, keys, 64, generator=g)
        layer.lazy_initialization(k, k)
        layer.store.append(k, k)
        layer.store.accumulate(torch.rand(1, 3, keys, generator=g))
        layer.store.observe_queries(torch.randn(1, 9, keys, 64, generator=g))  # (Expected Attention's prompt queries)
        layer.store.evict()
    q, nk = torch.randn(1, 9, 1, 64, generator=g), torch.randn(1, 3, 1, 64, generator=g)
    start = time.perf_counter()
    for _ in range(steps):
        for layer, module in zip(stack, modules):
            k, v = layer.update(nk, nk, kwargs={})
            layer.attention(module, q, k, v, scaling=0.125)
    return (time.perf_counter() - start) / (steps * layers) * 1e6


def _plain_step(keys: int, layers: int, steps: int) -> float:
    g = torch.Generator().manual_seed(0)
    cache = [torch.randn(1, 3, keys, 64, generator=g) for _ in range(layers)]
    q, nk = torch.randn(1, 9, 1, 64, generator=g), torch.randn(1, 3, 1, 64, generator=g)
    modules = [_Module(i) for i in range(layers)]
    start = time.perf_counter()
    for _ in range(steps):
        for k, module in zip(cache, modules):
            k2, v2 = torch.cat([k, nk], dim=-2), torch.cat([k, nk], dim=-2)
            sdpa_attention_forward(module, q, k2, v2, None, scaling=0.125)
    return (time.perf_counter() - start) / (steps * layers) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--keys", type=int, default=128, help="kept keys per layer (the policies' capacity)")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--repeats", type=int, default=3, help="the fastest of this many runs is reported")
    args = p.parse_args()
    torch.set_num_threads(1)
    n = args.keys
    cases = {
        "plain (cat + SDPA)": lambda: _plain_step(n, args.layers, args.steps),
        "H2O": lambda: _policy_step(H2O(heavy=n // 2, recent=n - n // 2), n, args.layers, args.steps),
        "StreamingLLM": lambda: _policy_step(StreamingLLM(sink=4, window=n - 4), n, args.layers, args.steps),
        "local window": lambda: _policy_step(LocalWindow(window=n), n, args.layers, args.steps),
        "Knorm": lambda: _policy_step(Knorm(size=n), n, args.layers, args.steps),
        "KeyDiff": lambda: _policy_step(KeyDiff(size=n), n, args.layers, args.steps),
        "Expected Attention": lambda: _policy_step(ExpectedAttention(size=n), n, args.layers, args.steps),
        "EA refresh=16": lambda: _policy_step(ExpectedAttention(size=n, refresh=16), n, args.layers, args.steps),
    }
    for label, run in cases.items():
        print(f"{label:20s} {min(run() for _ in range(args.repeats)):6.1f} us per layer and step")


if __name__ == "__main__":
    main()
