"""The first GPU numbers, in one prepared run of about 8 minutes (issue 42).

Three phases, each recorded even when a later one fails or runs out of time, all into one folder:

1. ``env.json``: the GPU (name, multiprocessors, memory, driver), torch / CUDA / transformers
   versions, and the measured device-to-device copy bandwidth (the bandwidth floor's yardstick).
2. ``exactness.json``: on the GPU, layer 0 of a greedy generation through ``EvictingCache`` (the
   fused decode path, in float32 and in bfloat16) keeps the tokens that the float64 NumPy
   reference (``kvpolicy_numpy.replay``) keeps on the same layer's logits, per policy: a tiny
   random-weight Llama (2 layers, 4 heads, no GQA so layer 0's logits are one softmax per head),
   a 48-token prompt and 24 new tokens. The reference's logits are float64 products of the
   queries and keys the model computed in its own dtype, so a bf16 difference can only come from
   the cache's own rounding of the scores; each mismatch records the reference's score gap at
   the cut-off, to tell a near-tie from a wrong rule.
3. ``decode/``: ``benchmarks/gpu_decode.py`` on the Llama-2-7B-shaped bf16 model at batch 1 and
   8, contexts 2,048 and 32,768, for ``DynamicCache``, ``FullCache``, H2O, StreamingLLM, BUZZ,
   KeyDiff and AdaKV (over KeyDiff) at 25%: eager, then compiled with ``mode="reduce-overhead"``
   (CUDA graphs), up to ``--deadline`` seconds from the start (the rows past it are recorded as
   not run).

Run on a GPU machine::

    python benchmarks/gpu_first.py --out gpu-first

and on CPU, to check every path (``tests/benchmarks/test_gpu_first.py`` does)::

    python benchmarks/gpu_first.py --tiny --device cpu --out /tmp/gpu-first
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "integrations", ROOT / "benchmarks", ROOT / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

#: The policies of the exactness check: every score kind the fused decode serves.
EXACTNESS_POLICIES = (
    "H2O(heavy=6, recent=6)", "TOVA(size=12)", "BUZZ(sink=2, window=5, stride=3, threshold=8)", "StreamingLLM(sink=2, window=9)",
    "Scissorhands(size=12, history=5, drop=0.25, recent=2)", "KeyDiff(size=12, recent=2)", "Knorm(size=12)",
    "AdaKV(scorer=H2O(heavy=6, recent=4), alpha_safeguard=0.2)",
)
DECODE_POLICIES = ("h2o", "streaming_llm", "buzz", "keydiff", "adakv_keydiff")


def environment(device: str, tiny: bool) -> dict[str, Any]:
    """What ran: the device, the libraries, the copy bandwidth."""
    import torch
    import transformers

    from gpu_decode import copy_bandwidth

    env: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "transformers": transformers.__version__, "device": device,
    }
    if torch.device(device).type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, multiprocessors=props.multi_processor_count, memory_bytes=props.total_memory)
        try:
            env["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,clocks.max.mem", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20,
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError) as e:
            env["driver"] = f"nvidia-smi failed: {e}"
    env["copy_bandwidth_bytes_per_s"] = copy_bandwidth(device, nbytes=(1 << 24) if tiny else (1 << 30))
    return env


def _reference_logits_and_keys(model: Any, tokens: Any) -> tuple[Any, Any]:
    """Layer 0's logits ``[steps, heads, steps]`` and RoPE'd keys ``[steps, kv_heads, dim]``, float64
    products of the queries and keys as the model computed them in its own dtype."""
    import torch
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from layer0 import layer0_states

    with torch.no_grad():
        q, k, _, (cos, sin) = layer0_states(model, tokens)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        q, k = q.double(), k.double()
        logits = torch.einsum("bhqd,bhkd->bqhk", q, k) * model.model.layers[0].self_attn.scaling
    return logits[0].cpu().numpy(), k[0].transpose(0, 1).cpu().numpy()


def exactness(device: str, dtypes: Sequence[str]) -> list[dict[str, Any]]:
    """Per policy and dtype: whether layer 0 keeps what the float64 reference keeps (section 2)."""
    import numpy as np
    import torch

    import kvpolicy_numpy
    from kvpolicy import AdaKV, BUZZ, H2O, TOVA, KeyDiff, Knorm, Scissorhands, StreamingLLM  # noqa: F401 (eval below)
    from kvpolicy.hf import EvictingCache
    from kvpolicy_tools.models import tiny_llama

    from layer0 import greedy_tokens

    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 here
    torch.backends.cudnn.allow_tf32 = False
    out = []
    for dtype_name in dtypes:
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
        model = tiny_llama(num_layers=2, heads=4, kv_heads=4, head_dim=32, vocab=128, seed=3).to(device=device, dtype=dtype)
        ids = torch.randint(3, 128, (1, 48), generator=torch.Generator().manual_seed(5)).to(device)
        for spec in EXACTNESS_POLICIES:
            policy = eval(spec)  # the specs are this file's own constants
            row: dict[str, Any] = {"policy": spec, "dtype": dtype_name}
            try:
                cache = EvictingCache(policy, model)
                tokens = greedy_tokens(model, cache, ids, 24)
                logits, keys = _reference_logits_and_keys(model, tokens)  # every token fed, the last decoded one included
                trace = kvpolicy_numpy.replay(policy, logits, prompt_len=ids.shape[1], keys=keys)
                got = cache.layers[0].store.positions[0].cpu().numpy()
                want = trace.kept[-1]
                same = got.shape == want.shape and bool((got == want).all())
                row.update(same=same, heads=int(want.shape[0]), kept=int((want >= 0).sum()))
                if not same:
                    row["heads_differing"] = [h for h in range(want.shape[0]) if got.shape != want.shape or not (got[h] == want[h]).all()]
                    scores = np.asarray(trace.scores[-1]) if getattr(trace, "scores", None) is not None else None
                    row["got"], row["want"] = got.tolist(), want.tolist()
                    if scores is not None:
                        row["reference_scores"] = scores.tolist()
            except Exception as e:  # recorded, not fatal: the other policies still run
                row["error"] = f"{type(e).__name__}: {e}"[:500]
            out.append(row)
            print(f"exactness {dtype_name} {spec}: {row.get('same', row.get('error'))}", file=sys.stderr, flush=True)
        del model
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="gpu-first")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model and small contexts (checks every path on CPU)")
    p.add_argument("--deadline", type=float, default=420.0, help="seconds from the start after which decode rows are not run (default 420)")
    args = p.parse_args(argv)
    if args.deadline <= 0:
        raise ValueError(f"--deadline must be > 0 seconds, got {args.deadline}")
    warnings.filterwarnings("ignore", message=".*lru_cache.*")  # dynamo tracing array_api_compat, thousands of lines
    started = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    status: dict[str, Any] = {}
    tiny = args.tiny

    def phase(name: str, fn: Any, path: str) -> None:
        t0 = time.monotonic()
        try:
            (out / path).write_text(json.dumps(fn(), indent=1, default=str))
            status[name] = f"ok ({time.monotonic() - t0:.0f} s)"
        except Exception:  # each phase stands alone: the next still runs
            status[name] = traceback.format_exc()[-3000:]
            print(status[name], file=sys.stderr)
        (out / "status.json").write_text(json.dumps(status, indent=1))

    phase("env", lambda: environment(args.device, tiny), "env.json")
    phase("exactness", lambda: exactness(args.device, ("float32", "bfloat16")), "exactness.json")

    def decode() -> dict[str, Any]:
        import gpu_decode

        left = args.deadline - (time.monotonic() - started)
        # the order that matters most first: batch 1 at 2,048 eager and compiled (CUDA graphs), then the
        # long contexts eager (where the bandwidth floor rules), then the compiled rows of the rest
        order = "1x64,1x64c,2x64,1x256,2x256,2x64c" if tiny else "1x2048,1x2048c,8x2048,1x32768,8x32768,8x2048c,1x32768c,8x32768c"
        grid = ["--order", order]
        modes = "default" if tiny else "reduce-overhead"
        argv = [*grid, "--policies", ",".join(DECODE_POLICIES), "--budget", "0.25", "--steps", "8" if tiny else "24",
                "--warmup", "3", "--max-steps", "64" if tiny else "160", "--compile-modes", modes,
                "--deadline", f"{max(left, 1.0):.0f}", "--out", str(out / "decode"), "--device", args.device]
        if tiny:
            argv.append("--tiny")
        result = gpu_decode.run(gpu_decode.parse(argv))
        return {"command": result["command"], "rows": len(result["rows"])}

    phase("decode", decode, "decode.json")
    status["wall_s"] = round(time.monotonic() - started, 1)
    (out / "status.json").write_text(json.dumps(status, indent=1))
    print(json.dumps(status, indent=1), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
