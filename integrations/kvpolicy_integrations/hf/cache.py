"""The whole evicting cache: :class:`EvictingCache`, a transformers ``Cache`` whose layers are
:class:`~kvpolicy_integrations.hf.EvictingLayer`, and the forward hooks that switch a model to
kvpolicy's attention during (and only during) its forwards (:func:`scope_attention`); also
:func:`output_projections`, the model's ``W_o`` as CriticalKV reads it (a part of
:mod:`kvpolicy_integrations.hf`, whose docstring describes the whole). The hooks live here, with the
cache they check for and hand the forward's padding to.
"""

from __future__ import annotations

import math
import threading
import warnings
import weakref
from typing import Any, Callable

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import Cache

from kvpolicy.driver import NonFiniteWarning
from kvpolicy.policy import EvictionPolicy
from kvpolicy.validation import check_bool, check_int
from kvpolicy_torch import LayerGroup
from kvpolicy_torch.queries import PreRope
from kvpolicy_torch.storage import pooled_capacity

from ..capabilities import ModelCapabilities, RopeLayout, detect, model_layers, query_rotations, rope_layouts, text_config
from .attention import ATTENTION_NAME, ATTENTION_SCOPES, SCOPED_ATTENTION_NAME, register_attention, set_attention_implementation
from .layer import EvictingLayer, ForwardScope, Padding, PositionsMode, ShiftMatrices

#: Tokens per forward when :func:`generate` and :func:`greedy_decode` prefill a longer prompt
#: (their ``prefill_chunk``; ``None`` or ``0``: the whole prompt in one forward). An
#: :class:`EvictingCache` given the same ``prefill_chunk`` (its default) then holds at most the
#: policy's capacity plus one chunk during the prefill, whatever the prompt's length; a one-shot
#: prefill holds the whole prompt for a moment, and is faster (each later chunk attends through a
#: mask over the tokens kept before it): docs/performance.md, "Prefill (time to first token)".
PREFILL_CHUNK = 512


def _switch_attention(config: PretrainedConfig, name: str) -> None:
    """Set ``config``'s attention implementation for the forward in flight: the one place kvpolicy
    writes transformers' ``config._attn_implementation`` (docs/design.md, "The attention switch").
    The public ``model.set_attn_implementation`` validates the name and walks every submodule at
    each call (about a millisecond on a 30-layer model) and cannot run inside a compiled step, so
    the scope's hooks, which run at every forward (compiled ones included), write the config's
    own setter directly; :func:`scope_attention` has validated both names once, through
    ``set_attn_implementation``."""
    config._attn_implementation = name


class _Scope:
    """The forward hooks of one model (see :func:`scope_attention`).

    The switch is the model config's attention implementation, which every thread running the
    model reads: while one thread's forward holds it, a forward of the same model in another
    thread (with any cache) is refused with a clear error, never served by the wrong attention or
    the wrong cache."""

    def __init__(self) -> None:
        self.owner: torch.nn.Module | None = None  # the module whose forward switched the model
        self.saved: Any = None  # the implementation to put back
        self.cache: EvictingCache | None = None  # the cache of the forward in flight
        self.thread: int | None = None  # the thread of that forward (None inside torch.compile)

    def check_thread(self) -> None:
        """``RuntimeError`` when another thread's forward has switched the model."""
        if self.owner is not None and self.thread is not None and self.thread != threading.get_ident():
            raise RuntimeError(
                "this model is running a forward with an EvictingCache in another thread, which switched the "
                "model's attention implementation (a setting of the model's config, shared by every thread) for that "
                "forward: one model serves one forward with an EvictingCache at a time. Give each thread its own "
                "model (e.g. copy.deepcopy(model)) and cache, or run the forwards one after another (a lock)"
            )

    def before(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.owner is not None:  # (a nested forward of the same model, or another thread's)
            self.check_thread()
            return
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if not isinstance(cache, EvictingCache):
            return
        if kwargs.get("output_attentions", getattr(module.config, "output_attentions", False)):
            # (before anything is appended: the cache is left as it was)
            raise ValueError(
                "output_attentions=True with an EvictingCache: its attention runs over the kept slots (in slot order, "
                "evicted tokens gone), so it has no per-position attention maps to return. Leave output_attentions "
                "off, or read the maps with a transformers cache (DynamicCache); what each kept token received is in "
                "the cache's scores"
            )
        ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        q = (ids if ids is not None else embeds).shape[1]
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        mask = mask if isinstance(mask, torch.Tensor) else None
        compiling = torch.compiler.is_compiling()
        if not compiling:  # (a weak reference is not traced: the eager prompt forward checks it)
            cache.check_model(module)
        positions = kwargs.get("position_ids")
        cache.check_forward(mask, q, kwargs.get("use_cache"), positions if isinstance(positions, torch.Tensor) else None)
        cache.note_padding(mask, q)
        if not compiling:
            cache.enter()  # (last: the post-hook leaves what this hook entered)
        config = module.config
        self.owner, self.saved, self.cache = module, config._attn_implementation, cache
        self.thread = None if compiling else threading.get_ident()
        _switch_attention(config, SCOPED_ATTENTION_NAME)

    def after(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        if self.owner is module and (self.thread is None or self.thread == threading.get_ident()):
            _switch_attention(module.config, self.saved)
            if self.cache is not None and not torch.compiler.is_compiling():
                self.cache.leave()
            self.owner, self.saved, self.cache, self.thread = None, None, None, None

    def interrupted(self, module: torch.nn.Module, error: BaseException) -> None:
        """``module``'s forward ended by ``error`` that torch's ``always_call`` hooks do not see
        (a ``KeyboardInterrupt``, a ``SystemExit``: not an ``Exception``): the model is put back as
        :meth:`after` does, and the cache in flight, which holds part of that forward's step, is
        marked so (:meth:`EvictingCache.interrupted`)."""
        cache = self.cache if self.owner is module else None
        self.after(module, (), {}, None)
        if cache is not None:
            cache.interrupted(error)


class ScopedForward:
    """The ``forward`` of a model under :func:`scope_attention`: the model's own, inside a
    ``try`` whose handler puts the model back when the forward ends by an exception that is not an
    ``Exception`` (``KeyboardInterrupt`` from Ctrl-C, ``SystemExit``). torch runs a module's
    ``always_call`` forward hooks only for an ``Exception``; every other path goes through the
    hooks (:func:`scope_attention`). ``inspect.signature`` sees the model's own forward
    (``__wrapped__``), and a deep copy or a pickle of the model carries it (bound to the copy).

    Example:
        >>> import inspect
        >>> from kvpolicy import H2O
        >>> from kvpolicy_tools.models import tiny_llama
        >>> model = tiny_llama()
        >>> _ = EvictingCache(H2O(4, 4), model)
        >>> isinstance(model.forward, ScopedForward), "attention_mask" in inspect.signature(model.forward).parameters
        (True, True)
    """

    def __init__(self, module: torch.nn.Module, scope: _Scope) -> None:
        self.module = module
        self.scope = scope
        #: a forward another library set on the instance before (accelerate's hooks), else ``None``
        self.inner: Callable[..., Any] | None = module.__dict__.get("forward")

    @property
    def __wrapped__(self) -> Callable[..., Any]:
        return self.inner if self.inner is not None else type(self.module).forward.__get__(self.module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        if torch.compiler.is_compiling():  # (traced: a compiled forward's switch is a side effect applied at its end)
            return self.__wrapped__(*args, **kwargs)
        try:
            return self.__wrapped__(*args, **kwargs)
        except Exception:
            raise  # (torch's always_call hook puts the model back)
        except BaseException as error:
            self.scope.interrupted(module, error)
            raise


_SCOPED: "weakref.WeakKeyDictionary[torch.nn.Module, _Scope]" = weakref.WeakKeyDictionary()
#: the attribute of a scoped model holding its scope, so that a deep copy of the model (which
#: copies its hooks, bound to a copy of the scope) is known as scoped and not hooked twice
SCOPE_ATTRIBUTE = "kvpolicy_attention_scope"


def scope_attention(model: torch.nn.Module) -> None:
    """Let ``model`` run kvpolicy's attention during the forwards given an :class:`EvictingCache`
    (``cache=`` or ``past_key_values=``), and its own everywhere else (idempotent; the
    :class:`EvictingCache` constructor calls it).

    Two forward hooks on the model (and on its base model, for callers of ``model.model``) switch
    the config's attention implementation when such a forward starts and put the model's own back
    when it ends (even when it raises), and hand the cache the forward's 2-D padding mask. They
    do nothing for any other cache, so the model keeps running transformers' caches eager and
    compiled (``fullgraph=True``), and ``output_attentions=True`` on an eager model. Hooks are
    traced by ``torch.compile`` like the rest of the forward: no global or context state.

    Example:
        >>> from kvpolicy import H2O
        >>> from kvpolicy_integrations.hf import cache_kwargs
        >>> from kvpolicy_tools.models import tiny_llama
        >>> model = tiny_llama()
        >>> cache = EvictingCache(H2O(4, 4), model)
        >>> _ = model(torch.arange(1, 9)[None], **cache_kwargs(model, cache))
        >>> model.config._attn_implementation  # as loaded
        'sdpa'
    """
    register_attention()
    if model in _SCOPED:
        return
    scope = getattr(model, SCOPE_ATTRIBUTE, None)
    if not isinstance(scope, _Scope):  # (a deep copy of a scoped model carries its hooks and their scope)
        saved = model.config._attn_implementation
        # transformers' own checks, which it runs for an SDPA-named implementation: can this class run it?
        set_attention_implementation(model, ATTENTION_NAME)
        set_attention_implementation(model, saved)
        scope = _Scope()
        modules = [model]
        base = getattr(model, "base_model", model)
        if isinstance(base, torch.nn.Module) and base is not model:
            modules.append(base)
        for module in modules:
            module.register_forward_pre_hook(scope.before, with_kwargs=True)
            module.register_forward_hook(scope.after, with_kwargs=True, always_call=True)
            module.forward = ScopedForward(module, scope)  # (the paths the always_call hook does not see)
        setattr(model, SCOPE_ATTRIBUTE, scope)
    _SCOPED[model] = scope
    for sub in model.modules():
        if isinstance(getattr(sub, "layer_idx", None), int):
            ATTENTION_SCOPES[sub] = scope


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
            to rounding; ``False`` reproduces SDPA's outputs exactly (caches without holes only).
        static_shapes: attend over every allocated slot at every decode step (holes masked), so
            a decode step's tensor shapes never change (``torch.compile``, CUDA graphs).
        max_tokens: tokens a layer will hold at most (prompt plus new tokens), if known: an
            unbounded policy (the full cache) allocates exactly that instead of growing.
        prefill_chunk: the chunk size of a chunked prefill (default :data:`PREFILL_CHUNK`, what
            :func:`generate` and :func:`greedy_decode` feed a long prompt in): when the first
            forward brings exactly this many tokens, a bounded policy's layers allocate room for
            one chunk beyond the capacity, so the cache never holds more than the capacity and one
            chunk during the prefill (:class:`kvpolicy_torch.LayerCache`'s ``prompt_chunk``), and
            gives the room back at the first decode step;
            ``None``: no room (a chunk that does not fit is held beside the storage until evicted).

    Left-padded batches work for every policy: pads are never attended, scored or kept, and each
    row evicts on its own schedule (the 2-D ``attention_mask`` says which tokens are pads).

    Example:
        >>> from kvpolicy import make_policy
        >>> from kvpolicy_integrations.hf import cache_kwargs
        >>> from kvpolicy_tools.models import tiny_llama
        >>> model = tiny_llama()
        >>> cache = EvictingCache(make_policy("buzz", 0.5, context_length=64), model)
        >>> out = model.generate(torch.arange(1, 33)[None], max_new_tokens=8, do_sample=False, **cache_kwargs(model, cache))
        >>> tuple(out.shape), max(cache.lengths()) <= cache.policy.capacity
        ((1, 40), True)
    """

    def __init__(
        self,
        policy: EvictionPolicy,
        model: Any,
        *,
        positions: PositionsMode | None = None,
        reduce_scores: Callable[[torch.Tensor], torch.Tensor] | None = None,
        fused_decode: bool = True,
        static_shapes: bool = False,
        max_tokens: int | None = None,
        prefill_chunk: int | None = PREFILL_CHUNK,
    ) -> None:
        if not isinstance(policy, EvictionPolicy):
            raise ValueError(f"policy must be an EvictionPolicy, got {policy!r}")
        if not isinstance(model, (torch.nn.Module, PretrainedConfig)):
            raise TypeError(f"model must be a transformers model (or its config), got {type(model).__name__} {model!r:.80}")
        caps = detect(model)
        positions = positions or policy.default_positions
        if positions not in ("original", "cache"):
            raise ValueError(f"positions must be 'original' or 'cache', got {positions!r}")
        ropes: list[RopeLayout | None] = [None] * len(caps.layers)
        if positions == "cache" or policy.observes_queries:
            # (Expected Attention rotates each query back to before RoPE and averages RoPE over the next positions)
            if not isinstance(model, torch.nn.Module):
                raise ValueError(
                    f"positions='cache' (pos-shift) and {type(policy).__name__}'s query statistics need the model itself, not "
                    f"only its config: its RoPE layout is measured with one forward"
                    + ("; positions='original' works with a config" if positions == "cache" else "")
                )
            # (a model without RoPE serves Expected Attention with its queries as they are)
            ropes = rope_layouts(model) if positions == "cache" else query_rotations(model)
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1 or None, got {max_tokens!r}")
        fused_decode = check_bool("fused_decode", fused_decode)
        static_shapes = check_bool("static_shapes", static_shapes)
        if static_shapes and positions == "cache":
            rule = policy.decode_eviction
            if rule is None or rule.victim != "oldest":
                raise ValueError(
                    f"static_shapes=True with positions='cache' (pos-shift) serves policies whose decode eviction is "
                    f"'oldest' (StreamingLLM); {policy!r} would re-rotate keys per slot on the host: use "
                    f"positions='original' or static_shapes=False"
                )
        if isinstance(model, torch.nn.Module):
            scope_attention(model)
        #: the forward using this cache and the model it serves (a weak reference; none when built
        #: from a config, or in a copy: pickle and deepcopy drop it, so a restored cache serves a
        #: model of the same shape), shared with the layers: transformers' ``Cache.update`` hands
        #: each call to a layer, which tells a forward's from one made by hand
        self.scope = ForwardScope(model if isinstance(model, torch.nn.Module) else None)
        self.policy = policy
        #: whether a decode step keeps its shapes (the cache :func:`compile_decode_step` serves)
        self.static_shapes = static_shapes
        self.positions_mode = positions
        self.capabilities: ModelCapabilities = caps
        self.padding = Padding()  # shared by the layers: the padding of the forward in flight
        self._reported: set[int] = set()  # layers report_nonfinite has warned about since the last reset
        self._interrupted: str | None = None  # what ended a forward mid-step (interrupted), until reset()
        shift_matrices = ShiftMatrices()  # shared by the layers: pos-shift rotations, built once a step
        pre_rope = PreRope()  # (and the rotation of a step's queries back to before RoPE)
        n_layers = len(caps.layers)
        # shared by the layers: one victim search a decode step for all (static shapes search on the
        # device, each layer in its own graph nodes)
        group = None if static_shapes else LayerGroup(n_layers)
        per_layer = [policy.for_layer(i, n_layers) for i in range(n_layers)]
        # layers of different capacities (PyramidKV) take the spare slots of their mean: the memory
        # bound over the cache, not over each layer (a small layer would compact at every step)
        pooled = pooled_capacity([p.capacity for p in per_layer])
        layers = [
            EvictingLayer(
                per_layer[i], i, positions=positions, rope=ropes[i], attention=caps.layers[i], reduce_scores=reduce_scores,
                fused_decode=fused_decode, static_shapes=static_shapes, reserve=max_tokens, padding=self.padding,
                shift_matrices=shift_matrices, pre_rope=pre_rope, group=group,
                prefill_chunk=None if prefill_chunk is None else check_int("prefill_chunk", prefill_chunk, minimum=1),
                pooled_capacity=pooled, scope=self.scope,
            )
            for i in range(n_layers)
        ]
        super().__init__(layers=layers)

    @property
    def needs_settle(self) -> bool:
        """Whether compiled decode steps leave work to :meth:`settle` (static shapes, and a bounded
        policy without a one-token decode eviction, BUZZ, Scissorhands; or a storage that may
        still grow: an unbounded policy, one given a ``max_tokens`` below its capacity, or AdaKV's
        storage, sized by the widest head held)."""
        return any(layer.store.needs_settle for layer in self.layers)

    def settle(self) -> list[list[tuple[int, int]]]:
        """Between compiled decode steps: run the general evictions those steps left to the host,
        and grow a storage the next step would find full (see :attr:`needs_settle`;
        :func:`decode_steps` and :func:`generate` call it). Eager code needs no call: each step
        evicts itself. Returns each layer's rounds."""
        return [layer.store.settle() for layer in self.layers]

    def check_model(self, model: torch.nn.Module) -> None:
        """Refuse a forward of ``model`` (a model or its base model, whose hooks call this) when it
        is not the model this cache was built for (its keys, values and layers are that model's):
        ``ValueError`` naming both."""
        if not self.scope.for_model:
            return  # built from a config, or a copy
        mine = self.scope.built_for  # (None: that model is gone, so this one is another)
        if model is not mine and getattr(mine, "base_model", None) is not model \
                and getattr(model, "base_model", None) is not mine:
            raise ValueError(
                f"this EvictingCache was built for another model ({type(mine).__name__ if mine is not None else 'gone'}, "
                f"{len(self.layers)} layers) than "
                f"the one running this forward ({type(model).__name__}): a cache holds one model's keys and values; "
                "make one per model (EvictingCache(policy, model))"
            )

    def check_forward(self, attention_mask: torch.Tensor | None, q_length: int, use_cache: Any,
                      position_ids: torch.Tensor | None = None) -> None:
        """Refuse a forward this cache cannot serve exactly (its hooks call this first): a 4-D mask,
        ``use_cache=False`` (transformers then feeds the whole sequence at every step), or a new
        prompt without :meth:`reset`: a 2-D mask that does not cover the columns this cache has
        seen plus the new ones, or a prompt chunk (``q_length > 1``) without pads whose first
        position lies before a row's tokens seen (``generate()`` passes positions and drops an
        all-ones mask). A one-token decode step reads nothing here (no host sync); a chunk
        without positions or mask whose tokens follow what the cache has seen is a continuation
        for the cache as for the model (transformers' caches cannot tell either)."""
        if self._interrupted is not None:
            raise RuntimeError(
                f"this EvictingCache's last forward was interrupted mid-step ({self._interrupted}): its layers hold part "
                "of that step (some appended, some not, scores half accumulated), so it cannot continue the sequence "
                "exactly; call cache.reset() and run the prompt again (or make a new cache). The model was put back "
                "as it was"
            )
        if use_cache is False:
            raise ValueError(
                "use_cache=False with an EvictingCache: transformers would feed the whole sequence to the cache at every "
                "step (a fine-tuned checkpoint's generation config may say use_cache=False): pass use_cache=True"
            )
        if q_length < 1:
            seen = self.layers[0].store.seen if self.layers[0].store.is_initialized else [0]
            raise ValueError(
                f"this forward brings no new tokens, and this EvictingCache has seen {max(seen)}: generate() given a used "
                "cache feeds the model only the prompt's tokens beyond what the cache has seen, none here. A cache "
                "serves one sequence from its first token: for a new prompt call cache.reset() (or make a new cache)"
            )
        if q_length > 1 and position_ids is not None and self.layers[0].store.is_initialized:
            self._check_positions(attention_mask, q_length, position_ids)
        if attention_mask is None:
            return
        if attention_mask.ndim != 2:
            raise ValueError(
                "EvictingCache builds the attention mask from the kept tokens' positions; this forward got a "
                f"{attention_mask.ndim}-D attention_mask, which cannot be applied to an evicting cache: pass the usual 2-D "
                "padding mask (or none)"
            )
        seen = self.layers[0].store.sequence_length if self.layers[0].store.is_initialized else 0
        if isinstance(seen, int) and attention_mask.shape[1] != seen + q_length:
            raise ValueError(
                f"this EvictingCache has seen {seen} columns, but the forward's attention_mask covers "
                f"{attention_mask.shape[1]} for {q_length} new tokens: a cache serves one sequence (batch) from its first "
                f"token; for a new prompt call cache.reset() (or make a new cache)"
            )

    def _check_positions(self, attention_mask: torch.Tensor | None, q_length: int, position_ids: torch.Tensor) -> None:
        """A prompt chunk's first positions against each row's tokens seen (one host read a chunk)."""
        if attention_mask is not None and attention_mask.ndim == 2 and not bool(attention_mask[:, -q_length:].all()):
            return  # pads in the chunk: the mask check below speaks for it
        seen = self.layers[0].store.seen
        first = position_ids.reshape(-1, position_ids.shape[-1])[:, 0].tolist()
        if len(first) == 1:
            first = first * len(seen)
        for row, (p, s) in enumerate(zip(first, seen)):
            if p < s:
                raise ValueError(
                    f"this EvictingCache has seen {s} tokens in row {row}, but the forward's {q_length}-token chunk starts at "
                    f"position {p}: that is a new prompt, not a continuation (a cache serves one sequence from its first "
                    f"token; generate() given a used cache would feed it only the prompt's tail): call cache.reset() "
                    f"(or make a new cache) for a new prompt"
                )

    def interrupted(self, error: BaseException) -> None:
        """A forward using this cache ended by ``error`` that is not an ``Exception`` (Ctrl-C's
        ``KeyboardInterrupt``), maybe mid-step (:class:`ScopedForward` calls this): the cache is
        released, and its next forward is refused until :meth:`reset`."""
        self._interrupted = type(error).__name__
        self.leave()

    def enter(self) -> None:
        """A forward starts using this cache (its hooks call this): one at a time."""
        self.scope.enter()

    def leave(self) -> None:
        """The forward that :meth:`enter`-ed has ended."""
        self.scope.leave()

    def report_nonfinite(self) -> list[int]:
        """The layers whose attention output was not finite (NaN or infinite) since the last
        :meth:`reset`, for a policy with log n (BUZZ, paper section 3.5): the logits times the
        log-n scale overflowed the model's dtype. Such a step's probabilities are NaN, so its
        scores follow the NaN rule (they rank lowest: :attr:`kvpolicy.CacheView.ranking_scores`),
        and the model's output from there on means little. A layer flags it on the device (no
        host read in the decode path); this reads the flags (one host read) and warns
        :class:`kvpolicy.driver.NonFiniteWarning` once per layer. :func:`generate`,
        :func:`greedy_decode`, :meth:`lengths`, :meth:`row_lengths` and :meth:`reset` call it.

        Example:
            >>> from kvpolicy import BUZZ
            >>> from kvpolicy_tools.models import tiny_llama
            >>> model = tiny_llama()
            >>> from kvpolicy_integrations.hf import greedy_decode
            >>> cache = EvictingCache(BUZZ(sink=2, window=8, stride=3, log_n=True), model)
            >>> _ = greedy_decode(model, torch.arange(1, 17)[None], cache, 4)
            >>> cache.report_nonfinite()
            []
        """
        flags = [layer.nonfinite for layer in self.layers]
        present = [i for i, f in enumerate(flags) if f is not None and f.device.type != "meta"]  # (meta: no values)
        if not present:
            return []
        values = torch.stack([flags[i].to("cpu", non_blocking=False) for i in present]).tolist()
        bad = [i for i, v in zip(present, values) if not math.isfinite(v)]  # (the layers' totals: device_total)
        new = [i for i in bad if i not in self._reported]
        if new:
            self._reported.update(new)
            warnings.warn(
                f"{self.policy!r}: the attention output of layer(s) {new} of this EvictingCache was not finite: the "
                f"logits times the log-n scale overflowed {self.layers[new[0]].store.keys.dtype}. Those steps' "
                "probabilities are NaN; their scores rank lowest (kvpolicy.CacheView.ranking_scores), so such tokens go "
                "first, and the model's outputs from there on are not meaningful: use a larger log_base or "
                "log_floor=0, or run the model in float32",
                NonFiniteWarning,
                stacklevel=2,
            )
        return bad

    def note_padding(self, attention_mask: torch.Tensor | None, q_length: int) -> None:
        """Record the padding of the forward about to run (``attention_mask``: the 2-D mask of all
        columns so far, or ``None``). Read once per prompt chunk (one host sync); decode tokens
        (``q_length == 1``) are taken as real, as ``generate()`` makes them."""
        if q_length == 1:
            return  # a decode step: nothing to note (and nothing a compiled step would have to guard on)
        pad = self.padding
        pad.serial += 1
        pad.valid, pad.real, pad.q = None, None, q_length
        if attention_mask is None or attention_mask.ndim != 2:
            return
        valid = attention_mask[:, -q_length:].to(torch.bool)
        real = valid.sum(dim=-1).tolist()
        if any(r != q_length for r in real):
            pad.valid, pad.real = valid, real

    def reset(self) -> None:
        """Forget the sequence (every layer), so that the cache serves a new prompt; a non-finite
        attention not yet reported is reported first (:meth:`report_nonfinite`)."""
        self.report_nonfinite()
        self._reported = set()
        self._interrupted = None
        super().reset()

    def lengths(self) -> list[int]:
        """Kept tokens per layer (the most any row keeps; see :meth:`row_lengths`)."""
        self.report_nonfinite()
        return [max(layer.store.lengths, default=0) for layer in self.layers]

    def row_lengths(self) -> list[list[int]]:
        """Kept tokens per layer and row (rows of a left-padded batch differ)."""
        self.report_nonfinite()
        return [layer.store.lengths for layer in self.layers]

    @property
    def kv_bytes(self) -> int:
        """Bytes of keys and values held now, all layers."""
        return sum(layer.store.kv_bytes for layer in self.layers)

    @property
    def allocated_bytes(self) -> int:
        """Bytes allocated by the stores (keys, values, positions, scores, bias), all layers."""
        return sum(layer.store.nbytes for layer in self.layers)

    def full_kv_bytes(self) -> int:
        """Bytes a full cache would hold for the (real) tokens seen so far."""
        total = 0
        for layer in self.layers:
            if layer.store.is_initialized:
                total += layer.store.token_bytes * sum(layer.store.seen)
        return total


def output_projections(model: torch.nn.Module) -> list[torch.Tensor]:
    """Each decoder layer's output projection ``W_o`` as :class:`~kvpolicy.CriticalKV` reads it
    (its ``projections``): ``[kv_heads, group, head_dim, hidden]``, the rows of ``o_proj.weight``
    transposed that query head ``g`` of KV head ``h`` multiplies (transformers' GQA layout: query
    head ``h x group + g``), in layer order, detached, on the model's device and dtype.
    ``ValueError`` for a model whose attention modules have no ``o_proj`` (or whose count is not
    the config's layer count).

    Example:
        >>> from kvpolicy_tools.models import tiny_llama
        >>> w = output_projections(tiny_llama(num_layers=2, heads=4, kv_heads=2, head_dim=8, vocab=32))
        >>> len(w), tuple(w[0].shape)
        (2, (2, 2, 8, 32))
    """
    config = text_config(model)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if not isinstance(heads, int) or not isinstance(kv_heads, int) or heads < 1 or kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"output_projections needs the config's num_attention_heads and num_key_value_heads, got {heads!r}, {kv_heads!r}")
    found = {}
    for module in model.modules():
        o_proj, layer = getattr(module, "o_proj", None), getattr(module, "layer_idx", None)
        if isinstance(o_proj, torch.nn.Linear) and isinstance(layer, int):
            found[layer] = o_proj.weight
    layers = model_layers(model)
    if not found or (layers is not None and sorted(found) != list(range(layers))):
        raise ValueError(
            f"output_projections reads each attention layer's o_proj (a Linear, with layer_idx); found "
            f"{len(found)} of {layers} layers in {type(model).__name__}"
        )
    out = []
    for i in sorted(found):
        w = found[i].detach().transpose(0, 1)  # [heads x head_dim, hidden]
        out.append(w.reshape(kv_heads, heads // kv_heads, w.shape[0] // heads, w.shape[1]))
    return out
