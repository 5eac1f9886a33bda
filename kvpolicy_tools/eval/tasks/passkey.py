"""``passkey``: a pass key at depths of haystacks of given lengths, on ``needle``'s grid (exact match)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import metrics as M
from .base import Sample, register_task
from .needle import NeedleTask


@register_task
class PasskeyTask(NeedleTask):
    """Passkey retrieval (a 5-digit number at each depth); exact match."""

    name = "passkey"
    title = "Passkey retrieval (exact match)"
    metric = "em"
    metrics = ("em",)
    default_max_new_tokens = 8
    answer_prefix = "The pass key is"
    help = "passkey retrieval on the same grid (exact match); SmolLM2-135M fails it even with the full cache"

    def _needle_for(self, k: int) -> tuple[str, str, str]:
        key = str(10000 + int(np.random.default_rng(self.opt.seed * 1000 + k).integers(0, 90000)))
        return f"The pass key is {key}. Remember it. {key} is the pass key.", "What is the pass key?", key

    def score(self, sample: Sample, output: dict[str, Any]) -> dict[str, float]:
        return {"em": M.exact_match(output["text"], [sample.target["answer"]])}
