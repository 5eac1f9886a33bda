"""kvpolicy_numpy: the exact NumPy reference backend (simple, literal, slow is fine).

Every other backend is tested against :func:`replay`.
"""

import array_api_compat.numpy as _xp
import numpy as _np

from kvpolicy.policy import register_namespace as _register_namespace

from .replay import Trace, replay, softmax

_register_namespace(_np.ndarray, _xp)  # (what array_namespace answers for an ndarray, without the search)

__all__ = ["Trace", "replay", "softmax"]
