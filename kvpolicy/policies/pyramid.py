"""Per-layer budgets: PyramidKV (Cai et al., 2024, "PyramidKV: Dynamic KV Cache Compression based
on Pyramidal Information Funneling")."""

from __future__ import annotations

import math
from typing import Any

from ..validation import check_int
from ..policy import Array, CacheView, DecodeEviction, EvictionPolicy, SizeRule, WrappingPolicy
from ..registry import get_policy, register_policy


def pyramid_sizes(size: int, layers: int, *, beta: float = 20.0, floor: int = 1) -> list[int]:
    """Per-layer sizes of the pyramid: their mean is ``size``, the bottom layer gets the most.

    PyramidKV's schedule (section 3.3 of the paper, and its code): above a ``floor`` every layer
    keeps (the observation window in the paper), the top layer gets ``e // beta`` of the mean
    share ``e = size - floor``, the bottom layer ``2 e - e // beta``, and the layers between are
    spaced evenly (an arithmetic sequence, so the mean is ``e``). Shares are rounded down and the
    remainder goes to the layers with the largest fractions (the lower layer first on a tie), so
    the sizes add up to exactly ``layers x size``.

    Example:
        >>> pyramid_sizes(100, 4, beta=20, floor=10)
        [186, 129, 71, 14]
        >>> sum(pyramid_sizes(37, 30, floor=9)) == 30 * 37
        True
    """
    size = check_int("size", size, minimum=1)
    layers = check_int("layers", layers, minimum=1)
    floor = check_int("floor", floor, minimum=0, maximum=size)
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not math.isfinite(beta) or beta < 1:
        raise ValueError(f"beta must be a number >= 1 (the mean share over the top layer's), got {beta!r}")
    if layers == 1:
        return [size]
    share = size - floor
    top = int(share // beta)
    bottom = 2 * share - top
    exact = [bottom - (bottom - top) * i / (layers - 1) for i in range(layers)]
    shares = [math.floor(x) for x in exact]
    order = sorted(range(layers), key=lambda i: (-(exact[i] - shares[i]), i))
    for i in order[: share * layers - sum(shares)]:
        shares[i] += 1
    return [floor + s for s in shares]


@register_policy
class PyramidKV(WrappingPolicy):
    """Per-layer budgets: layer ``l`` of ``L`` runs the ``base`` policy planned for its own size
    from :func:`pyramid_sizes` (pyramidal by depth: lower layers keep more), the sizes summing to
    ``L x size``, the same total as ``base`` at ``size`` in every layer.

    A cache asks :meth:`for_layer` for each layer's policy (``EvictingCache``, the DeepSpeed
    cache). Where one layer stands for all (the NumPy reference, the conformance kit) this policy
    *is* ``base`` at the mean ``size``. Plan it with the model's layer count,
    ``plan_policy("pyramidkv", b, ..., layers=L)``: the budget is then realised over every layer.
    The mean layer alone plans the total only while every layer's budget fits in the tokens the
    run has seen (a lower layer's larger budget is otherwise partly unused, and the run keeps less
    than planned; the planner warns). :attr:`capacity` is the mean layer's; a layer's own is
    ``for_layer(l, L).capacity`` (up to about twice the mean at the bottom: preallocate per layer,
    as ``EvictingCache`` does).

    Parameters (the paper's):
        base: the registry name of the policy every layer runs (the paper selects with SnapKV's
            observation window and pooling after the prompt, then lets the cache grow: ``"snapkv"``,
            the ``pyramidkv`` preset; ``pyramid_h2o`` keeps a pyramid of H2O budgets while decoding).
        size: the mean size per layer, as ``base``'s ``from_size`` takes it.
        beta: the mean share over the top layer's (the paper: 20).
        floor: tokens every layer keeps besides its share (the paper: its observation window).
            Default: ``base``'s smallest size.
        base_params: fixed parameters of ``base`` (e.g. ``window=8`` for SnapKV).

    Example:
        >>> from kvpolicy import PyramidKV
        >>> p = PyramidKV("h2o", size=64, beta=4, floor=8)
        >>> [q.capacity for q in (p.for_layer(0, 3), p.for_layer(2, 3))], p.capacity
        ([107, 23], 65)
    """

    name = "pyramid"

    def __init__(self, base: str, size: int, beta: float = 20.0, floor: int | None = None, **base_params: Any) -> None:
        if not isinstance(base, str):
            raise ValueError(f"base must be a registered policy name (e.g. 'h2o', 'snapkv'), got {base!r}")
        entry = get_policy(base)
        self.base = base
        self.size = check_int("size", size, minimum=1)
        self.floor = entry.min_size if floor is None else check_int("floor", floor, minimum=0, maximum=self.size)
        self.beta = beta
        self.base_params = dict(base_params)
        pyramid_sizes(self.size, 1, beta=beta, floor=self.floor)  # validates beta and floor
        self.mean = entry.from_size(self.size, **self.base_params)
        self.wrapped = self.mean
        super().__init__(selection=self.mean.selection)
        self.log_n = self.mean.log_n

    def sizes(self, layers: int) -> list[int]:
        """The ``size`` of each of ``layers`` layers (see :func:`pyramid_sizes`)."""
        return pyramid_sizes(self.size, layers, beta=self.beta, floor=self.floor)

    def for_layer(self, layer: int, layers: int) -> EvictionPolicy:
        """``base`` planned for layer ``layer``'s size out of ``layers``."""
        layers = check_int("layers", layers, minimum=1)
        layer = check_int("layer", layer, minimum=0, maximum=layers - 1)
        size = self.sizes(layers)[layer]
        return get_policy(self.base).from_size(max(size, get_policy(self.base).min_size), **self.base_params)

    # ---------------------------------------------------------------- one layer: base at the mean
    # (what backends read is the mean layer's: WrappingPolicy)

    @property
    def decode_eviction(self) -> DecodeEviction | None:
        # a subclass check: the base's rule keeps what the base's select keeps
        return self.mean.decode_eviction

    def size_rule(self) -> SizeRule | None:
        # select is the base's at the mean size, so are its sizes (the planner plans the mean)
        return self.mean.size_rule()

    def init_state(self) -> dict[str, int]:
        return self.mean.init_state()

    def select(self, view: CacheView) -> Array | None:
        return self.mean.select(view)

    def params(self) -> dict[str, Any]:
        return {"base": self.base, "size": self.size, "beta": self.beta, "floor": self.floor, **self.base_params}

    def __repr__(self) -> str:
        extra = "".join(f", {k}={v!r}" for k, v in self.base_params.items())
        return f"PyramidKV(base={self.base!r}, size={self.size}, beta={self.beta!r}, floor={self.floor}{extra})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PyramidKV) and self.params() == other.params()

    def __hash__(self) -> int:
        return hash(("PyramidKV", tuple(sorted((k, repr(v)) for k, v in self.params().items()))))

    min_size = 2

    @classmethod
    def from_size(cls, size: int, **overrides: Any) -> "PyramidKV":
        """``base`` (required: a registry name), ``beta`` and ``floor`` are this policy's; the other
        overrides are ``base``'s."""
        base = overrides.pop("base", None)
        if not isinstance(base, str):
            raise ValueError(f"PyramidKV plans from a base policy's registry name: base='h2o' (or use a preset such as pyramidkv), got {base!r}")
        beta = overrides.pop("beta", 20.0)
        floor = overrides.pop("floor", None)
        return cls(base, max(size, get_policy(base).min_size if floor is None else floor), beta, floor, **overrides)


register_policy(
    PyramidKV, name="pyramidkv", preset={"base": "snapkv", "window": 8, "floor": 9},
    doc="PyramidKV: SnapKV after the prompt (window 8) with a pyramid of per-layer sizes, then the cache grows",
)
register_policy(
    PyramidKV, name="pyramid_h2o", preset={"base": "h2o"},
    doc="H2O with a pyramid of per-layer budgets (lower layers keep more), the same total as H2O",
)
