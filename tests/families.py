"""Tiny random-weight decoders of every causal-LM model type transformers ships (for the family
matrix, tests/integrations/test_families.py): built from the config alone, no download."""

from __future__ import annotations

from typing import Any

import torch

# Size fields set wherever a config has them: tiny models, 2 layers, GQA (4 query, 2 KV heads).
_TINY: dict[str, Any] = {
    "hidden_size": 64, "n_embd": 64, "d_model": 64, "dim": 64,
    "intermediate_size": 128, "n_inner": 128, "ffn_dim": 128, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32, "ffn_hidden_size": 128,
    "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "n_layers": 2,
    "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "num_heads": 4,
    "num_key_value_heads": 2, "num_kv_heads": 2, "n_kv_heads": 2,
    "head_dim": 16, "vocab_size": 256, "max_position_embeddings": 512, "n_positions": 512,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "moe_num_experts": 4, "n_shared_experts": 1,
}


def tiny_config(model_type: str, **overrides: Any) -> Any:
    """A tiny config of ``model_type`` (sizes above wherever the config has the field)."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name, value in _TINY.items():
        if name in type(text).__dict__ and isinstance(type(text).__dict__[name], property):
            continue
        if hasattr(text, name) and isinstance(getattr(text, name), int) and not isinstance(getattr(text, name), bool):
            setattr(text, name, value)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if isinstance(getattr(text, name, None), int) and getattr(text, name) >= 256:
            setattr(text, name, 0)
    lt = getattr(text, "layer_types", None)
    if isinstance(lt, list) and len(lt) != text.num_hidden_layers:
        kinds = list(dict.fromkeys(lt))
        text.layer_types = [kinds[i % len(kinds)] for i in range(text.num_hidden_layers)]
    for name, value in overrides.items():
        setattr(text, name, value)
    return config


def tiny_model(model_type: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A float32 eval-mode random-weight causal LM of ``model_type``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides), dtype=torch.float32)
    return model.eval()
