"""Policy registry: built-ins, presets, and third-party policies from the ``kvpolicy.policies``
entry-point group.

A third-party package registers its policy either by decorating the class with
:func:`register_policy` (when its module is imported) or, to be found without an import, by
declaring an entry point::

    [project.entry-points."kvpolicy.policies"]
    every_kth = "my_package.policies:EveryKth"
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import inspect
from dataclasses import dataclass, field
from typing import Any, Iterator, TypeVar

from .validation import check_bool
from .policy import EvictionPolicy

__all__ = ["register_policy", "isolated_registry", "mark_builtin_policies", "is_builtin_policy", "get_policy", "create_policy", "available_policies", "Preset", "ENTRY_POINT_GROUP"]

ENTRY_POINT_GROUP = "kvpolicy.policies"

_REGISTRY: dict[str, "type[EvictionPolicy] | Preset"] = {}
_ALIASES = {
    "full_cache": "full",
    "fullcache": "full",
    "local_window": "local",
    "localwindow": "local",
    "streamingllm": "streaming_llm",
    "streaming": "streaming_llm",
    "buzz_log_n": "buzz_logn",
}
_entry_points_loaded = False
#: Names kvpolicy itself registered, and their classes (see :func:`mark_builtin_policies`).
_BUILTINS: set[str] = set()
_BUILTIN_CLASSES: set[type] = set()

P = TypeVar("P", bound="type[EvictionPolicy]")


@dataclass(frozen=True)
class Preset:
    """A registered name for a policy class with some parameters fixed (e.g. ``buzz_logn``)."""

    cls: "type[EvictionPolicy]"
    fixed: dict[str, Any] = field(default_factory=dict)
    doc: str = ""

    @property
    def name(self) -> str:
        return next((k for k, v in _REGISTRY.items() if v is self), self.cls.name)

    def __call__(self, **params: Any) -> "EvictionPolicy":
        return self.cls(**self.with_fixed(params))

    def from_size(self, size: int, **overrides: Any) -> "EvictionPolicy":
        return self.cls.from_size(size, **self.with_fixed(overrides))

    def with_fixed(self, params: dict[str, Any]) -> dict[str, Any]:
        """``params`` with the preset's fixed parameters added; ``ValueError`` naming the
        parameter when one of ``params`` sets a fixed parameter to another value (the preset
        would silently become another policy: ``adakv_h2o`` with ``scorer="keydiff"``).

        Example:
            >>> get_policy("adakv_h2o").with_fixed({"scorer": "keydiff"})
            Traceback (most recent call last):
            ...
            ValueError: scorer='keydiff' conflicts with the preset 'adakv_h2o', which fixes scorer='h2o': drop the override, or use the policy 'adakv' with scorer='keydiff'
        """
        for key, value in params.items():
            if key in self.fixed and not _same_value(value, self.fixed[key]):
                raise ValueError(
                    f"{key}={value!r} conflicts with the preset {self.name!r}, which fixes {key}={self.fixed[key]!r}: "
                    f"drop the override, or use the policy {self.cls.name!r} with {key}={value!r}"
                )
        return {**params, **self.fixed}  # (a restated name in the preset's spelling)

    @property
    def min_size(self) -> int:
        return self.cls.min_size


def _same_value(given: Any, fixed: Any) -> bool:
    """Whether an override restates a preset's fixed value (registry names in any spelling)."""
    if isinstance(given, str) and isinstance(fixed, str):
        return normalize_name(given) == normalize_name(fixed)
    return bool(given == fixed)


def _spelling(name: str) -> str:
    return name.strip().lower().replace("-", "_").replace(" ", "_")


def normalize_name(name: str) -> str:
    key = _spelling(name)
    return _ALIASES.get(key, key)


def mark_builtin_policies() -> frozenset[str]:
    """Record every name registered so far as a built-in (kvpolicy calls it once, after its own
    policies are registered) and return them: :func:`register_policy` refuses to replace a
    built-in, or take one of their aliases, unless it is given ``replace=True``.

    Example:
        >>> "h2o" in mark_builtin_policies()
        True
    """
    _BUILTINS.update(_REGISTRY)
    _BUILTIN_CLASSES.update(e.cls if isinstance(e, Preset) else e for e in _REGISTRY.values())
    return frozenset(_BUILTINS)


def is_builtin_policy(policy: object) -> bool:
    """Whether ``policy`` is an instance of one of kvpolicy's own policy classes exactly (not a
    subclass, which may redefine ``select``), and so is every policy it wraps (a composition's
    parts): the policies the conformance kit holds to the contract in kvpolicy's own CI. The torch
    backend skips the host read of its answer checks for them at decode steps (no sync there).

    Example:
        >>> from kvpolicy import H2O, compose, SnapKV
        >>> is_builtin_policy(H2O(heavy=2, recent=2)), is_builtin_policy(compose(prefill=SnapKV(size=40), decode=H2O(heavy=2, recent=2)))
        (True, True)
    """
    if type(policy) not in _BUILTIN_CLASSES:
        return False
    inner = [v for v in policy.params().values() if isinstance(v, EvictionPolicy)]  # type: ignore[attr-defined]
    return all(is_builtin_policy(v) for v in inner)


def _same_definition(old: object, new: object) -> bool:
    """``new`` is ``old``, or the same definition run again (a module reloaded, a notebook cell re-run)."""
    if old == new:
        return True
    a, b = (x.cls if isinstance(x, Preset) else x for x in (old, new))
    fixed = (getattr(old, "fixed", None), getattr(new, "fixed", None))
    return (a.__module__, a.__qualname__) == (b.__module__, b.__qualname__) and fixed[0] == fixed[1]  # type: ignore[union-attr]


def register_policy(
    cls: P | None = None,
    *,
    name: str | None = None,
    preset: dict[str, Any] | None = None,
    doc: str = "",
    replace: bool = False,
) -> Any:
    """Register an :class:`~kvpolicy.EvictionPolicy` subclass under ``name`` (default: ``cls.name``).

    Usable as a bare decorator, as ``@register_policy(name="x")``, or to register a preset:
    ``register_policy(BUZZ, name="buzz_logn", preset={"log_n": True})``.

    A name that is taken (a built-in such as ``"h2o"``, one of its aliases such as
    ``"streaming"``, or another package's policy) raises ``ValueError`` unless ``replace=True``:
    :func:`make_policy`, the ``kvpolicy`` command and ``kvpolicy compare`` would otherwise run
    the newcomer under the old name without a word. Registering the same definition again (a
    re-imported module) is fine.

    Example:
        >>> from kvpolicy import EvictionPolicy, register_policy, get_policy
        >>> @register_policy
        ... class KeepAll(EvictionPolicy):
        ...     name = "keep_all_example"
        ...     capacity = None
        ...     def select(self, view):
        ...         return None
        >>> get_policy("keep-all-example") is KeepAll
        True
    """

    replace = bool(check_bool("replace", replace))
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise ValueError(f"name must be a non-empty string (or None for the class's own name), got {name!r}")

    def decorate(c: P) -> P:
        if not (inspect.isclass(c) and issubclass(c, EvictionPolicy)):
            raise ValueError(f"register_policy expects an EvictionPolicy subclass, got {c!r}")
        spelled = _spelling(name or c.name or c.__name__)
        if not spelled:
            raise ValueError(f"policy {c.__name__} needs a non-empty `name`")
        entry = Preset(c, dict(preset), doc) if preset else c
        if spelled in _ALIASES:
            if not replace:
                raise ValueError(
                    f"policy name {spelled!r} is an alias of the built-in policy {_ALIASES[spelled]!r}: register "
                    f"{c.__name__} under another name, or pass replace=True to make {spelled!r} name it instead"
                )
            del _ALIASES[spelled]
        old = _REGISTRY.get(spelled)
        if old is not None and not replace and not _same_definition(old, entry):
            taken = old.cls if isinstance(old, Preset) else old
            shown = f"{taken.__module__}.{taken.__qualname__}" + (" (a preset)" if isinstance(old, Preset) else "")
            what = "the built-in policy" if spelled in _BUILTINS else "already registered to"
            raise ValueError(
                f"policy name {spelled!r} is {what} {shown}: register {c.__name__} under another name, or pass replace=True to replace it (make_policy, the "
                "kvpolicy command and compare then run yours under this name)"
            )
        _REGISTRY[spelled] = entry
        return c

    if cls is not None:
        return decorate(cls)
    return decorate


@contextlib.contextmanager
def isolated_registry(*, rescan_entry_points: bool = False) -> Iterator[None]:
    """Forget, when the block ends, every registration made inside it (policies, presets, names
    taken from aliases, entry points scanned): for tests and notebooks that register policies
    without leaking them into the rest of the process.

    Args:
        rescan_entry_points: scan the installed packages' ``kvpolicy.policies`` entry points again
            inside the block (once scanned, they are not read again), e.g. after installing a
            package, or in a test that fakes ``importlib.metadata.entry_points``.

    Example:
        >>> from kvpolicy import H2O, available_policies, register_policy
        >>> with isolated_registry():
        ...     @register_policy
        ...     class Mine(H2O):
        ...         name = "mine_for_the_example"
        ...     print("mine_for_the_example" in available_policies())
        True
        >>> "mine_for_the_example" in available_policies()
        False
    """
    global _entry_points_loaded
    check_bool("rescan_entry_points", rescan_entry_points)
    registered, aliases, scanned = dict(_REGISTRY), dict(_ALIASES), _entry_points_loaded
    if rescan_entry_points:
        _entry_points_loaded = False
    try:
        yield
    finally:
        # put back in place: the dictionaries are the module's, whoever holds them
        _REGISTRY.clear()
        _REGISTRY.update(registered)
        _ALIASES.clear()
        _ALIASES.update(aliases)
        _entry_points_loaded = scanned


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True

    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        key = normalize_name(ep.name)
        if key in _REGISTRY:
            continue
        obj = ep.load()
        if inspect.isclass(obj) and issubclass(obj, EvictionPolicy):
            _REGISTRY[key] = obj
        elif isinstance(obj, Preset):
            _REGISTRY[key] = obj
        else:
            raise ValueError(
                f"entry point {ep.name!r} in group {ENTRY_POINT_GROUP!r} must name an EvictionPolicy "
                f"subclass, got {obj!r}"
            )


def available_policies() -> dict[str, "type[EvictionPolicy] | Preset"]:
    """All registered policies (built-ins, presets, entry points), by name."""
    _load_entry_points()
    return dict(sorted(_REGISTRY.items()))


def get_policy(name: str) -> "type[EvictionPolicy] | Preset":
    """The class (or preset) registered as ``name``; ``ValueError`` listing the known names."""
    if not isinstance(name, str):
        raise ValueError(
            f"policy name must be a string (one of {', '.join(sorted(available_policies()))}), got {name!r}"
        )
    key = normalize_name(name)
    if key not in _REGISTRY:
        _load_entry_points()
    if key not in _REGISTRY:
        known = ", ".join(sorted(_REGISTRY))
        raise ValueError(f"unknown policy {name!r}; known policies: {known}")
    return _REGISTRY[key]


def create_policy(name: str, **params: Any) -> "EvictionPolicy":
    """Instantiate a registered policy by name with explicit parameters.

    Example:
        >>> from kvpolicy import create_policy
        >>> create_policy("streaming-llm", sink=4, window=28)
        StreamingLLM(sink=4, window=28)
    """
    return get_policy(name)(**params)


def signature_of(entry: "type[EvictionPolicy] | Preset") -> list[tuple[str, Any]]:
    """``(parameter, default)`` pairs of a registered entry, for listings."""
    cls = entry.cls if isinstance(entry, Preset) else entry
    fixed = entry.fixed if isinstance(entry, Preset) else {}
    out = []
    for p in inspect.signature(cls.__init__).parameters.values():
        if p.name == "self" or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
            continue
        default = fixed.get(p.name, p.default)
        out.append((p.name, default if default is not inspect.Parameter.empty else None))
    return out

