"""Errors raised for bad input: every message names the field and the rule it broke."""

from __future__ import annotations

from typing import Mapping, TypeVar

import numpy as np

T = TypeVar("T")


class SpecFitInputError(ValueError):
    """Bad input to SpecFit.

    Parameters
    ----------
    field : str
        The offending field, in the vocabulary of the instance JSON (``parents``, ``path_prob``,
        ``experts``, ``cost.per_expert_ms``, ...).
    rule : str
        The rule it broke, as a short sentence.

    The message is ``"<field>: <rule>"`` so that the command line can print it as one line.
    """

    def __init__(self, field: str, rule: str):
        self.field = field
        self.rule = rule
        super().__init__(f"{field}: {rule}")


def lookup(table: Mapping[str, T], name: str, field: str) -> T:
    """``table[name]``, or a :class:`SpecFitInputError` on ``field`` that lists the known names.

    Raises
    ------
    SpecFitInputError
        If ``name`` is not a key of ``table``.
    """
    try:
        return table[name]
    except (KeyError, TypeError):
        raise SpecFitInputError(field, f"unknown {field} {name!r}; known: {', '.join(sorted(table))}") from None


def check_positive_int(field: str, value) -> int:
    """Return ``value`` as an int if it is an integer >= 1 (``bool`` excluded).

    Raises
    ------
    SpecFitInputError
        Naming ``field``, otherwise.
    """
    return _check_int(field, value, 1, "a positive integer")


def check_nonnegative_int(field: str, value) -> int:
    """Return ``value`` as an int if it is an integer >= 0 (``bool`` excluded), e.g. a seed.

    Raises
    ------
    SpecFitInputError
        Naming ``field``, otherwise.
    """
    return _check_int(field, value, 0, "an integer >= 0")


def _check_int(field: str, value, low: int, what: str) -> int:
    import numbers

    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise SpecFitInputError(field, f"must be {what}, got {value!r}")
    return int(value)


def check_single_sequence(field: str, shape: tuple[int, ...]) -> None:
    """Check that token ids of ``shape`` are one sequence: ``(T,)`` or ``(1, T)``. Batch size 1 only.

    SpecFit decodes one sequence at a time (the draft tree, the expert cache and the KV are per
    sequence); a ``(B, T)`` batch with B > 1 is refused rather than flattened into one prompt.

    Raises
    ------
    SpecFitInputError
        Naming ``field``: batch size 1 only for ``(B, T)`` with B > 1, otherwise a shape that is
        not 1-D or ``(1, T)``.
    """
    shape = tuple(int(s) for s in shape)
    if len(shape) == 2 and shape[0] != 1:
        raise SpecFitInputError(field, f"batch size 1 only: got {shape[0]} sequences (shape {shape}); "
                                "pass one sequence of shape (T,) or (1, T)")
    if len(shape) not in (1, 2):
        raise SpecFitInputError(field, f"must be token ids of shape (T,) or (1, T) (batch size 1 only), got shape {shape}")


def check_context(field: str, prompt_tokens: int, max_new_tokens: int, context: int) -> None:
    """Refuse a generation that would run past the model's context.

    Raises
    ------
    SpecFitInputError
        On ``field`` if ``prompt_tokens + max_new_tokens > context`` (``max_position_embeddings``):
        positions past it are outside what the model was trained on, and a long run there only
        costs time.
    """
    if prompt_tokens + max_new_tokens > context:
        raise SpecFitInputError(field, f"the prompt ({prompt_tokens} tokens) plus {max_new_tokens} new tokens exceed "
                                f"the model's context of {context} tokens (max_position_embeddings)")


def as_int_array(values, field: str, ndim: int, copy: bool = True) -> np.ndarray:
    """``values`` as an int64 array of ``ndim`` dimensions (integral floats converted; an empty one reshaped).

    Parameters
    ----------
    values : array_like
    field : str
        Named in the errors.
    ndim : int
    copy : bool
        Copy an int64 array of ``ndim`` dimensions (returned as it is, unchecked, when False).

    Raises
    ------
    SpecFitInputError
        Naming ``field``: if ``values`` is ragged, has another number of dimensions, or holds anything but
        integers (non-integral floats, bools, strings, ids beyond int64).
    """
    if isinstance(values, np.ndarray) and values.dtype == np.int64 and values.ndim == ndim:
        return values.copy() if copy else values  # already the internal form: no checks to repeat
    try:
        arr = np.asarray(values)
    except ValueError as exc:  # numpy refuses ragged nested lists
        raise SpecFitInputError(field, f"must be a rectangular array ({exc})") from None
    if arr.dtype == object:
        raise SpecFitInputError(field, "must be a rectangular array of integers (ragged lists)")
    if arr.size == 0 and arr.ndim < ndim:
        arr = arr.reshape((0,) * ndim)
    if arr.ndim != ndim:
        raise SpecFitInputError(field, f"must have {ndim} dimension(s), got shape {arr.shape}")
    if arr.size and arr.dtype.kind == "u" and arr.max() > np.iinfo(np.int64).max:  # astype would wrap them
        raise SpecFitInputError(field, "must contain integers that fit in int64")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        if np.issubdtype(arr.dtype, np.floating) and np.all(np.isfinite(arr)) and np.all(arr == np.round(arr)):
            arr = arr.astype(np.int64)
        else:
            raise SpecFitInputError(field, "must contain integers")
    return arr.astype(np.int64)
