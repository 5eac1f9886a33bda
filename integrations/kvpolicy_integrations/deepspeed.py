"""DeepSpeed-inference integration: evicting caches inside AutoTP engines, head-sharded over ranks.

DeepSpeed's *automatic tensor parallelism* (AutoTP, ``replace_with_kernel_inject=False``) keeps
the transformers modules, attention function and ``Cache`` and only shards the weights: every
rank computes the attention of a contiguous block of KV heads (and their query heads). So an
:class:`~kvpolicy_integrations.hf.EvictingCache` built on a rank simply holds that rank's KV heads
and the policy state is head-sharded:

* per-head policies (BUZZ, H2O, StreamingLLM, local window, full) need no communication: a KV
  head's decision depends only on that head's scores, so rank ``r`` keeps exactly the positions a
  single process keeps for the same global heads;
* a policy with ``selection="shared"`` sums its scores over *all* KV heads before choosing one
  set of slots. Each rank sums its local heads and :func:`make_cache` passes an all-reduce (SUM)
  over the tensor-parallel group as ``reduce_scores``, so every rank chooses the same slots.
  That is one small collective (``[batch, 1, cached]`` float32) per layer and eviction round;
* head-wise budgets (:class:`~kvpolicy.AdaKV`) rank all of a layer's KV heads at once (one
  top-k), so the cache runs AdaKV's share for this rank (:class:`~kvpolicy.policies.ShardedAdaKV`):
  in a round that evicts, each rank gathers every rank's positions and scores
  (:class:`TensorParallelHeads`: an all-reduce of the width and an all-gather of ``[batch,
  kv_heads, cached]``, twice), runs AdaKV on the whole layer and keeps its own heads' share: the
  positions a single process keeps for the same heads. Whether to evict is decided on host
  integers, alike on every rank (no exchange at a step that evicts nothing). One sequence at a
  time (batch 1, refused otherwise); AdaKV inside another policy (a composition) is refused.

How DeepSpeed 0.19 shards heads (``deepspeed/module_inject/tp_shard.py``, ``get_shard_size``;
checked against real engines in ``tests/ds_worker.py``): with ``num_key_value_heads = K`` read
from the model config, rank ``r`` of ``tp`` gets ``K // tp + (1 if r < K % tp else 0)`` KV heads,
contiguous and in rank order, and the query heads of those KV heads (the q/k/v rows and o_proj
columns are cut at the same head boundaries). So 3 KV heads / 9 query heads over 2 ranks give
2 + 1 KV heads and 6 + 3 query heads; Llama-2-13B's 40 heads over 3 ranks give 14 + 13 + 13.
The attention modules' attributes are left alone (transformers 5 Llama attention has no
``num_heads``; ``num_key_value_groups`` stays correct because whole groups move together) and
``model.config`` still holds the global counts; the local head count is visible only in the
projection weights' shapes, which :func:`make_cache` checks. ``tp > K`` would leave ranks without
heads and is refused.

Kernel injection (``replace_with_kernel_inject=True``) replaces the attention with fused kernels
that keep their own append-only KV workspace and never call the transformers cache; it is
refused (:data:`KERNEL_INJECTION_ERROR`).

Entry points: :func:`init_inference` (a ``deepspeed.init_inference`` that validates, sets
``max_out_tokens`` from the context, and returns an :class:`EvictingInferenceEngine` whose
``generate`` evicts) and :func:`make_cache` (the cache for an engine you built yourself; pass it
to ``engine.module.generate`` as ``**cache_kwargs(engine.module, cache)``: ``cache=`` on
transformers >= 5.24, ``past_key_values=`` before). The head arithmetic (:func:`shard_layout`,
:func:`weight_numel_per_rank`) needs neither DeepSpeed nor a process group.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping

import torch
import torch.distributed as tdist

from kvpolicy import FullCache
from kvpolicy.validation import check_bool
from kvpolicy.budget import make_policy
from kvpolicy.policies import AdaKV, ShardedAdaKV
from kvpolicy.policy import EvictionPolicy
from kvpolicy.registry import get_policy

from .capabilities import Geometry, cache_kwargs, detect, geometry, model_layers
from .hf.cache import EvictingCache
from .hf.layer import PositionsMode

__all__ = [
    "ATTENTION_SPECS",
    "CUDA_GRAPH_ERROR",
    "KERNEL_INJECTION_ERROR",
    "AttentionSpec",
    "EvictingInferenceEngine",
    "HeadShard",
    "ModelGeometry",
    "ShardLayout",
    "ShardedEvictingCache",
    "TensorParallelHeads",
    "init_inference",
    "local_heads",
    "check_launcher_env",
    "finish_distributed",
    "SHM_BUFFER_PREFIX",
    "SHM_DIR",
    "make_cache",
    "materialize_shards",
    "parameter_shard",
    "shard_layout",
    "split_sizes",
    "tp_all_reduce",
    "weight_numel_per_rank",
]

KERNEL_INJECTION_ERROR = (
    "replace_with_kernel_inject=True cannot be used with a kvpolicy cache: DeepSpeed's kernel injection "
    "replaces the transformers attention with fused inference kernels that keep their own append-only KV "
    "workspace (sized by max_out_tokens) and never call the Hugging Face cache, so an EvictingCache would be "
    "ignored and nothing would be evicted. Use automatic tensor parallelism instead: "
    "replace_with_kernel_inject=False (the default here) with tp_size=N, which shards the heads but keeps "
    "the transformers attention and cache."
)

CUDA_GRAPH_ERROR = (
    "enable_cuda_graph=True cannot be used with a kvpolicy cache: a CUDA graph replays fixed tensor shapes and "
    "addresses, but an evicting cache changes its length and gathers new storage at every eviction. Leave "
    "enable_cuda_graph=False."
)

# DeepSpeed's own default for tensor_parallel.tp_grain_size (deepspeed/inference/config.py).
DEFAULT_TP_GRAIN_SIZE = 64


# ------------------------------------------------------------------------------------------------
# Declarative model description
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionSpec:
    """Where a model family keeps its decoder layers, attention projections and head counts.

    Every name is an attribute name (dotted for nested modules), not a pattern: the geometry is
    read from the config by these names and the sharded head counts from these modules' weights.
    """

    layers: str = "model.layers"
    attention: str = "self_attn"
    q_proj: str = "q_proj"
    k_proj: str = "k_proj"
    v_proj: str = "v_proj"
    o_proj: str = "o_proj"
    heads_attr: str = "num_attention_heads"
    kv_heads_attr: str = "num_key_value_heads"
    head_dim_attr: str = "head_dim"
    #: Parameter-name suffixes AutoTP leaves whole on every rank besides norms (the embedding
    #: lies outside the decoder layers AutoTP walks; verified: it keeps its full shape).
    replicated: tuple[str, ...] = ("embed_tokens.weight",)
    lm_head: str = "lm_head"


#: Module layouts by model type; a type not listed gets the Llama layout (``AttentionSpec()``),
#: which is checked against the model's modules (a model whose attention is not laid out so,
#: e.g. a fused ``qkv_proj``, is refused by name of the missing module).
ATTENTION_SPECS: Mapping[str, AttentionSpec] = {}


def _check_layout(model: Any, spec: AttentionSpec, model_type: str) -> None:
    """``ValueError`` unless ``model`` has ``spec``'s decoder layers and separate q/k/v/o projections."""
    node = model
    for part in spec.layers.split("."):
        node = getattr(node, part, None)
    layers = list(node) if isinstance(node, torch.nn.ModuleList) else []
    attn = getattr(layers[0], spec.attention, None) if layers else None
    missing = [n for n in (spec.q_proj, spec.k_proj, spec.v_proj, spec.o_proj) if not hasattr(attn, n)] if attn is not None else []
    if not layers or attn is None or missing:
        what = f"{spec.layers}[i].{spec.attention}" + (f" with {', '.join(missing)}" if missing else "")
        raise ValueError(
            f"kvpolicy's DeepSpeed integration shards decoders laid out as {what} (separate q/k/v/o projections, "
            f"as Llama, Mistral, Qwen, Gemma); model_type {model_type!r} is not. EvictingCache without DeepSpeed "
            f"works for it"
        )


@dataclass(frozen=True)
class ModelGeometry(Geometry):
    """A decoder's :class:`~kvpolicy_integrations.capabilities.Geometry`, read through its
    :class:`AttentionSpec` (whose ``spec`` it carries); ``intermediate_size`` and ``vocab_size``
    are always given (the memory arithmetic needs them)."""

    spec: AttentionSpec = AttentionSpec()

    @classmethod
    def from_config(cls, model_or_config: Any) -> "ModelGeometry":
        """Read and check the geometry (``ValueError`` for unsupported or inconsistent configs):
        :func:`kvpolicy_integrations.capabilities.geometry` under the family's :class:`AttentionSpec`
        names, which must also give the MLP width and the vocabulary."""
        model_type = detect(model_or_config).model_type  # the same capability check as EvictingCache
        spec = ATTENTION_SPECS.get(model_type, AttentionSpec())
        if isinstance(model_or_config, torch.nn.Module):
            _check_layout(model_or_config, spec, model_type)
        g = geometry(model_or_config, heads_attr=spec.heads_attr, kv_heads_attr=spec.kv_heads_attr, head_dim_attr=spec.head_dim_attr)
        for name in ("intermediate_size", "vocab_size"):
            if getattr(g, name) is None:
                raise ValueError(f"model config has no {name!r}")
            _positive(name, getattr(g, name))
        return cls(**{f.name: getattr(g, f.name) for f in fields(Geometry)}, spec=spec)


def _positive(name: str, value: Any, where: str = "model config: ") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}{name} must be a positive integer, got {value!r}")
    return value


# ------------------------------------------------------------------------------------------------
# Head arithmetic (mirrors deepspeed/module_inject/tp_shard.py:get_shard_size of DeepSpeed 0.19)
# ------------------------------------------------------------------------------------------------


def split_sizes(total: int, tp_size: int, *, kv_heads: int | None, grain: int = DEFAULT_TP_GRAIN_SIZE, by_heads: bool) -> list[int]:
    """How AutoTP cuts a dimension of ``total`` over ``tp_size`` ranks (rank order).

    ``by_heads=True`` is the attention rule: when ``total`` is a multiple of ``kv_heads`` the cut
    falls on KV-head boundaries, ``kv_heads // tp + (r < kv_heads % tp)`` heads' worth on rank
    ``r``. Otherwise (MLP, ``lm_head``, or no head count) ``total`` is cut into ``grain``-sized
    pieces dealt out the same way, the last rank taking the remainder.

    Example:
        >>> split_sizes(9 * 64, 2, kv_heads=3, by_heads=True)   # SmolLM2's q_proj rows
        [384, 192]
        >>> split_sizes(13824, 8, kv_heads=40, by_heads=False)  # Llama-2-13B's MLP
        [1728, 1728, 1728, 1728, 1728, 1728, 1728, 1728]
    """
    by_heads = check_bool("by_heads", by_heads)
    sizes = []
    for rank in range(tp_size):
        if by_heads and kv_heads is not None and total % kv_heads == 0:
            slices = kv_heads // tp_size + (1 if rank < kv_heads % tp_size else 0)
            sizes.append(total * slices // kv_heads)
        elif total >= grain:
            pieces, remainder = divmod(total, grain)
            size = (pieces // tp_size + (1 if rank < pieces % tp_size else 0)) * grain
            sizes.append(size + (remainder if rank == tp_size - 1 else 0))
        else:
            sizes.append(total // tp_size + (1 if rank < total % tp_size else 0))
    return sizes


@dataclass(frozen=True)
class HeadShard:
    """The heads one tensor-parallel rank computes: global ids ``[start, stop)``."""

    rank: int
    kv_start: int
    kv_stop: int
    q_start: int
    q_stop: int

    @property
    def kv_heads(self) -> range:
        return range(self.kv_start, self.kv_stop)

    @property
    def q_heads(self) -> range:
        return range(self.q_start, self.q_stop)

    @property
    def n_kv_heads(self) -> int:
        return self.kv_stop - self.kv_start

    @property
    def n_q_heads(self) -> int:
        return self.q_stop - self.q_start


@dataclass(frozen=True)
class ShardLayout:
    """Every rank's heads for one model and tensor-parallel size."""

    geometry: ModelGeometry
    tp_size: int
    shards: tuple[HeadShard, ...]

    def __getitem__(self, rank: int) -> HeadShard:
        return self.shards[rank]

    def kv_bytes_per_token(self, rank: int = 0, dtype_bytes: int = 2) -> int:
        """Key + value bytes one token adds on ``rank``: ``2 * layers * kv_heads_local * head_dim * dtype_bytes``."""
        g = self.geometry
        return 2 * g.layers * self.shards[rank].n_kv_heads * g.head_dim * dtype_bytes

    def store_bytes_per_token(self, rank: int = 0) -> int:
        """Bookkeeping bytes per token on ``rank``: int64 position + float32 score per KV head and layer."""
        return self.geometry.layers * self.shards[rank].n_kv_heads * (8 + 4)

    def describe(self) -> str:
        g = self.geometry
        rows = [
            f"rank {s.rank}: KV heads {s.kv_start}..{s.kv_stop - 1} ({s.n_kv_heads}), "
            f"query heads {s.q_start}..{s.q_stop - 1} ({s.n_q_heads})"
            for s in self.shards
        ]
        return f"{g.heads} query / {g.kv_heads} KV heads over {self.tp_size} ranks\n" + "\n".join(rows)


def shard_layout(model_or_config: Any, tp_size: int) -> ShardLayout:
    """The heads AutoTP gives each of ``tp_size`` ranks (no DeepSpeed, no process group needed).

    Example:
        >>> from kvpolicy_tools.models import tiny_llama
        >>> [(s.n_q_heads, s.n_kv_heads) for s in shard_layout(tiny_llama(heads=9, kv_heads=3), 2).shards]
        [(6, 2), (3, 1)]
    """
    geometry = model_or_config if isinstance(model_or_config, ModelGeometry) else ModelGeometry.from_config(model_or_config)
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size must be a positive integer, got {tp_size!r}")
    if tp_size > geometry.kv_heads:
        raise ValueError(
            f"tp_size={tp_size} is larger than the model's {geometry.kv_heads} KV heads: AutoTP cuts attention at "
            f"KV-head boundaries, so {tp_size - geometry.kv_heads} rank(s) would get no heads at all. "
            f"Use tp_size <= {geometry.kv_heads}."
        )
    kv_sizes = split_sizes(geometry.kv_heads, tp_size, kv_heads=geometry.kv_heads, by_heads=True)
    shards, start = [], 0
    for rank, n in enumerate(kv_sizes):
        shards.append(HeadShard(rank, start, start + n, start * geometry.groups, (start + n) * geometry.groups))
        start += n
    return ShardLayout(geometry, tp_size, tuple(shards))


def _split_rule(name: str, geometry: ModelGeometry) -> tuple[int, bool] | None:
    """``(dim, by_heads)`` for a parameter AutoTP shards, ``None`` for one it replicates.

    The declarative table of AutoTP's default path for Llama-layout decoders: q/k/v (weight and
    bias) are column-parallel (rows cut at head boundaries), o_proj row-parallel (columns cut at
    head boundaries), gate/up column-parallel and down_proj row-parallel in ``grain`` pieces, the
    untied or tied ``lm_head`` row-parallel (hidden columns) in ``grain`` pieces; norms, rotary
    buffers and the embedding stay whole.
    """
    spec = geometry.spec
    parts = name.split(".")
    if len(parts) < 2:
        return None
    module, kind = parts[-2], parts[-1]
    if parts[-3:-2] == [spec.attention]:
        if module in (spec.q_proj, spec.k_proj, spec.v_proj):
            return (0, True)
        if module == spec.o_proj and kind == "weight":
            return (1, True)
        return None
    if parts[-3:-2] == ["mlp"]:
        if module in ("gate_proj", "up_proj"):
            return (0, False)
        if module == "down_proj" and kind == "weight":
            return (1, False)
        return None
    if module == spec.lm_head and kind == "weight" and len(parts) == 2:
        return (1, False)
    return None


def weight_numel_per_rank(model: torch.nn.Module, tp_size: int, *, grain: int = DEFAULT_TP_GRAIN_SIZE) -> list[int]:
    """Parameter elements each rank holds after AutoTP, from the *unsharded* model's shapes.

    Works on a meta-device model (no weights). Tied input/output embeddings count once at
    ``tp_size == 1``; with ``tp_size > 1`` AutoTP unties them (the embedding stays whole, the
    ``lm_head`` copy is sharded).
    """
    geometry = ModelGeometry.from_config(model)
    shard_layout(geometry, tp_size)  # validates tp_size against the heads
    totals = [0] * tp_size
    seen: set[int] = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        rule = _split_rule(name, geometry) if tp_size > 1 else None
        if rule is None:
            if id(param) in seen:
                continue
            seen.add(id(param))
            for r in range(tp_size):
                totals[r] += param.numel()
            continue
        seen.add(id(param))
        dim, by_heads = rule
        sizes = split_sizes(param.shape[dim], tp_size, kv_heads=geometry.kv_heads, grain=grain, by_heads=by_heads)
        other = param.numel() // param.shape[dim]
        for r in range(tp_size):
            totals[r] += sizes[r] * other
    return totals


def parameter_shard(
    name: str, shape: tuple[int, ...], geometry: ModelGeometry, tp_size: int, rank: int, *, grain: int = DEFAULT_TP_GRAIN_SIZE
) -> tuple[int, int, int] | None:
    """``(dim, start, stop)``: the slice of the *unsharded* parameter ``name`` (of ``shape``) that
    AutoTP gives ``rank``; ``None`` when every rank holds it whole.

    The rule of :func:`weight_numel_per_rank` (q/k/v rows and o_proj columns at KV-head
    boundaries, MLP and ``lm_head`` in ``grain`` pieces, contiguous in rank order), so a rank can
    read or generate exactly its part of a checkpoint without the whole model.

    Example:
        >>> from kvpolicy_tools.models import tiny_llama
        >>> g = ModelGeometry.from_config(tiny_llama(heads=9, kv_heads=3, head_dim=16))
        >>> parameter_shard("model.layers.0.self_attn.q_proj.weight", (144, 144), g, 2, 1)
        (0, 96, 144)
        >>> parameter_shard("model.norm.weight", (144,), g, 2, 1) is None
        True
    """
    rule = _split_rule(name, geometry) if tp_size > 1 else None
    if rule is None:
        return None
    dim, by_heads = rule
    sizes = split_sizes(shape[dim], tp_size, kv_heads=geometry.kv_heads, grain=grain, by_heads=by_heads)
    start = sum(sizes[:rank])
    return dim, start, start + sizes[rank]


def materialize_shards(
    module: torch.nn.Module,
    full_shapes: Mapping[str, tuple[int, ...]],
    fill: Callable[[str, tuple[int, ...]], torch.Tensor | Callable[[tuple[slice, ...]], torch.Tensor]],
    *,
    tp_size: int,
    rank: int,
    geometry: ModelGeometry | None = None,
) -> int:
    """Fill this rank's (sharded, e.g. freshly ``to_empty``-ed) parameters, one at a time.

    ``fill(name, full_shape)`` returns either the whole unsharded tensor (e.g. seeded random
    values: the same on every rank and for every ``tp_size``) or a function that returns the
    part for an index tuple (e.g. a safetensors slice: only this rank's bytes are read). The
    part is cast to the parameter's dtype and device. Returns the bytes written.

    Raises:
        ValueError: a parameter has no entry in ``full_shapes`` or its local shape is not the
            slice AutoTP's rule gives this rank.
    """
    geometry = geometry or ModelGeometry.from_config(module)
    written = 0
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name not in full_shapes:
                raise ValueError(f"no unsharded shape for parameter {name!r}")
            full = tuple(full_shapes[name])
            shard = parameter_shard(name, full, geometry, tp_size, rank)
            index = [slice(None)] * len(full)
            if shard is not None:
                dim, start, stop = shard
                index[dim] = slice(start, stop)
            expected = tuple(len(range(*s.indices(n))) for s, n in zip(index, full))
            if tuple(param.shape) != expected:
                raise ValueError(f"{name}: rank {rank} of {tp_size} holds {tuple(param.shape)}, AutoTP's rule gives {expected}")
            source = fill(name, full)
            part = source(tuple(index)) if callable(source) else source[tuple(index)]
            param.copy_(part.to(dtype=param.dtype, device=param.device))
            written += param.numel() * param.element_size()
            del source, part
    return written


#: Where DeepSpeed's CPU all-reduce keeps each rank's shared-memory buffer (``shm_open`` names live
#: in /dev/shm on Linux): ``deepspeed_allreduce_buffer_<uid>_<master addr>_<master port>_<rank>``.
SHM_DIR = "/dev/shm"
SHM_BUFFER_PREFIX = "deepspeed_allreduce_buffer"


def finish_distributed(environ: Mapping[str, str] | None = None) -> None:
    """End a DeepSpeed run cleanly, on every rank, at the end of a script (a no-op where there is
    nothing to end): destroy the process group ``deepspeed.init_inference`` started, so each
    rank's communication threads are joined before the interpreter exits instead of being torn
    down with it (which can kill a rank that has finished its work: "terminate called without an
    active exception"), and remove this rank's shared-memory all-reduce buffer of DeepSpeed's CPU
    backend, which DeepSpeed (0.19) never unlinks: 66 MiB of RAM a rank and run, held in /dev/shm
    until the machine restarts (the other ranks keep their mappings; the name is no longer needed
    once the group is up). ``environ``: the launcher's variables (default ``os.environ``).

    Example:
        >>> finish_distributed()  # (no process group and no launcher here: nothing to do)
    """
    if tdist.is_available() and tdist.is_initialized():
        tdist.destroy_process_group()
    env = os.environ if environ is None else environ
    addr, port, rank = env.get("MASTER_ADDR"), env.get("MASTER_PORT"), env.get("RANK")
    if addr and port and rank is not None and hasattr(os, "getuid") and os.path.isdir(SHM_DIR):
        buffer = os.path.join(SHM_DIR, f"{SHM_BUFFER_PREFIX}_{os.getuid()}_{addr}_{port}_{rank}")
        try:
            os.unlink(buffer)
        except FileNotFoundError:
            pass  # (another backend, a world of one, or removed already)


def check_launcher_env(environ: Mapping[str, str] | None = None, *, accelerator: str | None = None) -> None:
    """Refuse a multi-process launch DeepSpeed's CPU backend would crash on.

    DeepSpeed's CPU accelerator and its shared-memory all-reduce read ``LOCAL_SIZE`` (processes
    on this node), which only the ``deepspeed`` launcher sets; under ``torchrun`` both ranks
    segfault in the first all-reduce. ``accelerator`` defaults to DeepSpeed's.

    Example:
        >>> check_launcher_env({"WORLD_SIZE": "2"}, accelerator="cpu")
        Traceback (most recent call last):
        ...
        ValueError: WORLD_SIZE=2 but LOCAL_SIZE is not set: ...
    """
    env = os.environ if environ is None else environ
    world = int(env.get("WORLD_SIZE", "1"))
    if world <= 1 or "LOCAL_SIZE" in env:
        return
    if accelerator is None:
        from deepspeed.accelerator import get_accelerator  # optional: the deepspeed extra

        accelerator = get_accelerator().device_name()
    if accelerator != "cpu":
        return
    local = env.get("LOCAL_WORLD_SIZE")
    hint = f"LOCAL_SIZE={local} " if local else "LOCAL_SIZE=<processes on this node> "
    raise ValueError(
        f"WORLD_SIZE={world} but LOCAL_SIZE is not set: DeepSpeed's CPU backend needs it (its shared-memory "
        f"all-reduce crashes without it) and only the deepspeed launcher sets it. Launch with "
        f"`deepspeed --num_gpus {world} script.py`, or with torchrun set it: `{hint}torchrun --nproc-per-node "
        f"{local or world} script.py`"
    )


def _resolve(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def local_heads(module: torch.nn.Module, geometry: ModelGeometry | None = None) -> tuple[int, int]:
    """``(query heads, KV heads)`` this process's (possibly sharded) first attention computes."""
    geometry = geometry or ModelGeometry.from_config(module)
    spec = geometry.spec
    attn = _resolve(_resolve(module, spec.layers)[0], spec.attention)
    q = _resolve(attn, spec.q_proj).weight.shape[0]
    k = _resolve(attn, spec.k_proj).weight.shape[0]
    return q // geometry.head_dim, k // geometry.head_dim


# ------------------------------------------------------------------------------------------------
# The cache
# ------------------------------------------------------------------------------------------------


class TensorParallelHeads:
    """The :class:`~kvpolicy.policies.HeadExchange` of one tensor-parallel rank: its KV heads
    among the layer's (``layout[rank]``) and an all-gather over ``group``, for head-wise budgets
    (:class:`~kvpolicy.policies.ShardedAdaKV`) under AutoTP.

    :meth:`gather` is two collectives over ``group`` (every rank calls it, in the same order): an
    all-reduce (MAX) of the width, then an all-gather of the rows padded to the widest rank's
    width and the most heads a rank holds (AutoTP's split may be uneven: 2 + 1 heads).

    Example (one rank: no process group needed):
        >>> from kvpolicy.models import tiny_llama
        >>> ex = TensorParallelHeads(shard_layout(tiny_llama(heads=9, kv_heads=3), 1), 0)
        >>> ex.heads, ex.start, ex.gather(torch.tensor([[[4, 5]]]), -1).tolist()
        (3, 0, [[[4, 5]]])
    """

    def __init__(self, layout: ShardLayout, rank: int, group: Any = None) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < layout.tp_size:
            raise ValueError(f"rank must be an integer in [0, {layout.tp_size}), got {rank!r}")
        self.layout, self.rank, self.group = layout, rank, group
        self.heads = layout.geometry.kv_heads
        self.start = layout[rank].kv_start

    def gather(self, x: torch.Tensor, fill: Any) -> torch.Tensor:
        """Every rank's ``x`` ``[batch, its KV heads, n]``, in head order, each left-padded with ``fill``
        to the widest rank's ``n``: ``[batch, kv_heads, widest]``."""
        if self.layout.tp_size == 1:
            return x
        width = torch.tensor([x.shape[-1]], dtype=torch.int64, device=x.device)
        tdist.all_reduce(width, op=tdist.ReduceOp.MAX, group=self.group)
        m, most = int(width.item()), max(s.n_kv_heads for s in self.layout.shards)
        padded = x.new_full((x.shape[0], most, m), fill)
        padded[:, : x.shape[1], m - x.shape[-1] :] = x
        parts = [torch.empty_like(padded) for _ in range(self.layout.tp_size)]
        tdist.all_gather(parts, padded, group=self.group)
        return torch.cat([p[:, : s.n_kv_heads] for p, s in zip(parts, self.layout.shards)], dim=1)

    def __repr__(self) -> str:
        return f"TensorParallelHeads(rank={self.rank} of {self.layout.tp_size}, KV heads {self.start}..{self.layout[self.rank].kv_stop - 1} of {self.heads})"


def tp_all_reduce(group: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """A ``reduce_scores`` hook: all-reduce (SUM) of the head-summed scores over ``group``."""
    import deepspeed.comm as dist  # optional: the deepspeed extra

    def reduce_scores(summed: torch.Tensor) -> torch.Tensor:
        summed = summed.contiguous()
        dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=group)
        return summed

    return reduce_scores


class ShardedEvictingCache(EvictingCache):
    """An :class:`EvictingCache` for one tensor-parallel rank.

    Its layers hold the rank's KV heads (``shard.kv_heads``, global ids); ``layer.store.positions``
    is ``[batch, shard.n_kv_heads, cached]``. Build it with :func:`make_cache`.
    """

    def __init__(
        self,
        policy: EvictionPolicy,
        model: Any,
        *,
        layout: ShardLayout,
        rank: int,
        group: Any = None,
        positions: PositionsMode | None = None,
    ) -> None:
        #: the policy asked for (``policy``, the one the layers run, is its share of a sharded layer
        #: for head-wise budgets)
        self.requested_policy = policy
        self.headwise_split = policy.ragged_heads and layout.tp_size > 1
        if self.headwise_split:
            # AdaKV's one top-k over a layer's heads: each rank gathers the others' scores when it evicts
            if not isinstance(policy, AdaKV):
                raise ValueError(
                    f"{policy!r} shares a layer's budget over all of its KV heads (head-wise budgets), which are split over "
                    f"{layout.tp_size} tensor-parallel ranks here: kvpolicy exchanges the ranks' scores for AdaKV itself "
                    "only, not inside another policy (a composition, a per-layer schedule). Run it with tp_size=1, or "
                    "AdaKV(scorer) alone"
                )
            policy = ShardedAdaKV(policy, TensorParallelHeads(layout, rank, group))
        reduce = tp_all_reduce(group) if policy.selection == "shared" and layout.tp_size > 1 else None
        super().__init__(policy, model, positions=positions, reduce_scores=reduce)
        self.layout = layout
        self.rank = rank
        self.group = group

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' ``Cache.update`` (each call to the layer of that index), refusing a batch of
        several sequences under head-wise budgets split over ranks (every rank refuses alike, before
        any exchange: no rank waits)."""
        if self.headwise_split and key_states.shape[0] > 1:
            raise ValueError(
                f"{self.requested_policy!r} over {self.tp_size} tensor-parallel ranks serves one sequence at a time "
                f"(batch 1), got a batch of {key_states.shape[0]}: the cache groups a batch's rows by their widest KV head, "
                "which differs between ranks, so the ranks' exchanges would not pair up. Generate one sequence per call"
            )
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    @property
    def shard(self) -> HeadShard:
        return self.layout[self.rank]

    @property
    def tp_size(self) -> int:
        return self.layout.tp_size

    def gather_positions(self) -> list[torch.Tensor]:
        """Every layer's kept positions for *all* KV heads, ``[batch, kv_heads, cached]`` on CPU,
        gathered from the ranks (a collective: call it on every rank). Under head-wise budgets a
        rank's rows are as wide as its widest head: the others are left-padded with holes (``-1``),
        as a single process lays them out."""
        local = [layer.store.positions.detach().cpu() for layer in self.layers]
        if self.tp_size == 1:
            return local

        parts: list[Any] = [None] * self.tp_size
        tdist.all_gather_object(parts, local, group=self.group)
        out = []
        for i in range(len(local)):
            # head-wise budgets: a rank's rows are as wide as its widest head; holes (-1) lead a row
            widest = max(p[i].shape[-1] for p in parts)
            out.append(torch.cat([torch.nn.functional.pad(p[i], (widest - p[i].shape[-1], 0), value=-1) for p in parts], dim=1))
        return out


def _unwrap(engine_or_model: Any) -> tuple[torch.nn.Module, Any]:
    """``(module, tensor-parallel group)`` of a DeepSpeed engine, our wrapper, or a plain model."""
    if isinstance(engine_or_model, EvictingInferenceEngine):
        engine_or_model = engine_or_model.engine
    module = getattr(engine_or_model, "module", None)
    if isinstance(module, torch.nn.Module) and hasattr(engine_or_model, "mp_group"):  # a deepspeed InferenceEngine
        return module, engine_or_model.mp_group
    if isinstance(engine_or_model, torch.nn.Module):
        return engine_or_model, None
    raise ValueError(f"expected a DeepSpeed InferenceEngine or a transformers model, got {type(engine_or_model).__name__}")


def make_cache(
    engine_or_model: Any,
    policy: EvictionPolicy,
    *,
    positions: PositionsMode | None = None,
    tp_group: Any = None,
) -> ShardedEvictingCache:
    """The evicting cache for this rank of a (possibly AutoTP-sharded) model.

    Args:
        engine_or_model: a ``deepspeed.InferenceEngine`` (its ``module`` and ``mp_group`` are
            used), an :class:`EvictingInferenceEngine`, or a transformers model.
        policy: the eviction policy. With ``selection="shared"`` and more than one rank the
            head-summed scores are all-reduced over the tensor-parallel group; AdaKV (head-wise
            budgets) gathers the ranks' per-head scores when it evicts (batch 1).
        positions: ``"original"`` / ``"cache"`` (default: the policy's).
        tp_group: the tensor-parallel group when ``engine_or_model`` is a bare, already sharded
            model (an engine brings its own).

    Raises:
        ValueError: the model type is unsupported, the module's sharded projections do not have
            the heads AutoTP's rule gives this rank (a sharding this cache does not understand), or
            a head-wise policy other than AdaKV itself (e.g. a composition around it) is split over ranks.

    Example (on each rank, after ``engine = deepspeed.init_inference(model, tensor_parallel={"tp_size": 2},
    replace_with_kernel_inject=False)``)::

        cache = make_cache(engine, BUZZ.from_size(512))
        engine.module.generate(ids, max_new_tokens=64, do_sample=False, **cache_kwargs(engine.module, cache))
    """
    if not isinstance(policy, EvictionPolicy):
        raise ValueError(f"policy must be an EvictionPolicy, got {policy!r}")
    module, group = _unwrap(engine_or_model)
    group = group if group is not None else tp_group
    if group is not None:
        tp_size, rank = tdist.get_world_size(group), tdist.get_rank(group)
        if rank < 0:
            raise ValueError("this process is not a member of the tensor-parallel group")
    else:
        tp_size, rank = 1, 0
    geometry = ModelGeometry.from_config(module)
    layout = shard_layout(geometry, tp_size)
    expected = (layout[rank].n_q_heads, layout[rank].n_kv_heads)
    found = local_heads(module, geometry)
    if found != expected:
        raise ValueError(
            f"rank {rank} of {tp_size}: the attention projections hold {found[0]} query / {found[1]} KV heads, but "
            f"DeepSpeed AutoTP's head split gives this rank {expected[0]} / {expected[1]} of {geometry.heads} / "
            f"{geometry.kv_heads}. Was the model sharded by something other than AutoTP, or is tp_group wrong?"
        )
    return ShardedEvictingCache(policy, module, layout=layout, rank=rank, group=group, positions=positions)


# ------------------------------------------------------------------------------------------------
# The engine
# ------------------------------------------------------------------------------------------------

# Options refused with a reason: (field of DeepSpeedInferenceConfig, refused value, message).
_REFUSED_OPTIONS: tuple[tuple[str, Any, str], ...] = (
    ("replace_with_kernel_inject", True, KERNEL_INJECTION_ERROR),
    ("enable_cuda_graph", True, CUDA_GRAPH_ERROR),
)

_DTYPES: Mapping[str, torch.dtype] = {
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
}  # fmt: skip
_ENGINE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what InferenceEngine._convert_to_dtype handles


def _as_dtype(value: Any) -> torch.dtype:
    if isinstance(value, torch.dtype):
        dtype = value
    elif isinstance(value, str) and value.lower().removeprefix("torch.") in _DTYPES:
        dtype = _DTYPES[value.lower().removeprefix("torch.")]
    else:
        raise ValueError(f"dtype must be one of float16, bfloat16, float32 (or fp16/bf16/fp32), got {value!r}")
    if dtype not in _ENGINE_DTYPES:
        raise ValueError(f"dtype must be one of float16, bfloat16, float32, got {dtype}")
    return dtype


def _merged_config(config: str | os.PathLike[str] | Mapping[str, Any] | None, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` (dict or JSON path) updated with ``kwargs``, refusing conflicting values (as DeepSpeed does)."""
    if config is None:
        merged: dict[str, Any] = {}
    elif isinstance(config, Mapping):
        merged = dict(config)
    elif isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            merged = json.load(f)
    else:
        raise ValueError(f"config must be a dict or a path to a JSON file, got {type(config).__name__}")
    for key in set(merged) & set(kwargs):
        if merged[key] != kwargs[key]:
            raise ValueError(f"conflicting {key!r}: {merged[key]!r} in config and {kwargs[key]!r} as a keyword")
    merged.update(kwargs)
    return merged


def _parse_ds_config(merged: Mapping[str, Any]) -> Any:
    """Parse with DeepSpeed's own pydantic schema (aliases, types, unknown keys), then apply the refusals."""
    from deepspeed.inference.config import DeepSpeedInferenceConfig  # optional: the deepspeed extra

    parsed = DeepSpeedInferenceConfig(**merged)
    for field_name, refused, message in _REFUSED_OPTIONS:
        if getattr(parsed, field_name) == refused:
            raise ValueError(message)
    return parsed


def _explicit(merged: Mapping[str, Any], parsed: Any, field_name: str) -> bool:
    """Whether the user set ``field_name`` (under its name or its DeepSpeed alias)."""
    info = type(parsed).model_fields[field_name]
    return field_name in merged or (info.alias is not None and info.alias in merged)


class EvictingInferenceEngine:
    """A DeepSpeed ``InferenceEngine`` whose :meth:`generate` decodes with an evicting cache.

    Everything else (``module``, ``mp_group``, ``forward``, ``__call__``, ...) is the wrapped
    engine's (``self.engine``). Use :meth:`make_cache` to drive ``self.module`` directly.

    Attributes:
        engine: the ``deepspeed.InferenceEngine``.
        policy: an :class:`EvictionPolicy`, or a registered name planned per call for ``budget``.
        layout: the :class:`ShardLayout`; ``shard`` is this rank's :class:`HeadShard`.
        context_length: the longest prompt the engine accepts (DeepSpeed's ``max_out_tokens``).
        last_cache: the cache of the latest :meth:`generate` (its per-head state, for inspection).
    """

    def __init__(
        self,
        engine: Any,
        policy: EvictionPolicy | str,
        *,
        budget: float | None = None,
        positions: PositionsMode | None = None,
        context_length: int,
    ) -> None:
        self.engine = engine
        self.policy = policy
        self.budget = budget
        self.positions = positions
        self.context_length = context_length
        self.last_cache: ShardedEvictingCache | None = None
        probe = make_cache(engine, policy if isinstance(policy, EvictionPolicy) else _placeholder_policy())
        self.layout, self.rank = probe.layout, probe.rank

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    @property
    def shard(self) -> HeadShard:
        return self.layout[self.rank]

    def __getattr__(self, name: str) -> Any:
        if name == "engine":  # not set yet (during __init__ failures)
            raise AttributeError(name)
        return getattr(self.engine, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine(*args, **kwargs)

    def resolve_policy(self, prompt_length: int, max_new_tokens: int | None, policy: EvictionPolicy | str | None = None) -> EvictionPolicy:
        """The policy for one run (a name is planned for ``budget`` on ``prompt_length + max_new_tokens``)."""
        policy = self.policy if policy is None else policy
        if isinstance(policy, EvictionPolicy):
            return policy

        if max_new_tokens is None:
            raise ValueError(f"policy {policy!r} is planned per run: pass max_new_tokens to generate()")
        return make_policy(
            policy, self.budget if self.budget is not None else 0.4,
            context_length=prompt_length + max_new_tokens, prompt_length=prompt_length,
            layers=model_layers(self.module),  # (per-layer budgets realised over every layer)
        )  # fmt: skip

    def make_cache(self, policy: EvictionPolicy | None = None) -> ShardedEvictingCache:
        """A fresh cache for this rank (``policy`` default: the engine's, which must be a policy object)."""
        chosen = policy if policy is not None else self.policy
        if not isinstance(chosen, EvictionPolicy):
            raise ValueError(f"the engine's policy is the name {chosen!r}: pass a policy object to make_cache()")
        return make_cache(self.engine, chosen, positions=self.positions)

    def generate(self, input_ids: torch.Tensor | None = None, *, policy: EvictionPolicy | str | None = None, **kwargs: Any) -> Any:
        """``engine.generate`` with a fresh evicting cache (unless one is given, as ``cache`` or
        ``past_key_values``: the name transformers 5.24 deprecates).

        Run it on every rank with the same inputs. ``policy`` overrides the engine's for this call.
        """
        if input_ids is None:
            input_ids = kwargs.pop("inputs", None)
        if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2:
            raise ValueError("generate() needs input_ids as a [batch, tokens] tensor")
        prompt_length = int(input_ids.shape[1])
        if prompt_length > self.context_length:
            raise ValueError(
                f"prompt of {prompt_length} tokens is longer than context_length={self.context_length} (DeepSpeed's "
                f"max_out_tokens): pass a larger context_length to kvpolicy.deepspeed.init_inference"
            )
        given = kwargs.pop("cache", None)
        if given is None:
            given = kwargs.pop("past_key_values", None)
        if given is None:
            chosen = self.resolve_policy(prompt_length, kwargs.get("max_new_tokens"), policy)
            given = make_cache(self.engine, chosen, positions=self.positions)
        if isinstance(given, ShardedEvictingCache):
            self.last_cache = given
        kwargs.update(cache_kwargs(self.engine.module, given))  # under the name the installed transformers takes
        kwargs.setdefault("attention_mask", torch.ones_like(input_ids))
        with torch.no_grad():
            return self.engine.generate(input_ids=input_ids, **kwargs)


def _placeholder_policy() -> EvictionPolicy:
    return FullCache()


def init_inference(
    model: torch.nn.Module,
    policy: EvictionPolicy | str,
    *,
    tp_size: int | None = None,
    dtype: torch.dtype | str | None = None,
    budget: float | None = None,
    context_length: int | None = None,
    positions: PositionsMode | None = None,
    config: str | os.PathLike[str] | Mapping[str, Any] | None = None,
    **ds_kwargs: Any,
) -> EvictingInferenceEngine:
    """``deepspeed.init_inference`` with AutoTP, returning an engine whose ``generate`` evicts.

    Run under the DeepSpeed launcher, one process per GPU, e.g.
    ``deepspeed --num_gpus 2 my_script.py``; every rank calls this with the same arguments.

    Args:
        model: a transformers decoder that EvictingCache serves, laid out as Llama (separate q/k/v/o projections), unsharded, on CPU or
            the meta device as DeepSpeed accepts.
        policy: an :class:`EvictionPolicy`, or a registered name (``"buzz"``, ``"h2o"``, ...)
            planned for ``budget`` on each call's prompt length plus ``max_new_tokens``.
        tp_size: tensor-parallel ranks (default: ``tensor_parallel.tp_size`` of ``config`` /
            ``ds_kwargs``, else 1). Must be at most the model's KV heads and the launched world size.
        dtype: float16, bfloat16 or float32 (default: the model's current dtype, *not* DeepSpeed's
            float16 default).
        budget: the budget for a policy given by name (default 0.4).
        context_length: the longest prompt (in tokens) you will pass; sets DeepSpeed's
            ``max_out_tokens`` (its ``max_tokens``), which otherwise refuses prompts over 1024 tokens.
            Default: ``max(max_position_embeddings, 1024)``.
        positions: the cache's positions mode (default: the policy's).
        config, ds_kwargs: any other ``deepspeed.init_inference`` options, as a dict / JSON path
            and keywords (merged, conflicting values refused). ``replace_with_kernel_inject=True``
            and ``enable_cuda_graph=True`` are refused with the reason.

    Raises:
        ValueError: before any DeepSpeed work, for refused options, an unsupported model, a
            ``tp_size`` that disagrees with the config, exceeds the KV heads or the launched world
            size, an unsupported dtype, or a ``max_tokens`` below ``context_length``.

    Example::

        engine = init_inference(model, "buzz", budget=0.25, tp_size=2, dtype=torch.float16, context_length=8192)
        out = engine.generate(input_ids, max_new_tokens=128, do_sample=False)
    """
    if not isinstance(policy, (EvictionPolicy, str)):
        raise ValueError(f"policy must be an EvictionPolicy or a registered policy name, got {policy!r}")
    merged = _merged_config(config, ds_kwargs)
    parsed = _parse_ds_config(merged)  # refusals first: they hold whatever else is wrong
    if isinstance(policy, str):
        get_policy(policy)  # unknown names fail now, not at the first generate()
    geometry = ModelGeometry.from_config(model)

    configured_tp = parsed.tensor_parallel.tp_size
    if parsed.mp_size != 1:  # deprecated alias of tensor_parallel.tp_size
        configured_tp = parsed.mp_size if configured_tp == 1 else configured_tp
    if tp_size is None:
        tp_size = configured_tp
    elif configured_tp not in (1, tp_size):
        raise ValueError(f"tp_size={tp_size} disagrees with tensor_parallel.tp_size={configured_tp} in the DeepSpeed config")
    shard_layout(geometry, tp_size)  # tp_size against the KV heads
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if tp_size > world:
        raise ValueError(
            f"tp_size={tp_size} needs {tp_size} processes, but this one was started with WORLD_SIZE={world}: launch "
            f"with `deepspeed --num_gpus {tp_size} your_script.py` (every rank runs the script)"
        )
    own_group = parsed.tensor_parallel.tp_group is not None or parsed.tensor_parallel.mpu is not None
    if 1 < tp_size < world and not own_group:
        raise ValueError(
            f"tp_size={tp_size} with WORLD_SIZE={world}: DeepSpeed's inference engine builds one tensor-parallel group "
            f"from ranks 0..{tp_size - 1}, leaving the other ranks outside it; launch exactly {tp_size} processes"
        )

    if dtype is None:
        dtype = parsed.dtype if _explicit(merged, parsed, "dtype") else _model_dtype(model)
    dtype = _as_dtype(dtype)

    limit = max(geometry.max_positions or 0, parsed.max_out_tokens)
    if context_length is not None:
        limit = _positive("context_length", context_length, where="")
    if _explicit(merged, parsed, "max_out_tokens"):
        if context_length is not None and parsed.max_out_tokens < context_length:
            raise ValueError(
                f"max_tokens={parsed.max_out_tokens} is below context_length={context_length}: DeepSpeed would refuse "
                f"longer prompts. Drop max_tokens (it is set from context_length) or raise it"
            )
        limit = parsed.max_out_tokens

    raw_tp = merged.pop("tensor_parallel", None) or merged.pop("tp", None) or {}
    if not isinstance(raw_tp, Mapping):  # a DeepSpeedTPConfig object
        raw_tp = {k: getattr(raw_tp, k) for k in raw_tp.model_fields_set}
    tp_config = {**raw_tp, "tp_size": tp_size}  # the user's tp_group / mpu / grain size are kept
    for key in ("tensor_parallel", "tp", "mp_size", "dtype", "max_out_tokens", "max_tokens", "replace_with_kernel_inject", "kernel_inject"):
        merged.pop(key, None)
    check_launcher_env()  # last: the configuration errors above say more
    import deepspeed  # optional: the deepspeed extra

    engine = deepspeed.init_inference(
        model,
        config=merged,
        tensor_parallel=tp_config,
        dtype=dtype,
        max_out_tokens=limit,
        replace_with_kernel_inject=False,
    )
    # EvictingInferenceEngine builds a probe cache through make_cache, which checks the sharded module
    # against `layout`'s rule.
    return EvictingInferenceEngine(engine, policy, budget=budget, positions=positions, context_length=limit)


def _model_dtype(model: torch.nn.Module) -> torch.dtype:
    first = next(iter(model.parameters()), None)
    return first.dtype if first is not None else torch.float32
