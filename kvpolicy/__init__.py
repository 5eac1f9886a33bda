"""kvpolicy: KV-cache eviction policies for LLM inference.

The backend-agnostic core: :class:`EvictionPolicy`, the built-in policies (BUZZ, H2O,
StreamingLLM, local window, full cache), the registry and budgets. Imports neither torch nor
transformers; backends live in ``kvpolicy_numpy`` (exact reference) and ``kvpolicy_torch``.

Example:
    >>> import kvpolicy
    >>> p = kvpolicy.make_policy("buzz", budget=0.3, context_length=4096)
    >>> p.capacity <= 4096
    True
"""

from .driver import PolicyError
from .budget import PolicyPlan, make_policy, plan_capacity, plan_policy, realised_budget, simulate_sizes
from .policies import (
    BUZZ,
    Composed,
    ExpectedAttention,
    H2O,
    FullCache,
    KeyDiff,
    Knorm,
    LocalWindow,
    PyramidKV,
    Scissorhands,
    SnapKV,
    StreamingLLM,
    TOVA,
    compose,
    estimate_threshold,
    fixed_point_middle,
    pyramid_sizes,
    threshold_ratio,
)
from .params import REQUIRED, Param, declared_params
from .policy import KEY_STATISTICS, CacheView, DecodeEviction, DeferredScoresView, EvictionPolicy, LogNScaling
from .registry import (
    ENTRY_POINT_GROUP,
    Preset,
    available_policies,
    create_policy,
    get_policy,
    register_policy,
)

__version__ = "0.1.0"

__all__ = [
    "BUZZ",
    "Composed",
    "CacheView",
    "DecodeEviction",
    "DeferredScoresView",
    "ENTRY_POINT_GROUP",
    "ExpectedAttention",
    "KEY_STATISTICS",
    "EvictionPolicy",
    "FullCache",
    "H2O",
    "KeyDiff",
    "Knorm",
    "LocalWindow",
    "LogNScaling",
    "Param",
    "REQUIRED",
    "PolicyError",
    "PolicyPlan",
    "Preset",
    "PyramidKV",
    "Scissorhands",
    "SnapKV",
    "StreamingLLM",
    "TOVA",
    "available_policies",
    "compose",
    "create_policy",
    "declared_params",
    "estimate_threshold",
    "fixed_point_middle",
    "get_policy",
    "make_policy",
    "plan_capacity",
    "plan_policy",
    "pyramid_sizes",
    "realised_budget",
    "register_policy",
    "simulate_sizes",
    "threshold_ratio",
]
