"""Text-generation metrics for the ``kvpolicy compare`` evaluations.

Pure Python (``rouge_score`` is imported lazily, only by the ROUGE functions), so the
module imports cheaply and :func:`normalize_answer` / :func:`exact_match` can be used
by the data layer without any optional dependency.

* ROUGE-1/2/L F-measure with Porter stemming (``rouge_score``), the XSum/CNN-DM metrics
  the H2O and BUZZ papers report, and :func:`rouge_mean`, the geometric mean of the
  three that the BUZZ paper uses as its single summarisation number.
* SQuAD-style answer normalisation and the lost-in-the-middle "best subspan" exact
  match (any normalised gold answer occurs inside the normalised prediction), plus a
  strict whole-string variant.
* Perplexity from a summed negative log-likelihood.
"""

from __future__ import annotations

import functools
import math
import re
import string
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ROUGE_KEYS",
    "rouge",
    "rouge_mean",
    "corpus_rouge",
    "normalize_answer",
    "exact_match",
    "exact_match_strict",
    "perplexity_from_nll",
    "METRICS",
    "MetricInfo",
    "metric_info",
]

ROUGE_KEYS: tuple[str, str, str] = ("rouge1", "rouge2", "rougeL")

_PUNCT = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


@functools.lru_cache(maxsize=1)
def _scorer() -> Any:
    try:
        from rouge_score import rouge_scorer  # optional: the eval extra
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "ROUGE needs the 'rouge-score' package: pip install rouge-score "
            "(or pip install 'kvpolicy[eval]')"
        ) from exc
    return rouge_scorer.RougeScorer(list(ROUGE_KEYS), use_stemmer=True)


def rouge(prediction: str, reference: str | Sequence[str]) -> dict[str, float]:
    """ROUGE-1, ROUGE-2 and ROUGE-L F-measures (Porter stemming on).

    With several references, each metric is the maximum over the references.

    >>> rouge("the cat sat", "the cat sat")
    {'rouge1': 1.0, 'rouge2': 1.0, 'rougeL': 1.0}
    >>> round(rouge("the cat", "the cat sat on the mat")["rouge1"], 4)  # P=1, R=2/6
    0.5
    """
    refs = [reference] if isinstance(reference, str) else list(reference)
    if not refs:
        raise ValueError("rouge() needs at least one reference")
    scorer = _scorer()
    best = dict.fromkeys(ROUGE_KEYS, 0.0)
    for ref in refs:
        scores = scorer.score(ref, prediction)  # rouge_score takes (target, prediction)
        for k in ROUGE_KEYS:
            best[k] = max(best[k], float(scores[k].fmeasure))
    return best


def rouge_mean(scores: Mapping[str, float]) -> float:
    """Geometric mean of ROUGE-1, ROUGE-2 and ROUGE-L (the BUZZ paper's "mean").

    >>> rouge_mean({"rouge1": 0.5, "rouge2": 0.25, "rougeL": 0.5}) == (0.5 * 0.25 * 0.5) ** (1 / 3)
    True
    >>> rouge_mean({"rouge1": 0.4, "rouge2": 0.0, "rougeL": 0.3})
    0.0
    """
    vals = [float(scores[k]) for k in ROUGE_KEYS]
    if any(v < 0 for v in vals):
        raise ValueError(f"ROUGE scores must be non-negative, got {vals}")
    if any(v == 0.0 for v in vals):
        return 0.0
    return math.exp(sum(math.log(v) for v in vals) / len(vals))


def corpus_rouge(
    predictions: Iterable[str], references: Iterable[str | Sequence[str]]
) -> dict[str, float]:
    """Average per-example ROUGE over a corpus, plus ``"mean"`` (:func:`rouge_mean` of the averages).

    >>> corpus_rouge(["a b", "c d"], ["a b", "c d"])["mean"]
    1.0
    """
    totals = dict.fromkeys(ROUGE_KEYS, 0.0)
    n = 0
    for pred, ref in zip(predictions, references, strict=True):
        s = rouge(pred, ref)
        for k in ROUGE_KEYS:
            totals[k] += s[k]
        n += 1
    if n == 0:
        raise ValueError("corpus_rouge() needs at least one prediction")
    out = {k: v / n for k, v in totals.items()}
    out["mean"] = rouge_mean(out)
    return out


def normalize_answer(s: str) -> str:
    """SQuAD answer normalisation: lowercase, drop punctuation, drop articles, collapse spaces.

    >>> normalize_answer("  The  Eiffel-Tower! ")
    'eiffeltower'
    >>> normalize_answer("An apple a day")
    'apple day'
    """
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def _answers(answers: str | Iterable[str]) -> list[str]:
    return [answers] if isinstance(answers, str) else list(answers)


def exact_match(prediction: str, answers: str | Iterable[str]) -> float:
    """Lost-in-the-middle "best subspan" EM: 1.0 if any normalised answer occurs in the normalised prediction.

    Answers that normalise to the empty string (e.g. ``"the"``) are ignored, because the
    empty string is a substring of everything.

    >>> exact_match("The answer is Wilhelm Conrad Röntgen.", ["Wilhelm Conrad Röntgen"])
    1.0
    >>> exact_match("Marie Curie", ["Wilhelm Conrad Röntgen", "Röntgen"])
    0.0
    """
    pred = normalize_answer(prediction)
    for ans in _answers(answers):
        gold = normalize_answer(ans)
        if gold and gold in pred:
            return 1.0
    return 0.0


def exact_match_strict(prediction: str, answers: str | Iterable[str]) -> float:
    """SQuAD strict EM: 1.0 if the normalised prediction equals some normalised answer.

    >>> exact_match_strict("the Beatles.", ["Beatles"])
    1.0
    >>> exact_match_strict("It was the Beatles", ["Beatles"])
    0.0
    """
    pred = normalize_answer(prediction)
    return 1.0 if any(pred == normalize_answer(a) for a in _answers(answers)) else 0.0


def perplexity_from_nll(total_nll: float, n_tokens: int) -> float:
    """Perplexity ``exp(total_nll / n_tokens)`` from a summed natural-log NLL.

    A uniform distribution over ``V`` tokens has NLL ``log V`` per token, so its
    perplexity is ``V``:

    >>> round(perplexity_from_nll(10 * math.log(50), 10), 6)
    50.0
    """
    if n_tokens <= 0:
        raise ValueError(f"n_tokens must be positive, got {n_tokens}")
    if not math.isfinite(total_nll):
        raise ValueError(f"total_nll must be finite, got {total_nll}")
    return math.exp(total_nll / n_tokens)


# =========================================================================== how a metric is shown
@dataclass(frozen=True)
class MetricInfo:
    """How the report shows a metric: its name, whether its values are shares in ``[0, 1]`` shown
    in percent (ROUGE, exact match, recall) or values shown as they are (perplexity: two decimals,
    log-scaled plots), and which way is better.

    Example:
        >>> metric_info("ppl").title, metric_info("ppl").percent, metric_info("em").percent
        ('perplexity', False, True)
    """

    title: str
    #: a share in [0, 1], shown in percent (tables and plots); otherwise a value shown as it is (2
    #: decimals, log-scaled plot axes, a ratio to the full cache instead of a difference in points)
    percent: bool = True
    #: lower is better (perplexity): a policy keeps "99% of the full cache's" value at full / value >= 0.99
    lower_is_better: bool = False


#: The metrics of the built-in tasks, by the key their ``score`` returns. A plug-in task's metric
#: not listed here is named by its key and shown with 4 significant digits.
METRICS: dict[str, MetricInfo] = {
    "ppl": MetricInfo("perplexity", percent=False, lower_is_better=True),
    "rouge1": MetricInfo("ROUGE-1"),
    "rouge2": MetricInfo("ROUGE-2"),
    "rougeL": MetricInfo("ROUGE-L"),
    "mean": MetricInfo("mean ROUGE (geometric)"),
    "em": MetricInfo("exact match"),
    "recall": MetricInfo("needle-word recall"),
    "string_match": MetricInfo("string match"),
}


def metric_info(key: str) -> MetricInfo | None:
    """The :class:`MetricInfo` of a built-in metric key (``None`` for a plug-in task's own)."""
    return METRICS.get(key)
