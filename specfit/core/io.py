"""Atomic file writes: nothing half-written is ever left under a final name (CONTRIBUTING.md)."""

from __future__ import annotations

import os
import sys
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


#: Significant decimal digits every double keeps through a decimal string and back (DBL_DIG, C's
#: ``<float.h>``; ``sys.float_info.dig``). Rounding to them drops only binary round-off, the 16th and
#: 17th digits that ``repr`` shows (``0.1 + 0.2`` is 0.3, not 0.30000000000000004), and moves a value by
#: at most 5e-15 of itself.
FLOAT_DIGITS = sys.float_info.dig


def json_ready(obj, digits: int | None = None):
    """``obj`` with every non-finite float (NaN, ±infinity) replaced by None, recursively through
    dicts, lists and tuples (tuples become lists; numpy scalars become Python numbers); with
    ``digits``, every finite float rounded to that many significant decimal digits
    (:data:`FLOAT_DIGITS` drops binary round-off only). Ints and bools are left as they are.

    Every JSON or JSONL file SpecFit writes, and every ``--json`` line it prints, goes through
    :func:`dumps`, so that a strict parser (RFC 8259 has no NaN or Infinity) reads it: a value that
    is not defined (a ratio of two zeros, a gap against a solver that timed out) is written as
    ``null``.
    """
    import math

    import numpy as np

    if isinstance(obj, float):
        if not math.isfinite(obj):
            return None
        return obj if digits is None else float(f"{obj:.{digits}g}")
    if isinstance(obj, dict):
        return {k: json_ready(v, digits) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_ready(v, digits) for v in obj]
    if isinstance(obj, np.generic):
        return json_ready(obj.item(), digits)
    return obj


def dumps(obj, digits: int | None = None, **kwargs) -> str:
    """``json.dumps`` of :func:`json_ready` (obj, digits) with ``allow_nan=False``: strict JSON (RFC 8259).
    Floats print as Python's ``repr`` (the shortest string that reads back to the same double) unless
    ``digits`` rounds them first."""
    import json

    return json.dumps(json_ready(obj, digits), allow_nan=False, **kwargs)
