"""kvpolicy_tools/perf/report.py: slope fits and markdown tables."""

from __future__ import annotations

import pytest

from kvpolicy_tools.perf.report import fit_slope, markdown_table, slopes


def test_slopes_and_tables() -> None:
    xs = [256, 512, 1024, 2048]
    assert fit_slope(xs, [3e-6 * x for x in xs]) == pytest.approx(1.0)
    assert fit_slope(xs, [5e-6] * 4) == pytest.approx(0.0)
    rows = [{"backend": "t", "policy": "p", "batch": 1, "heads": 1, "size": x, "v": x**2} for x in xs]
    assert slopes(rows, "v")[("t", "p", 1, 1)] == (pytest.approx(2.0), 4)
    assert markdown_table(["a", "b"], [[1, 2]]).splitlines() == ["| a | b |", "| --- | ---: |", "| 1 | 2 |"]
