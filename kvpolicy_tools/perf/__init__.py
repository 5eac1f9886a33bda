"""Performance measurement for kvpolicy: eviction complexity, decode throughput and memory, the
per-step overhead breakdown, and the reports (tables, log-log slopes, plots).

Used by the ``kvpolicy bench`` command (:mod:`kvpolicy_tools.perf.bench`), the pytest-benchmark suite in
``benchmarks/`` and ``benchmarks/gpu_decode.py``. Nothing here is imported by ``import kvpolicy``;
the submodules import torch / transformers / matplotlib inside their functions.

* :mod:`kvpolicy_tools.perf.eviction`: the cost of one eviction and the amortised eviction cost per
  decoded token, against the cache size, on the torch and NumPy backends.
* :mod:`kvpolicy_tools.perf.decode`: tokens/s and cache bytes of a transformers model with
  ``DynamicCache`` and with kvpolicy's caches, measured interleaved, plus the breakdown of a
  decode step (attention, score product, accumulation, eviction, the rest of the model).
* :mod:`kvpolicy_tools.perf.report`: machine description, log-log slope fits, Markdown and PNG output.
"""
