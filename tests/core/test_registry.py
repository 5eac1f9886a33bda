"""kvpolicy/registry.py: built-ins, presets, name normalisation, entry-point discovery, third-party
policies, and the names it refuses."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import kvpolicy.registry as registry
from kvpolicy import (
    BUZZ,
    H2O,
    ENTRY_POINT_GROUP,
    EvictionPolicy,
    FullCache,
    LocalWindow,
    Preset,
    StreamingLLM,
    available_policies,
    create_policy,
    get_policy,
    make_policy,
    plan_policy,
    register_policy,
)
from kvpolicy.registry import normalize_name, signature_of
from kvpolicy_numpy import replay


@pytest.fixture
def clean_registry():
    """What one test registers is forgotten after it, and entry points are scanned afresh in it."""
    with registry.isolated_registry(rescan_entry_points=True):
        yield


# ---------------------------------------------------------------------------- a third-party policy
# What a user writes: about 30 lines, nothing but the public base class.
class EveryOther(EvictionPolicy):
    """Keep the last ``window`` tokens; when the cache reaches ``window + limit`` tokens, keep
    every other one of the older tokens."""

    name = "every_other"
    uses_scores = False

    def __init__(self, window: int = 8, limit: int = 8, *, selection: str = "per_head") -> None:
        super().__init__(selection=selection)
        if window < 1 or limit < 2:
            raise ValueError(f"window must be >= 1 and limit >= 2, got {window}, {limit}")
        self.window, self.limit = window, limit

    @property
    def capacity(self) -> int:
        return self.window + self.limit

    def select(self, view):
        n = view.n_cached
        if n < self.capacity:
            return None
        older = n - self.window
        return view.keep(view.arange(0, older, 2), view.arange(older, n))

    def params(self) -> dict[str, Any]:
        return {"window": self.window, "limit": self.limit}

    min_size = 3

    @classmethod
    def from_size(cls, size: int, **overrides: Any) -> "EveryOther":
        window = overrides.pop("window", max(1, size // 2))
        return cls(window=window, limit=overrides.pop("limit", max(2, size - window)), **overrides)


class NoBudget(EvictionPolicy):
    """A policy without from_size: usable, but not from a budget."""

    name = "no_budget"
    capacity = None

    def select(self, view):
        return None


# ---------------------------------------------------------------------------- built-ins
def test_builtins_are_registered() -> None:
    names = available_policies()
    assert {"buzz", "buzz_logn", "h2o", "streaming_llm", "local", "full"} <= set(names)
    assert names["buzz"] is BUZZ and names["h2o"] is H2O and names["full"] is FullCache
    assert names["streaming_llm"] is StreamingLLM and names["local"] is LocalWindow
    assert list(names) == sorted(names)


@pytest.mark.parametrize(
    "alias, name",
    [
        ("BUZZ", "buzz"),
        (" buzz ", "buzz"),
        ("Streaming-LLM", "streaming_llm"),
        ("streaming llm", "streaming_llm"),
        ("streamingllm", "streaming_llm"),
        ("streaming", "streaming_llm"),
        ("full_cache", "full"),
        ("FullCache", "full"),
        ("local-window", "local"),
        ("LocalWindow", "local"),
        ("buzz-log-n", "buzz_logn"),
        ("H2O", "h2o"),
    ],
)
def test_name_normalisation(alias, name) -> None:
    assert normalize_name(alias) == name
    assert get_policy(alias) is get_policy(name)


def test_create_policy_by_name() -> None:
    assert create_policy("Streaming-LLM", sink=2, window=5) == StreamingLLM(sink=2, window=5)
    assert create_policy("h2o", heavy=3, recent=4, selection="shared").selection == "shared"


# ---------------------------------------------------------------------------- presets
def test_buzz_logn_preset() -> None:
    entry = get_policy("buzz_logn")
    assert isinstance(entry, Preset) and entry.cls is BUZZ and entry.fixed == {"log_n": True}
    assert entry.name == "buzz_logn"
    p = create_policy("buzz_logn", sink=1, window=4, stride=3, threshold=6)
    assert isinstance(p, BUZZ) and p.log_n is not None and p.log_n.base == 512.0
    assert p.params()["log_n"] is True
    assert dict(signature_of(entry))["log_n"] is True
    assert dict(signature_of(BUZZ))["log_n"] is False
    planned = make_policy("buzz_logn", 0.3, context_length=1024)
    assert planned.log_n is not None


def test_register_a_preset(clean_registry) -> None:
    register_policy(H2O, name="h2o-shared", preset={"selection": "shared"}, doc="H2O, shared heads")
    entry = get_policy("H2O_shared")
    assert isinstance(entry, Preset) and entry.doc == "H2O, shared heads"
    assert entry(heavy=2, recent=3) == H2O(heavy=2, recent=3, selection="shared")
    assert make_policy("h2o_shared", 0.3, context_length=256).selection == "shared"
    assert "h2o_shared" in available_policies()



PRESET_FIELDS = [(name, key) for name, e in sorted(available_policies().items()) if isinstance(e, Preset) for key in e.fixed]


@pytest.mark.parametrize("name,key", PRESET_FIELDS)
def test_a_preset_refuses_an_override_of_what_it_fixes(name, key) -> None:
    """Issue 44 class 4: make_policy("adakv_h2o", ..., scorer="keydiff") silently became AdaKV over
    KeyDiff; now every preset refuses, by name, an override that changes one of its fixed
    parameters (planned or created), and takes one that restates it (any spelling of a name)."""
    entry = get_policy(name)
    fixed = entry.fixed[key]
    other = ("tova" if fixed != "tova" else "h2o") if isinstance(fixed, str) else (not fixed) if isinstance(fixed, bool) else fixed + 1
    message = (rf"^{key}={other!r} conflicts with the preset '{name}', which fixes {key}={fixed!r}: drop the override, "
               rf"or use the policy '{entry.cls.name}' with {key}={other!r}$").replace("(", r"\(").replace(")", r"\)")
    with pytest.raises(ValueError, match=message):
        make_policy(name, 0.3, context_length=400, prompt_length=300, **{key: other})
    with pytest.raises(ValueError, match=message):
        entry(**{key: other})
    same = fixed.upper() if isinstance(fixed, str) else fixed
    assert make_policy(name, 0.3, context_length=400, prompt_length=300, **{key: same}) == make_policy(name, 0.3, context_length=400, prompt_length=300)


# ---------------------------------------------------------------------------- register_policy
def test_register_policy_decorator_forms(clean_registry) -> None:
    assert register_policy(EveryOther) is EveryOther
    assert get_policy("Every-Other") is EveryOther

    @register_policy(name="my policy")
    class Named(EveryOther):
        pass

    assert get_policy("my_policy") is Named
    assert "every_other" in available_policies() and "my_policy" in available_policies()


def test_register_policy_rejects_non_policies(clean_registry) -> None:
    with pytest.raises(ValueError, match="expects an EvictionPolicy subclass"):
        register_policy(dict)
    with pytest.raises(ValueError, match="expects an EvictionPolicy subclass"):
        register_policy(EveryOther(4, 4))


# ---------------------------------------------------------------------------- entry points
class _FakeEntryPoint:
    def __init__(self, name: str, obj: Any) -> None:
        self.name, self.group, self._obj = name, ENTRY_POINT_GROUP, obj
        self.loaded = False

    def load(self) -> Any:
        self.loaded = True
        return self._obj


def _patch_entry_points(monkeypatch, eps: list[_FakeEntryPoint]) -> list[dict]:
    calls: list[dict] = []

    def fake_entry_points(**kwargs):
        calls.append(kwargs)
        return [ep for ep in eps if kwargs.get("group") in (None, ep.group)]

    monkeypatch.setattr(registry.importlib.metadata, "entry_points", fake_entry_points)
    return calls


def test_entry_point_discovery(clean_registry, monkeypatch) -> None:
    class FromPlugin(EveryOther):
        name = "from_plugin"

    ep = _FakeEntryPoint("Plugin-Policy", FromPlugin)
    calls = _patch_entry_points(monkeypatch, [ep])
    assert get_policy("plugin_policy") is FromPlugin
    assert ep.loaded and calls == [{"group": ENTRY_POINT_GROUP}]
    assert available_policies()["plugin_policy"] is FromPlugin
    assert len(calls) == 1  # scanned once
    p = make_policy("plugin-policy", 0.3, context_length=512)
    assert isinstance(p, FromPlugin)


def test_entry_points_are_scanned_lazily(clean_registry, monkeypatch) -> None:
    calls = _patch_entry_points(monkeypatch, [])
    get_policy("buzz")  # a built-in: no scan needed
    assert calls == []
    with pytest.raises(ValueError, match="unknown policy"):
        get_policy("not_installed")
    assert calls == [{"group": ENTRY_POINT_GROUP}]


def test_entry_point_preset_and_no_override_of_builtins(clean_registry, monkeypatch) -> None:
    class Impostor(EveryOther):
        pass

    shadow = _FakeEntryPoint("buzz", Impostor)
    preset = _FakeEntryPoint("tiny_buzz", Preset(BUZZ, {"window": 2, "stride": 3, "threshold": 3}))
    _patch_entry_points(monkeypatch, [shadow, preset])
    names = available_policies()
    assert names["buzz"] is BUZZ and not shadow.loaded
    assert create_policy("tiny_buzz", sink=1).capacity == 1 + 2 + 3


def test_entry_point_of_the_wrong_type(clean_registry, monkeypatch) -> None:
    _patch_entry_points(monkeypatch, [_FakeEntryPoint("broken", object())])
    with pytest.raises(ValueError, match="entry point 'broken' in group 'kvpolicy.policies' must name"):
        available_policies()


# ---------------------------------------------------------------------------- third party end to end
def test_third_party_policy_through_replay(clean_registry) -> None:
    register_policy(EveryOther)
    policy = create_policy("every_other", window=3, limit=4)
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(40, 2, 40))
    trace = replay(policy, logits, prompt_len=5, values=rng.normal(size=(40, 2, 3)))
    assert trace.sizes.max() <= policy.capacity
    for t in range(4, 40):
        row = trace.kept[t][0].tolist()
        assert row[-3:] == list(range(t - 2, t + 1))  # last window kept
        assert row == sorted(set(row)) and len(row) < policy.capacity
    cache = list(range(5))  # the rule by hand
    for t in range(5, 40):
        cache.append(t)
        if len(cache) >= 7:
            cache = cache[:-3][::2] + cache[-3:]
        assert trace.kept[t].tolist() == [cache, cache]
    assert trace.output_error().shape == (40, 2)


def test_third_party_policy_through_make_policy(clean_registry) -> None:
    register_policy(EveryOther)
    for budget in (0.2, 0.5):
        plan = plan_policy("every-other", budget, context_length=512)
        assert isinstance(plan.policy, EveryOther)
        assert abs(plan.realised_budget - budget) <= 0.05
    # the class itself works too, registered or not
    assert isinstance(make_policy(EveryOther, 0.3, context_length=256), EveryOther)


def test_policy_without_from_size_has_no_budget(clean_registry) -> None:
    register_policy(NoBudget)
    assert replay(create_policy("no_budget"), np.zeros((4, 1, 4))).kept[3].tolist() == [[0, 1, 2, 3]]
    with pytest.raises(ValueError, match="policy 'no_budget' has no size knob"):
        make_policy("no_budget", 0.5, context_length=100)


def test_package_docstring_names_every_builtin_policy() -> None:
    """``kvpolicy``'s module docstring is where a reader meets the policies: it names every
    built-in registry name (a new policy that is not named there fails here)."""
    import kvpolicy
    from kvpolicy.registry import Preset, available_policies

    own = [name for name, entry in available_policies().items()
           if (entry.cls if isinstance(entry, Preset) else entry).__module__.startswith("kvpolicy.policies.")]
    assert "h2o" in own and "pyramid_h2o" in own
    missing = [name for name in own if f"``{name}``" not in (kvpolicy.__doc__ or "")]
    assert not missing, f"kvpolicy/__init__.py's docstring does not name {missing}"


# ---------------------------------------------------------------------------- validation: bad input raises a ValueError naming the parameter

@pytest.mark.parametrize("name", ["nope", "buzzz", "", "h20"])
def test_unknown_policy_name(name) -> None:
    for fn in (get_policy, create_policy):
        with pytest.raises(ValueError, match=r"unknown policy .*; known policies: .*buzz.*h2o"):
            fn(name)
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy(name, 0.3, context_length=100)


@pytest.mark.parametrize("bad", [None, 123, 1.5, BUZZ(), object(), ["buzz"]])
def test_policy_name_of_the_wrong_type(bad) -> None:
    with pytest.raises(ValueError, match=r"^name must be a registered policy name .*, an EvictionPolicy subclass or a Preset; got"):
        make_policy(bad, 0.3, context_length=100)
    with pytest.raises(ValueError, match=r"^name must be a registered policy name"):
        plan_policy(bad, 0.3, context_length=100)
    for fn in (get_policy, create_policy):
        with pytest.raises(ValueError, match=r"^policy name must be a string \(one of .*buzz.*\), got"):
            fn(bad)


def test_policy_instance_hint() -> None:
    with pytest.raises(ValueError, match=r"an instance: pass its class"):
        make_policy(H2O(heavy=2, recent=2), 0.3, context_length=100)
    # the accepted forms, for contrast
    assert make_policy(H2O, 0.3, context_length=100) == make_policy("h2o", 0.3, context_length=100)
    assert make_policy(get_policy("buzz_logn"), 0.3, context_length=100).log_n is not None
