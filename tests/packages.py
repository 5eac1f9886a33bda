"""Where our packages live and their modules by name (tests/project's layering test and doctest
sweep read every module from here)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Each top-level package and its folder.
PACKAGES = {
    "kvpolicy": ROOT / "kvpolicy",
    "kvpolicy_numpy": ROOT / "kvpolicy_numpy",
    "kvpolicy_torch": ROOT / "kvpolicy_torch",
    "kvpolicy_integrations": ROOT / "integrations" / "kvpolicy_integrations",
    "kvpolicy_tools": ROOT / "kvpolicy_tools",
}


def module_name(package: str, path: Path) -> str:
    """The dotted name of the module at ``path`` in ``package`` (a package's ``__init__`` is the package)."""
    parts = list(path.relative_to(PACKAGES[package]).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([package, *parts])


def module_files() -> dict[str, Path]:
    """Every module of ours: dotted name -> file."""
    return {module_name(package, path): path for package, folder in PACKAGES.items() for path in sorted(folder.rglob("*.py"))}
