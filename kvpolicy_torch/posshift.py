"""StreamingLLM's pos-shift: kept keys placed at consecutive positions ending at the newest token.

A kept token's shifted position is ``seen - count + rank`` (``rank``: its index among the kept
tokens), so it moves by the number of evicted tokens *after* it. Under an ``"oldest"`` decode
eviction (StreamingLLM) the tokens after the sinks are contiguous up to the newest, so only the
sinks move, all by the same amount: a :class:`PrefixShift`. :class:`SinkShift` then holds the
sinks' keys already rotated in the storage (kept aside as originals), so a decode step's attention
is plain SDPA; :func:`slot_shifts` gives the per-slot shift of any other layout.

RoPE's rotations by a number of positions live here (:func:`rope_rotate`, :func:`rope_matrix`):
the pos-shift, Expected Attention's queries rotated back and the static step use them.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import torch

from .storage import Storage

__all__ = ["KeyShift", "PrefixShift", "RopeShift", "ShiftMatrices", "SinkShift", "rope_matrix", "rope_rotate", "slot_shifts"]


def rope_rotate(
    x: torch.Tensor,
    delta: torch.Tensor,
    inv_freq: torch.Tensor,
    *,
    style: str = "half",
    rotary_dim: int | None = None,
) -> torch.Tensor:
    """Rotate ``x`` ``[..., head_dim]`` by ``delta`` positions with RoPE; ``delta`` broadcasts
    against ``x[..., 0]``.

    Args:
        style: ``"half"`` (Llama's ``rotate_half``, pairs ``(i, i + rotary_dim / 2)``) or
            ``"interleaved"`` (pairs ``(2i, 2i + 1)``: Cohere, GLM, GPT-J).
        rotary_dim: the leading dimensions rotated (partial rotary: GPT-NeoX, Phi, StableLM,
            GLM); the rest pass through. Default ``head_dim``; must be ``2 * len(inv_freq)``.

    RoPE scores depend only on the difference of the query's and the key's positions, so moving a
    key by ``delta`` or its query by ``-delta`` gives the same score. Angles are computed as
    transformers computes them (``float32(delta) * inv_freq``), in float32 (float64 for float64
    inputs). Scaled variants (linear, NTK, llama3, YaRN, LongRoPE) differ only in ``inv_freq``
    and in a magnitude factor that a key already carries, so rotating by angles alone is exact.

    Example:
        >>> x = torch.tensor([[1.0, 0.0]])
        >>> y = rope_rotate(rope_rotate(x, torch.tensor([3]), torch.tensor([0.5])), torch.tensor([-3]), torch.tensor([0.5]))
        >>> bool(torch.allclose(y, x, atol=1e-6))
        True
        >>> rope_rotate(torch.tensor([[1.0, 0.0, 0.0, 0.0, 2.0]]), torch.tensor([1]), torch.tensor([1.0, 0.0]),
        ...             style="interleaved", rotary_dim=4)
        tensor([[0.5403, 0.8415, 0.0000, 0.0000, 2.0000]])
    """
    if style not in ("half", "interleaved"):
        raise ValueError(f"style must be 'half' or 'interleaved', got {style!r}")
    dim = x.shape[-1] if rotary_dim is None else rotary_dim
    if dim != 2 * inv_freq.shape[-1] or dim > x.shape[-1]:
        raise ValueError(
            f"RoPE needs rotary_dim = 2 * len(inv_freq) <= head_dim, got rotary_dim {dim}, "
            f"{inv_freq.shape[-1]} frequencies, head_dim {x.shape[-1]}"
        )
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    angles = delta.to(torch.float32)[..., None] * inv_freq.to(device=x.device, dtype=torch.float32)
    cos, sin = angles.cos().to(work), angles.sin().to(work)
    xf = x.to(work)
    rot, rest = xf[..., :dim], xf[..., dim:]
    if style == "half":
        half = dim // 2
        x1, x2 = rot[..., :half], rot[..., half:]
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    if rest.shape[-1]:
        rotated = torch.cat((rotated, rest), dim=-1)
    return rotated.to(x.dtype)


def rope_matrix(
    delta: torch.Tensor,
    inv_freq: torch.Tensor,
    head_dim: int,
    *,
    style: str = "half",
    rotary_dim: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``[len(delta), 1, head_dim, head_dim]`` matrices ``R`` such that ``x @ R`` rotates row ``r``
    of ``x`` ``[batch, heads, s, head_dim]`` by ``delta[r]`` positions, as :func:`rope_rotate`.

    For rotating many small tensors by the same shifts (StreamingLLM's sinks in every layer of a
    model): the matrices are built once, and each rotation is then one matmul instead of a dozen
    element-wise ops. Same angles as :func:`rope_rotate` (``float32(delta) * inv_freq``); the
    product may round differently in the last bit.

    Example:
        >>> x, d, f = torch.randn(2, 3, 4, 8), torch.tensor([1, 5]), torch.rand(4)
        >>> got = x @ rope_matrix(d, f, 8)
        >>> bool(torch.allclose(got, rope_rotate(x, d.view(2, 1, 1), f), atol=1e-6))
        True
    """
    if style not in ("half", "interleaved"):
        raise ValueError(f"style must be 'half' or 'interleaved', got {style!r}")
    dim = head_dim if rotary_dim is None else rotary_dim
    if dim != 2 * inv_freq.shape[-1] or dim > head_dim:
        raise ValueError(
            f"RoPE needs rotary_dim = 2 * len(inv_freq) <= head_dim, got rotary_dim {dim}, "
            f"{inv_freq.shape[-1]} frequencies, head_dim {head_dim}"
        )
    if delta.ndim != 1:
        raise ValueError(f"delta must be 1-D (one shift per row), got shape {tuple(delta.shape)}")
    dev = delta.device
    angles = delta.to(torch.float32)[:, None] * inv_freq.to(device=dev, dtype=torch.float32)  # [b, dim/2]
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    half = dim // 2
    i = torch.arange(half, device=dev)
    # pairs (first, second) rotate as y_first = x_first cos - x_second sin, y_second = x_second cos + x_first sin
    first, second = (i, i + half) if style == "half" else (2 * i, 2 * i + 1)
    r = torch.zeros(delta.shape[0], head_dim, head_dim, dtype=dtype, device=dev)
    r[:, first, first] = cos
    r[:, second, second] = cos
    r[:, second, first] = -sin
    r[:, first, second] = sin
    rest = torch.arange(dim, head_dim, device=dev)
    r[:, rest, rest] = 1  # partial rotary: the other dimensions pass through
    return r[:, None]

#: ``key_shift(keys, delta)``: keys ``[batch, kv_heads, s, head_dim]`` rotated by ``delta`` positions
#: (RoPE), ``delta`` one host int per row.
KeyShift = Callable[[torch.Tensor, list[int]], torch.Tensor]


class PrefixShift(NamedTuple):
    """Positions of a pos-shift cache whose keys differ from their original positions only in a
    prefix: slots ``[0, length)`` of row ``r`` sit ``delta[r]`` positions later, every other kept
    token at its original position (StreamingLLM: the sinks, by the number of evicted tokens)."""

    length: int
    delta: list[int]


def slot_shifts(positions: torch.Tensor, shift: list[int]) -> torch.Tensor:
    """Per-slot pos-shift ``[batch, kv_heads, n]`` of slots whose original ``positions`` are given
    (``-1``: a hole, shift 0), every slot before them a hole: a kept token sits
    ``shift[row] + rank - position`` later (``shift``: tokens each row has evicted).

    Example:
        >>> slot_shifts(torch.tensor([[[0, -1, 5, 6]]]), [4]).tolist()
        [[[4, 0, 0, 0]]]
    """
    kept = positions >= 0
    rank = torch.cumsum(kept.to(torch.int64), dim=-1) - 1
    offset = torch.tensor(shift, device=positions.device)[:, None, None]
    return torch.where(kept, offset + rank - positions, 0)


class SinkShift:
    """The sinks' keys of a ring layout held at their pos-shift positions in the storage.

    Whenever a row's shift changes (a decode step that evicted), the sinks' keys are rotated from
    their originals, kept aside (``O(batch x kv_heads x sink)``); :meth:`undo` puts the originals
    back before anything but a decode step reads or moves keys.

    Args:
        key_shift: rotates keys by a number of positions (:data:`KeyShift`).
        sink: the sinks, slots ``[0, sink)`` of every row.

    Example:
        >>> s = Storage.allocate(torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2), 4, torch.float32)
        >>> s.keys.fill_(1.0)[0, 0, 0].tolist()
        [1.0, 1.0]
        >>> shift = SinkShift(lambda keys, delta: keys * (1 + delta[0]), sink=1)
        >>> shift.apply(s, [2])
        >>> s.keys[0, 0, :2].tolist(), shift.delta
        ([[3.0, 3.0], [1.0, 1.0]], [2])
        >>> shift.undo(s)
        >>> s.keys[0, 0, 0].tolist(), shift.delta
        ([1.0, 1.0], None)
    """

    def __init__(self, key_shift: KeyShift, sink: int) -> None:
        self.key_shift = key_shift
        self.sink = sink
        self.originals: torch.Tensor | None = None  # [b, h, sink, d] while the storage holds them shifted
        self.delta: list[int] | None = None  # each row's shift of the keys in the storage
        # the sinks' slots of the storage that holds them shifted: a view made once, written at each shift
        self.held: Storage | None = None
        self.slots: torch.Tensor | None = None

    def apply(self, storage: Storage, delta: list[int]) -> None:
        """The sinks' keys rotated by ``delta`` (per row); nothing to do while it is unchanged."""
        if delta == self.delta:
            return
        if self.originals is None:
            self.originals = storage.keys[:, :, : self.sink].clone()
        if storage is not self.held:  # a first shift, or the storage grew (carrying the shifted sinks)
            self.held, self.slots = storage, storage.keys.narrow(2, 0, self.sink)
        self.slots.copy_(self.key_shift(self.originals, delta))  # type: ignore[union-attr]
        self.delta = delta

    def undo(self, storage: Storage | None) -> None:
        """Put the sinks' original keys back in their slots."""
        if self.originals is not None and storage is not None:
            storage.keys[:, :, : self.originals.shape[2]] = self.originals
        self.originals, self.delta, self.held, self.slots = None, None, None, None


class ShiftMatrices:
    """StreamingLLM's pos-shift rotations shared by the layers of one cache (the transformers
    integration's ``EvictingCache`` gives its layers one).

    At a decode step every layer's sinks move by the same shift, so :meth:`rotate` turns every
    layer's sinks at once: the first layer to ask at a new shift rotates all layers' sinks in one
    batch (:func:`~kvpolicy_torch.rope_rotate` on ``[layers, batch, kv_heads, sink, head_dim]``),
    the others take their slice of it (a rotation per layer cost ~20 us of a decode step's
    per-layer bookkeeping on a CPU). Layers whose shifts or RoPE differ within a step (per-layer
    budgets, per-layer frequencies) fall back to one product per layer with a RoPE matrix per row
    (:func:`~kvpolicy_torch.rope_matrix`, built once per shift and RoPE: :meth:`get`).
    """

    def __init__(self) -> None:
        self._key: tuple[Any, ...] | None = None
        self._frequencies: torch.Tensor | None = None  # kept alive, so its id cannot be reused
        self._value: torch.Tensor | None = None
        self._sinks: dict[int, torch.Tensor] = {}  # layer -> its sinks' original keys [b, h, s, d]
        self._batch: tuple[torch.Tensor, ...] | None = None  # per layer of the batch, its sinks rotated [b, h, s, d]
        self._batch_key: tuple[Any, ...] | None = None  # (shifts, style, rotary_dim, dtype, device) of the batch
        self._batch_frequencies: torch.Tensor | None = None  # and its frequencies
        self._index: dict[int, int] = {}  # layer -> its row of the batch
        self._served: set[int] = set()  # layers that took their slice of the batch
        #: False once layers asked for different shifts or RoPE in one step: a product per layer
        self.batched = True

    def get(self, delta: Sequence[int], inv_freq: torch.Tensor, head_dim: int, style: str, rotary_dim: int,
            dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """``[batch, 1, head_dim, head_dim]`` for these shifts (see :func:`~kvpolicy_torch.rope_matrix`)."""
        key = (tuple(delta), id(inv_freq), head_dim, style, rotary_dim, dtype, device)
        if key != self._key or self._frequencies is not inv_freq:
            work = torch.float64 if dtype == torch.float64 else torch.float32
            matrix = rope_matrix(torch.tensor(list(delta), device=device), inv_freq, head_dim, style=style,
                                 rotary_dim=rotary_dim, dtype=work)
            self._key, self._frequencies, self._value = key, inv_freq, matrix
        return self._value  # type: ignore[return-value]

    def rotate(self, layer: int, keys: torch.Tensor, delta: Sequence[int], inv_freq: torch.Tensor, style: str,
               rotary_dim: int) -> torch.Tensor:
        """Layer ``layer``'s sinks ``keys`` ``[batch, kv_heads, s, head_dim]`` (their original keys)
        rotated by ``delta[r]`` positions in row ``r``, as :func:`~kvpolicy_torch.rope_rotate`.

        Example:
            >>> from kvpolicy_torch import rope_rotate
            >>> shifts, freq = ShiftMatrices(), torch.tensor([1.0, 0.1])
            >>> sinks = [torch.randn(1, 2, 3, 4) for _ in range(2)]
            >>> out = [shifts.rotate(l, sinks[l], [5], freq, "half", 4) for l in range(2)]
            >>> all(torch.allclose(o, rope_rotate(k, torch.tensor([5]), freq), atol=1e-5) for o, k in zip(out, sinks))
            True
        """
        if self.batched:
            key = (tuple(delta), style, rotary_dim, keys.dtype, keys.device)
            if self._sinks.get(layer) is not keys:  # new sinks (a first shift, or taken again after a chunk)
                self._sinks[layer] = keys
                self._batch = None
            same = self._batch_key == key and self._batch_frequencies is inv_freq
            if self._batch is not None and same and layer in self._index:
                self._served.add(layer)
                return self._batch[self._index[layer]]
            if self._batch is not None and not same and len(self._served) < len(self._index):
                self.batched = False  # a layer still waits for the last shift: shifts differ between layers
            else:
                like = [l for l, k in self._sinks.items()
                        if k.shape == keys.shape and k.dtype == keys.dtype and k.device == keys.device]
                shifts = torch.tensor(list(delta), device=keys.device).view(-1, 1, 1)  # [b, 1, 1] against [L, b, h, s]
                # unbound once: each layer then takes a view made here (no op a layer)
                self._batch = rope_rotate(torch.stack([self._sinks[l] for l in like]), shifts, inv_freq, style=style,
                                          rotary_dim=rotary_dim).unbind(0)
                # served at this shift so far (a layer joining mid-step: its first shift) plus this one
                served = self._served if same else set()
                self._batch_key, self._batch_frequencies = key, inv_freq
                self._index, self._served = {l: i for i, l in enumerate(like)}, served | {layer}
                return self._batch[self._index[layer]]
        matrix = self.get(delta, inv_freq, keys.shape[-1], style, rotary_dim, keys.dtype, keys.device)
        b, h, s, d = keys.shape
        # one [h * s, d] x [d, d] product per row (a broadcast 4-D matmul costs twice as much here)
        rows = keys.reshape(b, h * s, d)
        if rows.dtype != matrix.dtype:
            return torch.bmm(rows.to(matrix.dtype), matrix[:, 0]).to(keys.dtype).view(b, h, s, d)
        return torch.bmm(rows, matrix[:, 0]).view(b, h, s, d)


class RopeShift:
    """One layer's RoPE (its frequencies, style and rotated dimensions), as the layer's other parts
    read it: a :data:`KeyShift` for its :class:`~kvpolicy_torch.LayerCache` (StreamingLLM's sinks,
    rotated with every other layer's at once by the cache's shared :class:`ShiftMatrices`),
    :meth:`rotate` for the queries of a shifted prefix, and the description a query's rotation
    back (Expected Attention) or a static step's prefix is built from, with no call back into the
    framework that owns the layer.

    Args:
        frequencies: the rotary frequencies ``[rotary_dim / 2]``: a tensor, or an object whose
            ``inv_freq`` is read at each use (a model's rotary module, whose buffer dynamic RoPE
            scaling updates in place).
        style: ``"half"`` or ``"interleaved"`` (:func:`~kvpolicy_torch.rope_rotate`).
        rotary_dim: the leading dimensions rotated (``None``: all of them).
        layer: the layer's index among those sharing ``matrices``.
        matrices: the rotations the layers of one cache share.

    Example:
        >>> from kvpolicy_torch import rope_rotate
        >>> freq, keys = torch.tensor([1.0, 0.1]), torch.randn(1, 2, 3, 4)
        >>> shift = RopeShift(freq, "half", None, 0, ShiftMatrices())
        >>> bool(torch.allclose(shift(keys, [5]), rope_rotate(keys, torch.tensor([5]), freq), atol=1e-5))
        True
    """

    def __init__(self, frequencies: Any, style: str, rotary_dim: int | None, layer: int, matrices: ShiftMatrices) -> None:
        self.frequencies, self.style, self.rotary_dim = frequencies, style, rotary_dim
        self.layer, self.matrices = layer, matrices

    @property
    def inv_freq(self) -> torch.Tensor:
        """The frequencies now."""
        f = self.frequencies
        return f if isinstance(f, torch.Tensor) else f.inv_freq

    def __call__(self, keys: torch.Tensor, delta: list[int]) -> torch.Tensor:
        """Keys ``[batch, kv_heads, s, head_dim]`` rotated by ``delta[r]`` positions in row ``r``."""
        dim = self.rotary_dim if self.rotary_dim is not None else keys.shape[-1]
        return self.matrices.rotate(self.layer, keys, delta, self.inv_freq, self.style, dim)

    def rotate(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """``x`` ``[batch, heads, q, head_dim]`` rotated by ``delta`` positions (broadcast to its
        first three dimensions), as :func:`~kvpolicy_torch.rope_rotate`."""
        return rope_rotate(x, delta, self.inv_freq, style=self.style, rotary_dim=self.rotary_dim)
