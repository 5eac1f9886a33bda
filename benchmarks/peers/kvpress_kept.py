"""Kept positions of NVIDIA kvpress's presses after one prefill: the peer side of
``benchmarks/peers/kept_positions.py``.

Runs INSIDE the kvpress virtual environment (``benchmarks/peers/setup_kvpress.sh``); it does not
import kvpolicy. The model is read from a directory (the dequantized SmolLM2-135M float32
safetensors that ``kvpolicy_tools.models.load("smollm2-135m")`` writes), the prompt from a JSON file of
token ids. For every press and compression ratio it prefills the prompt with the press applied
(``with press(model)``, transformers' ``DynamicCache``) and records, per layer and KV head, which
prompt positions the compressed cache holds: each kept key is matched to the one prompt key it
equals (the press gathers keys, so every kept key is bit-equal to one of its inputs).

Presses: ``StreamingLLMPress`` (4 sinks), ``TOVAPress``, ``SnapKVPress`` (window 64, kernel 5),
``KnormPress``, ``KeyDiffPress``, ``ExpectedAttentionPress`` (defaults), all at their defaults
but ``compression_ratio``; on request (``--presses kvzip``) ``KVzipPress(layerwise=True)``, which
masks what it evicts instead of gathering (its kept positions are the complement of the
``masked_key_indices`` it leaves on each attention module) and reads the tokenizer from
``--model-dir`` (its repeat prompts and chat-template prefix);
and (issue 41) ``ChunkKVPress`` over that SnapKV (``chunkkv``) and over
Knorm (``chunkkv_knorm``), chunks of 20, ``CriticalKVPress`` over Knorm (``critical_knorm``) and over
Expected Attention without its value norm (``critical_expected_attention``), ``LagKVPress``
(``lagkv``, defaults).

Example (from the repository root)::

    .venv-kvpress/bin/python benchmarks/peers/kvpress_kept.py \\
        --model-dir ~/.cache/kvpolicy/models/smollm2-135m --ids prompt.json --ratios 0.5,0.75 --out kept.json
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Callable

PRESSES = ("streaming_llm", "tova", "snapkv", "knorm", "keydiff", "expected_attention")


def make_press(name: str, ratio: float) -> Any:
    """kvpress's press ``name`` at ``compression_ratio=ratio``."""
    import kvpress

    build: dict[str, Callable[[], Any]] = {
        "streaming_llm": lambda: kvpress.StreamingLLMPress(compression_ratio=ratio, n_sink=4),
        "tova": lambda: kvpress.TOVAPress(compression_ratio=ratio),
        "snapkv": lambda: kvpress.SnapKVPress(compression_ratio=ratio, window_size=64, kernel_size=5),
        "knorm": lambda: kvpress.KnormPress(compression_ratio=ratio),
        "keydiff": lambda: kvpress.KeyDiffPress(compression_ratio=ratio),
        "expected_attention": lambda: kvpress.ExpectedAttentionPress(compression_ratio=ratio),
        # the budget per layer (kvpolicy's policies decide per layer; kvpress's default shares it over layers)
        "kvzip": lambda: kvpress.KVzipPress(compression_ratio=ratio, layerwise=True),
        "chunkkv": lambda: kvpress.ChunkKVPress(kvpress.SnapKVPress(compression_ratio=ratio, window_size=64, kernel_size=5), 20),
        "chunkkv_knorm": lambda: kvpress.ChunkKVPress(kvpress.KnormPress(compression_ratio=ratio), 20),
        "critical_knorm": lambda: kvpress.CriticalKVPress(kvpress.KnormPress(compression_ratio=ratio)),
        "critical_expected_attention": lambda: kvpress.CriticalKVPress(
            kvpress.ExpectedAttentionPress(compression_ratio=ratio, use_vnorm=False)),
        "lagkv": lambda: kvpress.LagKVPress(compression_ratio=ratio),
    }
    return build[name]()


def masked_kept(model: Any, ids: Any, press: Any) -> list[list[list[int]]]:
    """``[layer][kv_head]`` prompt positions a masking press (``KVzipPress``) keeps: the complement
    of the ``masked_key_indices`` it leaves on each attention module (batch of one)."""
    import torch
    from transformers import DynamicCache

    with torch.no_grad(), press(model):
        model(input_ids=ids, past_key_values=DynamicCache(), use_cache=True)
    n, kept = int(ids.shape[1]), []
    for layer in model.model.layers:
        _, heads, positions = layer.self_attn.masked_key_indices
        pruned: list[set[int]] = [set() for _ in range(model.config.num_key_value_heads)]
        for h, j in zip(heads.tolist(), positions.tolist()):
            pruned[h].add(j)
        kept.append([[j for j in range(n) if j not in p] for p in pruned])
        del layer.self_attn.masked_key_indices  # (read by kvpress's attention on the next forward)
    return kept


def kept_positions(model: Any, ids: Any, press: Any) -> list[list[list[int]]]:
    """``[layer][kv_head]`` sorted prompt positions the press keeps (batch of one)."""
    import torch
    from transformers import DynamicCache

    if type(press).__name__ == "KVzipPress":
        return masked_kept(model, ids, press)

    found: dict[int, list[list[int]]] = {}
    compress = press.compress

    def recording(module: Any, hidden_states: Any, keys: Any, values: Any, attentions: Any, kwargs: Any) -> Any:
        new_keys, new_values = compress(module, hidden_states, keys, values, attentions, kwargs)
        same = (new_keys[0][:, :, None, :] == keys[0][:, None, :, :]).all(dim=-1)  # [heads, kept, n]
        if not bool(same.any(dim=-1).all()):
            raise RuntimeError(f"layer {module.layer_idx}: a kept key matches no prompt key")
        found[module.layer_idx] = same.to(torch.int8).argmax(dim=-1).sort(dim=-1).values.tolist()
        return new_keys, new_values

    press.compress = recording  # the forward hook calls self.compress
    with torch.no_grad(), press(model):
        model(input_ids=ids, past_key_values=DynamicCache(), use_cache=True, logits_to_keep=1)
    return [found[i] for i in sorted(found)]


def main(argv: list[str] | None = None) -> int:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--ids", required=True, help="JSON list of prompt token ids")
    parser.add_argument("--ratios", default="0.5,0.75", help="compression ratios, comma-separated")
    parser.add_argument("--presses", default=",".join(PRESSES))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    with open(args.ids) as f:
        ids = torch.tensor([json.load(f)], dtype=torch.int64)
    out: dict[str, Any] = {"prompt_length": int(ids.shape[1]), "kept": {}}
    for name in args.presses.split(","):
        for ratio in (float(r) for r in args.ratios.split(",")):
            out["kept"][f"{name}@{ratio}"] = kept_positions(model, ids, make_press(name, ratio))
    with open(args.out, "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
