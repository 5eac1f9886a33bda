"""``kvpolicy.deepspeed``: the DeepSpeed-inference integration (re-exported from ``kvpolicy_integrations.deepspeed``).

Importing this module imports torch and transformers; DeepSpeed itself is imported when an engine
is built (:func:`init_inference`, :func:`make_cache` on an engine), so the head arithmetic
(:func:`shard_layout`) works without it.
"""

from kvpolicy_integrations.deepspeed import *  # noqa: F401,F403
from kvpolicy_integrations.deepspeed import __all__  # noqa: F401
