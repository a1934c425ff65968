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


#: Upper bounds on the sizes that drive memory: an instance's per-node coverage bitsets hold
#: ``nodes x layers x experts`` bits, a generated instance set ``count x nodes`` trees. Every
#: public model stays far below them (Qwen3-30B-A3B: 48 MoE layers x 128 experts; DeepSeek-V3:
#: 58 x 256; EAGLE trees verify 32-128 of at most a few thousand drafted nodes).
MAX_EXPERTS = 1024
#: MoE layers of an instance or a generated one.
MAX_LAYERS = 256
#: Nodes of one draft tree.
MAX_NODES = 4096
#: Instances per size a generated comparison draws.
MAX_COUNT = 100_000
#: Seeds lie in [0, MAX_SEED): what ``torch.Generator.manual_seed`` and numpy take without wrapping.
MAX_SEED = 2**63
#: Largest duration, ms, a cost field may hold (about 11.6 days): sums over the largest instance
#: (MAX_NODES nodes, MAX_LAYERS x MAX_EXPERTS experts) stay finite, and so does every reported number.
MAX_MS = 1e9
#: Smallest time of a cycle, ms (``fixed_ms + per_node_ms``): 1 ns, so that a throughput
#: ``1000 A / T`` stays finite.
MIN_CYCLE_MS = 1e-6


def _num(x) -> str:
    return f"{x:g}" if isinstance(x, float) else ("2**63" if x == 2**63 else str(x))


def _range_text(low, high, low_open: bool = False, high_open: bool = False) -> str:
    if low is not None and high is not None and high_open and not low_open:  # a seed: ">= 0 and < 2**63"
        return f">= {_num(low)} and < {_num(high)}"
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{_num(low)}, {_num(high)}{')' if high_open else ']'}"
    if low is not None:
        return f"{'>' if low_open else '>='} {_num(low)}"
    if high is not None:
        return f"{'<' if high_open else '<='} {_num(high)}"
    return ""


def is_integer(value) -> bool:
    """True for a Python or numpy integer; False for ``bool``, floats (``2.0`` too) and strings."""
    import numbers

    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def check_int(field: str, value, low: int | None = None, high: int | None = None, *, high_open: bool = False) -> int:
    """``value`` as an int if it is an integer in ``[low, high]`` (``[low, high)`` with ``high_open``).

    The one rule for every integer SpecFit takes (instance JSON, API keyword arguments, CLI flags,
    config files): an integer is a Python or numpy integer, never a ``bool``, a float (``2.0``
    included) or a numeric string.

    Raises
    ------
    SpecFitInputError
        Naming ``field`` and the rule, otherwise.
    """
    rng = _range_text(low, high, high_open=high_open)
    what = f"an integer {rng}".strip()
    if not is_integer(value):
        raise SpecFitInputError(field, f"must be {what}, got {value!r} (a {type(value).__name__})")
    v = int(value)
    if (low is not None and v < low) or (high is not None and (v >= high if high_open else v > high)):
        raise SpecFitInputError(field, f"must be {what}, got {v}")
    return v


def check_number(field: str, value, low: float | None = None, high: float | None = None, *,
                 low_open: bool = False, high_open: bool = False, unit: str = "") -> float:
    """``value`` as a float if it is a finite real number in the given range (``-0.0`` read as 0.0).

    The one rule for every real number SpecFit takes: an int or float (numpy's too), never a
    ``bool`` or a string, finite (no NaN, no infinity), and inside ``[low, high]`` (an end open with
    ``low_open`` / ``high_open``).

    Raises
    ------
    SpecFitInputError
        Naming ``field`` and the rule, otherwise.
    """
    import math
    import numbers

    rng = _range_text(low, high, low_open, high_open)
    what = f"a finite number {rng}{f' ({unit})' if unit else ''}".replace("  ", " ")
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise SpecFitInputError(field, f"must be {what}, got {value!r} (a {type(value).__name__})")
    v = float(value)
    if not math.isfinite(v):
        raise SpecFitInputError(field, f"must be {what}, got {v}")
    if (low is not None and (v <= low if low_open else v < low)) or (
            high is not None and (v >= high if high_open else v > high)):
        raise SpecFitInputError(field, f"must be {what}, got {v}")
    return v + 0.0  # -0.0 -> 0.0


def check_seed(field: str, value) -> int:
    """A seed: an integer in ``[0, 2**63)`` (:data:`MAX_SEED`), used as given (never reduced modulo).

    Raises
    ------
    SpecFitInputError
        Naming ``field``: not an integer (floats, bools and strings included) or out of range.
    """
    return check_int(field, value, 0, MAX_SEED, high_open=True)


def check_unique_ids(field: str, ids) -> None:
    """Refuse a repeated id where a set is meant (a node's experts in one layer, a layer's cache).

    Raises
    ------
    SpecFitInputError
        Naming ``field`` and the first repeated id.
    """
    seen = set()
    for i in ids:
        i = int(i)
        if i in seen:
            raise SpecFitInputError(field, f"names expert id {i} twice; the ids are a set")
        seen.add(i)


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
    if not is_integer(value) or value < low:
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
    """``values`` as an int64 array of ``ndim`` dimensions (an empty one reshaped).

    Integers only, the rule of :func:`check_int`: a float (``0.0`` too), a ``bool``, a string or an
    integer beyond int64 is refused, not converted.

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
        integers (floats, bools, strings, ids beyond int64).
    """
    if isinstance(values, np.ndarray) and values.dtype == np.int64 and values.ndim == ndim:
        return values.copy() if copy else values  # already the internal form: no checks to repeat
    try:
        arr = np.asarray(values)
    except (ValueError, OverflowError) as exc:  # numpy refuses ragged nested lists
        raise SpecFitInputError(field, f"must be a rectangular array ({exc})") from None
    if arr.dtype == object:
        _refuse_object_array(values, field)
    if arr.size == 0 and arr.ndim < ndim:
        arr = arr.reshape((0,) * ndim)
    if arr.ndim != ndim:
        raise SpecFitInputError(field, f"must have {ndim} dimension(s), got shape {arr.shape}")
    if not arr.size:
        return arr.astype(np.int64)
    if arr.dtype.kind == "u" and arr.max() > np.iinfo(np.int64).max:  # astype would wrap them
        raise SpecFitInputError(field, "must contain integers that fit in int64")
    if arr.dtype.kind not in "iu":
        kind = {"f": "floats", "b": "booleans", "U": "strings", "S": "strings"}.get(arr.dtype.kind, str(arr.dtype))
        raise SpecFitInputError(field, f"must contain integers, got {kind} (e.g. {arr.ravel()[0].item()!r})")
    if not isinstance(values, np.ndarray) and has_bool(values):  # [True, 2] reads as int64
        raise SpecFitInputError(field, "must contain integers, got a boolean")
    return arr.astype(np.int64)


def has_bool(values) -> bool:
    """True if ``values`` (a scalar or a nested list or tuple) is or holds a ``bool``: numpy reads
    ``[True, 2]`` as an int64 array, so a list is searched before it is trusted as numbers."""
    stack = [values]
    while stack:
        v = stack.pop()
        if isinstance(v, (list, tuple)):
            if any(x is True or x is False for x in v):
                return True
            stack.extend(x for x in v if isinstance(x, (list, tuple)))
        elif isinstance(v, (bool, np.bool_)):
            return True
    return False


def _refuse_object_array(values, field: str) -> None:
    """The error for a nested list numpy could only read as objects: ragged lists, or an entry
    that is not an int64 integer (a huge integer, ``None``, a mix of types)."""
    def walk(v, depth):
        if isinstance(v, (list, tuple, np.ndarray)):
            lens = {len(x) for x in v if isinstance(x, (list, tuple, np.ndarray))}
            if len(lens) > 1 or (lens and any(not isinstance(x, (list, tuple, np.ndarray)) for x in v)):
                raise SpecFitInputError(field, "must be a rectangular array of integers (ragged lists)")
            for x in v:
                walk(x, depth + 1)
        elif not is_integer(v):
            raise SpecFitInputError(field, f"must contain integers, got {v!r}")
        elif not np.iinfo(np.int64).min <= int(v) <= np.iinfo(np.int64).max:
            raise SpecFitInputError(field, f"must contain integers that fit in int64, got {v}")
    walk(values, 0)
    raise SpecFitInputError(field, "must be a rectangular array of integers")
