"""Built-in policies, one per module."""

from ..registry import mark_builtin_policies, register_policy
from .adakv import AdaKV, HeadExchange, ShardedAdaKV, headwise_keep, keep_best
from .chunkkv import ChunkKV
from .buzz import BUZZ, estimate_threshold, fixed_point_middle, small_stride, threshold_ratio
from .critical import CriticalKV
from .composition import Composed, compose
from .expected_attention import ExpectedAttention
from .full import FullCache
from .h2o import H2O
from .keydiff import KeyDiff
from .knorm import Knorm
from .kvzip import KVzip
from .lagkv import LagKV
from .local import LocalWindow
from .prefill_only import PrefillOnly, prefill_only
from .pyramid import PyramidKV, pyramid_sizes
from .scissorhands import Scissorhands
from .snapkv import SnapKV
from .streaming import StreamingLLM
from .tova import TOVA

register_policy(BUZZ, name="buzz_logn", preset={"log_n": True}, doc="BUZZ with log n attention scaling")
mark_builtin_policies()  # register_policy refuses to replace these (or take their aliases) unless told to

__all__ = [
    "AdaKV",
    "HeadExchange",
    "ShardedAdaKV",
    "headwise_keep",
    "keep_best",
    "BUZZ",
    "ChunkKV",
    "Composed",
    "CriticalKV",
    "ExpectedAttention",
    "FullCache",
    "H2O",
    "KeyDiff",
    "Knorm",
    "KVzip",
    "LagKV",
    "LocalWindow",
    "PrefillOnly",
    "PyramidKV",
    "Scissorhands",
    "SnapKV",
    "StreamingLLM",
    "TOVA",
    "estimate_threshold",
    "fixed_point_middle",
    "small_stride",
    "threshold_ratio",
    "compose",
    "prefill_only",
    "pyramid_sizes",
]
