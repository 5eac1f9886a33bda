"""Cross-cutting: every public function or constructor of every package with a bool parameter accepts
only True or False (or None where None means "decide automatically"), with a ValueError naming the
parameter."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import strategies as st

from kvpolicy import BUZZ, H2O


def _bool_sites():
    """Every public function or constructor with a bool parameter, called with ``value`` there
    (each call raises, on a bad value, before doing any work)."""
    from kvpolicy_tools.eval.data import Passage, SummaryExample, load_wiki_articles, make_needle_example
    from kvpolicy_tools.eval.tasks import QAOptions, SummarizationOptions
    from kvpolicy_tools.perf.decode import PolicySpec, standard_candidates
    from kvpolicy_tools.perf.report import machine
    from kvpolicy.testing import check_policy, compare_backends, policy_machine, replay_events
    from kvpolicy.testing.profiles import register_profiles
    from kvpolicy.testing.stateful import run_machine
    from kvpolicy.testing.timing import bench_report

    def evaluate(v):
        from kvpolicy_tools.eval.engine import evaluate

        return evaluate(None, None, [], [], [], progress=v)

    def load(v):
        from kvpolicy_tools.models import load

        return load("smollm2-135m", progress=v)

    def split_sizes(v):
        from kvpolicy_integrations.deepspeed import split_sizes

        return split_sizes(576, 2, kv_heads=3, by_heads=v)

    def evicting_cache(**flag):
        from kvpolicy_tools.models import tiny_llama
        from kvpolicy_integrations.hf import EvictingCache

        return EvictingCache(H2O(2, 2), tiny_llama().config, **flag)

    def generate(v):
        from kvpolicy_integrations.hf import generate

        return generate(None, None, "text", "h2o", chat=v)

    small = BUZZ(sink=1, window=2, stride=3, threshold=3)
    return {
        "log_n": lambda v: BUZZ(log_n=v),
        "progress": [evaluate, load],
        "include_disambiguation": lambda v: load_wiki_articles(include_disambiguation=v),
        "snap_to_sentence": lambda v: make_needle_example("Some text. More text.", 0.5, snap_to_sentence=v),
        "include_short_answers": lambda v: QAOptions(include_short_answers=v),
        "equal_prompts": lambda v: SummarizationOptions(equal_prompts=v),
        "is_prompt": lambda v: SummaryExample("id", "article", "ref", is_prompt=v),
        "is_gold": lambda v: Passage("title", "text", is_gold=v),
        "budgeted": lambda v: PolicySpec("x", lambda b, c, p: small, budgeted=v),
        "capture_only": lambda v: standard_candidates(64, 8, capture_only=v),
        "full": lambda v: standard_candidates(64, 8, full=v),
        "plain_names": lambda v: register_profiles(plain_names=v),
        "plots": lambda v: bench_report([], ".", plots=v),
        "by_heads": split_sizes,
        "fused_decode": lambda v: evicting_cache(fused_decode=v),
        "static_shapes": lambda v: evicting_cache(static_shapes=v),
        # the ones where None means "decide automatically"
        "shared": lambda v: machine(shared=v),
        "torch": [
            lambda v: compare_backends(small, np.zeros((4, 1, 4)), torch=v),
            lambda v: check_policy(lambda: small, torch=v),
            lambda v: replay_events(small, [], torch=v),
            lambda v: policy_machine(lambda: small, torch=v),
            lambda v: run_machine(st.just(small), torch=v),
        ],
        "chat": generate,
    }


BOOL_SITES = [
    pytest.param(name, i, id=f"{name}-{i}")
    for name, fns in _bool_sites().items()
    for i in range(len(fns) if isinstance(fns, list) else 1)
]


NONE_ALLOWED = {("shared", 0), ("torch", 0), ("torch", 1), ("torch", 2), ("torch", 3), ("chat", 0)}


@pytest.mark.parametrize("name, i", BOOL_SITES)
@pytest.mark.parametrize("bad", ["yes", "no", 1, 0.0], ids=repr)
def test_every_bool_parameter_accepts_only_bools(name, i, bad) -> None:
    fns = _bool_sites()[name]
    fn = fns[i] if isinstance(fns, list) else fns
    allowed = "True, False or None" if (name, i) in NONE_ALLOWED else "True or False"
    with pytest.raises(ValueError, match=rf"^{name} must be {allowed}, got {re.escape(repr(bad))}$"):
        fn(bad)


def test_none_is_refused_where_it_means_nothing() -> None:
    with pytest.raises(ValueError, match=r"^log_n must be True or False, got None$"):
        BUZZ(log_n=None)
    from kvpolicy_integrations.deepspeed import split_sizes

    with pytest.raises(ValueError, match=r"^by_heads must be True or False, got None$"):
        split_sizes(576, 2, kv_heads=3, by_heads=None)
