"""What every ``kvpolicy`` verb shares: the user-error type, the output-path checks done before
any work, and :func:`run_command`, which turns a verb's documented errors into ``prog: error: ...``
with exit status 2 (the verbs' modules - :mod:`kvpolicy_tools.cli`, :mod:`kvpolicy_tools.eval.compare`,
:mod:`kvpolicy_tools.perf.bench` - import it from here, below all of them)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Callable

from kvpolicy.driver import PolicyError

__all__ = ["CLIError", "check_output_file", "check_output_folder", "describe_os_error", "run_command"]


class CLIError(ValueError):
    """A user error the CLI reports without a traceback."""


def check_output_file(path: Path, flag: str) -> Path:
    """``path`` if a file can be written there (its folder exists or can be made, and it is not a
    folder itself), else :class:`CLIError` naming ``flag``; checked before any work is done.

    Example:
        >>> check_output_file(Path("/proc/x.png"), "--out")
        Traceback (most recent call last):
        ...
        kvpolicy_tools.command.CLIError: --out /proc/x.png: cannot write there (/proc is not a folder kvpolicy may write to)
    """
    if path.is_dir():
        raise CLIError(f"{flag} {path}: is a folder; give a file name, e.g. {path / 'trace.png'}")
    _check_writable_below(path.parent, path, flag)
    return path


def check_output_folder(path: Path, flag: str) -> Path:
    """``path`` if it is a folder that can be written to or made, else :class:`CLIError` naming
    ``flag`` (``kvpolicy compare --out``: checked before the model is loaded).

    Example:
        >>> check_output_folder(Path("/proc/report"), "--out")
        Traceback (most recent call last):
        ...
        kvpolicy_tools.command.CLIError: --out /proc/report: cannot write there (/proc is not a folder kvpolicy may write to)
    """
    _check_writable_below(path, path, flag)
    return path


def _check_writable_below(folder: Path, path: Path, flag: str) -> None:
    """The nearest existing folder at or above ``folder`` must be a folder kvpolicy may write to."""
    existing = next((p for p in (folder, *folder.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise CLIError(f"{flag} {path}: {existing} is a file, not a folder")
    # /proc, /sys and read-only mounts: os.access may say yes to root, so look at the mount as well
    writable = existing is not None and os.access(existing, os.W_OK)
    if writable:
        try:
            writable = not (os.statvfs(existing).f_flag & os.ST_RDONLY) and existing.resolve().parts[1:2] not in (("proc",), ("sys",))
        except OSError:
            writable = False
    if not writable:
        raise CLIError(f"{flag} {path}: cannot write there ({existing} is not a folder kvpolicy may write to)")


def describe_os_error(e: OSError) -> str:
    """An ``OSError`` as one line that names the file first (``/proc/x.png: No such file or
    directory`` rather than ``[Errno 2] ...``); an error raised with a message of its own keeps it.

    Example:
        >>> describe_os_error(FileNotFoundError(2, "No such file or directory", "/proc/x.png"))
        '/proc/x.png: No such file or directory'
    """
    if e.strerror and e.filename is not None:
        return f"{e.filename}: {e.strerror}"
    return str(e) or type(e).__name__


def run_command(prog: str, run: Callable[[argparse.Namespace], Any], args: argparse.Namespace) -> int:
    """``run(args)`` as a command's exit status: a ``ValueError`` (the library's documented
    errors, and :class:`CLIError`) or an ``OSError`` (a file or folder that cannot be read or
    written: it names the path) is the user's, printed as ``prog: error: ...`` with status 2."""
    try:
        return int(run(args) or 0)
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"{prog}: error: {describe_os_error(e)}", file=sys.stderr)
        return 2
    except PolicyError as e:  # a (third-party) policy broke its contract: it names the policy
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
