"""The clocks the engine reads: wall time for its records, host time for the host work it learns from.

The engine reads three things (:class:`specfit.engine.decoder.CycleRecord`): wall-clock ms of each step
of a cycle (reported, never decided on); the host ms of its own work (the predictor, the tree, the
solver, the bookkeeping: learned per draft level and per cycle, :mod:`specfit.engine.online`, priced
by the stop rule, the selection and the AR gate, and the modeled cycle's host part), from ``cpu()``;
and this machine's thread CPU time of that work, from ``thread()`` (reported only,
``CycleRecord.host_thread_ms``). Where host work happens the engine calls ``charge(kind, n)`` with
its count (:data:`specfit.core.host_cost.HOST_WORK`).

One protocol, two implementations that decide:

* :class:`MeasuredClock` (on a real GPU): ``cpu()`` is the thread's CPU time; the engine learns what
  its host work costs on the machine it serves on. Two runs of the same prompts can decide differently.
* :class:`CountedClock` (modeled figures): ``cpu()`` is the sum of the prices of the work charged so
  far (:class:`specfit.core.host_cost.HostCosts`), a function of the counts alone: the same command
  gives the same decisions and modeled figures on any machine (greedy).

:class:`FrozenClock` (a test's) never moves: host work costs 0 ms.
"""

from __future__ import annotations

import time
from typing import Protocol

from specfit.core.host_cost import HOST_WORK, HostCosts

#: The clock kinds by name (``specfit eval --clock``): ``counted`` prices host work from its counts,
#: ``measured`` reads this machine's CPU time.
CLOCKS = ("counted", "measured")


class Clock(Protocol):
    """What the engine reads of time: ``wall()``, ``cpu()`` and ``thread()``, seconds from an arbitrary
    origin; and where host work happens, ``charge(kind, n)``."""

    def wall(self) -> float:
        """Wall-clock seconds (monotonic)."""

    def cpu(self) -> float:
        """Host seconds the engine learns from and prices: measured or counted."""

    def thread(self) -> float:
        """This machine's CPU seconds of the calling thread (reported, never decided on)."""

    def charge(self, kind: str, n: float = 1) -> None:
        """``n`` counts of host work ``kind`` (a name of :data:`specfit.core.host_cost.HOST_WORK`) ran."""


class MeasuredClock:
    """The machine's clocks: ``time.perf_counter`` and ``time.thread_time``; charges are ignored."""

    name = "measured"

    def wall(self) -> float:
        """``time.perf_counter()``, s."""
        return time.perf_counter()

    def cpu(self) -> float:
        """``time.thread_time()``, s: unlike wall time it does not grow with other processes' load."""
        return time.thread_time()

    def thread(self) -> float:
        """``time.thread_time()``, s."""
        return time.thread_time()

    def charge(self, kind: str, n: float = 1) -> None:
        """Nothing: the work's CPU time is measured."""


class CountedClock:
    """Host work priced from its counts: ``cpu()`` is the sum of ``costs.ms(kind, n)`` over every
    ``charge`` so far, in seconds; ``wall()`` and ``thread()`` are the machine's (reported only).

    Parameters
    ----------
    costs : HostCosts
        ms per count of each kind of host work (a profile's, :data:`specfit.core.host_cost.HOST_COSTS`).

    Attributes
    ----------
    counts : dict
        Counts charged so far per kind (for fits and tests).

    Raises
    ------
    SpecFitInputError
        From :meth:`charge`: an unknown kind (field ``kind``).
    """

    name = "counted"

    def __init__(self, costs: HostCosts):
        self.costs = costs
        self._ms = 0.0
        self.counts = dict.fromkeys(HOST_WORK, 0.0)

    def wall(self) -> float:
        """``time.perf_counter()``, s."""
        return time.perf_counter()

    def cpu(self) -> float:
        """Counted host seconds charged so far."""
        return self._ms / 1e3

    def thread(self) -> float:
        """``time.thread_time()``, s."""
        return time.thread_time()

    def charge(self, kind: str, n: float = 1) -> None:
        """Add ``costs.ms(kind, n)`` to the counted time."""
        self._ms += self.costs.ms(kind, n)
        self.counts[kind] += n


class FrozenClock:
    """A clock that never moves: every interval is 0 s, so host work costs 0 ms and the engine's
    decisions depend on its inputs alone (the cycle-record comparison, ``tests/engine/test_golden.py``)."""

    name = "frozen"

    def wall(self) -> float:
        """0.0."""
        return 0.0

    def cpu(self) -> float:
        """0.0."""
        return 0.0

    def thread(self) -> float:
        """0.0."""
        return 0.0

    def charge(self, kind: str, n: float = 1) -> None:
        """Nothing."""


def make_clock(kind: str, costs: HostCosts | None = None):
    """The clock named ``kind`` (:data:`CLOCKS`): a :class:`CountedClock` of ``costs`` or a :class:`MeasuredClock`.

    Raises
    ------
    SpecFitInputError
        An unknown kind (field ``clock``), or ``counted`` without ``costs`` (field ``host_costs``).
    """
    from specfit.core.errors import SpecFitInputError

    if kind == "measured":
        return MeasuredClock()
    if kind == "counted":
        if costs is None:
            raise SpecFitInputError("host_costs", "a counted clock needs the profile's host prices")
        return CountedClock(costs)
    raise SpecFitInputError("clock", f"must be one of {', '.join(CLOCKS)}, got {kind!r}")
