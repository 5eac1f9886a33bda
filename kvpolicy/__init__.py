"""kvpolicy: KV-cache eviction policies for LLM inference.

The backend-agnostic core: :class:`EvictionPolicy`, the built-in policies, the registry and
budgets. Imports neither torch nor transformers; backends live in ``kvpolicy_numpy`` (exact
reference) and ``kvpolicy_torch``.

The built-in policies, by their registry names (``kvpolicy policies`` lists them with their
parameters; docs/policies.md gives their exact semantics):

* ``buzz`` (:class:`BUZZ`), and ``buzz_logn``, BUZZ with log n attention scaling: sinks, a
  beehive-sampled middle of segmented heavy hitters, a sliding window;
* ``h2o`` (:class:`H2O`): heavy hitters plus a recent window;
* ``tova`` (:class:`TOVA`): at capacity, drop the token the current query attends to least;
* ``scissorhands`` (:class:`Scissorhands`): drop the tokens most often unimportant lately;
* ``streaming_llm`` (:class:`StreamingLLM`): attention sinks plus the last ``window`` positions;
* ``local`` (:class:`LocalWindow`): the last ``window`` positions;
* ``full`` (:class:`FullCache`): keep every token;
* ``knorm`` (:class:`Knorm`) and ``keydiff`` (:class:`KeyDiff`): score the cached keys (lowest L2
  norm; most different from the others), no attention scores needed;
* ``expected_attention`` (:class:`ExpectedAttention`): the attention future queries are expected
  to pay each key (from a running estimate of the queries), times its value's norm;
* ``snapkv`` (:class:`SnapKV`): a prefill policy, the prompt's tokens the observation window
  attends to most;
* ``kvzip`` (:class:`KVzip`) and ``kvzip_headwise`` (its head-wise budgets): a prefill policy, the
  prompt's tokens the model attends to most while it repeats the prompt (context reconstruction);
* ``compose`` (:class:`Composed`, :func:`compose`): a prefill policy, then a decode policy, and the
  presets ``snapkv_h2o``, ``snapkv_tova``, ``snapkv_buzz``;
* ``pyramid`` (:class:`PyramidKV`): per-layer budgets over any base policy, and the presets
  ``pyramid_h2o`` (over H2O) and ``pyramidkv`` (PyramidKV's own: over SnapKV);
* ``adakv`` (:class:`AdaKV`): head-wise budgets, a layer's budget shared among its KV heads by one
  top-k over a scorer's scores, and the presets ``adakv_snapkv``, ``adakv_h2o``, ``adakv_keydiff``,
  ``adakv_tova``, ``adakv_expected_attention``;
* ``chunkkv`` (:class:`ChunkKV`): a scorer's selection in whole chunks of consecutive tokens
  (planned over SnapKV, as kvpress's leaderboard runs it);
* ``critical_kv`` (:class:`CriticalKV`): a scorer's scores refined by each value's norm through the
  output projection, and the presets ``critical_expected_attention`` and
  ``critical_adakv_expected_attention`` (AdaKV over it);
* ``lagkv`` (:class:`LagKV`): attention-free, each token's keys and values against the next
  partition's range.

Not registered (planned from kvpress's ``compression_ratio``, not a budget): :func:`prefill_only`
(:class:`PrefillOnly`), any scorer run as kvpress runs its presses: the context compressed once,
every later token kept.

Example:
    >>> import kvpolicy
    >>> p = kvpolicy.make_policy("buzz", budget=0.3, context_length=4096)
    >>> p.capacity <= 4096
    True
"""

from .driver import PolicyError
from .budget import PolicyPlan, make_policy, plan_capacity, plan_policy, realised_budget, simulate_sizes
from .policies import (
    AdaKV,
    BUZZ,
    ChunkKV,
    Composed,
    CriticalKV,
    ExpectedAttention,
    H2O,
    FullCache,
    KeyDiff,
    Knorm,
    KVzip,
    LagKV,
    LocalWindow,
    PrefillOnly,
    PyramidKV,
    Scissorhands,
    SnapKV,
    StreamingLLM,
    TOVA,
    compose,
    prefill_only,
    estimate_threshold,
    fixed_point_middle,
    pyramid_sizes,
    threshold_ratio,
)
from .params import REQUIRED, Param, declared_params
from .policy import KEY_STATISTICS, CacheView, CandidateSum, DecodeEviction, DeferredScoresView, EvictionPolicy, HeadwiseEviction, LogNScaling, Ranking, WrappingPolicy
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
    "AdaKV",
    "ChunkKV",
    "BUZZ",
    "Composed",
    "CriticalKV",
    "CacheView",
    "DecodeEviction",
    "DeferredScoresView",
    "ENTRY_POINT_GROUP",
    "ExpectedAttention",
    "KEY_STATISTICS",
    "EvictionPolicy",
    "FullCache",
    "H2O",
    "HeadwiseEviction",
    "CandidateSum",
    "KeyDiff",
    "Knorm",
    "KVzip",
    "LagKV",
    "LocalWindow",
    "LogNScaling",
    "Param",
    "REQUIRED",
    "PolicyError",
    "PolicyPlan",
    "Preset",
    "PrefillOnly",
    "PyramidKV",
    "Ranking",
    "Scissorhands",
    "SnapKV",
    "StreamingLLM",
    "TOVA",
    "available_policies",
    "compose",
    "prefill_only",
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
    "WrappingPolicy",
]
