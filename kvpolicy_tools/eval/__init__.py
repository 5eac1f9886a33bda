"""Evaluation data and metrics for ``kvpolicy compare`` (no torch import here).

* :mod:`kvpolicy_tools.eval.data` - typed examples, loaders for local files / package-shipped
  text / hub fallbacks, and prompt formatters: one module per data source.
* :mod:`kvpolicy_tools.eval.metrics` - ROUGE (+ the BUZZ geometric mean), SQuAD-normalised
  exact match, perplexity, and how the report shows each metric.
* :mod:`kvpolicy_tools.eval.tasks` - the tasks of ``kvpolicy compare``, one per file; what is
  particular to a task (commands, report sections, plots) is in its hooks.
"""

from __future__ import annotations

from . import data, metrics
from .data import (
    QAExample,
    RetrievalExample,
    SummaryExample,
    TextDoc,
    shared_data_dir,
)
from .metrics import (
    exact_match,
    exact_match_strict,
    normalize_answer,
    perplexity_from_nll,
    rouge,
    rouge_mean,
)

__all__ = [
    "data",
    "metrics",
    "QAExample",
    "RetrievalExample",
    "SummaryExample",
    "TextDoc",
    "shared_data_dir",
    "exact_match",
    "exact_match_strict",
    "normalize_answer",
    "perplexity_from_nll",
    "rouge",
    "rouge_mean",
]
