"""Atomic file writes: nothing half-written is ever left under a final name (CONTRIBUTING.md)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable


def atomic_write(path: str | Path, write: Callable[[Path], object]) -> None:
    """Write a file through ``write(tmp_path)``, fsync it and rename it over ``path``.

    The temporary file is a hidden sibling (``.<name>.tmp<pid>``, same folder so the rename is
    atomic); if ``write`` raises, it is removed and ``path`` is left as it was.

    Parameters
    ----------
    path : str or Path
        The final file name.
    write : callable
        ``write(tmp_path)`` creates the file at ``tmp_path``.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically (:func:`atomic_write`)."""
    atomic_write(path, lambda p: Path(p).write_text(text, encoding="utf-8"))
