"""Policy-declared invariants: what a policy promises beyond the common contract.

An invariant is a callable ``invariant(policy, kept, t)``: ``kept`` is the ``[heads, n]`` int
array of positions one sequence keeps right after token ``t`` was processed (and the policy had
its evictions); it returns ``None`` / ``True`` when the promise holds, and returns ``False`` or
raises ``AssertionError`` (with a message) when it does not. :func:`~kvpolicy.testing.check_policy`
checks them after every step, on every example. A policy can also declare its own as a method,
``def invariants(self, kept, t)``, found automatically.

The helpers below cover the usual promises. Sizes may be an int or the *name* of a policy
attribute (``keeps_first("sink")`` reads ``policy.sink``), so one invariant serves every drawn
parameter set.

Example:
    >>> import numpy as np
    >>> from kvpolicy import StreamingLLM
    >>> inv = keeps_first("sink")
    >>> inv(StreamingLLM(sink=2, window=3), np.array([[0, 1, 7, 8, 9]]), 9)
    >>> inv(StreamingLLM(sink=2, window=3), np.array([[0, 7, 8, 9]]), 9)
    Traceback (most recent call last):
    ...
    AssertionError: keeps_first('sink'): position(s) [1] of the first 2 are not kept after token 9 (head 0 keeps [0, 7, 8, 9])
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from kvpolicy import BUZZ, H2O, TOVA, FullCache, KeyDiff, Knorm, LocalWindow, Scissorhands, SnapKV, StreamingLLM

__all__ = ["Invariant", "builtin_invariants", "follows_builtin_rules", "keeps_everything", "keeps_first", "keeps_last", "policy_invariants", "run_invariants"]

Invariant = Callable[[Any, np.ndarray, int], "bool | None"]


class _Named:
    """An invariant with a replayable ``repr`` (``kvpolicy.testing.keeps_first('sink')``)."""

    def __init__(self, fn: Invariant, name: str) -> None:
        self.fn, self.__name__ = fn, name

    def __call__(self, policy: Any, kept: np.ndarray, t: int) -> Any:
        return self.fn(policy, kept, t)

    def __repr__(self) -> str:
        return f"kvpolicy.testing.{self.__name__}"


def _size(policy: Any, size: int | str) -> int:
    return int(getattr(policy, size) if isinstance(size, str) else size)


def _require_kept(kept: np.ndarray, want: range, name: str, span: str, t: int) -> None:
    """``AssertionError`` naming the first head that lost a position of ``want`` after token ``t``."""
    for h, row in enumerate(np.asarray(kept)):
        have = set(row.tolist())
        lost = [p for p in want if p not in have]
        if lost:
            raise AssertionError(
                f"{name}: position(s) {lost} of {span} are not kept after token {t} (head {h} keeps {row.tolist()})"
            )


def keeps_first(size: int | str) -> Invariant:
    """The first ``size`` positions (attention sinks) are never evicted."""

    def invariant(policy: Any, kept: np.ndarray, t: int) -> None:
        n = _size(policy, size)
        _require_kept(kept, range(min(n, t + 1)), f"keeps_first({size!r})", f"the first {n}", t)

    return _Named(invariant, f"keeps_first({size!r})")


def keeps_last(size: int | str) -> Invariant:
    """The last ``size`` positions (a recent window) are always kept."""

    def invariant(policy: Any, kept: np.ndarray, t: int) -> None:
        n = _size(policy, size)
        want = range(max(0, t - n + 1), t + 1)
        _require_kept(kept, want, f"keeps_last({size!r})", f"the last {len(want)}", t)

    return _Named(invariant, f"keeps_last({size!r})")


def keeps_everything() -> Invariant:
    """Nothing is ever evicted (the full cache)."""

    def invariant(policy: Any, kept: np.ndarray, t: int) -> None:
        for h, row in enumerate(np.asarray(kept)):
            if row.tolist() != list(range(t + 1)):
                raise AssertionError(f"keeps_everything: head {h} keeps {row.tolist()} after token {t}")

    return _Named(invariant, "keeps_everything()")


def builtin_invariants(policy: Any) -> list[Invariant]:
    """What each built-in policy promises: BUZZ and StreamingLLM keep their sink and window, H2O
    and TOVA (and Scissorhands, Knorm, KeyDiff) their recent tokens, SnapKV its observation window, the local window its window, the full cache everything. Matched by exact
    type (a subclass may change the rules); ``[]`` for any other policy."""
    kind = type(policy)
    if kind is SnapKV:
        return [keeps_last("window")]
    if kind in (BUZZ, StreamingLLM):
        return [keeps_first("sink"), keeps_last("window")]
    if kind in (H2O, TOVA, Scissorhands, Knorm, KeyDiff):
        return [keeps_last("recent")]
    if kind is LocalWindow:
        return [keeps_last("window")]
    if kind is FullCache:
        return [keeps_everything()]
    return []


def _follows_builtin_rules(policy: Any, kept: np.ndarray, t: int) -> None:
    run_invariants(builtin_invariants(policy), policy, kept, t)


#: One invariant that checks :func:`builtin_invariants` of whatever policy it is given.
follows_builtin_rules: Invariant = _Named(_follows_builtin_rules, "follows_builtin_rules")


def policy_invariants(policy: Any, extra: Invariant | Sequence[Invariant] | None = None) -> list[Invariant]:
    """``extra`` (one callable or several) plus the policy's own ``invariants(kept, t)`` method."""
    out: list[Invariant] = []
    if extra is not None:
        out.extend([extra] if callable(extra) else list(extra))
    method = getattr(policy, "invariants", None)
    if callable(method):
        out.append(lambda p, kept, t, _m=method: _m(kept, t))
        out[-1].__name__ = f"{type(policy).__name__}.invariants"  # type: ignore[attr-defined]
    return out


def run_invariants(invariants: Sequence[Invariant], policy: Any, kept: np.ndarray, t: int) -> None:
    """Run every invariant; raise ``AssertionError`` naming the first that fails."""
    for inv in invariants:
        try:
            ok = inv(policy, kept, t)
        except AssertionError as e:
            name = getattr(inv, "__name__", repr(inv))
            msg = str(e)
            raise AssertionError(msg if msg.startswith(name) else f"{name}: {msg}") from None
        if ok is False:
            name = getattr(inv, "__name__", repr(inv))
            raise AssertionError(f"{name} does not hold after token {t}: kept {np.asarray(kept).tolist()}")
