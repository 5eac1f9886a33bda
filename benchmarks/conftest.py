"""pytest-benchmark suite of kvpolicy (not collected by the default ``pytest`` run: testpaths is
``tests``). Run it with::

    .venv/bin/python -m pytest benchmarks -q --benchmark-disable-gc          # full grid (long)
    KVPOLICY_BENCH_QUICK=1 .venv/bin/python -m pytest benchmarks -q          # the CI quick mode

The grid comes from the environment (``benchmarks/_settings.py``). At the end of the session the
log-log slopes of the eviction-complexity benchmarks (fitted to each point's fastest round) are printed (and written to
``$KVPOLICY_BENCH_JSON``). A quick run that measured fewer than ``MIN_RECORDED_QUICK`` points
fails, so the CI step cannot pass while measuring nothing.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _settings  # noqa: E402

RECORDS = _settings.RECORDS
DECODE = _settings.DECODE


def pytest_configure(config: pytest.Config) -> None:
    if _settings.THREADS:
        import torch

        torch.set_num_threads(_settings.THREADS)


@pytest.fixture
def record():
    """``record(benchmark, **info)``: keep the median of a finished benchmark for the slope fits."""

    def _record(benchmark: Any, *, per: int = 1, **info: Any) -> None:
        stats = getattr(benchmark, "stats", None)
        if stats is None or getattr(stats, "stats", None) is None:  # --benchmark-disable
            return
        info["median_s"] = stats.stats.median / per
        info["min_s"] = stats.stats.min / per
        RECORDS.append(info)

    return _record


def _slope_rows() -> list[tuple[str, str, int, int, str, float, int]]:
    from kvpolicy_tools.perf.report import slopes

    out = []
    for measure in ("one_eviction", "per_token"):
        # the fastest round: on a shared machine noise only adds time
        rows = [dict(r, value=r["min_s"]) for r in RECORDS if r["measure"] == measure]
        for (backend, policy, batch, heads), (slope, points) in slopes(rows, "value").items():
            out.append((backend, policy, batch, heads, measure, slope, points))
    return out


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if not RECORDS and not DECODE and not _settings.ENDURANCE and not _settings.ENDURANCE_WORK:
        return
    tr = terminalreporter
    if RECORDS:
        tr.write_sep("=", "eviction cost: log-log slope against the cache size")
        tr.write_line(f"{'backend':8s} {'policy':14s} {'batch':>5s} {'heads':>5s} {'measure':14s} {'slope':>7s} {'sizes':>5s}")
        for backend, policy, batch, heads, measure, slope, points in _slope_rows():
            s = "   n/a" if math.isnan(slope) else f"{slope:7.2f}"
            tr.write_line(f"{backend:8s} {policy:14s} {batch:5d} {heads:5d} {measure:14s} {s} {points:5d}")
    if DECODE:
        tr.write_sep("=", "decode on the embedded model: ratios to DynamicCache (same run)")
        for r in DECODE:
            tr.write_line(
                f"{r['context']:6d} {r['label']:24s} {r['tokens_per_s']:8.2f} tok/s  x{r['ratio_vs_dynamic']:.2f}"
                f"  kv {r['kv_bytes'] / 2**20:8.2f} MiB"
            )
    if _settings.ENDURANCE:
        from kvpolicy_tools.perf.endurance import markdown, summary_line

        tr.write_sep("=", "endurance: last / first decile after the warm-up (1.0 = flat)")
        for result in _settings.ENDURANCE:
            tr.write_line(summary_line(result))
        tr.write_line("")
        tr.write_line(markdown(_settings.ENDURANCE))
    if _settings.ENDURANCE_WORK:
        from kvpolicy_tools.perf.endurance import work_line

        tr.write_sep("=", "endurance, counted: each half's costliest token after the warm-up (x1.000 = no growth)")
        for result in _settings.ENDURANCE_WORK:
            tr.write_line(work_line(result))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _settings.JSON_OUT and (RECORDS or DECODE or _settings.ENDURANCE):
        slopes_out = [
            dict(zip(("backend", "policy", "batch", "heads", "measure", "slope", "points"), row)) for row in _slope_rows()
        ] if RECORDS else []
        endurance = [r.as_dict() for r in _settings.ENDURANCE]
        Path(_settings.JSON_OUT).write_text(
            json.dumps({"records": RECORDS, "slopes": slopes_out, "decode": DECODE, "endurance": endurance}, indent=1)
        )
    disabled = session.config.getoption("benchmark_disable", False)
    # the floor applies when the eviction-complexity benchmarks were collected (running only the
    # endurance file, say, records none of them)
    complexity = any("test_eviction_complexity" in item.nodeid for item in session.items)
    if _settings.QUICK and not disabled and exitstatus in (0, 5) and complexity and len(RECORDS) < _settings.MIN_RECORDED_QUICK:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(
                f"ERROR: quick benchmark run recorded {len(RECORDS)} measurements, expected at least "
                f"{_settings.MIN_RECORDED_QUICK} (were the benchmarks deselected or skipped?)",
                red=True,
            )
        session.exitstatus = 1
