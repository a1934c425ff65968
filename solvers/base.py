"""The solver interface, the selection it returns, and the registry.

Every solver maximises, over ancestor-closed subtrees S of an instance's draft tree,

* ratio mode (default): the predicted throughput ``A(S) / T(S)`` (SPECFIT.md §3), or
* rate mode: ``A(S) - λ T(S)`` for a given long-run rate λ (SPECFIT.md §3, "per-cycle ratio vs
  long-run rate": the policy that maximises long-run sum A / sum T solves this each cycle with
  λ the long-run rate),

subject to the instance's optional budgets ``max_nodes`` and ``max_new_experts_per_layer``.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import time
from dataclasses import dataclass
from typing import Sequence

from specfit.core.errors import SpecFitInputError, check_number, lookup
from specfit.core.instance import Instance
from specfit.core.objective import evaluate

#: Solver statuses. ``optimal``: proven optimal; ``feasible``: a valid selection, optimality not
#: proven (e.g. a time limit hit); ``heuristic``: a baseline that makes no optimality claim.
STATUSES = ("optimal", "feasible", "heuristic")


@dataclass(frozen=True)
class Selection:
    """A selected subtree and its predicted value.

    Attributes
    ----------
    solver : str
    nodes : tuple of int
        Sorted node ids, root (0) included; ancestor-closed.
    expected_tokens : float
        A(S), tokens per cycle.
    predicted_ms : float
        T(S), ms per cycle.
    throughput : float
        ``1000 * A / T``, tokens/s.
    solve_ms : float
        Wall-clock time of the solve in ms.
    status : str
        One of :data:`STATUSES`.
    mode : str
        ``"ratio"`` or ``"rate"``.
    rate : float or None
        λ in tokens/s in rate mode.
    """

    solver: str
    nodes: tuple[int, ...]
    expected_tokens: float
    predicted_ms: float
    throughput: float
    solve_ms: float
    status: str
    mode: str = "ratio"
    rate: float | None = None

    @property
    def objective(self) -> float:
        """The maximised value: tokens/s in ratio mode, ``A - (rate/1000) T`` (tokens) in rate mode."""
        if self.mode == "rate":
            return self.expected_tokens - self.rate / 1000.0 * self.predicted_ms
        return self.throughput

    def to_json(self) -> dict:
        """The selection JSON object of SPECFIT.md §4 (plus ``status``, ``mode`` and ``rate``)."""
        out = {"solver": self.solver, "nodes": list(self.nodes), "expected_tokens": self.expected_tokens,
               "predicted_ms": self.predicted_ms, "throughput": self.throughput, "solve_ms": self.solve_ms,
               "status": self.status, "mode": self.mode}
        if self.mode == "rate":
            out["rate"] = self.rate
        return out


def selection(solver: str, nodes: tuple, expected_tokens: float, predicted_ms: float, solve_ms: float,
              rate: float | None) -> Selection:
    """An ``"optimal"`` :class:`Selection` of ``nodes`` (a tuple of int) with A(S) ``expected_tokens`` and
    T(S) ``predicted_ms``, in ratio mode (``rate`` None) or rate mode; its throughput ``1000 A / T``
    (inf when T = 0). Equal to ``Selection(...)`` of the same fields, made without the frozen dataclass's
    ``__init__`` (one ``object.__setattr__`` per field): the engine makes one per solve, right after a
    forward has evicted the host's caches, where those calls cost several µs. Units: A in tokens, T and ``solve_ms`` in ms, ``rate`` in tokens/s; the fields are
    not checked (the caller's solver made them; :class:`Selection` documents them, A and T per SPECFIT.md §3)."""
    s = object.__new__(Selection)
    s.__dict__.update(solver=solver, nodes=nodes, expected_tokens=expected_tokens, predicted_ms=predicted_ms,
                      throughput=1000.0 * expected_tokens / predicted_ms if predicted_ms > 0 else float("inf"),
                      solve_ms=solve_ms, status="optimal", mode="ratio" if rate is None else "rate", rate=rate)
    return s


def check_rate(rate: float | None) -> float | None:
    """Validate a long-run rate in tokens/s (None = ratio mode): a finite number in [0, MAX_RATE]
    (:func:`~specfit.core.errors.check_number`).

    Raises
    ------
    SpecFitInputError
        If the rate is not a number (a bool or a string), negative, NaN, infinite or above
        :data:`MAX_RATE`.
    """
    if rate is None:
        return None
    return check_number("rate", rate, 0.0, MAX_RATE, unit="tokens/s")


#: Largest long-run rate, tokens/s: far above any decoder, small enough that ``rate / 1000 * T``
#: stays finite on every instance (:data:`~specfit.core.errors.MAX_MS`).
MAX_RATE = 1e9
#: Largest solver time limit, s (a year).
MAX_TIME_LIMIT_S = 3.2e7


def check_time_limit(value) -> float:
    """A solver's wall-clock limit: a finite number of seconds in (0, MAX_TIME_LIMIT_S].

    Raises
    ------
    SpecFitInputError
        On ``time_limit_s`` otherwise (NaN, infinity, 0, negative, a bool or a string).
    """
    return check_number("time_limit_s", value, 0.0, MAX_TIME_LIMIT_S, low_open=True, unit="seconds")


#: Largest search-node limit of a branch and bound.
MAX_VISITS = 10**12


def check_max_visits(value) -> int:
    """A branch and bound's search-node limit: an integer in [1, MAX_VISITS].

    Raises
    ------
    SpecFitInputError
        On ``max_visits`` otherwise (0, negative, a float, a bool or a string).
    """
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_VISITS:
        raise SpecFitInputError("max_visits", f"must be an integer in [1, {MAX_VISITS}], got {value!r}")
    return value


class SearchLimit:
    """Where one solve's branch and bound stops before proving its optimum (its status is then
    ``"feasible"``): past a wall-clock deadline, or past ``max_visits`` search nodes expanded (those the
    bound did not prune), summed over the solve's searches (Dinkelbach's iterations). The node limit is
    deterministic: an instance stops at the same node, with the same selection, on any machine and under
    any load, so the engine's decisions do not depend on the machine's speed (SPECFIT.md §3).

    Parameters
    ----------
    time_limit_s : float, optional
        Seconds from now (:func:`check_time_limit`).
    max_visits : int, optional
        Search nodes (:func:`check_max_visits`).
    """

    def __init__(self, time_limit_s: float | None = None, max_visits: int | None = None):
        self.deadline = None if time_limit_s is None else time.perf_counter() + time_limit_s
        self.max_visits = max_visits
        self.visits = 0
        self.hit = False

    def stop(self) -> bool:
        """Count one expanded search node; True (and from then on) once a limit is passed."""
        self.visits += 1
        if ((self.max_visits is not None and self.visits > self.max_visits)
                or (self.deadline is not None and time.perf_counter() > self.deadline)):
            self.hit = True
        return self.hit


class Solver:
    """Base class: subclasses set ``name`` and ``exact`` and implement :meth:`select`.

    ``select(instance, rate)`` returns ``(nodes, status)``; :meth:`solve` times it, evaluates
    the objective and returns a :class:`Selection`. A ``select`` that evaluated its own nodes may
    return ``(nodes, status, evaluation)`` (a :class:`~specfit.core.objective.Evaluation` of exactly
    those nodes, e.g. :func:`~specfit.core.objective.evaluate_uncovered`) instead.
    """

    name = "base"
    #: True iff the solver proves optimality (then it is checked against CP-SAT and brute force).
    exact = False
    #: True iff the selection depends on the cost model and the nodes' experts (not only on P).
    cost_aware = True

    def select(self, instance: Instance, rate: float | None) -> tuple[Sequence[int], str]:
        raise NotImplementedError

    def solve(self, instance: Instance, rate: float | None = None) -> Selection:
        """Select a subtree of ``instance``.

        Parameters
        ----------
        instance : Instance
        rate : float, optional
            Long-run rate λ in tokens/s: maximise ``A - (λ/1000) T`` instead of ``A / T``.

        Returns
        -------
        Selection

        Raises
        ------
        SpecFitInputError
            If ``rate`` is negative or not finite.
        """
        rate = check_rate(rate)
        from specfit.core.kernels import item_words_kernel

        item_words_kernel()  # loaded before the clock starts: a process's first solve timed numba's import
        t0 = time.perf_counter()
        nodes, status, *known = self.select(instance, rate)
        solve_ms = (time.perf_counter() - t0) * 1e3
        ev = known[0] if known and known[0] is not None else evaluate(instance, nodes)
        return Selection(self.name, ev.nodes, ev.expected_tokens, ev.predicted_ms, ev.throughput, solve_ms, status,
                         "ratio" if rate is None else "rate", rate)

    def solve_tree(self, tree, cost, cache=None, *, rate: float | None = None, sunk_ms: float = 0.0,
                   max_nodes: int | None = None) -> Selection:
        """Select a subtree of ``tree`` under ``cost`` plus ``sunk_ms``: the engine's per-cycle solve.

        The same selection, with the same floats, as ``solve(Instance(tree, cost.plus_ms(sunk_ms), cache,
        max_nodes=max_nodes), rate)``; a solver may answer it without building the instance (the exact
        solver's compiled path, :meth:`specfit.solvers.exact.ExactSolver.solve_tree`), so that a drafted
        cycle pays for the solve alone.

        Parameters
        ----------
        tree : DraftTree
            n nodes; with experts (n, L, k), or none (L = 0: no expert term).
        cost : CostModel or HostProfile
        cache : numpy.ndarray of bool, shape (L, num_experts), optional
            The expert cache; None: nothing cached.
        rate : float, optional
            Long-run rate λ in tokens/s (rate mode), as in :meth:`solve`.
        sunk_ms : float
            ms of the cycle already paid whatever is selected (draft levels, host work), added to T's constant
            term (SPECFIT.md §3, "Whole-cycle objective").
        max_nodes : int, optional
            At most this many nodes, root included (the instance's budget).

        Returns
        -------
        Selection

        Raises
        ------
        SpecFitInputError
            As :class:`~specfit.core.instance.Instance` and :meth:`solve` do (field ``cache``,
            ``cost.per_expert_ms``, ``max_nodes``, ``rate``), and on ``ms`` if ``sunk_ms`` is not a finite
            number >= 0.
        """
        cost = cost.plus_ms(sunk_ms) if sunk_ms else cost
        return self.solve(Instance(tree, cost, cache, max_nodes=max_nodes), rate)


#: name -> "module:class". Import happens on first use so that one solver's dependencies
#: (OR-Tools for cpsat) do not load for another.
_REGISTRY = {
    "exact": "specfit.solvers.exact:ExactSolver",
    "cpsat": "specfit.solvers.cpsat:CPSATSolver",
    "eagle": "specfit.solvers.greedy:EagleSolver",
    "scan": "specfit.solvers.greedy:ScanSolver",
    "greedy": "specfit.solvers.greedy:GreedySolver",
    "bruteforce": "specfit.solvers.bruteforce:BruteForceSolver",
}


def available_solvers() -> list[str]:
    """Names accepted by :func:`get_solver`."""
    return sorted(_REGISTRY)


@functools.lru_cache(maxsize=None)  # the registry is fixed; the engine asks per cycle (Method.cost_aware)
def solver_class(name: str) -> type[Solver]:
    """The class registered as ``name`` (imports its module, instantiates nothing).

    Raises
    ------
    SpecFitInputError
        If ``name`` is unknown.
    """
    module, cls = lookup(_REGISTRY, name, "solver").split(":")
    return getattr(importlib.import_module(module), cls)


def get_solver(name: str, **options) -> Solver:
    """Instantiate the solver registered as ``name`` with keyword ``options``.

    Raises
    ------
    SpecFitInputError
        If ``name`` is unknown, or an option is not accepted by that solver (the error's field is
        the option, its rule lists the options the solver does accept).
    """
    klass = solver_class(name)
    accepted = [p for p in inspect.signature(klass).parameters if p not in ("self", "args", "kwargs")]
    for option in options:
        if option not in accepted:
            takes = f"its options: {', '.join(accepted)}" if accepted else "it takes no options"
            raise SpecFitInputError(option, f"not accepted by solver {name!r} ({takes})")
    return klass(**options)
