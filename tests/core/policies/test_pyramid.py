"""PyramidKV's per-layer budgets (kvpolicy/policies/pyramid.py).

The schedule (``pyramid_sizes``) as properties; the policy through the conformance kit (where one
layer stands for all it is its base at the mean size); each layer of a transformers cache holding
its own schedule size, on a tiny random-weight Llama (fast) and on the embedded SmolLM2-135M
(slow, real weights: kept bytes per layer against the schedule).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpolicy import H2O, PyramidKV, get_policy, make_policy, plan_policy, pyramid_sizes
from kvpolicy.testing import check_policy


@given(size=st.integers(1, 5000), layers=st.integers(1, 80), beta=st.floats(1, 50), data=st.data())
@settings(max_examples=200, deadline=None)
def test_pyramid_sizes_keep_the_total_and_narrow_with_depth(size, layers, beta, data) -> None:
    floor = data.draw(st.integers(0, size))
    sizes = pyramid_sizes(size, layers, beta=beta, floor=floor)
    assert len(sizes) == layers and sum(sizes) == size * layers  # the uniform budget's total
    assert all(s >= floor for s in sizes)
    assert all(a >= b for a, b in zip(sizes, sizes[1:]))  # lower layers keep at least as much
    if layers > 1:
        share = size - floor
        assert sizes[-1] - floor in (int(share // beta), int(share // beta) + 1)  # the top layer: share / beta
        assert sizes[0] - floor in (2 * share - int(share // beta) - 1, 2 * share - int(share // beta))


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [({"size": 0, "layers": 3}, "size"), ({"size": 5, "layers": 0}, "layers"), ({"size": 5, "layers": 3, "floor": 6}, "floor"),
     ({"size": 5, "layers": 3, "beta": 0.5}, "beta"), ({"size": 5, "layers": 3, "beta": float("nan")}, "beta")],
)
def test_pyramid_sizes_refuse_bad_input(kwargs, name) -> None:
    with pytest.raises(ValueError, match=name):
        pyramid_sizes(**kwargs)


def test_layers_run_the_base_at_their_size_and_one_layer_is_the_mean() -> None:
    p = PyramidKV("h2o", size=64, beta=4, floor=8)
    assert p.sizes(3) == [106, 64, 22]
    assert [p.for_layer(i, 3) for i in range(3)] == [H2O.from_size(s) for s in (106, 64, 22)]
    assert p.capacity == H2O.from_size(64).capacity and p.decode_eviction == H2O.from_size(64).decode_eviction
    assert H2O(8, 8).for_layer(5, 30) == H2O(8, 8)  # a uniform policy: every layer the same
    with pytest.raises(ValueError, match="layer"):
        p.for_layer(3, 3)
    with pytest.raises(ValueError, match="base"):
        PyramidKV(H2O(8, 8), size=16)  # type: ignore[arg-type]


def test_registry_presets_and_planning_the_total() -> None:
    assert get_policy("pyramidkv").fixed["base"] == "snapkv" and get_policy("pyramid_h2o").fixed["base"] == "h2o"
    plan = plan_policy("pyramid_h2o", 0.25, context_length=600, prompt_length=512)
    assert abs(plan.realised_budget - 0.25) < 0.01
    p = plan.policy
    assert sum(q.capacity for q in (p.for_layer(i, 30) for i in range(30))) == 30 * p.capacity  # same total as uniform
    snap = make_policy("pyramidkv", 0.25, context_length=600, prompt_length=512)
    assert snap.for_layer(0, 30).window == 8 and snap.for_layer(29, 30).size >= 9


@pytest.mark.parametrize("budget, prompt", [(0.5, 20), (1.0, 20), (0.3, 0)])
def test_a_plan_over_the_layers_is_what_every_layer_keeps(budget, prompt) -> None:
    """Planned with ``layers``, a pyramid's realised budget is the mean over its layers of what
    each keeps, step by step, on the torch backend (a layer whose budget exceeds the tokens seen
    keeps only those: the mean layer's plan overstated it, 1.0 where the run kept 0.58). Planned
    without ``layers`` in that regime, the plan warns; a budget no size reaches warns too."""
    import warnings

    import numpy as np
    torch = pytest.importorskip("torch")
    from kvpolicy_torch import LayerCache

    context = 30
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = plan_policy("pyramid_h2o", budget, context_length=context, prompt_length=prompt, layers=2)
    assert not any("layers=" in str(w.message) for w in caught)
    assert any("out of reach" in str(w.message) for w in caught) == (plan.realised_budget < budget - 0.05)
    kept = []
    for layer in range(2):
        cache, sizes = LayerCache(plan.policy.for_layer(layer, 2)), []
        rng = torch.Generator().manual_seed(layer)
        for q in ([prompt] if prompt else []) + [1] * (context - prompt):
            k = torch.randn(1, 1, q, 4, generator=rng)
            keys, _ = cache.append(k, k)
            if q == 1:
                sizes.append(cache.length)
            cache.accumulate(torch.rand(1, 1, keys.shape[2], generator=rng))
            cache.evict()
        kept.append(sizes)
    full = np.mean(np.arange(prompt + 1, context + 1))
    assert np.mean(kept) / full == pytest.approx(plan.realised_budget, abs=1e-12)
    assert plan.as_dict()["layers"] == 2
    with pytest.warns(UserWarning, match="layers="):  # the mean layer's plan, where it misstates the run
        plan_policy("pyramid_h2o", budget, context_length=context, prompt_length=prompt)


pyramids = st.builds(
    PyramidKV,
    base=st.sampled_from(["h2o", "local", "streaming_llm", "snapkv", "tova"]),
    size=st.integers(4, 24),
    beta=st.sampled_from([1.0, 4.0, 20.0]),
)


def test_pyramid_keeps_the_contract() -> None:
    """One layer of PyramidKV is its base at the mean size: the kit's contract and its NumPy/torch
    differential properties hold."""
    check_policy(pyramids)


def _lengths_after_generate(model, policy, prompt: int, new: int) -> tuple[list[int], list[int]]:
    import torch

    from kvpolicy.hf import EvictingCache, cache_kwargs

    cache = EvictingCache(policy, model)
    ids = torch.arange(3, 3 + prompt)[None] % model.config.vocab_size
    with torch.no_grad():
        model.generate(ids, max_new_tokens=new, do_sample=False, **cache_kwargs(model, cache))
    return cache.lengths(), [layer.store.kv_bytes for layer in cache.layers]


def test_each_layer_of_a_transformers_cache_holds_its_schedule() -> None:
    """Tiny random-weight Llama (4 layers): after the prompt and every decode step each layer
    keeps exactly its own H2O size."""
    pytest.importorskip("transformers")
    from kvpolicy_tools.models import tiny_llama

    p = PyramidKV("h2o", size=12, beta=4, floor=2)
    lengths, _ = _lengths_after_generate(tiny_llama(num_layers=4, seed=0), p, prompt=40, new=5)
    assert lengths == p.sizes(4) == [20, 15, 9, 4]


@pytest.mark.slow
def test_kept_bytes_per_layer_match_the_schedule_on_the_real_model() -> None:
    """SmolLM2-135M (real weights, 30 layers, 3 KV heads x 64 dims): each layer's kept keys and
    values take exactly its schedule size's bytes."""
    pytest.importorskip("transformers")
    from kvpolicy_tools import models

    model = models.load("smollm2-135m")[0]
    p = make_policy("pyramid_h2o", 0.25, context_length=200 + 8, prompt_length=200)
    lengths, kv_bytes = _lengths_after_generate(model, p, prompt=200, new=8)
    sizes = p.sizes(30)
    per_token = 2 * 3 * 64 * 4  # keys and values, 3 KV heads, head_dim 64, float32
    assert lengths == sizes and kv_bytes == [per_token * s for s in sizes]
    assert sizes[0] > sizes[-1] and sum(sizes) == 30 * p.size


def test_doc_worked_example() -> None:
    """docs/policies.md's worked example, parsed and recomputed."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[3] / "docs" / "policies.md").read_text()
    found = re.findall(r"`pyramid_sizes\((\d+), (\d+), beta=(\d+), floor=(\d+)\)` = `\[([\d, ]+)\]`", text)
    assert found, "docs/policies.md lost its PyramidKV worked example"
    for size, layers, beta, floor, sizes in found:
        want = [int(x) for x in sizes.split(",")]
        assert pyramid_sizes(int(size), int(layers), beta=int(beta), floor=int(floor)) == want
