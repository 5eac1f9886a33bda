"""kvpolicy_numpy: the exact NumPy reference backend (simple, literal, slow is fine).

Every other backend is tested against :func:`replay`.
"""

from .replay import Trace, replay, softmax

__all__ = ["Trace", "replay", "softmax"]
