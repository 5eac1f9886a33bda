"""``replay`` with the contract of :func:`kvpolicy_numpy.replay`, run through :class:`LayerCache`."""

from __future__ import annotations

import numpy as np
import torch

from kvpolicy.validation import check_int
from kvpolicy.policy import EvictionPolicy, check_eviction_policy
from kvpolicy.driver import nonfinite_rows, warn_nonfinite
from kvpolicy.statistics import Rotary, history_record, low_attention
from kvpolicy_numpy.replay import Trace, validate_keys, validate_logits, validate_queries, validate_rope, validate_values

from .layer import LayerCache

__all__ = ["replay"]


def _scales(policy: EvictionPolicy, n_keys: torch.Tensor) -> torch.Tensor:
    """Log-n scale for queries attending to ``n_keys`` keys each (1 without log n)."""
    if policy.log_n is None:
        return torch.ones_like(n_keys, dtype=torch.float64)
    return policy.log_n.scales(n_keys)


def _host(x: np.ndarray | torch.Tensor) -> np.ndarray:
    """A NumPy copy of a tensor (complex kept complex, so it is refused rather than cast)."""
    if not isinstance(x, torch.Tensor):
        return np.asarray(x)
    x = x.detach().cpu()
    return x.numpy() if x.is_complex() or x.dtype == torch.bool else x.to(torch.float64).numpy()


def replay(
    policy: EvictionPolicy,
    logits: np.ndarray | torch.Tensor,
    prompt_len: int = 0,
    values: np.ndarray | torch.Tensor | None = None,
    keys: np.ndarray | torch.Tensor | None = None,
    queries: np.ndarray | torch.Tensor | None = None,
    rope: Rotary | None = None,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float64,
) -> Trace:
    """Replay ``policy`` on given logits through the torch backend's :class:`LayerCache`.

    Same arguments, checks and result as :func:`kvpolicy_numpy.replay` (arrays in the trace are NumPy);
    ``device`` and ``dtype`` pick where and in what precision the torch side runs.

    Example:
        >>> import numpy as np
        >>> from kvpolicy import StreamingLLM
        >>> replay(StreamingLLM(sink=1, window=2), np.zeros((6, 1, 6))).kept[5].tolist()
        [[0, 4, 5]]
    """
    policy = check_eviction_policy("policy", policy)
    # The reference's checks (shape, real, finite where read), on the host: replay is a tool, not
    # the decode hot path, so one transfer here is fine and both backends refuse the same inputs.
    logits_t = torch.as_tensor(validate_logits(_host(logits)), dtype=dtype, device=device)
    if logits_t.dtype != torch.float64:
        validate_logits(_host(logits_t))  # finite in float64 may overflow in a narrower dtype
    steps, heads, _ = logits_t.shape
    prompt_len = check_int("prompt_len", prompt_len, minimum=0, maximum=steps)
    if values is not None:
        values_t = torch.as_tensor(validate_values(_host(values), steps, heads, policy), dtype=dtype, device=device)
    else:
        values_t = torch.zeros(steps, heads, 1, dtype=dtype, device=device)
    keys_np = validate_keys(None if keys is None else _host(keys), steps, heads, policy)
    # a policy whose scores come from keys computes them from these (LayerCache holds them)
    keys_t = torch.zeros(steps, heads, 1, dtype=dtype, device=device) if keys_np is None else torch.as_tensor(keys_np, dtype=dtype, device=device)

    queries_np = None if keys_np is None else validate_queries(None if queries is None else _host(queries), steps, heads, keys_np.shape[2], policy)
    if queries_np is not None and values is None:
        raise ValueError(f"values are required for {policy!r}: its scores multiply by the value norm; pass values=[steps, heads, d]")
    # Expected Attention: the layer's running moments of the queries [steps, heads, group, d]
    queries_t = None if queries_np is None else torch.as_tensor(queries_np, dtype=dtype, device=device)
    rope = None if queries_np is None else validate_rope(rope, keys_np.shape[2])  # type: ignore[union-attr]
    rotary = None if rope is None else Rotary(torch.as_tensor(np.asarray(rope.inv_freq), device=device), rope.style, rope.rotary_dim)

    def observe(a: int, b: int) -> None:  # the queries of steps a..b-1, as [1, q_heads, q, d]
        if queries_t is not None:
            q = queries_t[a:b].permute(1, 2, 0, 3)
            layer.observe_queries(q.reshape(1, q.shape[0] * q.shape[1], b - a, q.shape[3]), rotary=rotary)

    layer = LayerCache(policy)
    kept: list[np.ndarray | None] = [None] * steps
    sizes: list[int] = []
    evictions: list[tuple[int, int, int]] = []
    outputs = torch.zeros(steps, heads, values_t.shape[2], dtype=dtype, device=device)
    nonfinite: list[tuple[int, int]] = []  # (step, head) rows whose probabilities overflowed

    def step_evict(t: int) -> None:
        evictions.extend((t, before, after) for before, after in layer.evict())

    if prompt_len:
        p = prompt_len
        vals = values_t[:p].permute(1, 0, 2)[None]  # [1, heads, p, d]
        layer.append(keys_t[:p].permute(1, 0, 2)[None], vals)
        scale = _scales(policy, torch.arange(1, p + 1, device=device)).to(dtype)
        rows = logits_t[:p, :, :p] * scale[:, None, None]
        causal = torch.ones(p, p, dtype=torch.bool, device=device).tril()[:, None, :]
        probs = torch.softmax(rows.masked_fill(~causal, float("-inf")), dim=-1)  # [p, heads, p]
        nonfinite += nonfinite_rows(probs, 0)
        if policy.score_statistic == "low_history":  # each row is a query of the record (Scissorhands)
            low = low_attention(probs, 1, kept=causal.expand(probs.shape))  # [p, heads, p]
            layer.accumulate(history_record(low.permute(1, 0, 2), policy.score_history)[None])  # type: ignore[arg-type]
        else:
            # the last prompt_rows rows, added one at a time in order as the reference adds them
            # (torch's sum over dim 0 adds trailing columns in another order: an exact tie between
            # equal columns would part by an ulp)
            window = probs[max(0, p - (policy.prompt_rows or p)) :]
            total = window[0].clone()
            for row in window[1:]:
                total += row
            layer.accumulate(total[None])
        outputs[:p] = torch.einsum("qhk,khd->qhd", probs, values_t[:p])
        observe(0, p)
        step_evict(p - 1)
        kept[p - 1] = layer.positions[0].cpu().numpy().copy()

    for t in range(prompt_len, steps):
        _, v_all = layer.append(keys_t[t][None, :, None, :], values_t[t][None, :, None, :])
        cached = layer.slot_positions[0]  # [heads, n] in slot order, -1 at holes
        # per head; under head-wise budgets (heads hold different numbers) on average, as the reference
        sizes.append(int((cached >= 0).sum()) // heads if policy.ragged_heads else layer.length)
        scale = _scales(policy, torch.tensor([layer.length], device=device)).to(dtype)  # n = kept keys
        rows = torch.gather(logits_t[t], 1, cached.clamp(min=0)) * scale
        probs = torch.softmax(rows.masked_fill(cached < 0, float("-inf")), dim=-1)  # [heads, n]
        nonfinite += nonfinite_rows(probs[None], t)  # (a host read a step: replay is a tool, not the decode path)
        if policy.score_statistic == "low_history":
            layer.accumulate(low_attention(probs, 1, kept=cached >= 0).to(torch.float64)[None])
        else:
            layer.accumulate(probs[None])
        outputs[t] = torch.einsum("hk,hkd->hd", probs, v_all[0])
        observe(t, t + 1)
        step_evict(t)
        kept[t] = layer.positions[0].cpu().numpy().copy()

    causal = torch.ones(steps, steps, dtype=torch.bool, device=device).tril()[:, None, :]
    full = torch.softmax(logits_t.masked_fill(~causal, float("-inf")), dim=-1)
    full_outputs = torch.einsum("qhk,khd->qhd", full, values_t)
    has_values = values is not None
    warn_nonfinite(policy, nonfinite)
    return Trace(
        kept,
        np.asarray(sizes, dtype=np.int64),
        evictions,
        prompt_len,
        outputs.cpu().numpy() if has_values else None,
        full_outputs.cpu().numpy() if has_values else None,
        steps,
        nonfinite,
    )
