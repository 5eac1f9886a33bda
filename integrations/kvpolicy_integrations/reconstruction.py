"""KVzip's context reconstruction on a transformers model (Kim et al., 2025, "KVzip: Query-Agnostic
KV Cache Compression with Context Reconstruction"; the rule of kvpress's ``KVzipPress``).

After the prompt (the context) is in an :class:`~kvpolicy_integrations.hf.EvictingCache` whose
policy is scored by a reconstruction (:attr:`kvpolicy.EvictionPolicy.needs_reconstruction`:
:class:`kvpolicy.KVzip`, ``kvzip_headwise``, :func:`kvpolicy.prefill_only` over either),
:func:`reconstruct` feeds the model, on a copy of that cache, a repeat prompt and the context
again, in chunks of :data:`CHUNK` tokens (each chunk on the context alone: its tokens are never
kept), records what each context token receives (:func:`kvpolicy.statistics.reconstruction_scores`:
the most over the chunk's queries and its KV head's query heads) and lets every layer evict once
on those scores (:meth:`kvpolicy_torch.LayerCache.evict_reconstructed`).

The cost: one more forward over about the context's length (plus a dozen tokens a chunk), with
attention over the context: about the prompt's prefill again (docs/policies.md, "KVzip").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvpolicy.statistics import reconstruction_scores
from kvpolicy.validation import check_int
from kvpolicy_torch import LayerCache

from .capabilities import cache_kwargs, last_logits_kwargs

__all__ = ["CHUNK", "OVERLAP", "PART_PROMPT", "RECONSTRUCTION_ATTENTION", "REPEAT_PROMPT", "RepeatPrompts", "reconstruct",
           "repeat_prompts", "score_context"]

#: The first chunk's repeat prompt (kvpress's, the paper's).
REPEAT_PROMPT = "\n\nRepeat the previous context exactly."
#: A later chunk's, followed by the previous chunk's last :data:`OVERLAP` tokens.
PART_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with"
#: Context tokens a reconstruction forward repeats at most (kvpress's ``chunk_size``).
CHUNK = 2048
#: The previous chunk's last tokens a later chunk's prompt quotes (kvpress's ``prev_postfix_size``).
OVERLAP = 8
#: The attention implementation a reconstruction forward runs under (SDPA, and the scores).
RECONSTRUCTION_ATTENTION = "kvpolicy_reconstruction"
#: The keyword a reconstruction forward hands its attention (a :class:`_Recorder`).
RECORDER_KWARG = "kvpolicy_reconstruction"


@dataclass(frozen=True)
class RepeatPrompts:
    """The token ids a reconstruction adds around the context (:func:`repeat_prompts`).

    Attributes:
        first: the first chunk's repeat prompt (:data:`REPEAT_PROMPT`).
        part: a later chunk's (:data:`PART_PROMPT`), before the previous chunk's last tokens.
        suffix: after the prompt, before the repeated chunk: the chat template's assistant turn,
            ``"\\n"`` without a template (kvpress's ``suffix_text``).
        prefix_ids: the tokens a chat template puts before a user's message (kvpress's
            ``prefix_length`` is their count, :attr:`prefix`): a context built with the template
            starts with them, and they are not repeated (:meth:`start`).
    """

    first: list[int]
    part: list[int]
    suffix: list[int]
    prefix_ids: tuple[int, ...] = ()

    @classmethod
    def from_texts(cls, encode: Callable[[str], Sequence[int]], prefix_text: str, suffix_text: str) -> "RepeatPrompts":
        """The repeat prompts tokenised by ``encode`` (text to ids, no special tokens added), with
        a chat template's text before and after a user's message (``""`` and ``"\\n"`` without one)."""
        ids = lambda text: [int(i) for i in encode(text)] if text else []  # noqa: E731
        return cls(ids(REPEAT_PROMPT), ids(PART_PROMPT), ids(suffix_text), tuple(ids(prefix_text)))

    @property
    def prefix(self) -> int:
        """The chat template's prefix length (kvpress's ``prefix_length``)."""
        return len(self.prefix_ids)

    def start(self, prompt_ids: torch.Tensor) -> int:
        """The first token of ``prompt_ids`` ``[batch, n]`` a reconstruction repeats: after the chat
        template's prefix when every row starts with it, else 0 (``start=`` of :func:`reconstruct`).

        Example:
            >>> p = RepeatPrompts([1], [2], [3], prefix_ids=(7, 8))
            >>> p.start(torch.tensor([[7, 8, 9, 9]])), p.start(torch.tensor([[9, 9, 9, 9]]))
            (2, 0)
        """
        k = self.prefix
        if not k or prompt_ids.shape[1] <= k:
            return 0
        head = torch.tensor(self.prefix_ids, dtype=prompt_ids.dtype, device=prompt_ids.device)
        return k if bool((prompt_ids[:, :k] == head).all()) else 0


def repeat_prompts(tokenizer: Any) -> RepeatPrompts:
    """The :class:`RepeatPrompts` of ``tokenizer``, as kvpress's ``KVzipPress`` builds them: with a
    chat template, the suffix and the prefix come from a dummy user message.

    Example:
        >>> class Tok:  # a stand-in tokenizer, one id per character
        ...     chat_template = None
        ...     def encode(self, text, add_special_tokens=False):
        ...         return [ord(c) for c in text]
        >>> p = repeat_prompts(Tok())
        >>> p.suffix, p.prefix, len(p.first) == len(REPEAT_PROMPT)
        ([10], 0, True)
    """

    def encode(text: str) -> list[int]:
        try:
            ids = tokenizer.encode(text, add_special_tokens=False)
        except TypeError:  # (a stand-in without the keyword)
            ids = tokenizer.encode(text)
        return [int(i) for i in (ids.tolist() if hasattr(ids, "tolist") else ids)]

    if getattr(tokenizer, "chat_template", None) is None:
        return RepeatPrompts.from_texts(encode, "", "\n")
    dummy = "dummy context"
    separator = "\n" + "#" * len(dummy)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": dummy + separator}], add_generation_prompt=True, tokenize=False,
    )
    context, suffix_text = text.split(separator)
    return RepeatPrompts.from_texts(encode, context.split(dummy)[0], suffix_text)


class _Recorder:
    """What one reconstruction forward records: per layer, the scores of the chunk's context tokens."""

    def __init__(self, layers: int, batch: int, kv_heads: list[int], n: int, lo: int, hi: int, sinks: list[int],
                 device: torch.device) -> None:
        self.n, self.lo, self.hi, self.sinks = n, lo, hi, sinks
        self.layers: set[int] = set()  # the layers whose attention recorded (each once)
        self.scores = [torch.zeros(batch, kv_heads[i], n, dtype=torch.float64, device=device) for i in range(layers)]


def _reconstruction_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention of a reconstruction forward, and the chunk's context tokens' scores: the
    queries ``[batch, q_heads, r, d]`` (after RoPE) attend to the layer's sinks before the chunk,
    the chunk and their own tokens (causal), as kvpress's ``KVzipPress.score_kvzip`` attends. When
    those are every key (one chunk from the first token, the usual case) and the attention is
    plain (no dropout, softcap, sliding window or sink logits), the output comes from the same
    probabilities (one attention, not two); else SDPA gives the output."""
    recorder = kwargs.pop(RECORDER_KWARG, None)
    if recorder is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    layer = int(module.layer_idx)
    recorder.layers.add(layer)
    lo, hi = recorder.lo, recorder.hi
    sink = min(recorder.sinks[layer], lo)
    batch, q_heads, r, d = query.shape
    kv_heads, n = key.shape[1], recorder.n
    if key.shape[2] != n + r:
        raise NotImplementedError(
            f"layer {layer} attends to {key.shape[2] - r} of the {n} context tokens (a sliding-window or chunked "
            "layer): KVzip's reconstruction scores every context token by what the whole context's repeat pays it, "
            "which needs every layer to attend to the whole context"
        )
    scale = scaling if scaling is not None else d**-0.5
    ctx = sink + hi - lo
    plain = not dropout and all(kwargs.get(k) is None for k in ("softcap", "sliding_window", "s_aux"))
    whole = plain and sink == 0 and lo == 0 and hi == n
    columns = None if whole else torch.cat([torch.arange(sink), torch.arange(lo, hi), torch.arange(n, n + r)]).to(key.device)
    own = torch.arange(r, device=key.device)
    hidden = torch.cat([torch.zeros(r, ctx, dtype=torch.bool, device=key.device), own[None, :] > own[:, None]], dim=1)
    grouped = query.view(batch, kv_heads, q_heads // kv_heads, r, d)
    scores = recorder.scores[layer]
    outputs = []
    for h in range(kv_heads):  # one KV head at a time: [batch, group, r, ctx + r] probabilities, not every head's
        keys = key[:, h] if whole else key[:, h, columns]
        logits = torch.matmul(grouped[:, h], keys.transpose(-1, -2)[:, None]) * scale
        probs = torch.softmax(logits.masked_fill(hidden, float("-inf")), dim=-1, dtype=torch.float32)
        scores[:, h, lo:hi] = reconstruction_scores(probs[:, None], ctx)[:, 0, sink:]
        if whole:
            outputs.append(torch.matmul(probs.to(value.dtype), value[:, h, None]))  # [batch, group, r, d]
    if whole:
        out = torch.stack(outputs, dim=1).reshape(batch, q_heads, r, -1).transpose(1, 2).contiguous()
        return out, None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


AttentionInterface.register(RECONSTRUCTION_ATTENTION, _reconstruction_attention)
AttentionMaskInterface.register(RECONSTRUCTION_ATTENTION, sdpa_mask)


def score_context(
    model: torch.nn.Module, cache: Any, prompt_ids: torch.Tensor, prompts: RepeatPrompts, *, start: int = 0,
    chunk: int = CHUNK,
) -> list[torch.Tensor]:
    """The reconstruction's scores of the prompt ``cache`` holds, per layer ``[batch, kv_heads, n]``
    float64: what each prompt token receives while the model repeats ``prompt_ids[:, start:]``
    (module docstring); ``cache`` is left as it was. :func:`reconstruct` evicts on them.

    Args:
        model: the model that filled ``cache`` with ``prompt_ids``.
        cache: a :class:`~kvpolicy_integrations.hf.EvictingCache` whose policy is scored by a
            reconstruction, holding exactly the prompt (every row whole: no pads, nothing evicted,
            nothing after it).
        prompt_ids: ``[batch, n]`` the prompt.
        prompts: the repeat prompts (:func:`repeat_prompts` of the model's tokenizer).
        start: the prompt's first token repeated (a chat template's prefix, ``prompts.prefix``,
            when the prompt was built with it): tokens before it score 0 (the policy's sinks
            are kept whatever they score).
        chunk: context tokens repeated per forward (kvpress's 2,048): each chunk's queries attend
            to the policy's sinks, the chunk and their own tokens.

    Example:
        >>> from kvpolicy import KVzip
        >>> from kvpolicy_integrations.hf import EvictingCache
        >>> from kvpolicy_tools.models import tiny_llama
        >>> model = tiny_llama()
        >>> ids = torch.arange(1, 41)[None]
        >>> cache = EvictingCache(KVzip(size=10), model)
        >>> _ = model(ids, **cache_kwargs(model, cache))
        >>> scores = score_context(model, cache, ids, RepeatPrompts([5, 6, 7], [8, 9], [10]))
        >>> len(scores), tuple(scores[0].shape), cache.lengths()
        (2, (1, 2, 40), [40, 40])
    """
    chunk = check_int("chunk", chunk, minimum=1)
    layers = getattr(cache, "layers", None)
    if not layers or not all(isinstance(getattr(layer, "store", None), LayerCache) for layer in layers):
        raise ValueError(f"cache must be a kvpolicy_integrations.hf.EvictingCache, got {type(cache).__name__}")
    for layer in layers:
        if not layer.policy.needs_reconstruction:
            raise ValueError(f"layer {layer.layer_idx}'s policy {layer.policy!r} is not scored by a context reconstruction (KVzip)")
    if prompt_ids.ndim != 2 or prompt_ids.shape[1] < 2:
        raise ValueError(f"prompt_ids must be [batch, n] with n >= 2 (a context to reconstruct), got {tuple(prompt_ids.shape)}")
    batch, n = (int(x) for x in prompt_ids.shape)
    start = check_int("start", start, minimum=0, maximum=n - 1)
    for layer in layers:
        store = layer.store
        if not store.is_initialized or store.lengths != [n] * batch or store.seen != [n] * batch or store.batch != batch:
            raise ValueError(
                f"layer {layer.layer_idx} must hold exactly the prompt ({batch} rows of {n} tokens, nothing evicted, "
                f"nothing after it) before its reconstruction; it holds {store.lengths if store.is_initialized else []}"
            )
        if layer.attention_kind.kind != "full":
            raise NotImplementedError(
                f"layer {layer.layer_idx} is a {layer.attention_kind.kind} attention layer (window "
                f"{layer.attention_kind.window}): KVzip's reconstruction scores each context token by what a repeat of the "
                "whole context pays it, which kvpolicy serves for full-attention layers only"
            )
        if layer.positions_mode != "original":
            raise NotImplementedError(f"a context reconstruction runs with positions='original' (keys at the positions they were computed at), not {layer.positions_mode!r}")
    device = prompt_ids.device
    context = prompt_ids[:, start:]
    pieces = [(lo, min(lo + chunk, n - start)) for lo in range(0, n - start, chunk)]
    sinks = [int(getattr(layer.policy.statistic_policy, "sink", 0)) for layer in layers]
    kv_heads = [int(layer.keys.shape[1]) for layer in layers]
    full = [torch.zeros(batch, kv_heads[i], n, dtype=torch.float64, device=device) for i in range(len(layers))]
    config = model.config
    saved = config._attn_implementation
    model.set_attn_implementation(RECONSTRUCTION_ATTENTION)
    try:
        with torch.no_grad():
            for i, (lo, hi) in enumerate(pieces):
                head = prompts.first
                if i:  # a later chunk quotes the previous chunk's last tokens (one prompt for the batch)
                    quoted = context[:, max(lo - OVERLAP, pieces[i - 1][0]):lo]
                    if not bool((quoted == quoted[:1]).all()):
                        raise NotImplementedError(
                            "a chunked reconstruction of a batch quotes the previous chunk's last tokens, which differ between "
                            "rows here: reconstruct the rows one at a time (or a larger chunk)"
                        )
                    head = prompts.part + quoted[0].tolist()
                added = torch.tensor(head + prompts.suffix, dtype=prompt_ids.dtype, device=device).expand(batch, -1)
                ids = torch.cat([added, context[:, lo:hi]], dim=1)
                copy = DynamicCache(config=config)
                for j, layer in enumerate(layers):
                    copy.update(layer.keys, layer.values, j)
                recorder = _Recorder(len(layers), batch, kv_heads, n, start + lo, start + hi, sinks, device)
                positions = torch.arange(n, n + ids.shape[1], device=device).expand(batch, -1)
                model(input_ids=ids, position_ids=positions, use_cache=True, **last_logits_kwargs(model),
                      **cache_kwargs(model, copy), **{RECORDER_KWARG: recorder})
                if recorder.layers != set(range(len(layers))):
                    missing = sorted(set(range(len(layers))) - recorder.layers)
                    raise NotImplementedError(
                        f"layers {missing} of {type(model).__name__} scored nothing in the reconstruction forward: their "
                        "attention is not handed the forward's keyword arguments (transformers' attention interface with "
                        "**kwargs), which KVzip's reconstruction records through"
                    )
                for j in range(len(layers)):
                    full[j][..., start + lo:start + hi] = recorder.scores[j][..., start + lo:start + hi]
    finally:
        model.set_attn_implementation(saved)
    return full


def reconstruct(
    model: torch.nn.Module, cache: Any, prompt_ids: torch.Tensor, prompts: RepeatPrompts, *, start: int = 0,
    chunk: int = CHUNK,
) -> list[list[tuple[int, int]]]:
    """KVzip's context reconstruction: score the prompt ``cache`` holds (:func:`score_context`,
    the same arguments), then let each layer evict once on those scores
    (:meth:`kvpolicy_torch.LayerCache.evict_reconstructed`); returns each layer's eviction rounds.

    Example:
        >>> from kvpolicy import KVzip
        >>> from kvpolicy_tools.models import tiny_llama
        >>> from kvpolicy_integrations.hf import EvictingCache
        >>> model = tiny_llama()
        >>> ids = torch.arange(1, 41)[None]
        >>> cache = EvictingCache(KVzip(size=10), model)
        >>> _ = model(ids, **cache_kwargs(model, cache))
        >>> rounds = reconstruct(model, cache, ids, RepeatPrompts([5, 6, 7], [8, 9], [10]))
        >>> rounds[0], cache.lengths()
        ([(40, 10)], [10, 10])
    """
    scores = score_context(model, cache, prompt_ids, prompts, start=start, chunk=chunk)
    return [layer.store.evict_reconstructed(scores[j]) for j, layer in enumerate(cache.layers)]
