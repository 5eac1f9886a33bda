"""Framework integrations of kvpolicy (installed from the top-level ``integrations/`` folder).

* :mod:`kvpolicy_integrations.hf`: transformers 5.x evicting cache and ``generate`` helper
  (also importable as :mod:`kvpolicy.hf`).
* :mod:`kvpolicy_integrations.deepspeed`: DeepSpeed-inference (AutoTP) glue.

Submodules import their framework on import; this package itself imports nothing heavy.
"""
