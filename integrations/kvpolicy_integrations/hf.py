"""Hugging Face transformers (5.x) integration: an evicting cache that ``generate()`` uses.

Pieces:

* :class:`EvictingCache` / :class:`EvictingLayer`: a ``transformers.Cache`` whose layers hold a
  :class:`kvpolicy_torch.LayerCache`. ``update`` appends the new keys/values and returns
  everything cached (the current queries attend to all of it, as in the paper); eviction runs
  right after that layer's attention.
* the attention function ``"kvpolicy_sdpa"``: SDPA computes the output; one extra product of
  the current queries with the cached keys gives the probabilities each cached token received
  (summed per KV head under GQA); BUZZ's log-n scaling is applied in the same function. A decode
  step (one query) of a policy that reads scores takes the fused path instead: one product of the
  query with the keys, one softmax, one product with the values, so the probabilities SDPA would
  compute internally are the scores (``fused_decode=False`` restores SDPA plus the extra product).
  It is registered in ``AttentionInterface`` *and* ``AttentionMaskInterface`` (without the latter
  transformers passes no mask, and SDPA's top-left ``is_causal`` then drops keys during a
  chunked prefill).
* :func:`generate`: the one-line helper.

Positions: ``get_seq_length`` is the number of tokens *seen* (like transformers' own
sliding-window layer), so positions built from it stay right after eviction, and
``get_mask_sizes`` reports the cached length plus the query, which is what ``update`` returns.
Two position modes: ``"original"`` (a key keeps the RoPE position it was computed at; default for
H2O and BUZZ) and ``"cache"`` (StreamingLLM's pos-shift: keys are re-rotated so that the
distances between query and keys are distances between cache slots).
"""

from __future__ import annotations

import contextvars

from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvpolicy.policy import EvictionPolicy
from kvpolicy_torch import LayerCache, received_attention

__all__ = [
    "ATTENTION_NAME",
    "SUPPORTED_MODEL_TYPES",
    "EvictingCache",
    "EvictingLayer",
    "GenerationResult",
    "generate",
    "register_attention",
    "use_kvpolicy_attention",
]

ATTENTION_NAME = "kvpolicy_sdpa"
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
PositionsMode = Literal["original", "cache"]

# The layer whose update() ran last in this thread/context: the attention call that follows
# belongs to it (transformers passes no cache to attention functions).
_ACTIVE: contextvars.ContextVar["EvictingLayer | None"] = contextvars.ContextVar("kvpolicy_active_layer", default=None)


def kvpolicy_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """SDPA output plus score capture and eviction for the :class:`EvictingLayer` that just updated."""
    layer = _ACTIVE.get()
    if layer is None or not layer.pending or layer.layer_idx != getattr(module, "layer_idx", None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    _ACTIVE.set(None)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q_len = query.shape[2]
    if q_len > 1 and layer.store.n_seen == q_len and attention_mask is not None and attention_mask.dtype == torch.bool:
        # Once per prompt: the last query row of a padding-free causal mask sees every key.
        if not bool(attention_mask[:, :, -1, :].all()):
            layer.pending = False
            raise ValueError(
                "EvictingCache got a padded batch (attention_mask has zeros): rows of different lengths are not "
                "supported yet; generate each prompt separately or batch prompts of equal length"
            )
    log_n = layer.policy.log_n
    query_scale = None
    sdpa_query, sdpa_scale = query, scale
    if log_n is not None:
        # n = keys each query row attends to (paper, section 3.5): all of `key` for a decode step,
        # key.shape[2] - q_len + i + 1 for row i of a chunk (causal)
        if q_len == 1:
            sdpa_scale = scale * log_n.scale(key.shape[2])
        else:
            n_keys = torch.arange(key.shape[2] - q_len + 1, key.shape[2] + 1, device=query.device)
            query_scale = log_n.scales(n_keys).to(torch.float32)
            sdpa_query = query * query_scale[:, None].to(query.dtype)
    if q_len == 1 and layer.fused_decode and layer.policy.uses_scores and not dropout and _fusable(attention_mask, kwargs):
        out, received = _fused_decode_attention(query, key, value, attention_mask, sdpa_scale)
        layer.finish_received(received)
        return out, None
    out, _ = sdpa_attention_forward(
        module, sdpa_query, key, value, attention_mask, dropout=dropout, scaling=sdpa_scale, **kwargs
    )
    layer.finish(query, key, scale if q_len > 1 or log_n is None else sdpa_scale, query_scale)
    return out, None


def _fusable(attention_mask: torch.Tensor | None, kwargs: dict[str, Any]) -> bool:
    """Whether a decode step may take :func:`_fused_decode_attention` (a mask shared by all heads,
    nothing SDPA-specific such as a position bias or softcap)."""
    if kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None:
        return False
    return attention_mask is None or (attention_mask.ndim == 4 and attention_mask.shape[1] == 1)


def _fused_decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one query per head, and what each key received, in one pass over the keys.

    Args:
        query: ``[batch, q_heads, 1, head_dim]``; key, value: ``[batch, kv_heads, n, head_dim]``.
        attention_mask: ``None``, or a boolean (True: attend) / additive ``[batch|1, 1, 1|q, n]`` mask.
        scaling: the logit scale (log-n scaling included).

    Returns:
        ``(out, received)``: ``out`` ``[batch, 1, q_heads, head_dim]`` (the layout
        ``sdpa_attention_forward`` returns) and ``received`` ``[batch, kv_heads, n]`` float32
        (float64 for float64 inputs), the probabilities summed over each KV head's query heads.

    GQA needs no copy: the ``r`` query heads of a KV head are the rows of one ``[r, d] x [d, n]``
    product. The logits are computed in the inputs' dtype and the softmax in float32 (float64 for
    float64), as SDPA's math path does; for float32 and float64 models the scores equal
    :func:`~kvpolicy_torch.received_attention`'s.
    """
    b, hq, _, d = query.shape
    g, n, dv = key.shape[1], key.shape[2], value.shape[-1]
    r = hq // g
    work = torch.float64 if query.dtype == torch.float64 else torch.float32
    # query head g * r + i attends with KV head g: [b * g, r, d] x [b * g, d, n] (a cache's
    # [batch, heads, :n] view of its storage reshapes without a copy)
    grouped = query.reshape(b * g, r, d)
    logits = torch.bmm(grouped, key.reshape(b * g, n, d).transpose(1, 2)).to(work).view(b, g, r, n) * scaling
    if attention_mask is not None:
        mask = attention_mask[:, :, -1:, :]  # [b|1, 1, 1, n]: broadcasts over g and r
        if mask.dtype == torch.bool:
            logits = logits.masked_fill(~mask, float("-inf"))
        else:
            logits = logits + mask.to(work)
    probs = torch.softmax(logits, dim=-1)  # [b, g, r, n]
    out = torch.bmm(probs.view(b * g, r, n).to(value.dtype), value.reshape(b * g, n, dv))  # [b * g, r, dv]
    return out.view(b, 1, hq, dv), probs.sum(dim=2)


def register_attention() -> str:
    """Register ``"kvpolicy_sdpa"`` in transformers' attention and mask interfaces (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, kvpolicy_sdpa_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    return ATTENTION_NAME


register_attention()


def use_kvpolicy_attention(model: torch.nn.Module) -> None:
    """Switch ``model`` to the score-capturing SDPA attention (outputs equal plain SDPA)."""
    register_attention()
    if getattr(model.config, "_attn_implementation", None) != ATTENTION_NAME:
        model.set_attn_implementation(ATTENTION_NAME)


class RotaryTable:
    """``cos`` and ``sin`` of ``delta * inv_freq`` for integer ``delta`` in ``[0, rows)``, built once
    and grown by doubling, shared by the layers of one cache (pos-shift reads a row per key instead
    of evaluating ``cos`` and ``sin`` for every cached key at every step). Rows are computed exactly
    as the direct formula computes them (``float32(delta) * inv_freq``, then ``cos``/``sin``)."""

    def __init__(self, inv_freq: torch.Tensor) -> None:
        self.inv_freq = inv_freq.detach().to(torch.float32)
        self.table: torch.Tensor | None = None  # [rows, head_dim]: cos | sin

    def lookup(self, delta: torch.Tensor, bound: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[*delta.shape, head_dim / 2]``; ``bound`` (a host int) exceeds every
        ``delta``, so growing the table needs no look at the tensor (no host-device sync)."""
        table = self.table
        if table is None or table.shape[0] < bound or table.device != delta.device:
            rows = max(bound, 256, 2 * table.shape[0] if table is not None else 0)
            angles = torch.arange(rows, device=delta.device, dtype=torch.float32)[:, None] * self.inv_freq.to(delta.device)
            table = self.table = torch.cat((angles.cos(), angles.sin()), dim=-1)
        half = table.shape[1] // 2
        both = table.index_select(0, delta.reshape(-1)).view(*delta.shape, 2 * half)
        return both[..., :half], both[..., half:]


class EvictingLayer(DynamicLayer):
    """One transformers cache layer backed by :class:`kvpolicy_torch.LayerCache`."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(
        self,
        policy: EvictionPolicy,
        layer_idx: int,
        *,
        positions: PositionsMode = "original",
        inv_freq: torch.Tensor | None = None,
        reduce_scores: Callable[[torch.Tensor], torch.Tensor] | None = None,
        fused_decode: bool = True,
        rotary: RotaryTable | None = None,
    ) -> None:
        self.store = LayerCache(policy, reduce_scores=reduce_scores)
        super().__init__()
        self.policy = policy
        self.layer_idx = layer_idx
        self.positions_mode = positions
        self.inv_freq = inv_freq
        self.fused_decode = fused_decode
        self.rotary = rotary
        self.pending = False

    # transformers' base classes assign self.keys / self.values; they live in the store here.
    @property  # type: ignore[override]
    def keys(self) -> torch.Tensor | None:
        return self.store.keys if self.store.is_initialized else None

    @keys.setter
    def keys(self, value: Any) -> None:
        if value is not None:
            raise AttributeError("EvictingLayer.keys is read-only; use update()")

    @property  # type: ignore[override]
    def values(self) -> torch.Tensor | None:
        return self.store.values if self.store.is_initialized else None

    @values.setter
    def values(self, value: Any) -> None:
        if value is not None:
            raise AttributeError("EvictingLayer.values is read-only; use update()")

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``[batch, kv_heads, q, head_dim]`` keys/values; return all cached ones."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.pending:
            self.pending = False
            raise RuntimeError(
                f"layer {self.layer_idx}: the previous step's attention did not go through kvpolicy, so no scores "
                f"were captured and nothing was evicted. Call kvpolicy_integrations.hf.use_kvpolicy_attention(model) "
                f"(or load the model with attn_implementation='{ATTENTION_NAME}') before using EvictingCache"
            )
        keys, values = self.store.append(key_states, value_states)
        if self.positions_mode == "cache":
            keys = self._shift_to_slots(keys)
        self.pending = True
        _ACTIVE.set(self)
        return keys, values

    def _shift_to_slots(self, keys: torch.Tensor) -> torch.Tensor:
        """Re-rotate cached keys so query-key distances are cache-slot distances (pos-shift)."""
        store = self.store
        slots = torch.arange(store.n_seen - store.length, store.n_seen, device=keys.device)
        delta = slots - store.positions  # [batch, heads, n], in [0, n_seen): slots hold positions in order
        if self.rotary is None:
            self.rotary = RotaryTable(self.inv_freq)  # type: ignore[arg-type]
        cos, sin = self.rotary.lookup(delta, store.n_seen)  # [batch, heads, n, head_dim / 2]
        # rotate_half's pairing (i, i + head_dim / 2), one half at a time: no concatenated angles,
        # no rotate_half temporaries.
        k = keys.to(torch.float32)
        half = k.shape[-1] // 2
        k1, k2 = k[..., :half], k[..., half:]
        out = torch.empty_like(k)
        torch.mul(k1, cos, out=out[..., :half]).addcmul_(k2, sin, value=-1.0)
        torch.mul(k2, cos, out=out[..., half:]).addcmul_(k1, sin)
        return out.to(keys.dtype)

    def finish(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        scaling: float,
        query_scale: torch.Tensor | None,
    ) -> None:
        """After attention: accumulate what each cached token received, then evict."""
        received = None
        if self.policy.uses_scores:
            received = received_attention(query, keys, scaling, query_scale=query_scale)
        self.finish_received(received)

    def finish_received(self, received: torch.Tensor | None) -> None:
        """After attention: accumulate ``received`` ``[batch, kv_heads, n]`` (if any), then evict."""
        if received is not None:
            self.store.accumulate(received)
        self.pending = False
        self.store.evict()

    def get_seq_length(self) -> int:
        """Tokens seen so far (positions of new tokens start here), not the cached length."""
        return self.store.n_seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(cached + query_length, offset)``: the length ``update`` will return, and an offset
        that places every cached key before the new queries."""
        return self.store.length + query_length, self.store.n_seen - self.store.length

    def get_max_length(self) -> int:
        cap = self.policy.capacity
        return -1 if cap is None else cap

    def reset(self) -> None:
        self.store.reset()
        self.pending = False
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise ValueError("an evicting cache cannot be cropped: evicted tokens cannot be restored")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.store.select_batch(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.store.select_batch(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.store.is_initialized:
            b = self.store._keys.shape[0]  # type: ignore[union-attr]
            self.store.select_batch(torch.arange(b).repeat_interleave(repeats))


def _config_of(model_or_config: Any) -> Any:
    config = getattr(model_or_config, "config", model_or_config)
    return getattr(config, "get_text_config", lambda: config)()


def _check_supported(config: Any) -> None:
    model_type = getattr(config, "model_type", None)
    missing = [a for a in ("num_hidden_layers", "num_attention_heads") if not hasattr(config, a)]
    if model_type not in SUPPORTED_MODEL_TYPES or missing:
        what = f"; config lacks {', '.join(missing)}" if missing else ""
        raise ValueError(
            f"EvictingCache supports Llama-family decoders ({', '.join(SUPPORTED_MODEL_TYPES)}) whose attention "
            f"calls past_key_values.update() and the attention interface with RoPE'd keys; got model_type "
            f"{model_type!r}{what}"
        )


def _inv_freq(model: Any) -> torch.Tensor | None:
    for module in getattr(model, "modules", lambda: [])():
        inv = getattr(module, "inv_freq", None)
        if isinstance(inv, torch.Tensor):
            return inv.detach()
    return None


class EvictingCache(Cache):
    """A transformers ``Cache`` that evicts with a kvpolicy policy, layer by layer.

    Args:
        policy: the eviction policy (one instance is shared; state is per layer).
        model: the model (or its config). A model is needed for ``positions="cache"`` (its
            rotary frequencies) and is switched to the ``"kvpolicy_sdpa"`` attention.
        positions: ``"original"`` or ``"cache"``; default: the policy's ``default_positions``.
        reduce_scores: hook for shared selection across tensor-parallel ranks.
        fused_decode: compute a decode step's attention output and scores in one pass over the
            keys (default) instead of SDPA plus an extra score product. Outputs agree with SDPA
            to rounding; ``False`` reproduces SDPA's outputs exactly.

    Example:
        >>> from kvpolicy import make_policy
        >>> from kvpolicy.models import tiny_llama
        >>> model = tiny_llama()
        >>> cache = EvictingCache(make_policy("buzz", 0.5, context_length=64), model)
        >>> out = model.generate(torch.arange(1, 33)[None], max_new_tokens=8, do_sample=False, past_key_values=cache)
        >>> cache.get_seq_length(), max(cache.lengths()) <= cache.policy.capacity
        (40, True)
    """

    def __init__(
        self,
        policy: EvictionPolicy,
        model: Any,
        *,
        positions: PositionsMode | None = None,
        reduce_scores: Callable[[torch.Tensor], torch.Tensor] | None = None,
        fused_decode: bool = True,
    ) -> None:
        if not isinstance(policy, EvictionPolicy):
            raise ValueError(f"policy must be an EvictionPolicy, got {policy!r}")
        config = _config_of(model)
        _check_supported(config)
        positions = positions or policy.default_positions
        if positions not in ("original", "cache"):
            raise ValueError(f"positions must be 'original' or 'cache', got {positions!r}")
        inv_freq = _inv_freq(model) if positions == "cache" else None
        if positions == "cache" and inv_freq is None:
            raise ValueError("positions='cache' needs the model (its rotary inv_freq), not only its config")
        if isinstance(model, torch.nn.Module):
            use_kvpolicy_attention(model)
        self.policy = policy
        self.positions_mode = positions
        rotary = RotaryTable(inv_freq) if inv_freq is not None else None  # one for all layers
        layers = [
            EvictingLayer(
                policy, i, positions=positions, inv_freq=inv_freq, reduce_scores=reduce_scores,
                fused_decode=fused_decode, rotary=rotary,
            )
            for i in range(config.num_hidden_layers)
        ]
        super().__init__(layers=layers)

    def lengths(self) -> list[int]:
        """Cached tokens per layer."""
        return [layer.store.length for layer in self.layers]

    @property
    def kv_bytes(self) -> int:
        """Bytes of keys and values held now, all layers."""
        return sum(layer.store.kv_bytes for layer in self.layers)

    @property
    def allocated_bytes(self) -> int:
        """Bytes allocated by the stores (keys, values, positions, scores), all layers."""
        return sum(layer.store.nbytes for layer in self.layers)

    def full_kv_bytes(self) -> int:
        """Bytes a full cache would hold for the tokens seen so far."""
        total = 0
        for layer in self.layers:
            if layer.store.length:
                total += layer.store.kv_bytes // layer.store.length * layer.store.n_seen
        return total


@dataclass
class GenerationResult:
    """What :func:`generate` returns."""

    text: str
    token_ids: list[int]
    prompt_tokens: int
    policy: EvictionPolicy
    kv_bytes: int
    full_kv_bytes: int
    cache_lengths: list[int] = field(default_factory=list)

    @property
    def cache_ratio(self) -> float:
        return self.kv_bytes / max(self.full_kv_bytes, 1)

    def __str__(self) -> str:
        return (
            f"{self.text}\n-- {self.policy!r}: cache {self.kv_bytes / 2**20:.2f} MiB vs full "
            f"{self.full_kv_bytes / 2**20:.2f} MiB ({self.cache_ratio:.0%})"
        )


def generate(
    model: Any,
    tokenizer: Any,
    prompt: str,
    policy: str | EvictionPolicy = "buzz",
    *,
    budget: float = 0.3,
    max_new_tokens: int = 64,
    chat: bool | None = None,
    positions: PositionsMode | None = None,
    **overrides: Any,
) -> GenerationResult:
    """Greedy generation of ``prompt`` with an evicting cache, in one call.

    ``policy`` is a policy or a registered name resolved with :func:`kvpolicy.make_policy` for
    ``budget`` on this prompt's length plus ``max_new_tokens``. ``chat`` applies the tokenizer's
    chat template (default: when it has one).

    Example:
        >>> from kvpolicy.models import tiny_llama
        >>> class Tok:  # a stand-in tokenizer for the doctest
        ...     chat_template = None
        ...     def __call__(self, text, return_tensors=None):
        ...         return {"input_ids": torch.tensor([[1 + ord(c) % 100 for c in text]])}
        ...     def decode(self, ids, skip_special_tokens=True):
        ...         return " ".join(map(str, ids))
        >>> res = generate(tiny_llama(), Tok(), "hello world " * 4, "h2o", budget=0.5, max_new_tokens=4)
        >>> len(res.token_ids)
        4
    """
    from kvpolicy.budget import make_policy

    use_chat = chat if chat is not None else bool(getattr(tokenizer, "chat_template", None))
    if use_chat:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
    else:
        text = prompt
    enc = tokenizer(text, return_tensors="pt")
    device = next(model.parameters()).device
    input_ids = enc["input_ids"].to(device)
    n_prompt = int(input_ids.shape[1])
    if isinstance(policy, str):
        policy = make_policy(
            policy, budget, context_length=n_prompt + max_new_tokens, prompt_length=n_prompt, **overrides
        )
    cache = EvictingCache(policy, model, positions=positions)
    with torch.no_grad():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            past_key_values=cache,
            pad_token_id=getattr(tokenizer, "pad_token_id", None) or getattr(tokenizer, "eos_token_id", None),
        )
    new_ids = out[0, n_prompt:].tolist()
    return GenerationResult(
        text=tokenizer.decode(new_ids, skip_special_tokens=True),
        token_ids=new_ids,
        prompt_tokens=n_prompt,
        policy=policy,
        kv_bytes=cache.kv_bytes,
        full_kv_bytes=cache.full_kv_bytes(),
        cache_lengths=cache.lengths(),
    )



