"""What the conformance kit watches around every ``select()`` call of a policy it checks:
:func:`watched` (used by :func:`~kvpolicy.testing.check_policy` on every drawn policy).

* **The deadline.** ``settings.deadline`` (hypothesis's, e.g. ``settings(deadline=200)``;
  ``None`` in the kit's profiles) bounds each ``select()`` call, the policy's own decision, not a
  whole example (one example replays dozens of steps on two backends). A call over it is timed
  again on the same view, so that one pause of the machine fails nothing; over it twice, the check
  fails naming the call and both times.
* **State kept outside ``view.state``.** A policy object is shared by every layer, row and
  sequence of a model, and its class by every such object: a ``select()`` that changes an
  attribute of either (``type(self).calls += 1``, ``self.seen.append(...)``) decides from state
  no backend keeps per sequence. Every plain attribute of the policy and of its classes is
  compared before and after each call; a change fails the check naming the attribute, instead of
  surfacing later as a replay that differs from itself (hypothesis's ``FlakyFailure``).

Example:
    >>> from kvpolicy import StreamingLLM
    >>> policy = watch(StreamingLLM(sink=1, window=2), deadline=None)
    >>> import numpy as np, kvpolicy_numpy
    >>> kvpolicy_numpy.replay(policy, np.zeros((6, 1, 6))).kept[5].tolist()
    [[0, 4, 5]]
"""

from __future__ import annotations

import copy
import functools
import time
from datetime import timedelta
from typing import Any

from hypothesis import strategies as st

from kvpolicy.policy import CacheView, EvictionPolicy

from ._driver import ContractViolation

__all__ = ["shared_state", "watch", "watched"]

#: The instance attribute :func:`watch` sets (the timed, watched ``select``).
_ATTRIBUTE = "select"


_PLAIN = (int, float, str, bool, bytes, type(None))


def _fingerprint(value: Any) -> Any:
    """A value to compare ``value`` by, cheaply (this runs twice per ``select()`` call): plain
    values as themselves, a policy (e.g. AdaKV's scorer) by its own attributes, anything else
    (lists, dicts, arrays: what changes in place) by its ``repr``, a hashable object by its identity."""
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, EvictionPolicy):
        return tuple((k, _fingerprint(v)) for k, v in getattr(value, "__dict__", {}).items() if _is_state(type(value), k))
    if isinstance(value, tuple):
        return tuple(_fingerprint(v) for v in value)
    try:
        hash(value)
    except TypeError:
        return repr(value)  # a list, dict, set or array: it may change in place
    return ("object", id(value))  # hashable (a frozen dataclass, a Param): replaced, not changed, if at all


#: ``cls -> (len(vars(cls)), its plain data attribute names)``: found again when a class gains an attribute.
_CLASS_DATA: dict[type, tuple[int, list[str]]] = {}


def _class_data(cls: type) -> list[str]:
    """The plain data attributes ``cls`` itself defines (no methods, descriptors or private names)."""
    size = len(vars(cls))
    known = _CLASS_DATA.get(cls)
    if known is None or known[0] != size:
        names = [name for name, value in vars(cls).items()
                 if not (name.startswith("_") or callable(value) or hasattr(value, "__get__"))]
        known = _CLASS_DATA[cls] = (size, names)
    return known[1]


def shared_state(policy: EvictionPolicy) -> dict[str, Any]:
    """``{"Class.name" or "self.name": fingerprint}`` of the plain data attributes of ``policy``
    and of the classes it is made of (its own and its bases' up to, not including, kvpolicy's
    :class:`~kvpolicy.EvictionPolicy`): what a ``select()`` call must leave as it found.
    Methods, properties and other descriptors are left out.

    Example:
        >>> from kvpolicy import H2O
        >>> state = shared_state(H2O(heavy=2, recent=1))
        >>> state["self.heavy"], state["H2O.name"]
        (2, 'h2o')
    """
    found: dict[str, Any] = {}
    for cls in type(policy).__mro__:
        if cls is EvictionPolicy or cls is object:
            break
        for name in _class_data(cls):
            found.setdefault(f"{cls.__name__}.{name}", _fingerprint(vars(cls)[name]))
    for name, value in getattr(policy, "__dict__", {}).items():
        if _is_state(type(policy), name):
            found[f"self.{name}"] = _fingerprint(value)
    return found


def _is_state(cls: type, name: str) -> bool:
    """Whether instance attribute ``name`` can be state: not the watched ``select`` and not a
    ``functools.cached_property``'s value (computed once, on first use, e.g. StreamingLLM's ``rule``)."""
    return name != _ATTRIBUTE and not isinstance(getattr(cls, name, None), functools.cached_property)


def watch(policy: EvictionPolicy, deadline: timedelta | None) -> EvictionPolicy:
    """A shallow copy of ``policy`` (equal to it) whose ``select()`` calls are watched: a call
    over ``deadline`` twice on the same view, or that changes :func:`shared_state`, raises
    :class:`~kvpolicy.testing.ContractViolation`. ``policy`` itself is left as it is."""
    watched_policy = copy.copy(policy)
    select = type(policy).select.__get__(watched_policy)
    limit = None if deadline is None else deadline.total_seconds()

    def timed(view: CacheView) -> Any:
        before = shared_state(watched_policy)
        state = dict(view.state)
        start = time.perf_counter()
        keep = select(view)
        took = time.perf_counter() - start
        after = shared_state(watched_policy)
        # (an instance attribute first set here, e.g. a functools.cached_property, is not state
        # yet: it counts once a later call changes it)
        changed = sorted(k for k in set(before) | set(after)
                         if before.get(k) != after.get(k) and not (k.startswith("self.") and k not in before))
        if changed:
            name = changed[0]
            raise ContractViolation(
                f"{policy!r}: select() changed {name} (from {before.get(name, '(unset)')} to {after.get(name, '(unset)')})"
                f"{' and ' + ', '.join(changed[1:]) if changed[1:] else ''} at n_seen={view.n_seen}: one policy object, "
                "and its class, decide for every layer, row and sequence of a model, so state kept there leaks between "
                "them (and makes replays of the same input differ). Keep per-sequence state in view.state (a dict of "
                "host ints, one per layer and row) or derive it from view.n_seen"
            )
        if limit is not None and took > limit:
            again = CacheView(view.positions, view.scores, view.n_seen, state, view.phase)
            start = time.perf_counter()
            select(again)
            retook = time.perf_counter() - start
            if retook > limit:
                raise ContractViolation(
                    f"{policy!r}: select() took {took * 1e3:.0f} ms, and {retook * 1e3:.0f} ms again on the same view "
                    f"({view.n_cached} tokens cached, n_seen={view.n_seen}), over the deadline of {limit * 1e3:g} ms per "
                    "select() call (settings.deadline; deadline=None lifts it)"
                )
        return keep

    object.__setattr__(watched_policy, _ATTRIBUTE, timed)
    return watched_policy


def watched(strategy: st.SearchStrategy[EvictionPolicy], deadline: timedelta | int | float | None) -> st.SearchStrategy[EvictionPolicy]:
    """``strategy`` with every drawn policy :func:`watch` ed (``deadline`` as hypothesis takes it:
    a ``timedelta`` or milliseconds)."""
    if deadline is not None and not isinstance(deadline, timedelta):
        deadline = timedelta(milliseconds=deadline)
    return strategy.map(lambda policy: watch(policy, deadline))
