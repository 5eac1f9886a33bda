"""``python -m kvpolicy``: the ``kvpolicy`` command line (:mod:`kvpolicy_tools.cli`)."""

from kvpolicy_tools.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
