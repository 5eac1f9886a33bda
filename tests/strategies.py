"""Our suite's hypothesis strategies are the public kit's: :mod:`kvpolicy.testing.strategies`.

Kept as a module so that ``from strategies import ...`` in the tests keeps working.
"""

from kvpolicy.testing.strategies import *  # noqa: F401,F403
from kvpolicy.testing.strategies import __all__  # noqa: F401
