"""benchmarks/peers/kept_positions.py (kept positions against kvpress's presses): skips cleanly
without the kvpress venv, its pieces on their own, and, with the venv present
(benchmarks/peers/setup_kvpress.sh), both sides on the tiny random-weight model
``kvpolicy_tools.models.tiny_llama`` (wiring, not language): the presses whose rule kvpolicy shares keep
the same positions per layer and KV head."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[3]
DRIVER = ROOT / "benchmarks" / "peers" / "kept_positions.py"


@pytest.fixture(scope="module")
def kept():
    sys.path.insert(0, str(DRIVER.parent))
    spec = importlib.util.spec_from_file_location("kept_positions", DRIVER)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)
        sys.path.remove(str(DRIVER.parent))


def test_skips_cleanly_without_the_kvpress_venv(kept, tmp_path, capsys):
    out = tmp_path / "out"
    assert kept.main(["--venv", str(tmp_path / "no-venv"), "--out", str(out)]) == 0
    assert "kvpress venv not found" in capsys.readouterr().out
    assert not out.exists()


def test_sizes_policies_and_agreement(kept):
    assert [kept.n_kept(512, r) for r in (0.5, 0.75, 0.999)] == [256, 128, 1]
    assert repr(kept.our_policy("streaming_llm", 128)) == "StreamingLLM(sink=4, window=124)"
    assert kept.our_policy("tova", 128).selection == "shared" and kept.our_policy("snapkv", 128).pooling == "avg"
    assert kept.our_policy("tova", 9, selection="per_head").selection == "per_head"
    assert kept.our_policy("critical_knorm", 128).projections is None  # (no model: W_o the identity)
    assert repr(kept.our_policy("chunkkv_knorm", 128)) == "ChunkKV(scorer=Knorm(size=128, recent=0), chunk_length=20)"
    ours = [[[0, 1, 2], [0, 1, 3]]]
    theirs = [[[0, 1, 2], [1, 2, 3]]]
    got = kept.agreement(ours, theirs)
    assert (got["equal"], got["sets"]) == (1, 2) and got["jaccard"] == pytest.approx((1 + 2 / 4) / 2)


# the venv benchmarks/peers/setup_kvpress.sh builds (KVPRESS_VENV: another one, e.g. a worktree's main checkout's)
VENV = Path(os.environ.get("KVPRESS_VENV", ROOT / ".venv-kvpress"))


@pytest.mark.slow
def test_both_sides_keep_the_same_positions_on_a_tiny_model(kept, tmp_path):
    python = kept.kvpress_python(VENV)
    if python is None:
        pytest.skip("the kvpress venv is missing (benchmarks/peers/setup_kvpress.sh)")
    from kvpolicy_tools.models import tiny_llama

    model = tiny_llama(num_layers=2, heads=4, kv_heads=2, head_dim=16, vocab=96, seed=2).eval()
    model.save_pretrained(tmp_path / "model")
    ids = torch.randint(3, 96, (1, 80), generator=torch.Generator().manual_seed(0))
    (tmp_path / "ids.json").write_text(json.dumps(ids[0].tolist()))
    # (issue 41) ChunkKV over Knorm (80 tokens: 4 whole chunks of 20, no partial one), CriticalKV over
    # Knorm with the model's W_o, LagKV (80 < 4 + 2 x 128: its ramp, the sinks and the newest)
    names = ["streaming_llm", "knorm", "keydiff", "tova", "expected_attention", "chunkkv_knorm", "critical_knorm", "lagkv"]
    subprocess.run([str(python), str(DRIVER.with_name("kvpress_kept.py")), "--model-dir", str(tmp_path / "model"),
                    "--ids", str(tmp_path / "ids.json"), "--ratios", "0.5", "--presses", ",".join(names),
                    "--out", str(tmp_path / "kept.json")], check=True, timeout=600)
    theirs = json.loads((tmp_path / "kept.json").read_text())["kept"]
    for name in names:
        # TOVAPress always keeps the newest token (it scores only the others): our recent=1; the
        # default recent=0 agrees where the newest token draws enough attention (SmolLM2: 90/90)
        variant = {"recent": 1} if name == "tova" else {}
        ours = kept.our_kept(model, ids, kept.our_policy(name, kept.n_kept(80, 0.5), model=model, **variant))
        got = kept.agreement(ours, theirs[f"{name}@0.5"])
        assert got["equal"] == got["sets"] == 4, (name, got)


def test_kvzip_is_compared_headwise_after_its_reconstruction(kept):
    """--policies kvzip: AdaKV over KVzip without a floor (KVzipPress(layerwise=True)'s head-wise
    budgets), the positions read after the reconstruction, holes left out (tiny random-weight Llama,
    a stand-in tokenizer)."""
    from kvpolicy import AdaKV, KVzip
    from kvpolicy_tools.models import tiny_llama

    policy = kept.our_policy("kvzip", 12)
    assert policy == AdaKV(KVzip(size=12, sink=4), alpha_safeguard=0.0)

    class Tok:
        chat_template = None

        def encode(self, text, add_special_tokens=False):
            return [3 + ord(c) % 50 for c in text]

    model = tiny_llama()
    ids = torch.randint(3, 100, (1, 30), generator=torch.Generator().manual_seed(3))
    got = kept.our_kept(model, ids, policy, Tok())
    assert len(got) == 2 and all(sum(len(head) for head in layer) == 2 * 12 for layer in got)
    assert all(head[:4] == [0, 1, 2, 3] for layer in got for head in layer)
