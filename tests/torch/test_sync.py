"""No host-device syncs and no device mix in the decode path, for every built-in policy.

Decode steps run with two instruments, and any hit *from library code* fails the test:

* the Python-level reads that force a sync on an accelerator, patched on ``torch.Tensor``:
  ``item``, ``tolist``, ``cpu``, ``numpy``, ``__bool__``, ``__int__``, ``__float__``,
  ``__index__`` (on a CPU tensor ``.cpu()`` and ``.numpy()`` never reach ATen, so a dispatch
  mode alone would miss them);
* a ``TorchDispatchMode`` over the ATen ops that sync (``_local_scalar_dense``, ``is_nonzero``,
  ``nonzero``, ``masked_select``, the ``unique`` family, ``equal``, ``repeat_interleave``
  without ``output_size``, indexing with a boolean mask) and, on the ``meta`` device, any op
  that returns a CPU tensor (a tensor created on the wrong device).

A hit is attributed to the nearest Python frame outside torch: library code is ``kvpolicy``,
``kvpolicy_numpy``, ``kvpolicy_torch`` and ``kvpolicy_integrations``; calls from this test or
from transformers (its model and mask code) are not ours to fix. The prefill runs outside the
instruments (it checks a padded batch once per prompt, on purpose).

Driven through the public API: an ``EvictingCache`` on a tiny model with a manual decode loop,
and ``LayerCache`` directly (``append``/``accumulate``/``evict``), on CPU and on ``meta``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from kvpolicy import BUZZ, H2O, FullCache, LocalWindow, StreamingLLM  # noqa: E402
from kvpolicy.hf import EvictingCache, cache_kwargs  # noqa: E402
from kvpolicy_tools.models import tiny_llama  # noqa: E402
from kvpolicy_torch import LayerCache  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = tuple(
    str(p) + "/" for p in (ROOT / "kvpolicy", ROOT / "kvpolicy_numpy", ROOT / "kvpolicy_torch", ROOT / "integrations" / "kvpolicy_integrations")
)
# torch's frames, under the path it was imported by and its real path (.venv may be a symlink)
TORCH_DIRS = tuple({str(Path(torch.__file__).parent) + "/", str(Path(torch.__file__).resolve().parent) + "/"})
HERE = str(Path(__file__).resolve())

PYTHON_SYNCS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")
ATEN_SYNCS = {
    "aten::_local_scalar_dense", "aten::is_nonzero", "aten::nonzero", "aten::masked_select", "aten::unique",
    "aten::_unique", "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive", "aten::equal", "aten::allclose",
}  # fmt: skip

POLICIES: dict[str, Callable[[], Any]] = {
    "full": FullCache,
    "local": lambda: LocalWindow(window=6),
    "streaming_llm (pos-shift)": lambda: StreamingLLM(sink=2, window=5),
    "h2o": lambda: H2O(heavy=3, recent=4),
    "h2o shared": lambda: H2O(heavy=3, recent=4, selection="shared"),
    "buzz": lambda: BUZZ(sink=2, window=3, stride=3, threshold=6),
    "buzz log n": lambda: BUZZ(sink=2, window=3, stride=3, threshold=6, log_n=True, log_base=4.0),
    "buzz shared": lambda: BUZZ(sink=2, window=3, stride=3, threshold=6, selection="shared"),
}


def _caller(library: tuple[str, ...]) -> str | None:
    """``file:line`` of the nearest frame outside torch and this module's instruments, if it is
    library code; ``None`` otherwise."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(TORCH_DIRS) or (name == HERE and frame.f_code.co_name in _INSTRUMENT_FUNCS):
            frame = frame.f_back
            continue
        return f"{name}:{frame.f_lineno} ({frame.f_code.co_name})" if name.startswith(library) else None
    return None


class Instruments(TorchDispatchMode):
    """Records sync-ing calls (and, with ``device``, outputs on another device) from ``library``."""

    def __init__(self, library: tuple[str, ...] = LIBRARY, device: str | None = None) -> None:
        super().__init__()
        self.library = library
        self.device = device
        self.hits: list[str] = []
        self.ops = 0
        self.library_ops = 0  # ops called from library code: the attribution does reach it
        self._patches: list[tuple[str, Any]] = []

    def record(self, what: str) -> None:
        where = _caller(self.library)
        if where is not None:
            self.hits.append(f"{what} from {where}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        if _caller(self.library) is not None:
            self.library_ops += 1
        name = func._schema.name
        syncs = name in ATEN_SYNCS
        if name == "aten::repeat_interleave" and kwargs.get("output_size") is None:
            syncs = True
        if name == "aten::index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ())):
            syncs = True
        if syncs:
            self.record(name)
        out = func(*args, **kwargs)
        if self.device is not None:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.device.type != self.device:
                    self.record(f"{name} returned a {t.device.type} tensor on a {self.device} run")
        return out

    def __enter__(self):
        for attr in PYTHON_SYNCS:
            original = getattr(torch.Tensor, attr)
            self._patches.append((attr, original))
            setattr(torch.Tensor, attr, _spy(self, attr, original))
        return super().__enter__()

    def __exit__(self, *exc):
        for attr, original in reversed(self._patches):
            setattr(torch.Tensor, attr, original)
        self._patches.clear()
        return super().__exit__(*exc)


def _spy(instruments: Instruments, attr: str, original: Any) -> Any:
    def spy(self, *args, **kwargs):
        instruments.record(f"Tensor.{attr}")
        return original(self, *args, **kwargs)

    return spy


_INSTRUMENT_FUNCS = {"spy", "record", "__torch_dispatch__"}


# ------------------------------------------------------------------------------------------------
# The instruments themselves (negative controls: a test that cannot fail is a defect)
# ------------------------------------------------------------------------------------------------


def _library_like_sync(x):
    return x.sum().item(), bool(x.any()), x.cpu(), x.tolist(), int(x[0]), x[x > 0]


def test_instruments_catch_syncs_from_library_code_only():
    x = torch.arange(1, 5)
    with Instruments(library=(HERE,)) as caught:  # this file stands in for library code
        _library_like_sync(x)
    kinds = " ".join(caught.hits)
    for needle in ("Tensor.item", "Tensor.__bool__", "Tensor.cpu", "Tensor.tolist", "Tensor.__int__", "aten::_local_scalar_dense", "aten::index"):
        assert needle in kinds, needle
    with Instruments() as clean:  # the same calls attributed to a test are allowed
        _library_like_sync(x)
    assert clean.hits == [] and clean.ops > 0
    assert torch.Tensor.item is not None and "spy" not in torch.Tensor.item.__name__  # patches undone


def test_instruments_catch_a_tensor_created_on_the_wrong_device():
    with Instruments(library=(HERE,), device="meta") as caught:
        torch.zeros(3, device="meta") + 1
        torch.arange(3)  # forgot device=
    assert len(caught.hits) == 1 and "cpu tensor on a meta run" in caught.hits[0]


# ------------------------------------------------------------------------------------------------
# The decode path
# ------------------------------------------------------------------------------------------------


def _model(device: str):
    model = tiny_llama(num_layers=2, heads=4, kv_heads=2, head_dim=8, vocab=64, seed=0)
    return model.to(device)


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("name", list(POLICIES))
def test_evicting_cache_decode_has_no_sync_and_no_device_mix(name, device):
    model = _model(device)
    policy = POLICIES[name]()
    cache = EvictingCache(policy, model)
    ids = torch.randint(3, 64, (2, 9), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        model(input_ids=ids, **cache_kwargs(model, cache), position_ids=torch.arange(9, device=device).expand(2, -1))
        steps = 14
        nxt = torch.randint(3, 64, (2, steps), generator=torch.Generator().manual_seed(1)).to(device)
        with Instruments(device=device if device == "meta" else None) as seen:
            for t in range(steps):
                pos = torch.full((2, 1), 9 + t, dtype=torch.long, device=device)
                model(input_ids=nxt[:, t : t + 1], **cache_kwargs(model, cache), position_ids=pos)
    assert seen.hits == [], "\n".join(seen.hits)
    assert seen.library_ops > 50  # the instruments saw the library's ops in the decode steps
    evictions = sum(layer.store.evictions for layer in cache.layers)
    if policy.capacity is not None:
        assert evictions > 0  # the instrumented steps include evictions
    assert max(cache.lengths()) <= (policy.capacity or 10**9)


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("name", list(POLICIES))
def test_layer_cache_decode_has_no_sync_and_no_device_mix(name, device):
    policy = POLICIES[name]()
    reduce_calls = []
    layer = LayerCache(policy, reduce_scores=lambda s: reduce_calls.append(1) or s)
    g = torch.Generator().manual_seed(2)
    k = torch.randn(2, 3, 10, 4, generator=g).to(device)
    keys, _ = layer.append(k, k)
    layer.accumulate(torch.rand(2, 3, keys.shape[2], generator=g).to(device))
    layer.evict()
    steps = [(torch.randn(2, 3, 1, 4, generator=g).to(device), torch.rand(2, 3, 64, generator=g).to(device)) for _ in range(20)]
    rounds = 0
    with Instruments(device=device if device == "meta" else None) as seen:
        for new, received in steps:
            keys, values = layer.append(new, new)
            layer.accumulate(received[:, :, : keys.shape[2]])
            rounds += len(layer.evict())
            _ = layer.positions, layer.scores, layer.keys, layer.values, layer.kv_bytes, layer.nbytes
    assert seen.hits == [], "\n".join(seen.hits)
    assert seen.library_ops > 20
    if policy.capacity is not None:
        assert rounds > 0
    if policy.selection == "shared" and policy.uses_scores:
        assert len(reduce_calls) >= rounds  # the reduction ran in the evicting rounds (and prefill)
