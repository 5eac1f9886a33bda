"""kvpolicy-sink-h2o: an example third-party eviction policy (H2O with attention sinks)."""

from .policy import SinkH2O

__all__ = ["SinkH2O"]
