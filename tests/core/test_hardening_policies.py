"""Issue 28, the policy surface (``kvpolicy``): ``register_policy`` refuses to replace a built-in
or take an alias unless told to, and an unreachable budget is blamed on the parameter that blocks it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvpolicy.registry as registry
from kvpolicy import H2O, EvictionPolicy, StreamingLLM, get_policy, make_policy, plan_policy, register_policy
from kvpolicy.registry import mark_builtin_policies


@pytest.fixture
def clean_registry():
    """What one test registers (names, aliases taken) is forgotten after it."""
    with registry.isolated_registry():
        yield


class Impostor(H2O):
    """What a user might register by mistake under a taken name."""

    name = "impostor"

    decode_eviction = size_rule = None  # its own select: no inherited rule

    def select(self, view):
        return super().select(view)


# ---------------------------------------------------------------------------- register_policy
@pytest.mark.parametrize("name", sorted(mark_builtin_policies()))
def test_a_builtin_is_not_replaced_without_replace(clean_registry, name: str) -> None:
    before = get_policy(name)
    with pytest.raises(ValueError, match=rf"policy name '{name}' is the built-in policy .*pass replace=True"):
        register_policy(Impostor, name=name)
    assert get_policy(name) is before


@pytest.mark.parametrize("alias", ["Streaming", "streamingllm", "full-cache", "local_window", "buzz-log-n"])
def test_an_alias_is_not_taken_without_replace(clean_registry, alias: str) -> None:
    before = get_policy(alias)
    with pytest.raises(ValueError, match="is an alias of the built-in policy"):
        register_policy(Impostor, name=alias)
    assert get_policy(alias) is before


def test_replace_true_replaces_and_says_nothing(clean_registry) -> None:
    register_policy(Impostor, name="h2o", replace=True)
    assert get_policy("h2o") is Impostor
    register_policy(Impostor, name="streaming", replace=True)
    assert get_policy("streaming") is Impostor and get_policy("streaming_llm") is StreamingLLM
    assert isinstance(make_policy("h2o", 0.5, context_length=64), Impostor)


def test_another_packages_name_is_not_taken_silently(clean_registry) -> None:
    class Mine(EvictionPolicy):
        name = "mine_hardening"
        capacity = None

        def select(self, view):
            return None

    class Theirs(Mine):
        name = "mine_hardening"

    register_policy(Mine)
    register_policy(Mine)  # the same definition again: fine
    with pytest.raises(ValueError, match="already registered to"):
        register_policy(Theirs)
    assert get_policy("mine_hardening") is Mine


def test_replace_must_be_a_bool(clean_registry) -> None:
    with pytest.raises(ValueError, match="replace must be True or False"):
        register_policy(Impostor, name="impostor", replace="yes")


# ---------------------------------------------------------------------------- the budget's blame
def test_make_policy_blames_window_not_the_budget() -> None:
    with pytest.raises(ValueError) as exc:
        make_policy("local", 0.3, context_length=300, window=250)
    msg = str(exc.value)
    assert msg.startswith("window=250 keeps local at a realised budget") and "lower window" in msg, msg
    # with nothing fixed, an unreachable budget is still the budget's fault
    with pytest.raises(ValueError, match=r"^budget 0.01 is below the smallest streaming_llm reaches"):
        make_policy("streaming_llm", 0.01, context_length=60)
    with pytest.raises(ValueError, match=r"^budget 0.05 is below the smallest snapkv_buzz reaches"):  # a preset by its name
        plan_policy("snapkv_buzz", 0.05, context_length=40, prompt_length=20)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(context=st.integers(64, 400), fraction=st.floats(0.6, 0.95))
def test_a_fixed_size_that_misses_the_budget_is_named(context: int, fraction: float) -> None:
    """Property: when a fixed ``window`` alone keeps the local window above the budget (and the
    budget is reachable without it), the error names ``window``, never just the budget."""
    window = int(context * fraction)
    budget = 0.2
    with pytest.raises(ValueError, match=rf"^window={window} keeps local"):
        plan_policy("local", budget, context_length=context, window=window)


@pytest.mark.parametrize("name", ["", "   "])
def test_register_policy_with_an_empty_name_says_so(name: str) -> None:
    """An empty name is refused as such (it used to fall back to the class's name and blame the
    built-in ``h2o``)."""

    class Mine(H2O):
        pass

    with pytest.raises(ValueError, match="name must be a non-empty string"):
        register_policy(Mine, name=name)
