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

    Raises
    ------
    OSError
        If the file cannot be written (a read-only folder, a full disk); its ``filename`` is
        ``path``, never the temporary file's name.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:  # name the file the caller asked for, not the temporary one
        if exc.filename is not None and Path(exc.filename) == tmp:
            raise OSError(exc.errno, exc.strerror, str(path)) from None
        raise
    finally:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically (:func:`atomic_write`)."""
    atomic_write(path, lambda p: Path(p).write_text(text, encoding="utf-8"))


def json_ready(obj):
    """``obj`` with every non-finite float (NaN, ±infinity) replaced by None, recursively through
    dicts, lists and tuples (tuples become lists; numpy scalars become Python numbers).

    Every JSON or JSONL file SpecFit writes, and every ``--json`` line it prints, goes through
    :func:`dumps`, so that a strict parser (RFC 8259 has no NaN or Infinity) reads it: a value that
    is not defined (a ratio of two zeros, a gap against a solver that timed out) is written as
    ``null``.
    """
    import math

    import numpy as np

    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_ready(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_ready(v) for v in obj]
    if isinstance(obj, np.generic):
        return json_ready(obj.item())
    return obj


def dumps(obj, **kwargs) -> str:
    """``json.dumps`` of :func:`json_ready` (obj) with ``allow_nan=False``: strict JSON (RFC 8259)."""
    import json

    return json.dumps(json_ready(obj), allow_nan=False, **kwargs)
