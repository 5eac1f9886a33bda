"""Benchmark grid, from the environment.

* ``KVPOLICY_BENCH_QUICK=1``: the quick mode CI runs (sizes 256/1024/4096, batch 1 x 8 heads,
  3 rounds; the model benchmarks are skipped).
* ``KVPOLICY_BENCH_MAX_TOKEN_HEADS``: skip torch workloads with more ``batch * heads * size``
  (default 2**21: 1 GiB of float32 keys and values at head_dim 64).
* ``KVPOLICY_BENCH_ROUNDS``: timed rounds per benchmark (default 3 quick, 5 full).
* ``KVPOLICY_BENCH_CONTEXTS``: comma-separated prompt lengths of the decode benchmark
  (default ``512,2048``; the full grid is ``kvpolicy bench``'s job).
* ``KVPOLICY_BENCH_THREADS``: torch threads (default: torch's own default).
* ``KVPOLICY_BENCH_JSON``: write every measurement and the fitted slopes to this file.
* ``KVPOLICY_BENCH_ENDURANCE_TOKENS``: tokens of the endurance benchmark (default 1,200 quick,
  100,000 full); ``KVPOLICY_BENCH_ENDURANCE_KEPT``: the policies' capacity (default 320);
  ``KVPOLICY_BENCH_ENDURANCE_TIME_TOL``: how far the last decile's per-token time may be from the
  first's, judged on the fastest token of each sample (default 0.05 full; quick: not asserted, only
  reported: a short run on a shared CI machine is noise-bound, and one CI run saw BUZZ's last
  decile 2.2x slower with nothing growing); ``KVPOLICY_BENCH_ENDURANCE_WORK_TOKENS``: tokens of
  the counted run that asserts, deterministically, that no token's work (torch calls, bytes of
  returned tensors) grows with the tokens seen (default 2,000, both modes).
"""

from __future__ import annotations

import os


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


QUICK = _flag("KVPOLICY_BENCH_QUICK")
SIZES = (256, 1024, 4096) if QUICK else tuple(2**k for k in range(8, 17))  # 256 ... 65,536
CONFIGS = ((1, 8),) if QUICK else ((1, 8), (1, 32), (8, 8), (8, 32))  # (batch, kv heads)
ROUNDS = int(os.environ.get("KVPOLICY_BENCH_ROUNDS", "3" if QUICK else "5"))
MAX_TOKEN_HEADS = int(os.environ.get("KVPOLICY_BENCH_MAX_TOKEN_HEADS", str(2**21)))
HEAD_DIM = 64
CONTEXTS = tuple(int(c) for c in os.environ.get("KVPOLICY_BENCH_CONTEXTS", "512,2048").split(",") if c.strip())
THREADS = int(os.environ["KVPOLICY_BENCH_THREADS"]) if os.environ.get("KVPOLICY_BENCH_THREADS") else None
JSON_OUT = os.environ.get("KVPOLICY_BENCH_JSON")
#: Fewest complexity measurements a quick run must record (it fails otherwise: no silent no-op).
MIN_RECORDED_QUICK = 20

ENDURANCE_TOKENS = int(os.environ.get("KVPOLICY_BENCH_ENDURANCE_TOKENS", "1200" if QUICK else "100000"))
ENDURANCE_KEPT = int(os.environ.get("KVPOLICY_BENCH_ENDURANCE_KEPT", "320"))
_TIME_TOL = os.environ.get("KVPOLICY_BENCH_ENDURANCE_TIME_TOL", "" if QUICK else "0.05")
#: None: time is reported, not asserted
ENDURANCE_TIME_TOL = float(_TIME_TOL) if _TIME_TOL.strip() else None
ENDURANCE_WORK_TOKENS = int(os.environ.get("KVPOLICY_BENCH_ENDURANCE_WORK_TOKENS", "2000"))

#: Measurements collected during a session (the conftest fits slopes and prints the summary).
RECORDS: list[dict] = []
DECODE: list[dict] = []
ENDURANCE: list = []  # kvpolicy_tools.perf.endurance.EnduranceResult
ENDURANCE_WORK: list = []  # the counted runs (count_work=True)
