"""The head-wise properties of the conformance kit (:func:`~kvpolicy.testing.check_policy`):
``ranking`` and ``head_ties``.

``ranking``
    A policy that ranks tokens (:attr:`~kvpolicy.EvictionPolicy.ranks_tokens`: it declares
    :meth:`~kvpolicy.EvictionPolicy.ranking` and :meth:`~kvpolicy.EvictionPolicy.head_budget`,
    so it can be an :class:`~kvpolicy.AdaKV` scorer) keeps with ``select`` exactly the
    ``head_budget`` tokens of each head that its ``ranking`` evicts last, the protected ones among
    them: what AdaKV keeps at ``alpha_safeguard=1``, "the scorer itself, token for token". A
    ranking that disagrees with ``select`` (e.g. reversed) would make AdaKV keep other tokens
    than the scorer it wraps. Checked on drawn views (several heads, ties, NaN scores).
``head_ties``
    :class:`~kvpolicy.AdaKV` (and any subclass) shares a layer's budget out as docs/policies.md
    says, ties between heads included: tokens of two heads equal in every ranking key go in head
    order, **the lower head's first**. Checked against :func:`documented_headwise_keep`, the rule
    read literally, on drawn views whose heads hold the same positions with the same few score
    levels (so such ties are common), holes and all; on NumPy and, when it takes part, torch views.

Example:
    >>> from kvpolicy import H2O
    >>> check_ranking(H2O(heavy=2, recent=1), np.array([[[3.0, 1.0, 1.0, 2.0, 0.0]]]))
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np

from kvpolicy.policies.adakv import AdaKV, headwise_keep
from kvpolicy.policy import CacheView, EvictionPolicy

from ._driver import ContractViolation

__all__ = ["check_head_ties", "check_ranking", "documented_headwise_keep", "ranking_lengths"]


def ranking_lengths(policy: EvictionPolicy, phase: Literal["prefill", "decode"], count: int = 8, limit: int = 4096) -> list[int]:
    """The first ``count`` cache lengths ``n`` (from 1, below ``limit``) at which ``policy``
    evicts in ``phase`` by its :meth:`~kvpolicy.EvictionPolicy.head_budget`: where ``ranking``
    and ``select`` can be compared (host integers only).

    Example:
        >>> from kvpolicy import H2O
        >>> ranking_lengths(H2O(heavy=2, recent=1), "decode", count=3)
        [4, 5, 6]
    """
    found: list[int] = []
    for n in range(1, limit):
        if policy.head_budget(n, phase) is not None:
            found.append(n)
            if len(found) == count:
                break
    return found


def check_ranking(
    policy: EvictionPolicy,
    scores: np.ndarray,
    positions: np.ndarray | None = None,
    n_seen: int | None = None,
    phase: Literal["prefill", "decode"] = "decode",
) -> None:
    """Check the ``ranking`` property on one view: ``select`` keeps, in every head, the
    ``head_budget(n, phase)`` tokens that ``ranking`` evicts last (:func:`headwise_keep` with a
    floor of the whole budget, i.e. AdaKV at ``alpha_safeguard=1``). Nothing to check for a
    policy that does not rank tokens, or declines to evict at this length.

    Args:
        policy: the policy.
        scores: ``[batch, heads, n]`` the view's scores (NaN allowed: it ranks as ``-inf``).
        positions: ``[batch, heads, n]`` ascending positions (default ``0 .. n - 1``).
        n_seen: tokens seen (default: the last position plus one).
        phase: the view's phase.

    Raises :class:`~kvpolicy.testing.ContractViolation` naming the head and both keeps.
    """
    if not policy.ranks_tokens:
        return
    scores = np.asarray(scores, dtype=np.float64)
    n = scores.shape[-1]
    if positions is None:
        positions = np.broadcast_to(np.arange(n, dtype=np.int64), scores.shape).copy()
    positions = np.asarray(positions, dtype=np.int64)
    n_seen = int(positions.max()) + 1 if n_seen is None else n_seen
    budget = policy.head_budget(n, phase)
    if budget is None:
        return
    keep = policy.select(CacheView(positions, scores, n_seen, policy.init_state(), phase))
    if keep is None:
        raise ContractViolation(
            f"{policy!r}: head_budget({n}, {phase!r}) is {budget}, but select() kept every one of the {n} tokens: "
            "head_budget must say what select keeps (AdaKV shares out the layer's budget from it)"
        )
    keep = np.asarray(keep)
    # AdaKV ranks views whose state is its own; the scorer's ranking sees an empty one
    ranking = policy.ranking(CacheView(positions, scores, n_seen, {}, phase))
    view = CacheView(positions, scores, n_seen, {}, phase)
    heads = scores.shape[1]
    expected = np.asarray(headwise_keep(view, ranking, heads * budget, budget))
    for b in range(scores.shape[0]):
        for h in range(heads):
            kept = sorted(int(s) for s in np.broadcast_to(keep, (scores.shape[0], heads, keep.shape[-1]))[b, h])
            ranked = sorted(int(s) for s in expected[b, h] if s >= 0)
            if kept != ranked:
                raise ContractViolation(
                    f"{policy!r}'s ranking() does not order the tokens as its select() keeps them: on a {phase} view of "
                    f"{n} tokens (positions {positions[b, h].tolist()}, scores {scores[b, h].tolist()}, row {b}, head {h}) "
                    f"select() kept slots {kept}, but the {budget} tokens (head_budget) its ranking() evicts last, the "
                    f"protected ones among them, are slots {ranked}. AdaKV ranks the heads with ranking(), so over this "
                    "policy at alpha_safeguard=1 it would keep other tokens than the policy itself: make ranking()'s keys "
                    "order the tokens as select() evicts them (the smallest first) and protect what select() always keeps"
                )


def documented_headwise_keep(view: CacheView, ranking: Any, budget: int, floor: int) -> list[list[list[int]]]:
    """docs/policies.md's head-wise rule read literally, one token at a time (the oracle of the
    ``head_ties`` property; :func:`~kvpolicy.policies.headwise_keep` is the array version): per
    row, each head keeps its protected tokens and its ``floor`` best by the ranking keys; of the
    rest, over all heads, the smallest keys go first, and of tokens equal in every key **the lower
    head's** (then the earlier slot), until ``budget`` tokens remain. Returns the kept slots,
    ``[batch][head]`` lists.

    Example:
        >>> from kvpolicy import Ranking
        >>> s = np.ones((1, 2, 3))
        >>> view = CacheView(np.broadcast_to(np.arange(3), (1, 2, 3)).copy(), s, 3)
        >>> documented_headwise_keep(view, Ranking(np.zeros((1, 2, 3), bool), (s, view.positions)), 5, 0)
        [[[1, 2], [0, 1, 2]]]
    """
    positions = np.asarray(view.positions)
    protected = np.asarray(ranking.protected)
    keys = [np.where(np.isnan(k), -np.inf, k) if np.issubdtype(k.dtype, np.floating) else k
            for k in (np.asarray(key) for key in ranking.keys)]
    batch, heads, n = positions.shape
    kept_all = []
    for b in range(batch):
        entries = []  # (key, head, slot) of every token outside its head's protected and floor best
        kept = [set() for _ in range(heads)]
        for h in range(heads):
            held = [j for j in range(n) if positions[b, h, j] >= 0]
            key = {j: tuple(k[b, h, j].item() for k in keys) for j in held}
            order = sorted(held, key=lambda j: (bool(protected[b, h, j]), key[j], j))  # eviction order, protected last
            must = set(order[max(len(order) - floor, 0):]) if floor else set()  # (all it holds, if fewer)
            must |= {j for j in held if protected[b, h, j]}
            kept[h] |= set(held)
            entries += [(key[j], h, j) for j in held if j not in must]
        for _, h, j in sorted(entries)[: max(sum(len(k) for k in kept) - budget, 0)]:
            kept[h].discard(j)
        kept_all.append([sorted(k) for k in kept])
    return kept_all


def check_head_ties(
    policy: EvictionPolicy,
    scores: np.ndarray,
    positions: np.ndarray,
    n_seen: int | None = None,
    phase: Literal["prefill", "decode"] = "decode",
    *,
    torch: bool = False,
) -> None:
    """Check the ``head_ties`` property on one view of an :class:`~kvpolicy.AdaKV` (or subclass):
    ``select`` keeps what :func:`documented_headwise_keep` (docs/policies.md, literally: the
    lower head's token first on a tie in every key) keeps with the scorer's ranking. ``positions``
    ``[batch, heads, n]`` may lead a head with holes (``-1``). ``torch``: on a torch view too.
    Nothing to check for another policy, or where it does not evict.
    """
    if not isinstance(policy, AdaKV):
        return
    scores = np.asarray(scores, dtype=np.float64)
    positions = np.asarray(positions, dtype=np.int64)
    n_seen = int(positions.max()) + 1 if n_seen is None else n_seen
    view = CacheView(positions, scores, n_seen, policy.init_state(), phase)
    share = policy.head_share(view)
    if share is None:
        return
    held_scores = np.where(positions >= 0, scores, 0.0)  # (AdaKV's scorer ranks holes as score 0)
    ranking = policy.scorer.ranking(CacheView(positions, held_scores, n_seen, {}, phase))
    want = documented_headwise_keep(view, ranking, positions.shape[1] * share, policy.floor_of(share))
    views: list[tuple[str, Any]] = [("NumPy", view)]
    if torch:
        import torch as th  # (here: torch is optional for the kit, and heavy)

        views.append(("torch", CacheView(th.as_tensor(positions), th.as_tensor(scores), n_seen, policy.init_state(), phase)))
    for name, shown in views:
        keep = policy.select(shown)
        got = np.asarray(keep.tolist() if keep is not None else np.broadcast_to(np.arange(positions.shape[-1]), positions.shape))
        for b in range(positions.shape[0]):
            for h in range(positions.shape[1]):
                mine = sorted(int(j) for j in got[b, h] if j >= 0 and positions[b, h, j] >= 0)
                if mine != want[b][h]:
                    raise ContractViolation(
                        f"{policy!r} broke ties between heads otherwise than docs/policies.md says ({name} view, "
                        f"{phase}, row {b}): of the tokens outside the floors and protected windows, the smallest ranking "
                        f"keys go first, and of tokens of two heads equal in every key the lower head's; so head {h} "
                        f"keeps slots {want[b][h]}, but select() kept {mine} (positions {positions[b].tolist()}, scores "
                        f"{scores[b].tolist()})"
                    )
