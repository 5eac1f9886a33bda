"""Do kvpolicy and NVIDIA kvpress keep the same tokens? Kept positions per layer and KV head after
one prefill, on identical weights and prompt.

This driver (main ``.venv``) loads the embedded SmolLM2-135M (float32; ``kvpolicy_tools.models.load``
writes the dequantized safetensors that kvpress's side reads), takes the first ``--prompt``
tokens of wikitext-2 (raw test; ``run_peers.prompt_ids``, seeded random ids without the data),
runs ``benchmarks/peers/kvpress_kept.py`` in the kvpress venv (``setup_kvpress.sh``) on the same
ids, and prefills the same prompt through kvpolicy's ``EvictingCache`` with the matching policy,
sized as kvpress sizes a press (``n_kept = max(1, int(n * (1 - ratio)))``, ``compute_n_kept``):

* ``streaming_llm``: ``StreamingLLM(sink=4, window=n_kept - 4)`` vs ``StreamingLLMPress(n_sink=4)``;
* ``tova``: ``TOVA(size=n_kept)`` (the paper's head average, our default) vs ``TOVAPress``;
* ``snapkv``: ``SnapKV(size=n_kept, window=64, kernel=5)`` (average pooling, our default) vs
  ``SnapKVPress(window_size=64, kernel_size=5)``;
* ``knorm``: ``Knorm(size=n_kept)`` vs ``KnormPress``; ``keydiff``: ``KeyDiff(size=n_kept)`` vs
  ``KeyDiffPress``;
* ``expected_attention``: ``ExpectedAttention(size=n_kept)`` (``sink=4``, ``future=512``,
  covariance and value norm: the press's defaults) vs ``ExpectedAttentionPress``; after a prefill
  both estimate the queries from the prompt's (from position 4 on);
* ``kvzip`` (on request, ``--policies kvzip``): ``AdaKV(KVzip(size=n_kept, sink=4),
  alpha_safeguard=0)`` after its context reconstruction (``kvpolicy_integrations.reconstruction``,
  the tokenizer's repeat prompts, the chat template's prefix not repeated) vs
  ``KVzipPress(layerwise=True)`` (kvpress's default shares the budget over layers, which a
  per-layer policy does not express);
* (issue 41) ``chunkkv``: ``ChunkKV(SnapKV(size=n_kept, window=64, kernel=5), 20)`` vs
  ``ChunkKVPress(SnapKVPress(window_size=64), 20)``; ``chunkkv_knorm``: ``ChunkKV(Knorm(size=n_kept),
  20)`` vs ``ChunkKVPress(KnormPress(), 20)``; ``critical_knorm`` and ``critical_expected_attention``:
  ``CriticalKV`` over ``Knorm(size=n_kept)`` and ``ExpectedAttention(size=n_kept, value_norm=False)``
  with the model's ``W_o`` vs ``CriticalKVPress`` over ``KnormPress`` and
  ``ExpectedAttentionPress(use_vnorm=False)``; ``lagkv``: ``LagKV(size=n_kept)`` vs ``LagKVPress``.

For every (policy, ratio) it reports how many of the ``layers x kv_heads`` kept sets are equal and
the mean Jaccard similarity (|ours ∩ theirs| / |ours ∪ theirs|), also for our earlier defaults
(TOVA per head, SnapKV with max pooling) against the same press, prints a Markdown table and writes
``kept_positions.json`` into ``--out``. Without the kvpress venv it says so and exits 0.

Example (from the repository root)::

    benchmarks/peers/setup_kvpress.sh     # once: .venv-kvpress
    .venv/bin/python benchmarks/peers/kept_positions.py --prompt 512 --ratios 0.5,0.75
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_peers import DEFAULT_VENV, kvpress_python, prompt_ids  # noqa: E402

SCRIPT = Path(__file__).resolve().with_name("kvpress_kept.py")
POLICIES = ("streaming_llm", "tova", "snapkv", "knorm", "keydiff", "expected_attention")


#: Our other variants, compared with the same press: what the defaults before issue 27 kept.
VARIANTS = {"tova": {"selection": "per_head"}, "snapkv": {"pooling": "max"}}


def n_kept(n: int, ratio: float) -> int:
    """Tokens a kvpress ScorerPress keeps of ``n`` at ``ratio`` (``kvpress.utils.compute_n_kept``)."""
    return max(1, int(n * (1 - ratio)))


def our_policy(name: str, kept: int, *, model: Any = None, **variant: Any) -> Any:
    """The kvpolicy policy that matches kvpress's press ``name`` keeping ``kept`` tokens (with the
    ``variant``'s parameters), or ``None``. CriticalKV reads ``model``'s output projections
    (``kvpolicy.hf.output_projections``; ``None``: the identity)."""
    from kvpolicy import (ChunkKV, CriticalKV, ExpectedAttention, KeyDiff, Knorm, LagKV, SnapKV, StreamingLLM, TOVA,
                          available_policies, create_policy)

    if name in ("critical_knorm", "critical_expected_attention"):
        from kvpolicy.hf import output_projections

        w_o = None if model is None else output_projections(model)
        scorer = Knorm(size=kept) if name == "critical_knorm" else ExpectedAttention(size=kept, value_norm=False)
        return CriticalKV(scorer, projections=w_o)
    if name == "chunkkv":
        return ChunkKV(SnapKV(size=kept, window=64, kernel=5), 20)
    if name == "chunkkv_knorm":
        return ChunkKV(Knorm(size=kept), 20)
    if name == "lagkv":
        return LagKV(size=kept)

    if name == "streaming_llm":
        return StreamingLLM(sink=4, window=kept - 4)
    if name == "tova":
        return TOVA(size=kept, **variant)
    if name == "snapkv":
        return SnapKV(size=kept, window=64, kernel=5, **variant)
    if name == "knorm":
        return Knorm(size=kept)
    if name == "keydiff":
        return KeyDiff(size=kept)
    if name == "expected_attention":
        return ExpectedAttention(size=kept)
    if name == "kvzip":
        from kvpolicy import AdaKV, KVzip

        return AdaKV(KVzip(size=kept, sink=min(4, kept - 1)), alpha_safeguard=0.0)
    if name in available_policies():
        return create_policy(name, size=kept)
    return None


def our_kept(model: Any, ids: Any, policy: Any, tokenizer: Any = None) -> list[list[list[int]]]:
    """``[layer][kv_head]`` positions kvpolicy's EvictingCache keeps after prefilling ``ids`` (and,
    for a policy scored by a context reconstruction, KVzip, after it: ``tokenizer`` gives its
    repeat prompts; holes of head-wise budgets left out)."""
    import torch

    from kvpolicy.hf import EvictingCache, cache_kwargs

    cache = EvictingCache(policy, model)
    with torch.no_grad():
        model(ids, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
    if policy.needs_reconstruction:
        from kvpolicy_integrations.reconstruction import reconstruct, repeat_prompts

        prompts = repeat_prompts(tokenizer)
        reconstruct(model, cache, ids, prompts, start=prompts.prefix)  # (kvpress skips the template's prefix)
    return [[[p for p in head if p >= 0] for head in layer.store.positions[0].tolist()] for layer in cache.layers]


def agreement(ours: list[list[list[int]]], theirs: list[list[list[int]]]) -> dict[str, float]:
    """Equal (layer, head) sets and the mean Jaccard similarity of the kept sets."""
    equal, jaccard, total = 0, 0.0, 0
    for layer_ours, layer_theirs in zip(ours, theirs, strict=True):
        for a, b in zip(layer_ours, layer_theirs, strict=True):
            a_set, b_set = set(a), set(b)
            equal += a_set == b_set
            jaccard += len(a_set & b_set) / max(1, len(a_set | b_set))
            total += 1
    return {"equal": equal, "sets": total, "jaccard": jaccard / total}


def main(argv: Sequence[str] | None = None) -> int:
    import torch

    from kvpolicy_tools import models

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens (default 512)")
    parser.add_argument("--ratios", default="0.5,0.75", help="kvpress compression ratios (1 - budget)")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="the kvpress virtual environment")
    parser.add_argument("--out", type=Path, default=Path("bench-results/kept-positions"))
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    python = kvpress_python(args.venv)
    if python is None:
        print(f"kvpress venv not found at {args.venv} (benchmarks/peers/setup_kvpress.sh builds it): nothing to compare")
        return 0
    ratios = [float(r) for r in args.ratios.split(",")]
    names = args.policies.split(",")
    model, tokenizer = models.load(models.EMBEDDED_MODEL, dtype="float32", progress=False)
    ids_list, source = prompt_ids(tokenizer, model.config.vocab_size, args.prompt, "wikitext")
    ids = torch.tensor([ids_list])
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        ids_file, theirs_file = Path(tmp) / "ids.json", Path(tmp) / "kept.json"
        ids_file.write_text(json.dumps(ids_list))
        cmd = [str(python), str(SCRIPT), "--model-dir", str(models.cache_path(models.EMBEDDED_MODEL)), "--ids", str(ids_file),
               "--ratios", args.ratios, "--presses", ",".join(names), "--threads", str(args.threads), "--out", str(theirs_file)]
        subprocess.run(cmd, check=True)
        theirs = json.loads(theirs_file.read_text())["kept"]
    rows: list[dict[str, Any]] = []
    for name in names:
        for ratio in ratios:
            kept = n_kept(len(ids_list), ratio)
            for variant in ({}, *([VARIANTS[name]] if name in VARIANTS else [])):
                policy = our_policy(name, kept, model=model, **variant)
                row: dict[str, Any] = {"policy": name, "ratio": ratio, "kept": kept, "ours": repr(policy)}
                if policy is not None:
                    row.update(agreement(our_kept(model, ids, policy, tokenizer), theirs[f"{name}@{ratio}"]))
                rows.append(row)
    report = {"model": models.EMBEDDED_MODEL, "prompt": source, "prompt_length": len(ids_list), "rows": rows}
    (args.out / "kept_positions.json").write_text(json.dumps(report, indent=1))
    print(f"prompt: {source}; {model.config.num_hidden_layers} layers x {model.config.num_key_value_heads} KV heads")
    print("| policy | ratio | kept | ours | equal sets | mean Jaccard |\n|---|---|---|---|---|---|")
    for r in rows:
        if "equal" in r:
            print(f"| {r['policy']} | {r['ratio']} | {r['kept']} | `{r['ours']}` | {r['equal']} / {r['sets']} | {r['jaccard']:.3f} |")
        else:
            print(f"| {r['policy']} | {r['ratio']} | {r['kept']} | not in kvpolicy | - | - |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
