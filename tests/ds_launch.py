"""Launching tests/ds_worker.py under the DeepSpeed launcher, one process per rank, on CPU (gloo)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "ds_worker.py"


def free_port() -> int:
    """A TCP port free on this machine now (the ranks' rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_worker(out: Path, tp: int, port: int, *extra: str, timeout: int = 900) -> subprocess.CompletedProcess:
    """``deepspeed --num_gpus tp tests/ds_worker.py --out out --tp tp *extra`` with the project on the path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "integrations"), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [
        sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(tp), "--master_port", str(port),
        str(WORKER), "--out", str(out), "--tp", str(tp), *extra,
    ]  # fmt: skip
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
