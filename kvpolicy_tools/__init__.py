"""kvpolicy_tools: what runs the library, above it - the ``kvpolicy`` command
(:mod:`kvpolicy_tools.cli`), ``kvpolicy compare`` (:mod:`kvpolicy_tools.eval`), the benchmarks'
machinery and ``kvpolicy bench`` (:mod:`kvpolicy_tools.perf`) and the model loaders
(:mod:`kvpolicy_tools.models`).

The top layer (docs/design.md, "Layers of the library"): it imports the core (``kvpolicy``), the
backends and the integrations; nothing of theirs imports it. Importing this package imports none
of its modules.
"""
