"""What the transformers-integration tests (tests/integrations/hf/) share: the tiny random-weight
Llamas they run on (wiring and numerics, not language), their token ids, and a greedy
``model.generate`` through a cache."""

from __future__ import annotations

from typing import Any

import torch

from kvpolicy_integrations.capabilities import cache_kwargs
from kvpolicy_tools.models import tiny_llama

#: The seed of the issue 44 edge tests' model (tiny_llama's default shape).
EDGE_SEED = 11


def tiny_model() -> Any:
    """The suite's model: 2 layers, 4 query heads over 2 KV heads of 16, a vocabulary of 128."""
    return tiny_llama(num_layers=2, heads=4, kv_heads=2, head_dim=16, vocab=128, seed=0)


def edge_model() -> Any:
    """The issue 44 edge tests' model: tiny_llama's default shape, seed :data:`EDGE_SEED`."""
    return tiny_llama(seed=EDGE_SEED)


def token_ids(batch: int = 2, length: int = 40, seed: int = 0) -> torch.Tensor:
    """``[batch, length]`` random ids in ``[3, 128)`` (no special ids), reproducible by ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (batch, length), generator=g)


def edge_ids(n: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    """The edge tests' ids: ``[batch, n]``, drawn as they always were (``token_ids`` with the
    arguments in the other order)."""
    return token_ids(batch, n, seed)


def greedy(model: Any, ids: torch.Tensor, cache: Any, n: int = 16) -> torch.Tensor:
    """``model.generate`` greedily for ``n`` tokens through ``cache`` (no padding)."""
    with torch.no_grad():
        return model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, **cache_kwargs(model, cache)
        )
