"""``kvpolicy.models``: the old path of the model loaders (re-exported from
:mod:`kvpolicy_tools.models`). Importing it imports torch and transformers; its layer is the
tools', not the core's."""

from kvpolicy_tools.models import *  # noqa: F401,F403
from kvpolicy_tools.models import __all__  # noqa: F401
