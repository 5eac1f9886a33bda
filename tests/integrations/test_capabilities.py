"""kvpolicy_integrations.capabilities: the one reader of a model's shape (``geometry``), which the
cache (through ``detect``), the DeepSpeed engine (``ModelGeometry.from_config``) and the model
loaders (``kvpolicy_tools.models.describe``) all read; the capability checks themselves are held
against every family in tests/integrations/test_families.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("transformers")

from kvpolicy_integrations.capabilities import detect, geometry, text_config  # noqa: E402
from kvpolicy_integrations.deepspeed import ModelGeometry  # noqa: E402
from kvpolicy_tools.models import describe, tiny_llama  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return tiny_llama(num_layers=3, heads=6, kv_heads=2, head_dim=8)


def test_every_reader_reads_the_same_shape(model) -> None:
    g = geometry(model)
    assert (g.layers, g.heads, g.kv_heads, g.head_dim, g.groups) == (3, 6, 2, 8, 3)
    assert detect(model).geometry == g
    ds = ModelGeometry.from_config(model)
    assert (ds.layers, ds.heads, ds.kv_heads, ds.head_dim, ds.hidden_size, ds.vocab_size, ds.max_positions) == (
        g.layers, g.heads, g.kv_heads, g.head_dim, g.hidden_size, g.vocab_size, g.max_positions)
    d = describe(model)
    assert {k: d[k] for k in ("model_type", "layers", "heads", "kv_heads", "head_dim", "hidden_size", "max_positions", "vocab_size")} == {
        "model_type": g.model_type, "layers": g.layers, "heads": g.heads, "kv_heads": g.kv_heads, "head_dim": g.head_dim,
        "hidden_size": g.hidden_size, "max_positions": g.max_positions, "vocab_size": g.vocab_size}


def test_a_model_and_its_config_read_alike(model) -> None:
    assert geometry(model.config) == geometry(model)
    assert text_config(model) is text_config(model.config)


@pytest.mark.parametrize(
    ("change", "message"),
    [({"num_key_value_heads": 4}, "num_attention_heads=6 is not a multiple of num_key_value_heads=4"),
     ({"num_hidden_layers": 0}, "num_hidden_layers must be a positive integer, got 0"),
     ({"hidden_size": None}, "model config has no 'hidden_size'")],
)
def test_a_bad_shape_is_named(change, message) -> None:
    """On a plain config object (transformers' own configs refuse such values themselves)."""
    shape = {"model_type": "llama", "num_hidden_layers": 3, "num_attention_heads": 6, "num_key_value_heads": 2,
             "hidden_size": 48, "vocab_size": 128}
    config = SimpleNamespace(**{**shape, **change})
    assert geometry(SimpleNamespace(**shape)).head_dim == 8
    with pytest.raises(ValueError, match=message):
        geometry(config)
