"""Pluggable subtree selection: exact solvers, the CP-SAT oracle, greedy baselines, one registry.

Imports neither torch nor transformers (ARCHITECTURE.md).
"""

from specfit.solvers.base import STATUSES, Selection, Solver, available_solvers, get_solver

__all__ = ["STATUSES", "Selection", "Solver", "available_solvers", "get_solver"]
