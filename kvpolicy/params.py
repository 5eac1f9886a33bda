"""Declared policy parameters: a policy states each parameter once, as a :class:`Param` on its class.

From that declaration :class:`~kvpolicy.EvictionPolicy` derives the constructor (positional and
keyword parameters in declaration order, ``selection`` last), validation (a ``ValueError`` naming
the parameter and its allowed range), :meth:`~kvpolicy.EvictionPolicy.params` (so ``repr``,
equality and hashing), the CLI's listings and the hypothesis strategies of the conformance kit
(they read the constructor's signature). A policy that needs more (a derived attribute, a check
across parameters) adds a ``__post_init__`` hook, as dataclasses do.

Example:
    >>> from kvpolicy import CacheView, EvictionPolicy, Param
    >>> class KeepFirst(EvictionPolicy):
    ...     '''Keep the first ``size`` tokens.'''
    ...     name = "keep_first_demo"
    ...     size = Param(int, minimum=1, doc="tokens kept")
    ...     @property
    ...     def capacity(self):
    ...         return self.size + 1
    ...     def select(self, view: CacheView):
    ...         return view.arange(self.size) if view.n_cached > self.size else None
    >>> KeepFirst(8), KeepFirst(8) == KeepFirst(size=8), KeepFirst(8).params()
    (KeepFirst(size=8), True, {'size': 8})
    >>> KeepFirst(0)
    Traceback (most recent call last):
    ...
    ValueError: size must be >= 1, got 0
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Literal

from .validation import check_bool, check_choice, check_float, check_int

__all__ = ["Param", "REQUIRED", "Selection", "declared_params"]

#: How a policy selects (its ``selection`` parameter): one choice per KV head, or one shared by the heads.
Selection = Literal["per_head", "shared"]


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


#: The default of a parameter the caller must give.
REQUIRED: Any = _Required()

class Param:
    """One parameter of a policy, declared as a class attribute (the attribute's name is the
    parameter's unless ``keyword`` renames it).

    Args:
        kind: ``int``, ``float`` or ``bool``; with ``choices``, one of those strings.
        default: the value when the caller gives none (:data:`REQUIRED`: the caller must).
        minimum, maximum: the allowed range (inclusive), or a callable of the policy computing
            it from parameters declared before (checked after every static bound).
        low_open, high_open: exclusive float bounds.
        choices: the allowed values of a string parameter.
        if_none: ``None`` given (or defaulted) becomes ``if_none(policy)`` (e.g. BUZZ's threshold
            from its stride and window).
        check: a further validation hook ``check(policy, value) -> value`` raising ``ValueError``.
        keyword: the constructor's (and :meth:`params`'s) name when the attribute is named
            otherwise (BUZZ stores ``log_n=True`` as ``use_log_n``: ``log_n`` is the scaling
            backends read).
        keyword_only: the parameter comes after ``*`` in the constructor.
        shown: whether :meth:`params` (and so ``repr`` and equality) includes it; ``None``:
            always; ``"non-default"``: only when it differs from the default; or a callable of
            the policy.
        doc: one line on what it is (listed by ``kvpolicy policies``).
    """

    def __init__(
        self,
        kind: type = int,
        default: Any = REQUIRED,
        *,
        minimum: Any = None,
        maximum: Any = None,
        low_open: bool = False,
        high_open: bool = False,
        choices: tuple[str, ...] | None = None,
        if_none: Callable[[Any], Any] | None = None,
        check: Callable[[Any, Any], Any] | None = None,
        keyword: str | None = None,
        keyword_only: bool = False,
        shown: Literal["non-default"] | Callable[[Any], bool] | None = None,
        doc: str = "",
    ) -> None:
        if kind not in (int, float, bool, str):
            raise ValueError(f"kind must be int, float, bool or str, got {kind!r}")
        if kind is str and not choices:
            raise ValueError("a str parameter needs its choices")
        self.kind, self.default, self.minimum, self.maximum = kind, default, minimum, maximum
        self.low_open, self.high_open, self.choices = low_open, high_open, choices
        self.if_none, self.check, self.keyword, self.keyword_only = if_none, check, keyword, keyword_only
        self.shown, self.doc = shown, doc
        self.attribute = ""  # set by __set_name__

    def __set_name__(self, owner: type, name: str) -> None:
        self.attribute = name
        if self.keyword is None:
            self.keyword = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        # the constructor stores every declared value in the instance, which shadows this
        raise AttributeError(f"{type(obj).__name__}.{self.attribute} was not set: a constructor that does not call "
                             f"the declared one (EvictionPolicy.__init__ of a class declaring Params) left it out")

    @property
    def dynamic(self) -> bool:
        """Whether a bound or default depends on other parameters (checked in the second pass)."""
        return callable(self.minimum) or callable(self.maximum) or self.if_none is not None or self.check is not None

    @property
    def annotation(self) -> Any:
        """The constructor's annotation (what the kit's strategies draw from)."""
        if self.choices:
            return Literal[self.choices]  # type: ignore[valid-type]
        if self.if_none is not None or self.default is None:
            return self.kind | None
        return self.kind

    def validate(self, policy: Any, value: Any) -> Any:
        """``value`` checked and converted, or a ``ValueError`` naming the parameter."""
        name = self.keyword or self.attribute
        if value is None and self.if_none is not None:
            value = self.if_none(policy)
        low = self.minimum(policy) if callable(self.minimum) else self.minimum
        high = self.maximum(policy) if callable(self.maximum) else self.maximum
        if self.choices:
            value = check_choice(name, value, self.choices)
        elif self.kind is bool:
            value = check_bool(name, value)
        elif self.kind is int:
            value = check_int(name, value, minimum=-(2**63) if low is None else low, maximum=high)
        else:
            value = check_float(name, value, low=-float("inf") if low is None else low,
                                high=float("inf") if high is None else high,
                                low_open=self.low_open, high_open=self.high_open)
        return self.check(policy, value) if self.check is not None else value

    def is_shown(self, policy: Any, value: Any) -> bool:
        if self.shown is None:
            return True
        if self.shown == "non-default":
            return value != self.default
        return bool(self.shown(policy))  # type: ignore[operator]

    def __repr__(self) -> str:
        return f"Param({self.kind.__name__}, name={self.keyword!r}, default={self.default!r})"


def declared_params(cls: type) -> tuple[Param, ...]:
    """The :class:`Param` declarations of ``cls`` and its bases, bases first, in declaration order
    (a redeclared name takes the subclass's declaration at the base's place).

    Example:
        >>> from kvpolicy import H2O
        >>> [p.keyword for p in declared_params(H2O)]
        ['heavy', 'recent']
    """
    found: dict[str, Param] = {}
    for klass in reversed(cls.__mro__):
        for name, value in vars(klass).items():
            if isinstance(value, Param):
                found[name] = value
    return tuple(found.values())


def make_init(cls: type, params: tuple[Param, ...], base_init: Callable[..., None]) -> Callable[..., None]:
    """The constructor of a class declaring ``params``: binds, validates (static bounds first, then
    bounds computed from other parameters, in declaration order), stores, then calls the class's
    ``__post_init__`` hook if it has one. ``base_init``: :class:`~kvpolicy.EvictionPolicy`'s own
    constructor (called with ``selection``; passed in, as this module sits below ``kvpolicy.policy``)."""

    def __init__(self: Any, *args: Any, selection: Selection | None = None, **kwargs: Any) -> None:
        positional = [p for p in params if not p.keyword_only]
        if len(args) > len(positional):
            raise ValueError(f"{cls.__name__} takes at most {len(positional)} positional parameters "
                             f"({', '.join(p.keyword for p in positional)}), got {len(args)}")  # type: ignore[misc]
        given = dict(zip((p.keyword for p in positional), args))
        for key in kwargs:
            if key in given:
                raise ValueError(f"{cls.__name__} got parameter {key!r} twice (by position and by name)")
        given.update(kwargs)
        known = {p.keyword for p in params}
        unknown = sorted(set(given) - known)
        if unknown:
            raise ValueError(f"unknown parameter{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} for "
                             f"{cls.__name__}; its parameters: {', '.join(p.keyword for p in params) or '(none)'}, selection")  # type: ignore[arg-type]
        for p in params:
            if p.keyword not in given and p.default is REQUIRED:
                raise ValueError(f"{cls.__name__} needs parameter {p.keyword!r}")
        base_init(self, selection=cls.default_selection if selection is None else selection)
        values = {p.attribute: given.get(p.keyword, p.default) for p in params}  # type: ignore[arg-type]
        for p in params:  # raw first: dynamic bounds may read any parameter
            self.__dict__[p.attribute] = values[p.attribute]
        for p in sorted(params, key=lambda p: p.dynamic):  # static checks first (a stable sort)
            self.__dict__[p.attribute] = p.validate(self, values[p.attribute])
        post = getattr(self, "__post_init__", None)
        if post is not None:
            post()

    parameters = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    for p in params:
        kind = inspect.Parameter.KEYWORD_ONLY if p.keyword_only else inspect.Parameter.POSITIONAL_OR_KEYWORD
        default = inspect.Parameter.empty if p.default is REQUIRED else p.default
        parameters.append(inspect.Parameter(p.keyword, kind, default=default, annotation=p.annotation))  # type: ignore[arg-type]
    parameters.append(inspect.Parameter("selection", inspect.Parameter.KEYWORD_ONLY, default=getattr(cls, "default_selection", "per_head"),
                                        annotation=Selection))
    __init__.__signature__ = inspect.Signature(parameters, return_annotation=None)  # type: ignore[attr-defined]
    __init__.__annotations__ = {p.keyword: p.annotation for p in params} | {"selection": Selection, "return": None}
    __init__.__qualname__ = f"{cls.__qualname__}.__init__"
    __init__.__doc__ = f"Build a {cls.__name__} (parameters: see the class docstring)."
    return __init__
