"""What layer 0's attention receives in a full (non-evicting) forward, for the tests that rebuild
its logits by hand (layer 0 sees only token embeddings, so a full forward reproduces them)."""

from __future__ import annotations

from typing import Any

import torch


def layer0_inputs(model: Any, tokens: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """``(hidden_states, (cos, sin))`` that layer 0's self-attention receives when ``model`` runs
    ``tokens`` without a cache."""
    captured: dict[str, Any] = {}

    def grab(module: Any, args: Any, kwargs: Any) -> None:
        captured["hidden"] = kwargs.get("hidden_states", args[0] if args else None)
        captured["pos"] = kwargs["position_embeddings"]

    h = model.model.layers[0].self_attn.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            model(tokens)
    finally:
        h.remove()
    return captured["hidden"], captured["pos"]


def layer0_states(model: Any, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
    """Layer 0's queries, keys and values ``[batch, heads, steps, head_dim]`` before RoPE (each
    projection's own heads) and the ``(cos, sin)`` it rotates them with, in a full forward."""
    attn = model.model.layers[0].self_attn
    hidden, pos = layer0_inputs(model, tokens)
    b, s, _ = hidden.shape

    def heads(projection: Any) -> torch.Tensor:
        return projection(hidden).view(b, s, -1, attn.head_dim).transpose(1, 2)

    return heads(attn.q_proj), heads(attn.k_proj), heads(attn.v_proj), pos


def layer0_logits_and_keys(model: Any, tokens: torch.Tensor) -> tuple[Any, Any]:
    """Layer 0's pre-softmax logits ``[steps, heads, steps]`` and RoPE'd keys ``[steps, kv_heads,
    head_dim]`` (float64 NumPy) in a full forward of ``tokens`` (layer 0 sees only token
    embeddings, so they are reproducible); a Llama-family model."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q, k, _, (cos, sin) = layer0_states(model, tokens)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    logits = torch.einsum("bhqd,bhkd->bqhk", q, k) * model.model.layers[0].self_attn.scaling
    return logits[0].detach().double().numpy(), k[0].transpose(0, 1).detach().double().numpy()


def greedy_tokens(model: Any, cache: Any, ids: torch.Tensor, steps: int) -> torch.Tensor:
    """``ids`` and ``steps`` greedily decoded tokens after them ``[batch, prompt + steps]``, the
    model running with ``cache`` (an EvictingCache: what the layer-0 differential tests replay)."""
    from kvpolicy.hf import cache_kwargs

    with torch.no_grad():
        out = model(ids, **cache_kwargs(model, cache))
        tokens = [ids]
        for _ in range(steps):
            tok = out.logits[:, -1:].argmax(-1)
            tokens.append(tok)
            out = model(tok, **cache_kwargs(model, cache))
    return torch.cat(tokens, dim=1)


def layer0_cached_values(model: Any, tokens: torch.Tensor, prompt_len: int) -> tuple[Any, Any, Any]:
    """Layer 0's logits and keys (a full forward, :func:`layer0_logits_and_keys`) and its values
    ``[steps, kv_heads, head_dim]`` (float64 NumPy) as the cache received them: the prompt in one
    forward, then one token at a time. A value is bit-equal to the cache's only then (a matmul's
    rounding depends on its rows), and greedy decoding repeats tokens, whose equal values tie
    exactly on both sides."""
    from transformers import DynamicCache

    from kvpolicy.hf import cache_kwargs

    logits, keys = layer0_logits_and_keys(model, tokens)
    attn = model.model.layers[0].self_attn
    seen = []
    hook = attn.v_proj.register_forward_hook(lambda module, args, out: seen.append(out))
    try:
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(tokens[:, :prompt_len], **cache_kwargs(model, cache))
            for t in range(prompt_len, tokens.shape[1]):
                model(tokens[:, t : t + 1], **cache_kwargs(model, cache))
    finally:
        hook.remove()
    v = torch.cat(seen, dim=1)[0].view(tokens.shape[1], -1, attn.head_dim)  # [steps, kv_heads, d]
    return logits, keys, v.double().numpy()


def layer0_logits(model: Any, tokens: torch.Tensor) -> Any:
    """Layer 0's pre-softmax logits ``[steps, heads, steps]`` (float64 NumPy) in a full
    (non-evicting) forward of ``tokens`` ``[1, steps]`` by a Llama-shaped ``model`` with as many
    query heads as KV heads: what :func:`kvpolicy_numpy.replay` takes."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    attn = model.model.layers[0].self_attn
    hidden, (cos, sin) = layer0_inputs(model, tokens)
    b, s, _ = hidden.shape
    d = attn.head_dim
    q = attn.q_proj(hidden).view(b, s, -1, d).transpose(1, 2)
    k = attn.k_proj(hidden).view(b, s, -1, d).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    logits = torch.einsum("bhqd,bhkd->bqhk", q, k) * attn.scaling
    return logits[0].detach().double().numpy()
