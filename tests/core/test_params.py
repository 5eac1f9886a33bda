"""kvpolicy/params.py, declared policy parameters (issue 12): ``kvpolicy.Param`` on a class gives its constructor,
validation, ``params()``, ``repr``, equality and hashing, from one declaration."""

from __future__ import annotations

import inspect

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvpolicy
from kvpolicy import BUZZ, H2O, TOVA, CacheView, EvictionPolicy, FullCache, LocalWindow, Param, Scissorhands, SnapKV, StreamingLLM
from kvpolicy.params import declared_params
from kvpolicy.testing.strategies import policies

DECLARED = [BUZZ, H2O, TOVA, SnapKV, StreamingLLM, LocalWindow, FullCache, Scissorhands]


@pytest.mark.parametrize("cls", DECLARED, ids=lambda c: c.__name__)
@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_a_declared_policy_round_trips_through_params_and_repr(cls, data) -> None:
    """For every built-in declared policy: rebuilding it from ``params()`` (and from its ``repr``)
    gives an equal policy with the same hash; ``params()`` names constructor parameters only."""
    policy = data.draw(policies(cls))
    again = cls(**policy.params(), selection=policy.selection)
    assert again == policy and hash(again) == hash(policy) and repr(again) == repr(policy)
    assert eval(repr(policy), vars(kvpolicy)) == policy
    names = set(inspect.signature(cls.__init__).parameters) - {"self"}
    assert set(policy.params()) <= names
    assert [p.keyword for p in cls.parameters] == [n for n in inspect.signature(cls.__init__).parameters if n not in ("self", "selection")]


def test_params_differ_so_policies_differ() -> None:
    assert H2O(2, 3) != H2O(3, 2) and hash(H2O(2, 3)) != hash(H2O(3, 2))
    assert H2O(2, 3) != H2O(2, 3, selection="shared")
    # shown="non-default" / a callable: hidden values do not make policies differ (as before)
    assert BUZZ() == BUZZ(log_base=100.0) and BUZZ(log_n=True) != BUZZ(log_n=True, log_base=100.0)
    assert "interval_keep" not in BUZZ().params() and BUZZ(interval_keep="last").params()["interval_keep"] == "last"


def test_the_constructor_comes_from_the_declaration() -> None:
    sig = inspect.signature(BUZZ.__init__)
    assert str(sig).startswith("(self, sink: int = 4, window: int = 64, stride: int = 5, threshold: int | None = None, *, log_n: bool = False")
    assert sig.parameters["interval_keep"].kind is inspect.Parameter.KEYWORD_ONLY
    assert inspect.signature(H2O.__init__).parameters["heavy"].default is inspect.Parameter.empty
    assert [p.keyword for p in declared_params(BUZZ)][:4] == ["sink", "window", "stride", "threshold"]
    # derived values: the hook, and a default computed from other parameters
    b = BUZZ(stride=7, window=30)
    assert b.s_hat == 4 and b.threshold == kvpolicy.estimate_threshold(7, 30) and b.log_n is None
    assert BUZZ(log_n=True).log_n == kvpolicy.LogNScaling(512.0, 0.0)


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: H2O(0, 1), "heavy must be >= 1, got 0"),
        (lambda: H2O(1), "H2O needs parameter 'recent'"),
        (lambda: H2O(1, 2, 3), "H2O takes at most 2 positional parameters"),
        (lambda: H2O(1, 2, heavy=3), "got parameter 'heavy' twice"),
        (lambda: H2O(1, 2, windw=3), "unknown parameter windw for H2O; its parameters: heavy, recent, selection"),
        (lambda: H2O(1.5, 2), "heavy must be an integer"),
        (lambda: TOVA(3, recent=3), "recent must be >= 0 and <= 2, got 3"),
        (lambda: SnapKV(16, window=16), "size must be >= 17, got 16"),
        (lambda: SnapKV(64, kernel=4), "kernel must be odd"),
        (lambda: BUZZ(stride=2), "stride must be >= 3, got 2"),
        (lambda: BUZZ(threshold=2), "threshold must be >= 3, got 2"),
        (lambda: BUZZ(log_base=1.0), r"log_base must be in \(1.0, inf\), got 1.0"),
        (lambda: BUZZ(log_n="yes"), "log_n must be True or False"),
        (lambda: BUZZ(interval_keep="mid"), "interval_keep must be one of 'first', 'last'"),
        (lambda: StreamingLLM(selection="all"), "selection must be one of"),
    ],
)
def test_bad_parameters_are_value_errors_naming_them(build, message) -> None:
    with pytest.raises(ValueError, match=message):
        build()


# ---------------------------------------------------------------- a third-party policy, declared
class KeepEvery(EvictionPolicy):
    """Keep every ``step``-th token of the first ``size`` (a toy for the declaration's features)."""

    name = "keep_every_test"
    size = Param(int, minimum=2, doc="tokens kept before thinning")
    step = Param(int, None, minimum=1, maximum=lambda p: p.size, if_none=lambda p: p.size // 2,
                 check=lambda p, v: v if p.size % v == 0 else p._reject(v), doc="thinning stride")
    use_flag = Param(bool, False, keyword="flag", keyword_only=True, shown="non-default")
    mode = Param(str, "a", choices=("a", "b"), keyword_only=True, shown=lambda p: p.use_flag)

    def _reject(self, v: int) -> int:
        raise ValueError(f"step must divide size {self.size}, got {v}")

    def __post_init__(self) -> None:
        self.kept = self.size // self.step

    @property
    def capacity(self) -> int:
        return self.size + 1

    def select(self, view: CacheView):
        return view.arange(0, self.size, self.step) if view.n_cached > self.size else None


def test_a_third_party_declaration_gets_every_feature() -> None:
    p = KeepEvery(8)
    assert (p.step, p.kept, p.params()) == (4, 2, {"size": 8, "step": 4})
    assert repr(KeepEvery(8, 2, flag=True, mode="b")) == "KeepEvery(size=8, step=2, flag=True, mode='b')"
    assert KeepEvery(8, mode="b") == KeepEvery(8)  # mode is shown only with the flag
    assert p.use_flag is False and "flag" in inspect.signature(KeepEvery.__init__).parameters
    with pytest.raises(ValueError, match="step must divide size 8, got 3"):
        KeepEvery(8, 3)
    with pytest.raises(ValueError, match="step must be >= 1 and <= 8, got 9"):
        KeepEvery(8, 9)


def test_subclasses_extend_or_replace_the_declaration() -> None:
    class H2OPlus(H2O):
        extra = Param(int, 0, minimum=0)

    class H2OCustom(H2O):
        def __init__(self, total: int) -> None:
            super().__init__(total // 2, total - total // 2)

    assert [p.keyword for p in H2OPlus.parameters] == ["heavy", "recent", "extra"]
    assert H2OPlus(2, 3, 1).params() == {"heavy": 2, "recent": 3, "extra": 1}
    assert H2OCustom(9).params() == {"heavy": 4, "recent": 5}

    class Forgetful(H2O):
        def __init__(self) -> None:  # does not call the declared constructor
            EvictionPolicy.__init__(self)

    with pytest.raises(AttributeError, match="heavy was not set"):
        Forgetful().heavy


def test_param_declarations_are_checked_up_front() -> None:
    with pytest.raises(ValueError, match="kind must be int, float, bool or str"):
        Param(list)
    with pytest.raises(ValueError, match="a str parameter needs its choices"):
        Param(str)


# ---------------------------------------------------------------------------- validation: bad input raises a ValueError naming the parameter

GOOD = {
    BUZZ: dict(sink=1, window=4, stride=3, threshold=6),
    H2O: dict(heavy=2, recent=2),
    StreamingLLM: dict(sink=1, window=4),
    LocalWindow: dict(window=4),
}


SIZE_PARAMS = [(cls, name) for cls, params in GOOD.items() for name in params]


@pytest.mark.parametrize("cls, param", SIZE_PARAMS, ids=lambda x: getattr(x, "__name__", x))
@pytest.mark.parametrize("bad", [0, -1, -100])
def test_zero_or_negative_sizes(cls, param, bad) -> None:
    with pytest.raises(ValueError, match=rf"^{param} must be >= \d+, got {bad}$"):
        cls(**{**GOOD[cls], param: bad})


@pytest.mark.parametrize("cls, param", SIZE_PARAMS, ids=lambda x: getattr(x, "__name__", x))
@pytest.mark.parametrize("bad", [2.5, "4", None, True])
def test_non_integer_sizes(cls, param, bad) -> None:
    if (cls, param, bad) == (BUZZ, "threshold", None):
        return  # None means "from the theorem" (tested in test_budget)
    with pytest.raises(ValueError, match=rf"^{param} must be an integer >= \d+"):
        cls(**{**GOOD[cls], param: bad})


def test_good_parameters_construct() -> None:
    """The baseline the error tests vary (so a failure above is about the one bad value)."""
    for cls, params in GOOD.items():
        assert cls(**params).params() == params
