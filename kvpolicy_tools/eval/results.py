"""Typed results of ``kvpolicy compare``: one :class:`TaskResult` per task, one :class:`CellResult`
per cache configuration. :func:`kvpolicy_tools.eval.compare.evaluate` returns them, the report takes
them, and ``results.json`` is their :meth:`~TaskResult.as_dict` (the file's format is this).

Example:
    >>> cell = CellResult(policy="h2o", row="h2o", label="30%", kind="budget", requested_budget=0.3,
    ...                   realised_budget=0.31, metrics={"ppl": 12.5})
    >>> task = TaskResult(info={"name": "ppl", "metric": "ppl"}, n_samples=2, cells=[cell])
    >>> task.as_dict()["cells"][0]["realised_budget"], task.name
    (0.31, 'ppl')
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["CellResult", "TaskResult"]


@dataclass
class CellResult:
    """One cache configuration of a task: its policy and budget (requested and realised), the
    cache sizes it attended to, its metrics over the samples, and the command that reruns it."""

    policy: str
    row: str
    label: str
    kind: str
    requested_budget: float | None = None
    realised_budget: float | None = None
    equalise: str | None = None
    variant_ratio: float | None = None
    capacity: int | None = None
    size: int | None = None
    ratio: float | None = None
    average_cache: float = 0.0
    full_average_cache: float = 0.0
    decode_steps: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    stderr: float | None = None
    groups: dict[str, dict[str, float]] = field(default_factory=dict)
    plans: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    samples: list[dict[str, Any]] = field(default_factory=list)
    command: str | None = None

    #: The keys of ``results.json``'s cells, in their order there.
    KEYS = ("policy", "row", "equalise", "variant_ratio", "capacity", "label", "kind", "requested_budget", "size",
            "ratio", "realised_budget", "average_cache", "full_average_cache", "decode_steps", "metrics", "stderr",
            "groups", "plans", "seconds", "samples")

    def as_dict(self) -> dict[str, Any]:
        """The cell as ``results.json`` holds it (``command`` last, once it is set)."""
        out = {k: getattr(self, k) for k in self.KEYS}
        if self.command is not None:
            out["command"] = self.command
        return out


@dataclass
class TaskResult:
    """One task's results: what the task says of itself (``info``: its ``describe()``), the samples'
    sizes, the wall time, its cells, and the command that reruns it."""

    info: dict[str, Any]
    n_samples: int = 0
    prompt_tokens: dict[str, float] = field(default_factory=dict)
    decode_steps_per_sample: int = 0
    seconds: float = 0.0
    cells: list[CellResult] = field(default_factory=list)
    command: str | None = None

    @property
    def name(self) -> str:
        return str(self.info.get("name", ""))

    def as_dict(self) -> dict[str, Any]:
        """The task as ``results.json`` holds it."""
        out = {**self.info, "n_samples": self.n_samples, "prompt_tokens": self.prompt_tokens,
               "decode_steps_per_sample": self.decode_steps_per_sample, "seconds": self.seconds,
               "cells": [c.as_dict() for c in self.cells]}
        if self.command is not None:
            out["command"] = self.command
        return out
