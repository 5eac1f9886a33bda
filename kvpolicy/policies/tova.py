"""TOVA (Oren et al., 2024, "Transformers are Multi-State RNNs", Token Omission Via Attention)."""

from __future__ import annotations

from ..registry import register_policy
from .lowest import KeepHighest


@register_policy
class TOVA(KeepHighest):
    """Keep ``size`` tokens; at capacity drop the one the *current* query attends to least.

    A token's score is the attention it received from the latest query only (``score_statistic
    = "latest"``: a decode step's query, or a prompt's last row), summed over the query heads of
    its KV head, not accumulated over the run as in H2O. While the cache holds more than ``size``
    tokens, the token with the lowest score outside the last ``recent`` positions is evicted
    (ties: the earliest position; a NaN score counts as ``-inf``). In decode that is one token per
    step, the paper's rule; after a prompt longer than ``size`` the ``size`` tokens the prompt's
    last query attends to most are kept (the ``recent`` newest among them).

    Parameters:
        size: tokens kept between steps, the paper's multi-state size (>= 1).
        recent: newest tokens never evicted (0 to ``size - 1``; default 0: the paper has no
            recent window).
        selection: ``"shared"`` (default since issue 27): scores summed over all heads of the
            layer, the same tokens kept on every head, the paper's variant (it averages the
            attention over a layer's heads; a sum ranks the same way) and kvpress's
            ``TOVAPress``; ``"per_head"``: every KV head keeps its own tokens (GQA: scores summed
            over the head's query heads). ``repr`` always names it.

    Example:
        >>> from kvpolicy import TOVA
        >>> TOVA(size=64).capacity, TOVA(size=64)
        (65, TOVA(size=64, recent=0, selection='shared'))
    """

    name = "tova"
    score_statistic = "latest"
    default_selection = "shared"
