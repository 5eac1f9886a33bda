"""Generation with the evicting cache (a part of :mod:`kvpolicy_integrations.hf`, whose docstring
describes the whole): :func:`generate`, the one-line helper, and the loop under it,
:func:`greedy_decode`; :func:`compile_decode_step`, a decode step as one compiled graph over an
``EvictingCache(..., static_shapes=True)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from kvpolicy.budget import make_policy
from kvpolicy.policy import EvictionPolicy, check_eviction_policy
from kvpolicy.validation import check_bool, check_float, check_int

from ..capabilities import cache_kwargs, last_logits_kwargs, model_layers
from ..reconstruction import reconstruct, repeat_prompts
from .cache import PREFILL_CHUNK, EvictingCache
from .layer import PositionsMode

def compile_decode_step(model: torch.nn.Module, *, mode: str | None = None, backend: str | None = None,
                        dynamic: bool | None = None) -> Callable[..., Any]:
    """``model`` compiled for decode steps: ``torch.compile(model, fullgraph=True)`` (``mode=
    "reduce-overhead"`` adds CUDA graphs on a GPU; ``backend`` ``None``: torch's default backend,
    inductor unless ``torch.compiler.set_default_backend`` says otherwise). With an
    ``EvictingCache(..., static_shapes=True)`` a decode step is one graph for every policy whose
    decode eviction is a :class:`~kvpolicy.DecodeEviction` (and for the others too, whose general
    evictions run between steps: :meth:`EvictingCache.settle`).

    Compile once per model and reuse it across caches and prompts: the first cache's step compiles
    a graph for its exact shapes; the first cache whose storage size, capacity or batch differs
    compiles one more, with those sizes dynamic (torch's automatic dynamic shapes), which then
    serves every other size. So a serving loop over prompts of any length, with capacities
    planned per prompt (:func:`generate` with ``compile=True``), runs on two graphs per policy
    kind. Policies of other kinds (their decode step is other code) compile graphs of their own,
    up to torch's recompile limit for the model's forward (``torch._dynamo.config.recompile_limit``,
    8, shared by every compiled caller of the model): compile a copy of the model for more kinds.
    ``dynamic=False`` specialises every graph to its cache (what a benchmark of one cache wants; at
    most 8 caches of different sizes); ``dynamic`` is ``torch.compile``'s. A step past the limit
    raises a ``ValueError`` saying which (``dynamic=False``'s sizes, or the policy kinds) and what
    to do, from torch's ``FailOnRecompileLimitHit``.

    A cache built without ``static_shapes=True`` is refused (``ValueError``) before anything is
    compiled: its decode step reads host bookkeeping that changes every step, so each step would
    compile a graph of its own.

    Example:
        >>> from kvpolicy import H2O
        >>> from kvpolicy_tools.models import tiny_llama
        >>> model = tiny_llama()
        >>> step = compile_decode_step(model, backend="eager")
        >>> callable(step)
        True
        >>> step(input_ids=torch.tensor([[5]]), cache=EvictingCache(H2O(4, 4), model))
        Traceback (most recent call last):
        ...
        ValueError: cache: compile_decode_step serves an EvictingCache built with static_shapes=True ...
    """
    if dynamic is not None:
        dynamic = check_bool("dynamic", dynamic)
    compiled = torch.compile(model, fullgraph=True, dynamic=dynamic, mode=mode, backend=backend)

    def step(*args: Any, **kwargs: Any) -> Any:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if isinstance(cache, EvictingCache) and not cache.static_shapes:
            raise ValueError(
                "cache: compile_decode_step serves an EvictingCache built with static_shapes=True (one graph a "
                "decode step); this one has static_shapes=False, whose decode step reads host bookkeeping that changes "
                "every step (each step would compile a graph of its own, up to torch's recompile limit): build it with "
                "EvictingCache(..., static_shapes=True), or run the decode steps eagerly (step=model)"
            )
        try:
            return compiled(*args, **kwargs)
        except Exception as error:
            # torch._dynamo.exc.FailOnRecompileLimitHit (torch names it nowhere public): said by name
            if type(error).__name__ != "FailOnRecompileLimitHit":
                raise
            raise ValueError(_recompile_limit_message(dynamic)) from error

    step.__doc__ = f"{type(model).__name__} compiled for decode steps (kvpolicy_integrations.hf.compile_decode_step)."
    return step


def _recompile_limit_message(dynamic: bool | None) -> str:
    """Why a :func:`compile_decode_step` step stopped at torch's recompile limit, and what to do."""
    limit = torch.compiler.config.recompile_limit
    where = f"torch's recompile limit (torch.compiler.config.recompile_limit = {limit})"
    if dynamic is False:
        return (
            f"dynamic=False: compile_decode_step compiles a graph per cache size, and this cache would be graph {limit + 1}, "
            f"past {where}: leave dynamic=None (the default: the sizes become dynamic at the second size, and two graphs "
            f"serve every size), compile a new step for each {limit} sizes, or raise the limit"
        )
    return (
        f"compile_decode_step: {where} is reached for this model's forward (shared by every compiled caller of the model): "
        f"each policy kind's decode step is other code, so a graph of its own; compile a copy of the model per policy kind "
        f"(compile_decode_step(copy.deepcopy(model))), or raise the limit"
    )


def greedy_decode(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    cache: Any,
    max_new_tokens: int,
    *,
    attention_mask: torch.Tensor | None = None,
    step: Callable[..., Any] | None = None,
    prefill_chunk: int | None = PREFILL_CHUNK,
    after_prompt: Callable[[], Any] | None = None,
) -> torch.Tensor:
    """Greedy decoding with ``cache``: the prompt through ``model`` (eager, in forwards of
    ``prefill_chunk`` tokens), then one token a step
    through ``step`` (default ``model``; e.g. :func:`compile_decode_step`), with
    :meth:`EvictingCache.settle` between steps when the cache asks for it.

    Decode steps pass positions (each row's next real position) and no attention mask: an
    :class:`EvictingCache` knows each row's pads from the prompt's mask, so the step's inputs keep
    their shapes and a compiled step never recompiles. Any other cache is given the growing 2-D mask.

    Args:
        input_ids: ``[batch, prompt]``; ``attention_mask`` ``[batch, prompt]`` (0: a left pad).
        step: the callable that runs a decode step (a compiled model).
        prefill_chunk: tokens per prompt forward (default :data:`PREFILL_CHUNK`): a longer
            prompt is fed in chunks, so an :class:`EvictingCache` holds at most its policy's
            capacity plus one chunk during the prefill; ``None`` or ``0``: the whole prompt in
            one forward.
        after_prompt: called once the prompt is in the cache, before the first decode step:
            required for a policy scored by a context reconstruction (KVzip: e.g. ``lambda:
            reconstruct(model, cache, input_ids, repeat_prompts(tokenizer))``,
            :mod:`kvpolicy_integrations.reconstruction`), which :func:`generate` passes.

    Returns:
        ``[batch, max_new_tokens]``: the new tokens.

    Example:
        >>> from kvpolicy import H2O
        >>> from kvpolicy_tools.models import tiny_llama
        >>> model = tiny_llama()
        >>> ids = torch.arange(1, 33)[None]
        >>> new = greedy_decode(model, ids, EvictingCache(H2O(8, 8), model, static_shapes=True), 8)
        >>> torch.equal(new, greedy_decode(model, ids, EvictingCache(H2O(8, 8), model), 8))
        True
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if input_ids.ndim != 2 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids must be [batch, prompt] with a prompt of at least one token, got {tuple(input_ids.shape)}")
    chunk = input_ids.shape[1] if not prefill_chunk else check_int("prefill_chunk", prefill_chunk, minimum=1)
    ours = isinstance(cache, EvictingCache)
    if ours and after_prompt is None and cache.policy.needs_reconstruction:
        raise ValueError(
            f"{cache.policy!r} scores the prompt by a context reconstruction: pass after_prompt=lambda: "
            "kvpolicy_integrations.reconstruction.reconstruct(model, cache, input_ids, repeat_prompts(tokenizer)) "
            "(kvpolicy_integrations.hf.generate does)"
        )
    step = step if step is not None else model
    if attention_mask is None:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    else:
        positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
    settle = ours and cache.needs_settle
    out = []
    last = last_logits_kwargs(model)
    with torch.no_grad():
        for lo in range(0, input_ids.shape[1], chunk):  # (the mask covers every column so far)
            hi = min(input_ids.shape[1], lo + chunk)
            logits = model(input_ids=input_ids[:, lo:hi], attention_mask=None if attention_mask is None else attention_mask[:, :hi],
                           position_ids=positions[:, lo:hi], use_cache=True, **last, **cache_kwargs(model, cache)).logits[:, -1]
        if after_prompt is not None:
            after_prompt()
        pos = positions[:, -1:] + 1
        mask = attention_mask
        for k in range(max_new_tokens):
            token = logits.argmax(-1, keepdim=True)
            out.append(token)
            if k + 1 == max_new_tokens:
                break
            extra: dict[str, Any] = {}
            if not ours and mask is not None:
                mask = torch.cat([mask, torch.ones_like(token)], dim=1)
                extra["attention_mask"] = mask
            logits = step(input_ids=token, position_ids=pos, use_cache=True, **extra, **cache_kwargs(model, cache)).logits[:, -1]
            if settle:
                cache.settle()
            pos = pos + 1
    if ours:
        cache.report_nonfinite()
    return torch.cat(out, dim=1)


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
    budget: float | None = None,
    max_new_tokens: int = 64,
    chat: bool | None = None,
    positions: PositionsMode | None = None,
    compile: bool = False,
    prefill_chunk: int | None = PREFILL_CHUNK,
    **overrides: Any,
) -> GenerationResult:
    """Greedy generation of ``prompt`` with an evicting cache, in one call.

    ``policy`` is a policy or a registered name resolved with :func:`kvpolicy.make_policy` for
    ``budget`` (in ``(0, 1]``; default 0.3) on this prompt's length plus ``max_new_tokens``, with
    ``overrides`` (its fixed parameters, e.g. ``heavy=2``). A policy object is used as it is:
    ``budget`` and ``overrides`` plan a name, so with an object they raise ``ValueError`` naming
    them rather than being ignored. ``chat`` applies the tokenizer's
    chat template (default: when it has one). ``compile=True`` runs the decode steps compiled
    (:func:`compile_decode_step`, one graph a step, on a static-shaped cache; compiling takes a
    while, so it pays for long generations) with :func:`greedy_decode`. A prompt longer than
    ``prefill_chunk`` tokens (default :data:`PREFILL_CHUNK`) is prefilled in chunks of that many,
    so the cache holds at most the policy's capacity plus one chunk however long the prompt is
    (``None`` or ``0``: one forward of the whole prompt, faster and holding all of it for a moment).
    A policy scored by a context reconstruction (KVzip) gets it after the prompt
    (:func:`kvpolicy_integrations.reconstruction.reconstruct`, with the tokenizer's repeat prompts;
    a chat template's prefix is not repeated) and decodes with :func:`greedy_decode`, which does not
    stop at an end-of-sequence token.

    Example:
        >>> from kvpolicy_tools.models import tiny_llama
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
    # every argument checked before the tokenizer or the model is touched
    if not isinstance(prompt, str):
        raise ValueError(f"prompt must be a string, got {type(prompt).__name__} {prompt!r:.80}")
    if not prompt.strip():
        raise ValueError(f"prompt is empty ({prompt!r}): give generate() some text to continue")
    max_new_tokens = check_int("max_new_tokens", max_new_tokens, minimum=1)
    if budget is not None:
        budget = check_float("budget", budget, low=0.0, high=1.0, low_open=True)
    if not isinstance(policy, str):
        policy = check_eviction_policy("policy", policy)
        # budget= and the overrides plan a registered name: with a policy object they would do nothing
        given = ([f"budget={budget!r}"] if budget is not None else []) + [f"{k}={v!r}" for k, v in overrides.items()]
        if given:
            raise ValueError(
                f"{', '.join(given)}: budget and parameter overrides plan a registered policy name, and policy "
                f"{policy!r} is an object, used as it is: set its parameters on it, or pass its name "
                f"({policy.name!r}) with them"
            )
    elif budget is None:
        budget = 0.3
    chunk = None if not prefill_chunk else check_int("prefill_chunk", prefill_chunk, minimum=1)
    chat = check_bool("chat", chat, allow_none=True)
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
    if n_prompt == 0:
        raise ValueError(f"prompt {prompt!r:.80} is empty after tokenization (0 tokens): give generate() some text")
    if isinstance(policy, str):
        policy = make_policy(
            policy, budget, context_length=n_prompt + max_new_tokens, prompt_length=n_prompt, layers=model_layers(model),
            **overrides,
        )
    compile = check_bool("compile", compile)
    cache = EvictingCache(policy, model, positions=positions, max_tokens=n_prompt + max_new_tokens, static_shapes=compile,
                          prefill_chunk=chunk)
    after_prompt = None
    if policy.needs_reconstruction:
        prompts = repeat_prompts(tokenizer)
        start = prompts.start(input_ids)
        after_prompt = lambda: reconstruct(model, cache, input_ids, prompts, start=start)  # noqa: E731
    if compile or after_prompt is not None:
        new = greedy_decode(model, input_ids, cache, max_new_tokens, attention_mask=torch.ones_like(input_ids),
                            step=compile_decode_step(model) if compile else None, prefill_chunk=chunk,
                            after_prompt=after_prompt)
        out = torch.cat([input_ids, new], dim=1)
    else:
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            prefill_chunk_size=chunk if chunk is not None and n_prompt > chunk else None,
            **cache_kwargs(model, cache),
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
