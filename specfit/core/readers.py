"""Reading the files SpecFit is given: one error kind for every unreadable input file.

Every file a user hands SpecFit (instance JSON, dataset JSONL, ``config.json`` of a checkpoint or
head, routing traces and probes as ``.npz``) is read through these functions, so a missing,
unreadable, truncated or wrongly formatted file is always a :class:`SpecFitInputError` whose message
names the file and what is wrong; the command line prints it as one line with exit code 2.
Safetensors checkpoints are read by :mod:`specfit.models` with the same rule (torch lives there).
"""

from __future__ import annotations

import json
import zipfile
import zlib
from pathlib import Path

import numpy as np

from specfit.core.errors import SpecFitInputError


def _fail(path: Path, field: str | None, what: str) -> SpecFitInputError:
    """``field: cannot read <path>: <what>`` or, without a field, ``<path>: cannot read: <what>``."""
    return SpecFitInputError(field, f"cannot read {path}: {what}") if field else SpecFitInputError(str(path), f"cannot read: {what}")


def read_text(path: str | Path, field: str | None = None) -> str:
    """The UTF-8 text of ``path``.

    Parameters
    ----------
    path : str or Path
    field : str, optional
        The input field the file was given as (``instance``, ``datasets``, ...); default: the
        error's field is the path itself.

    Raises
    ------
    SpecFitInputError
        If the file is missing, a folder, unreadable (permissions, I/O) or not UTF-8 text.
    """
    p = Path(path)
    if p.is_dir():
        raise _fail(p, field, "it is a folder, not a file")
    try:
        return p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise _fail(p, field, "no such file") from None
    except OSError as exc:
        raise _fail(p, field, f"{exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise _fail(p, field, f"not UTF-8 text (byte {exc.start}); a binary file?") from None


def read_json(path: str | Path, field: str | None = None, *, kind: type | None = dict):
    """The JSON value in ``path`` (non-standard ``NaN``/``Infinity`` read as float NaN/inf).

    Parameters
    ----------
    path : str or Path
    field : str, optional
        As in :func:`read_text`.
    kind : type or None
        Required type of the top-level value (default ``dict``: a JSON object); None accepts any.

    Raises
    ------
    SpecFitInputError
        As :func:`read_text`, or if the text is not JSON or its top level is not ``kind``.
    """
    p = Path(path)
    text = read_text(p, field)
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _fail(p, field, f"not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if kind is not None and not isinstance(obj, kind):
        name = "a JSON object" if kind is dict else f"a JSON {kind.__name__}"
        raise _fail(p, field, f"the top level must be {name}, got {type(obj).__name__}")
    return obj


def read_npz(path: str | Path, field: str | None = None, *, required: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    """Every array of an ``.npz`` file, read into memory (no pickles).

    Parameters
    ----------
    path : str or Path
    field : str, optional
        As in :func:`read_text`.
    required : tuple of str
        Array names that must be present.

    Returns
    -------
    dict of str to numpy.ndarray

    Raises
    ------
    SpecFitInputError
        If the file is missing, unreadable, not a (complete) ``.npz`` archive, holds pickled
        objects, or lacks a required array.
    """
    p = Path(path)
    if not p.is_file():
        raise _fail(p, field, "it is a folder, not a file" if p.is_dir() else "no such file")
    try:
        z = np.load(p, allow_pickle=False)
        if not hasattr(z, "files"):  # a plain .npy array
            raise ValueError("a single .npy array, not an archive")
        with z:
            out = {k: z[k] for k in z.files}
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile, zlib.error) as exc:
        raise _fail(p, field, f"not a complete .npz archive ({type(exc).__name__}: {exc})") from None
    missing = [k for k in required if k not in out]
    if missing:
        raise _fail(p, field, f"the array {missing[0]!r} is missing")
    return out
