"""A score kind the library does not ship, declared in this file alone (issue 43): a policy whose
``score_statistic = "cache"`` and whose one method ``cache_score`` gives each cached token's
score. Without an edit to any other module it passes the conformance kit (the NumPy reference
equals the torch backend), keeps in the transformers cache what the reference keeps (eager, and
compiled to one graph with the eager tokens), and runs sharded over two DeepSpeed ranks as in one
process: :func:`ds_cases` hands it to the DeepSpeed launches of
tests/integrations/test_deepspeed_multi.py (``--extra-cases``, as a user's own policy would join),
whose ``test_a_declared_score_kind_keeps_per_head_what_one_process_keeps`` holds it there (one
launch for every DeepSpeed check, not one more of its own). The models here are tiny random-weight
Llamas (wiring and numerics, not language).

The score: each token's value L2 norm (keep the tokens whose values are largest), a heuristic
from the value-norm literature; nothing in kvpolicy computes it.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import strategies as st

from kvpolicy.policies.lowest import KeepHighest
from kvpolicy.policy import Array, array_namespace
from kvpolicy.statistics import CachedTokens

class ValueNorm(KeepHighest):
    """Keep the ``size`` tokens whose cached values have the largest L2 norm (test only)."""

    name = "value_norm_test"
    score_statistic = "cache"

    def cache_score(self, tokens: CachedTokens) -> Array:
        xp = array_namespace(tokens.values)
        v = xp.astype(tokens.values, xp.float64)
        return xp.sqrt(xp.sum(v * v, axis=-1))


def ds_cases(prompt_length: int, new_tokens: int) -> dict[str, object]:
    """The DeepSpeed worker's cases (tests/ds_worker.py --extra-cases; tests/integrations/test_deepspeed_multi.py
    passes this function)."""
    return {"valuenorm": ValueNorm(size=max(2, prompt_length // 3))}


def test_a_cache_statistic_without_cache_score_is_refused_at_class_definition() -> None:
    with pytest.raises(TypeError, match="define cache_score"):

        class Forgot(KeepHighest):  # noqa: F841
            score_statistic = "cache"


def test_the_kit_holds_the_declared_score_numpy_equal_torch() -> None:
    pytest.importorskip("torch")
    from hypothesis import HealthCheck, settings

    from kvpolicy.testing import check_policy

    quick = settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    report = check_policy(ValueNorm, {"size": st.integers(1, 6), "recent": st.just(0)}, torch=True, settings=quick)
    assert report.results["backends"] == "passed" and report.results["replay"] == "passed", report.results


class OnceValueNorm(ValueNorm):
    """The same score declared token-local (``score_once``): a value's norm is its own (test only)."""

    name = "once_value_norm_test"
    score_once = True


class StaleKeyDiff(KeepHighest):
    """KeyDiff's cosine to the mean key, wrongly declared token-local: the mean moves with every
    token, so scores given once go stale (test only: the kit must catch the false declaration)."""

    name = "stale_keydiff_test"
    score_statistic = "cache"
    score_once = True

    def cache_score(self, tokens: CachedTokens) -> Array:
        from kvpolicy.statistics import key_scores

        return key_scores("key_diff", tokens.keys, tokens.positions, tokens.n_seen)


def test_a_token_local_score_declared_once_passes_the_kit() -> None:
    pytest.importorskip("torch")
    from hypothesis import HealthCheck, settings

    from kvpolicy.statistics import scored_once
    from kvpolicy.testing import check_policy

    assert scored_once(OnceValueNorm(size=2)) and not scored_once(ValueNorm(size=2))
    quick = settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    report = check_policy(OnceValueNorm, {"size": st.integers(1, 6), "recent": st.just(0)}, checks=["backends", "replay"],
                          torch=True, settings=quick)
    assert report.results["backends"] == "passed", report.results


def test_the_kit_fails_a_score_wrongly_declared_token_local() -> None:
    """The torch backend trusts ``score_once`` (a decode token scored when cached, never again);
    the NumPy reference rescores every time: their kept tokens part, and the kit says so."""
    pytest.importorskip("torch")
    from hypothesis import HealthCheck, settings

    from kvpolicy.testing import ContractViolation, check_policy

    quick = settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    with pytest.raises(ContractViolation, match="backends"):
        check_policy(StaleKeyDiff, {"size": st.integers(2, 6), "recent": st.just(0)}, checks=["backends"], torch=True,
                     settings=quick)


def test_the_reference_scores_from_the_values_it_is_given() -> None:
    import kvpolicy_numpy

    steps, heads = 9, 2
    values = np.zeros((steps, heads, 3))
    values[:, 0, 0] = [5, 1, 4, 1, 3, 9, 2, 6, 0.5]  # head 0: by norm
    values[:, 1, 0] = np.arange(steps)  # head 1: the latest are the largest
    trace = kvpolicy_numpy.replay(ValueNorm(size=3), np.zeros((steps, heads, steps)), prompt_len=6, values=values,
                                  keys=np.ones((steps, heads, 2)))  # fmt: skip
    # after the prompt: the 3 largest of 6; then each step the smallest of 4 goes
    assert trace.kept[5].tolist() == [[0, 2, 5], [3, 4, 5]]
    assert trace.kept[-1].tolist() == [[0, 5, 7], [6, 7, 8]]


@pytest.mark.hf
def test_the_transformers_cache_keeps_what_the_reference_keeps_eager_and_compiled() -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import kvpolicy_numpy
    from kvpolicy.hf import EvictingCache, compile_decode_step, greedy_decode
    from kvpolicy_tools.models import tiny_llama

    from layer0 import greedy_tokens, layer0_cached_values

    model = tiny_llama(num_layers=2, heads=4, kv_heads=4, head_dim=8, vocab=96, seed=3).double()
    ids = torch.randint(3, 96, (1, 30), generator=torch.Generator().manual_seed(5))
    policy = ValueNorm(size=12)
    cache = EvictingCache(policy, model)
    tokens = greedy_tokens(model, cache, ids, 20)
    logits, keys, values = layer0_cached_values(model, tokens, ids.shape[1])
    trace = kvpolicy_numpy.replay(policy, logits, prompt_len=ids.shape[1], keys=keys, values=values)
    np.testing.assert_array_equal(cache.layers[0].store.positions[0].numpy(), trace.kept[-1])
    # compiled: one graph per step (dynamo's eager backend traces what inductor would get), eager's tokens
    model32 = tiny_llama(num_layers=2, heads=4, kv_heads=2, head_dim=8, vocab=96, seed=3)
    want = greedy_decode(model32, ids, EvictingCache(policy, model32), 24)
    static = EvictingCache(policy, model32, static_shapes=True, max_tokens=ids.shape[1] + 25)
    got = greedy_decode(model32, ids, static, 24, step=compile_decode_step(model32, backend="eager"))
    assert torch.equal(got, want)
