"""Expected Attention (and KeyDiff, LagKV) with a refresh interval, against the exact rule: its speed
(``kvpolicy bench``) and its quality (``kvpolicy compare``), docs/policies.md (Expected Attention,
KeyDiff, LagKV). KeyDiff's factories are ``keydiff_refresh4``, ``_16``, ``_64``, its presets
``keydiff_r4``, ``_r16``, ``_r64``; LagKV's ``lagkv_refresh4`` ... and ``lagkv_r4`` ....

Speed, as ``module:factory`` policies planned per budget like the built-ins::

    PYTHONPATH=benchmarks kvpolicy bench --what decode --threads 1 --contexts 2048 --budgets 0.25 \\
        --steps 4 --decode-rounds 3 --policy h2o --policy expected_attention \\
        --policy ea_refresh:ea_refresh16 --policy ea_refresh:ea_refresh64 --no-unfused

Quality: this script registers ``expected_attention_r1``, ``_r4``, ``_r16`` and ``_r64`` as presets
(``_r1``: the every-step rule; the registered ``expected_attention`` and ``keydiff`` score every
64th step since 2026-11-28, ``lagkv`` since 2026-11-29), then runs ``kvpolicy compare`` with the arguments given::

    PYTHONPATH=.:integrations .venv/bin/python benchmarks/ea_refresh.py --tasks stream --budgets none \\
        --cache-sizes 64 --stream-tokens 192 --samples 2 --equalise mean --threads 1 \\
        --policies full,expected_attention,expected_attention_r4,expected_attention_r16
"""

from __future__ import annotations

import sys
from typing import Any, Callable

from kvpolicy import EvictionPolicy, ExpectedAttention, KeyDiff, LagKV, plan_policy, register_policy
from kvpolicy.registry import Preset

REFRESH = (4, 16, 64)


def planned(refresh: int, cls: type = ExpectedAttention, prefix: str = "ea_refresh") -> Callable[..., EvictionPolicy]:
    """A ``kvpolicy bench`` factory: ``cls`` (Expected Attention) with ``refresh``, planned for the budget."""

    def plan(budget: Any, context_length: int, prompt_length: int) -> EvictionPolicy:
        preset = Preset(cls, {"refresh": refresh})
        return plan_policy(preset, budget, context_length=context_length, prompt_length=prompt_length).policy

    plan.__name__ = f"{prefix}{refresh}"
    return plan


ea_refresh4, ea_refresh16, ea_refresh64 = (planned(n) for n in REFRESH)
keydiff_refresh4, keydiff_refresh16, keydiff_refresh64 = (planned(n, KeyDiff, "keydiff_refresh") for n in REFRESH)
lagkv_refresh4, lagkv_refresh16, lagkv_refresh64 = (planned(n, LagKV, "lagkv_refresh") for n in REFRESH)


def main(argv: list[str]) -> int:
    from kvpolicy_tools.eval.compare import main as compare  # here: the bench imports this module too

    for n in (1, *REFRESH):  # (r1: the every-step rule, no longer KeyDiff's, Expected Attention's or LagKV's default)
        register_policy(ExpectedAttention, name=f"expected_attention_r{n}", preset={"refresh": n})
        register_policy(KeyDiff, name=f"keydiff_r{n}", preset={"refresh": n})
        register_policy(LagKV, name=f"lagkv_r{n}", preset={"refresh": n})
    return compare(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
