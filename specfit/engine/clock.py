"""The clocks the engine reads: wall time for its records, CPU time for the host work it learns from.

The engine measures two things (:class:`specfit.engine.decoder.CycleRecord`): wall-clock ms of each
step of a cycle (reported, never decided on) and the host CPU ms of its own thread (the predictor,
the tree, the solver: learned per draft level and per cycle, :mod:`specfit.engine.online`, and
priced by the stop rule, the selection and the AR gate). Measured CPU time makes two runs of the same
prompts decide differently; a test that compares decisions across runs gives the engine a
:class:`FrozenClock` instead.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """What the engine reads of time: ``wall()`` and ``cpu()``, seconds from an arbitrary origin."""

    def wall(self) -> float:
        """Wall-clock seconds (monotonic)."""

    def cpu(self) -> float:
        """CPU seconds of the calling thread."""


class MeasuredClock:
    """The machine's clocks: ``time.perf_counter`` and ``time.thread_time`` (the engine's default)."""

    def wall(self) -> float:
        """``time.perf_counter()``, s."""
        return time.perf_counter()

    def cpu(self) -> float:
        """``time.thread_time()``, s: unlike wall time it does not grow with other processes' load."""
        return time.thread_time()


class FrozenClock:
    """A clock that never moves: every interval is 0 s, so host work costs 0 ms and the engine's
    decisions depend on its inputs alone (the cycle-record comparison, ``tests/engine/test_golden.py``)."""

    def wall(self) -> float:
        """0.0."""
        return 0.0

    def cpu(self) -> float:
        """0.0."""
        return 0.0
