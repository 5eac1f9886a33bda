"""Hypothesis strategies for eviction policies and their inputs.

Everything here draws *small* cases on purpose (a few dozen tokens, a few heads, capacities of a
few tokens), so that evictions happen often and shrunk failures are short enough to read.

Policies
    * one strategy per built-in policy, every parameter within its valid range:
      :func:`buzz_policies`, :func:`h2o_policies`, :func:`streaming_policies`,
      :func:`local_policies`, :func:`full_policies`, :func:`tova_policies`,
      :func:`snapkv_policies`, and :func:`any_policy` (all of them but SnapKV, whose capacity is
      unbounded although it evicts after a prompt);
    * any other policy: :func:`params_strategy` draws constructor arguments (each one from a
      strategy you pass, or derived from the signature: small ints, booleans, ``Literal`` choices,
      ``selection``) and :func:`policies` turns a class, registry preset or factory into a
      strategy of instances. Arguments the constructor rejects with ``ValueError`` are discarded.

Inputs
    * :func:`logits_arrays`: ``[steps, heads, steps]`` attention logits with controllable ties
      (``levels``, ``constant``) and extremes (``extremes``: probabilities exactly 0 or 1), or
      realistic-ish ones (``normal``, ``heavy``); every array comes from :func:`make_logits`, a
      pure function of its arguments, so a failing example can be rebuilt from one call;
    * :func:`prompt_lengths`, :func:`replay_cases` (``(policy, logits, prompt_len)``);
    * :func:`gqa_shapes` (``(kv_heads, group)``), :func:`padded_batches` (left-padded rows of
      different lengths in one batch).

Example:
    >>> from hypothesis import given, strategies as st
    >>> from kvpolicy.testing.strategies import params_strategy, policies
    >>> from kvpolicy import StreamingLLM
    >>> strategy = policies(StreamingLLM, sink=st.integers(1, 2))
    >>> @given(strategy)
    ... def test(policy):
    ...     assert policy.sink in (1, 2)
    >>> test()
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import math
import re
import typing
from dataclasses import dataclass
from typing import Any, Callable, Literal, Sequence

import numpy as np
from hypothesis import reject, strategies as st

from kvpolicy import BUZZ, H2O, TOVA, AdaKV, EvictionPolicy, ExpectedAttention, FullCache, KeyDiff, Knorm, LocalWindow, Preset, Scissorhands, SnapKV, StreamingLLM

__all__ = [
    "LOGIT_EXTREMES",
    "LOGIT_KINDS",
    "LOGIT_LEVELS",
    "MIN_THRESHOLD",
    "TIE_KINDS",
    "PaddedBatch",
    "adakv_policies",
    "any_policy",
    "builtin_strategy",
    "buzz_policies",
    "expected_attention_policies",
    "full_policies",
    "gqa_shapes",
    "h2o_policies",
    "last_refusal",
    "local_policies",
    "logits_arrays",
    "make_logits",
    "padded_batches",
    "params_strategy",
    "policies",
    "prompt_lengths",
    "replay_cases",
    "selections",
    "scissorhands_policies",
    "snapkv_policies",
    "streaming_policies",
    "tova_policies",
    "key_policies",
]

#: Kinds weighted towards exact ties in the accumulated scores (three in four draws), for
#: checks whose bugs live in tie-breaking (the NumPy/torch agreement of check_policy).
TIE_KINDS = ("onehot", "extremes", "levels", "onehot", "extremes", "levels", "normal", "heavy", "constant")
#: Few distinct logit values: many exact ties in the accumulated scores.
LOGIT_LEVELS = (-2.0, 0.0, 0.5, 1.0, 3.0)
#: Extremes: probabilities that are exactly 0 or 1 after the softmax (ties at 0).
LOGIT_EXTREMES = (-1.0e4, -30.0, 0.0, 30.0, 1.0e4)
#: The kinds :func:`make_logits` knows, in the order hypothesis shrinks towards (first = simplest).
LOGIT_KINDS = ("levels", "extremes", "onehot", "constant", "normal", "heavy")

#: ``"per_head"`` or ``"shared"``.
selections = st.sampled_from(["per_head", "shared"])
#: Smallest BUZZ threshold that shrinks the middle, for every stride >= 3 (tested).
MIN_THRESHOLD = 3


# ============================================================================ built-in policies
def _build(cls: Callable[..., EvictionPolicy], drawn: dict[str, Any], fixed: dict[str, Any]) -> EvictionPolicy:
    return cls(**{**drawn, **fixed})


@st.composite
def buzz_policies(draw: st.DrawFn, *, max_window: int = 6, max_threshold: int = 24, **fixed: Any) -> BUZZ:
    """:class:`~kvpolicy.BUZZ` with sink 1-4, window 1-``max_window``, stride 3-8, threshold
    ``MIN_THRESHOLD``-``max_threshold``, both ``interval_keep`` and ``selection`` values, and log n
    half the time (small bases, so the scale moves within a short replay). ``fixed`` parameters
    are used as given (e.g. ``log_n=True``)."""
    kw: dict[str, Any] = {
        "sink": draw(st.integers(1, 4)),
        "window": draw(st.integers(1, max_window)),
        "stride": draw(st.integers(3, 8)),
        "threshold": draw(st.integers(MIN_THRESHOLD, max_threshold)),
        "interval_keep": draw(st.sampled_from(["first", "last"])),
        "selection": draw(selections),
    }
    if fixed.get("log_n", draw(st.booleans())):
        kw.update(
            log_n=True,
            log_base=draw(st.sampled_from([2.0, 3.0, 8.0, 512.0])),
            log_floor=draw(st.sampled_from([0.0, 0.5, 1.0])),
        )
    return _build(BUZZ, kw, fixed)  # type: ignore[return-value]


@st.composite
def h2o_policies(draw: st.DrawFn, **fixed: Any) -> H2O:
    """:class:`~kvpolicy.H2O` with heavy 1-10, recent 1-8, both selections."""
    kw = {"heavy": draw(st.integers(1, 10)), "recent": draw(st.integers(1, 8)), "selection": draw(selections)}
    return _build(H2O, kw, fixed)  # type: ignore[return-value]


@st.composite
def streaming_policies(draw: st.DrawFn, **fixed: Any) -> StreamingLLM:
    """:class:`~kvpolicy.StreamingLLM` with sink 1-5, window 1-10."""
    return _build(StreamingLLM, {"sink": draw(st.integers(1, 5)), "window": draw(st.integers(1, 10))}, fixed)  # type: ignore[return-value]


@st.composite
def local_policies(draw: st.DrawFn, **fixed: Any) -> LocalWindow:
    """:class:`~kvpolicy.LocalWindow` with window 1-12."""
    return _build(LocalWindow, {"window": draw(st.integers(1, 12))}, fixed)  # type: ignore[return-value]


@st.composite
def tova_policies(draw: st.DrawFn, **fixed: Any) -> TOVA:
    """:class:`~kvpolicy.TOVA` with size 1-12, recent 0 half the time (else 1 to size - 1), both selections."""
    size = fixed.get("size", draw(st.integers(1, 12)))
    recent = draw(st.one_of(st.just(0), st.integers(0, size - 1)))
    return _build(TOVA, {"size": size, "recent": recent, "selection": draw(selections)}, fixed)  # type: ignore[return-value]


@st.composite
def key_policies(draw: st.DrawFn, kind: type = Knorm, **fixed: Any) -> EvictionPolicy:
    """:class:`~kvpolicy.Knorm` or :class:`~kvpolicy.KeyDiff` (``kind``), scores from keys, with
    size 1-12, recent 0 half the time (else 0 to size - 1), both selections; KeyDiff scored at
    every step (``refresh=1``, the paper's rule) unless ``refresh`` is fixed."""
    size = fixed.get("size", draw(st.integers(1, 12)))
    recent = draw(st.one_of(st.just(0), st.integers(0, size - 1)))
    params = {"size": size, "recent": recent, "selection": draw(selections)}
    if kind is KeyDiff:
        params["refresh"] = 1
    return _build(kind, params, fixed)  # type: ignore[arg-type]


@st.composite
def expected_attention_policies(draw: st.DrawFn, **fixed: Any) -> ExpectedAttention:
    """:class:`~kvpolicy.ExpectedAttention` with size 1-12, recent 0 half the time (else 0 to
    size - 1), sink 0 to what fits (0 or 1 half the time), future 1-16, epsilon 0 or 0.5,
    covariance and value norm on or off, both selections, refresh 1 half the time (else 2 to 4)."""
    size = fixed.get("size", draw(st.integers(1, 12)))
    recent = fixed.get("recent", draw(st.one_of(st.just(0), st.integers(0, size - 1))))
    kw = {
        "size": size,
        "recent": recent,
        "sink": draw(st.one_of(st.integers(0, min(1, size - recent)), st.integers(0, size - recent))),
        "future": draw(st.integers(1, 16)),
        "epsilon": draw(st.sampled_from([0.0, 0.5])),
        "covariance": draw(st.booleans()),
        "value_norm": draw(st.booleans()),
        "selection": draw(selections),
        "refresh": draw(st.one_of(st.just(1), st.integers(2, 4))),
    }
    return _build(ExpectedAttention, kw, fixed)  # type: ignore[return-value]


@st.composite
def snapkv_policies(draw: st.DrawFn, **fixed: Any) -> SnapKV:
    """:class:`~kvpolicy.SnapKV` with window 1-6, size window + 1 to window + 8, kernel 1-7 (odd),
    both poolings, both selections."""
    window = fixed.get("window", draw(st.integers(1, 6)))
    kw = {
        "size": draw(st.integers(window + 1, window + 8)),
        "window": window,
        "kernel": draw(st.sampled_from([1, 3, 5, 7])),
        "pooling": draw(st.sampled_from(["avg", "max"])),
        "selection": draw(selections),
    }
    return _build(SnapKV, kw, fixed)  # type: ignore[return-value]


@st.composite
def scissorhands_policies(draw: st.DrawFn, **fixed: Any) -> Scissorhands:
    """:class:`~kvpolicy.Scissorhands` with size 2-12, history 1-8, drop 0.05-0.75 and a recent
    window 0 to what fits (per-head selection only: records do not add up across heads)."""
    size = fixed.get("size", draw(st.integers(2, 12)))
    drop = fixed.get("drop", draw(st.floats(0.05, 0.75)))
    room = size - max(1, min(size - 1, math.floor(drop * size)))
    params = {"size": size, "history": draw(st.integers(1, 8)), "drop": drop, "recent": draw(st.integers(0, room))}
    return _build(Scissorhands, params, fixed)  # type: ignore[return-value]


@st.composite
def adakv_policies(draw: st.DrawFn, **fixed: Any) -> AdaKV:
    """:class:`~kvpolicy.AdaKV` over a per-head H2O, TOVA, Knorm, KeyDiff or SnapKV (drawn as
    their own strategies draw them), ``alpha_safeguard`` 0, 1 or between."""
    scorer = fixed.get("scorer", draw(st.one_of(
        h2o_policies(selection="per_head"),
        tova_policies(selection="per_head"),
        key_policies(Knorm, selection="per_head"),
        key_policies(KeyDiff, selection="per_head"),
        snapkv_policies(selection="per_head"),
    )))
    alpha = fixed.get("alpha_safeguard", draw(st.one_of(st.sampled_from([0.0, 1.0]), st.floats(0.05, 0.95))))
    return AdaKV(scorer, alpha)


def full_policies(**fixed: Any) -> st.SearchStrategy[FullCache]:
    """:class:`~kvpolicy.FullCache` (it has no parameters)."""
    return st.builds(FullCache)


def any_policy() -> st.SearchStrategy[EvictionPolicy]:
    """Any built-in policy (log-n BUZZ included)."""
    return st.one_of(
        buzz_policies(),
        h2o_policies(),
        streaming_policies(),
        local_policies(),
        st.just(FullCache()),
        tova_policies(),
        key_policies(Knorm),
        key_policies(KeyDiff),
        expected_attention_policies(),
        scissorhands_policies(),
    )


_BUILTIN: dict[type, Callable[..., st.SearchStrategy]] = {
    BUZZ: buzz_policies,
    H2O: h2o_policies,
    StreamingLLM: streaming_policies,
    LocalWindow: local_policies,
    FullCache: full_policies,
    TOVA: tova_policies,
    Knorm: lambda **fixed: key_policies(Knorm, **fixed),
    KeyDiff: lambda **fixed: key_policies(KeyDiff, **fixed),
    ExpectedAttention: expected_attention_policies,
    SnapKV: snapkv_policies,
    Scissorhands: scissorhands_policies,
    AdaKV: adakv_policies,
}


def builtin_strategy(cls: type, **fixed: Any) -> st.SearchStrategy[EvictionPolicy] | None:
    """The strategy of a built-in policy class (exactly that class, not a subclass), or ``None``."""
    make = _BUILTIN.get(cls)
    return None if make is None else make(**fixed)


# ============================================================================ any policy
#: Integers drawn for an ``int`` parameter nobody described: small, so evictions happen.
DEFAULT_INT = st.integers(1, 8)
#: Floats drawn for a ``float`` parameter without a default.
DEFAULT_FLOAT = st.floats(0.1, 10.0, allow_nan=False)


def _literal_choices(annotation: Any) -> tuple[Any, ...] | None:
    if typing.get_origin(annotation) is Literal:
        return typing.get_args(annotation)
    if isinstance(annotation, str):  # an annotation string that could not be evaluated
        m = re.fullmatch(r"\s*(?:typing\.|t\.)?Literal\[(.*)\]\s*", annotation)
        if m:
            try:
                return tuple(ast.literal_eval(f"({m.group(1)},)"))
            except (ValueError, SyntaxError):
                return None
    return None


_SIMPLE = {"int": int, "bool": bool, "float": float, "str": str}


def _resolve(annotation: Any, target: Any) -> Any:
    """Evaluate a string annotation in the target's module when possible (else keep the string)."""
    if not isinstance(annotation, str):
        return annotation
    if annotation.strip() in _SIMPLE:
        return _SIMPLE[annotation.strip()]
    try:
        return eval(annotation, dict(getattr(target, "__globals__", {})))  # noqa: S307 - annotations are code
    except Exception:
        return annotation


def _derived(name: str, param: inspect.Parameter, hints: dict[str, Any], owner: str) -> st.SearchStrategy:
    """A strategy for one constructor parameter nobody described, from its annotation / default."""
    if name == "selection":
        return selections
    annotation = hints.get(name, param.annotation)
    choices = _literal_choices(annotation)
    if choices:
        return st.sampled_from(choices)
    default = param.default
    has_default = default is not inspect.Parameter.empty
    kind = annotation if isinstance(annotation, type) else (type(default) if has_default else None)
    if kind is bool:
        return st.booleans()
    if kind is int:
        return DEFAULT_INT
    if kind is float:
        return st.just(default) if has_default else DEFAULT_FLOAT
    if has_default:
        return st.just(default)
    raise TypeError(
        f"cannot derive a strategy for parameter {name!r} of {owner} (annotation {annotation!r}, no default): "
        f"describe it, e.g. params_strategy({owner}, {name}=st.integers(1, 8))"
    )


def _signature_target(factory: Any) -> tuple[Callable[..., Any], dict[str, Any], str]:
    """``(callable whose signature describes the parameters, fixed parameters, display name)``."""
    if isinstance(factory, Preset):
        return factory.cls.__init__, dict(factory.fixed), factory.cls.__name__
    if inspect.isclass(factory):
        return factory.__init__, {}, factory.__name__
    return factory, {}, getattr(factory, "__name__", repr(factory))


def params_strategy(factory: Any, **overrides: st.SearchStrategy | Any) -> st.SearchStrategy[dict[str, Any]]:
    """Constructor arguments of a policy class (or registry preset, or factory function).

    Each keyword names a parameter and gives its strategy (a plain value means "always this
    value"); every other parameter is derived from the signature: ``int`` -> :data:`DEFAULT_INT`
    (1-8), ``bool`` -> both, ``Literal[...]`` -> its choices, ``selection`` -> both selections,
    anything else with a default -> the default. A required parameter that cannot be derived
    raises ``TypeError`` naming it. A preset's fixed parameters are left out (the preset sets them).

    Example:
        >>> from hypothesis import strategies as st
        >>> from kvpolicy import H2O
        >>> params_strategy(H2O, heavy=st.integers(2, 4)).example()["heavy"] in (2, 3, 4)
        True
    """
    target, fixed, owner = _signature_target(factory)
    sig = inspect.signature(target)
    try:
        hints = typing.get_type_hints(target)
    except Exception:  # an unresolvable annotation: resolve them one by one, or keep the strings
        hints = {n: _resolve(p.annotation, target) for n, p in sig.parameters.items() if p.annotation is not p.empty}
    fields: dict[str, st.SearchStrategy] = {}
    known = set()
    for name, param in sig.parameters.items():
        if name == "self" or param.kind in (param.VAR_KEYWORD, param.VAR_POSITIONAL):
            continue
        known.add(name)
        if name in fixed and name not in overrides:
            continue
        if name in overrides:
            value = overrides[name]
            fields[name] = value if isinstance(value, st.SearchStrategy) else st.just(value)
        else:
            fields[name] = _derived(name, param, hints, owner)
    unknown = sorted(set(overrides) - known)
    if unknown and not any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values()):
        raise TypeError(f"{owner} has no parameter(s) {', '.join(unknown)}; its parameters: {', '.join(sorted(known))}")
    for name in unknown:
        value = overrides[name]
        fields[name] = value if isinstance(value, st.SearchStrategy) else st.just(value)
    return st.fixed_dictionaries(fields)


_REFUSALS: list[str] = []  # the newest constructor refusal (see last_refusal)


def last_refusal() -> str | None:
    """The newest refusal of a policy constructor while drawing instances (``"H2O(heavy=-3,
    recent=2): heavy must be ..."``), or ``None``: what :func:`kvpolicy.testing.check_policy`
    quotes when every drawn parameter set was refused.

    Example:
        >>> isinstance(last_refusal(), (str, type(None)))
        True
    """
    return _REFUSALS[-1] if _REFUSALS else None


@st.composite
def _instances(draw: st.DrawFn, factory: Callable[..., Any], params: st.SearchStrategy[dict[str, Any]]) -> EvictionPolicy:
    kwargs = draw(params)
    try:
        policy = factory(**kwargs)
    except ValueError as exc:  # an invalid combination (the constructor said so): draw another
        name = getattr(factory, "__name__", repr(factory))
        _REFUSALS[:] = [f"{name}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())}): {exc}"]
        reject()
    if not isinstance(policy, EvictionPolicy):
        raise TypeError(f"{factory!r}(**{kwargs!r}) returned {policy!r}, not an EvictionPolicy")
    return policy


def policies(factory: Any = None, params: Any = None, **overrides: Any) -> st.SearchStrategy[EvictionPolicy]:
    """A strategy of policy instances from almost anything that makes policies.

    ``factory`` may be a strategy (returned as is), a policy instance (always that one), a
    built-in class (its own strategy above, unless parameters are described), any other
    :class:`~kvpolicy.EvictionPolicy` subclass, a registry preset, or a factory function; ``None``
    means :func:`any_policy`. Parameters come from ``params`` (a strategy of keyword dicts, or a
    dict of strategies) and/or keyword ``overrides``, the rest from the signature (see
    :func:`params_strategy`).

    Example:
        >>> from hypothesis import strategies as st
        >>> from kvpolicy import LocalWindow
        >>> policies(LocalWindow, window=st.just(3)).example().window  # selection is drawn too
        3
        >>> policies(LocalWindow, window=st.just(3), selection=st.just("shared")).example()
        LocalWindow(window=3, selection='shared')
    """
    if factory is None:
        return any_policy()
    if isinstance(factory, st.SearchStrategy):
        return factory
    if isinstance(factory, EvictionPolicy):
        return st.just(factory)
    described = dict(params) if isinstance(params, dict) else {}
    described.update(overrides)
    if params is None or isinstance(params, dict):
        if not described and inspect.isclass(factory):
            builtin = builtin_strategy(factory)
            if builtin is not None:
                return builtin
        if not described and isinstance(factory, Preset):
            builtin = builtin_strategy(factory.cls, **factory.fixed)
            if builtin is not None:
                return builtin
        params = params_strategy(factory, **described)
    elif described:
        raise TypeError("give parameters either as a strategy of dicts (params=) or as keyword strategies, not both")
    if not callable(factory):
        raise TypeError(f"cannot make policies from {factory!r}")
    return _instances(factory, params)


# ============================================================================ logits
def make_logits(
    steps: int,
    heads: int = 1,
    *,
    kind: str = "normal",
    seed: int = 0,
    scale: float = 1.0,
    n_heavy: int = 0,
    value: float = 0.0,
    levels: Sequence[float] = LOGIT_LEVELS,
    extremes: Sequence[float] = LOGIT_EXTREMES,
    batch: int | None = None,
) -> np.ndarray:
    """Deterministic ``[steps, heads, steps]`` float64 logits (``[batch, steps, heads, steps]``
    when ``batch`` is given), a pure function of its arguments. ``kind``:

    * ``levels``: every entry from ``levels`` (exact ties in the accumulated scores);
    * ``extremes``: every entry from ``extremes`` (probabilities exactly 0 and 1);
    * ``onehot``: each query puts all its attention (1e4 against -1e4) on one random earlier key,
      so accumulated scores are whole counts: exact ties everywhere, also between heads summed
      by GQA (a query whose key was evicted spreads evenly over what is cached);
    * ``constant``: ``value`` everywhere (uniform attention at every step);
    * ``normal``: Gaussian with standard deviation ``scale``, plus ``n_heavy`` heavy-hitter columns;
    * ``heavy``: ``normal`` plus a recency bias (realistic-ish attention).

    Example:
        >>> make_logits(3, kind="constant", value=1.0)[:, 0].tolist()
        [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
    """
    if kind not in LOGIT_KINDS:
        raise ValueError(f"kind must be one of {', '.join(LOGIT_KINDS)}, got {kind!r}")
    rng = np.random.default_rng(seed)
    lead = () if batch is None else (batch,)
    shape = (*lead, steps, heads, steps)
    if kind == "levels":
        return rng.choice(np.asarray(levels, dtype=np.float64), size=shape)
    if kind == "extremes":
        return rng.choice(np.asarray(extremes, dtype=np.float64), size=shape)
    if kind == "onehot":
        out = np.full(shape, -1.0e4)
        chosen = np.floor(rng.random(shape[:-1]) * (np.arange(steps)[:, None] + 1)).astype(np.int64)  # key <= query
        np.put_along_axis(out, chosen[..., None], 1.0e4, axis=-1)
        return out
    if kind == "constant":
        return np.full(shape, float(value))
    out = rng.normal(0.0, scale, size=shape)
    n_heavy = min(steps, n_heavy)
    if n_heavy:
        cols = rng.choice(steps, size=n_heavy, replace=False)
        out[..., cols] += rng.uniform(1.0, 5.0, size=n_heavy)
    if kind == "heavy":
        q = np.arange(steps)[:, None, None]
        k = np.arange(steps)[None, None, :]
        out -= 0.1 * np.maximum(q - k, 0)
    return out


@dataclass(frozen=True)
class LogitsSpec:
    """The arguments of one :func:`make_logits` call (what :func:`logits_arrays` draws)."""

    steps: int
    heads: int
    kind: str
    seed: int
    scale: float = 1.0
    n_heavy: int = 0
    value: float = 0.0
    levels: tuple[float, ...] = LOGIT_LEVELS
    extremes: tuple[float, ...] = LOGIT_EXTREMES
    batch: int | None = None

    def build(self) -> np.ndarray:
        return make_logits(
            self.steps, self.heads, kind=self.kind, seed=self.seed, scale=self.scale, n_heavy=self.n_heavy,
            value=self.value, levels=self.levels, extremes=self.extremes, batch=self.batch,
        )

    def call(self) -> str:
        """The :func:`make_logits` call that rebuilds the array, as source text."""
        args = [repr(self.steps), repr(self.heads), f"kind={self.kind!r}", f"seed={self.seed}"]
        if self.kind in ("normal", "heavy"):
            args += [f"scale={self.scale!r}", f"n_heavy={self.n_heavy}"]
        if self.kind == "constant":
            args.append(f"value={self.value!r}")
        if self.kind == "levels" and self.levels != LOGIT_LEVELS:
            args.append(f"levels={self.levels!r}")
        if self.kind == "extremes" and self.extremes != LOGIT_EXTREMES:
            args.append(f"extremes={self.extremes!r}")
        if self.batch is not None:
            args.append(f"batch={self.batch}")
        return f"kvpolicy.testing.make_logits({', '.join(args)})"


@st.composite
def logits_specs(
    draw: st.DrawFn,
    *,
    min_steps: int = 1,
    max_steps: int = 48,
    max_heads: int = 3,
    steps: int | None = None,
    heads: int | None = None,
    kinds: Sequence[str] = LOGIT_KINDS,
    levels: Sequence[float] = LOGIT_LEVELS,
    extremes: Sequence[float] = LOGIT_EXTREMES,
    batch: int | None = None,
) -> LogitsSpec:
    """The :class:`LogitsSpec` behind :func:`logits_arrays` (same arguments)."""
    if steps is None:
        steps = draw(st.integers(min_steps, max_steps))
    if heads is None:
        heads = draw(st.integers(1, max_heads))
    seed = draw(st.integers(0, 2**32 - 1))
    kind = draw(st.sampled_from(list(kinds)))
    spec = LogitsSpec(steps, heads, kind, seed, levels=tuple(levels), extremes=tuple(extremes), batch=batch)
    if kind == "constant":
        return dataclasses.replace(spec, value=draw(st.sampled_from(list(levels))))
    if kind in ("normal", "heavy"):
        scale = draw(st.sampled_from([0.1, 1.0, 4.0]))
        return dataclasses.replace(spec, scale=scale, n_heavy=draw(st.integers(0, 4)))
    return spec


def logits_arrays(
    *,
    min_steps: int = 1,
    max_steps: int = 48,
    max_heads: int = 3,
    steps: int | None = None,
    heads: int | None = None,
    kinds: Sequence[str] = LOGIT_KINDS,
    levels: Sequence[float] = LOGIT_LEVELS,
    extremes: Sequence[float] = LOGIT_EXTREMES,
) -> st.SearchStrategy[np.ndarray]:
    """``[steps, heads, steps]`` float64 attention logits (see :func:`make_logits` for the kinds).

    Control the ties with ``kinds`` (``["levels"]`` with ``levels=(0.0, 1.0)``: ties everywhere)
    and the extremes with ``extremes``; fix ``steps`` / ``heads`` or bound them.
    """
    return logits_specs(
        min_steps=min_steps, max_steps=max_steps, max_heads=max_heads, steps=steps, heads=heads,
        kinds=kinds, levels=levels, extremes=extremes,
    ).map(LogitsSpec.build)


def prompt_lengths(steps: int) -> st.SearchStrategy[int]:
    """A prompt length for a sequence of ``steps`` tokens: 0 (no prefill) half the time, else any
    of ``0..steps`` (a prompt of every token: no decode step at all)."""
    return st.one_of(st.just(0), st.integers(0, steps))


@st.composite
def replay_cases(draw: st.DrawFn, policies: st.SearchStrategy | None = None, **logit_kw: Any):
    """``(policy, logits, prompt_len)`` with ``0 <= prompt_len <= steps``, for
    :func:`kvpolicy_numpy.replay`; ``policies`` defaults to :func:`any_policy`, ``logit_kw`` go to
    :func:`logits_arrays`."""
    policy = draw(policies if policies is not None else any_policy())
    logits = draw(logits_arrays(**logit_kw))
    prompt_len = draw(prompt_lengths(logits.shape[0]))
    return policy, logits, prompt_len


# ============================================================================ shapes and batches
def gqa_shapes(*, max_kv_heads: int = 3, max_group: int = 4) -> st.SearchStrategy[tuple[int, int]]:
    """``(kv_heads, group)``: ``kv_heads * group`` query heads share ``kv_heads`` KV heads
    (``group == 1``: multi-head attention; ``kv_heads == 1``: multi-query attention)."""
    return st.tuples(st.integers(1, max_kv_heads), st.integers(1, max_group))


@dataclass(frozen=True)
class PaddedBatch:
    """A left-padded batch: ``logits[b]`` is ``[steps, query_heads, steps]``; row ``b``'s first
    ``pads[b]`` tokens are padding, whose keys get a logit of -1e4 (no attention, score ~0) from
    every real query."""

    spec: LogitsSpec
    pads: tuple[int, ...]

    @property
    def logits(self) -> np.ndarray:
        out = self.spec.build()
        for b, pad in enumerate(self.pads):
            if pad:
                out[b, pad:, :, :pad] = -1.0e4
        return out

    def call(self) -> str:
        """Source text that rebuilds :attr:`logits`."""
        return f"kvpolicy.testing.strategies.PaddedBatch(kvpolicy.testing.strategies.{self.spec!r}, pads={self.pads!r}).logits"


@st.composite
def padded_batches(
    draw: st.DrawFn,
    *,
    max_batch: int = 3,
    min_steps: int = 1,
    max_steps: int = 40,
    query_heads: int | None = None,
    max_heads: int = 3,
    kinds: Sequence[str] = LOGIT_KINDS,
) -> PaddedBatch:
    """A batch of 1-``max_batch`` rows of different real lengths, left-padded to one length (the
    layout batched generation uses), as a :class:`PaddedBatch`."""
    batch = draw(st.integers(1, max_batch))
    steps = draw(st.integers(min_steps, max_steps))
    heads = query_heads if query_heads is not None else draw(st.integers(1, max_heads))
    spec = draw(logits_specs(steps=steps, heads=heads, kinds=kinds, batch=batch))
    pads = tuple(draw(st.integers(0, steps - 1)) for _ in range(batch))
    return PaddedBatch(spec, pads)
