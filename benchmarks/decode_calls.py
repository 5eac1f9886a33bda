"""How far one decode step of one layer wanders: project modules and function calls, counted.

Issue 43 asks for one eager decode step of one layer through at most 5 project modules and about
15 project function calls (transformers' ``DynamicLayer.update`` is two ``torch.cat``). This script
counts them with ``sys.setprofile`` (Python-level calls into ``kvpolicy``, ``kvpolicy_torch`` and
``kvpolicy_integrations``; torch's kernels are not calls of ours) on tiny random-weight Llamas
(wiring, not language), after a 40-token prompt and three decode steps, so the cache is full and
evicting:

* **calls per layer**: a decode forward of a 2-layer model minus one of a 1-layer model (the same
  policy and state): what each further layer adds, the cache-level work of a forward (its checks,
  hooks, the attention switch) subtracted;
* **calls per forward**: that cache-level work (the 1-layer forward minus its layer);
* **modules per layer**: the project modules the 2-layer forward's last layer passes through,
  from its cache update to the end of its attention function (including what that layer does for
  the others: a :class:`~kvpolicy_torch.LayerGroup` searches every layer's victims in the last).

Run: ``python benchmarks/decode_calls.py [--policies h2o,knorm] [--json FILE]``; eager and
``static_shapes`` (the compiled step's code, run eagerly) are both counted.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from typing import Any

import torch

from kvpolicy import H2O, TOVA, KeyDiff, Knorm, LocalWindow, StreamingLLM
from kvpolicy_integrations.hf import EvictingCache, cache_kwargs
from kvpolicy_tools.models import tiny_llama

#: The policies counted by default: each one-token decode rule (built for a 16-token cache).
POLICIES = {
    "h2o": lambda: H2O(heavy=8, recent=8),
    "tova": lambda: TOVA(size=16),
    "streaming_llm": lambda: StreamingLLM(sink=4, window=12),
    "local": lambda: LocalWindow(window=16),
    "knorm": lambda: Knorm(size=16),
    "keydiff": lambda: KeyDiff(size=16),
}
PROJECT = ("/kvpolicy/", "/kvpolicy_torch/", "/kvpolicy_integrations/")


def _traced_step(policy: Any, layers: int, static: bool) -> list[tuple[str, str]]:
    """``(module file, function)`` of every project call in one decode forward of a full cache."""
    model = tiny_llama(num_layers=layers)
    cache = EvictingCache(policy, model, static_shapes=static)
    with torch.no_grad():
        model(torch.arange(1, 41).view(1, 40), **cache_kwargs(model, cache), position_ids=torch.arange(40)[None])
        for t in range(3):
            model(torch.tensor([[7]]), **cache_kwargs(model, cache), position_ids=torch.tensor([[40 + t]]))
    calls: list[tuple[str, str]] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            name = frame.f_code.co_filename
            if any(p in name for p in PROJECT):
                calls.append((name.rsplit("/", 2)[-2] + "/" + name.rsplit("/", 1)[-1], frame.f_code.co_name))

    with torch.no_grad():
        sys.setprofile(profile)
        try:
            model(torch.tensor([[7]]), **cache_kwargs(model, cache), position_ids=torch.tensor([[43]]))
        finally:
            sys.setprofile(None)
    return calls


def _last_layer(calls: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The calls of the forward's last layer: from its cache update (``EvictingLayer.update``, which
    transformers' ``Cache.update`` hands the call to) to the hooks' ``after``."""
    starts = [i for i, (m, f) in enumerate(calls) if f == "update" and m == "hf/layer.py"]
    end = next(i for i, (m, f) in enumerate(calls) if f == "after" and i > starts[-1])
    return calls[starts[-1]:end]


def count(policy_name: str, static: bool) -> dict[str, Any]:
    """The counts of one policy (see the module docstring).

    Example:
        >>> row = count("h2o", static=False)
        >>> row["calls_per_layer"] > 0 and row["modules_per_layer"] > 0
        True
    """
    make = POLICIES[policy_name]
    one, two = _traced_step(make(), 1, static), _traced_step(make(), 2, static)
    per_layer = len(two) - len(one)
    layer = _last_layer(two)
    modules = Counter(m for m, _ in layer)
    return {
        "policy": policy_name, "static_shapes": static, "calls_per_layer": per_layer,
        "calls_per_forward": len(one) - per_layer, "modules_per_layer": len(modules),
        "modules": dict(modules.most_common()), "layer_calls": [f for _, f in layer],
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policies", default=",".join(POLICIES), help=f"comma-separated, of {', '.join(POLICIES)}")
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    names = [n for n in args.policies.split(",") if n]
    unknown = [n for n in names if n not in POLICIES]
    if unknown:
        raise SystemExit(f"--policies: unknown {unknown}; choose from {', '.join(POLICIES)}")
    rows = [count(n, s) for n in names for s in (False, True)]
    print(f"{'policy':>14} {'layout':>7} {'calls/layer':>12} {'modules/layer':>14} {'calls/forward':>14}")
    for r in rows:
        print(f"{r['policy']:>14} {'static' if r['static_shapes'] else 'eager':>7} {r['calls_per_layer']:>12} "
              f"{r['modules_per_layer']:>14} {r['calls_per_forward']:>14}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
