"""``kvpolicy.cli``: the old path of the ``kvpolicy`` command (re-exported from
:mod:`kvpolicy_tools.cli`; console scripts installed before the move name it). Its layer is the
tools', not the core's."""

from kvpolicy_tools.cli import main

__all__ = ["main"]

if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
