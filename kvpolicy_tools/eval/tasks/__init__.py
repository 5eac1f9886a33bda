"""The evaluation tasks of ``kvpolicy compare``, one class per file, registered by name.

A new task is one :class:`Task` subclass in ``kvpolicy_tools/eval/tasks/<name>.py`` decorated with
:func:`register_task` (and imported below), or, from another package, the ``kvpolicy.tasks``
entry point group (``name = "package.module:TaskClass"``). Its own settings are an ``Options``
dataclass set by the flags it adds (:meth:`Task.add_arguments`); ``kvpolicy compare`` lists it,
adds its flags and runs it like the built-ins. The built-ins: ``ppl``, ``stream``, ``summ``,
``needle``, ``passkey``, ``qa``, ``kv``, ``tw`` and ``ruler`` (see their modules).
"""

from .base import (
    DEFAULT_TASKS,
    PAPER_TASKS,
    TASK_ENTRY_POINT_GROUP,
    TASKS,
    CacheConfig,
    DataSources,
    NoOptions,
    Sample,
    Task,
    TaskOptions,
    TokenizerAdapter,
    is_reference,
    log_n_variant_of,
    make_tasks,
    parse_floats,
    parse_ints,
    policy_class,
    register_task,
    simulate_chunked_sizes,
    split_csv,
    takes_threshold_ratio,
    task_registry,
    tw_window,
    unregister_task,
)
from .kv import KVOptions, KVRetrievalTask
from .needle import NeedleOptions, NeedleTask
from .passkey import PasskeyTask
from .ppl import PerplexityOptions, PerplexityTask
from .qa import QAOptions, QATask
from .ruler import RulerOptions, RulerTask
from .stream import StreamOptions, StreamTask
from .summ import SummarizationOptions, SummarizationTask
from .tw import TwOptions, TwSweepTask

__all__ = [
    "CacheConfig",
    "DEFAULT_TASKS",
    "DataSources",
    "KVOptions",
    "KVRetrievalTask",
    "NeedleOptions",
    "NeedleTask",
    "NoOptions",
    "PAPER_TASKS",
    "PasskeyTask",
    "PerplexityOptions",
    "PerplexityTask",
    "QAOptions",
    "QATask",
    "RulerOptions",
    "RulerTask",
    "Sample",
    "StreamOptions",
    "StreamTask",
    "SummarizationOptions",
    "SummarizationTask",
    "TASKS",
    "TASK_ENTRY_POINT_GROUP",
    "Task",
    "TaskOptions",
    "TokenizerAdapter",
    "TwOptions",
    "TwSweepTask",
    "is_reference",
    "log_n_variant_of",
    "make_tasks",
    "parse_floats",
    "parse_ints",
    "policy_class",
    "register_task",
    "simulate_chunked_sizes",
    "split_csv",
    "takes_threshold_ratio",
    "task_registry",
    "tw_window",
    "unregister_task",
]
