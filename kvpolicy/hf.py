"""``kvpolicy.hf``: the transformers integration (re-exported from ``kvpolicy_integrations.hf``).

Importing this module imports torch and transformers.
"""

from kvpolicy_integrations.hf import *  # noqa: F401,F403
from kvpolicy_integrations.hf import __all__  # noqa: F401
