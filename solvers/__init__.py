"""Pluggable subtree selection: exact solvers, the CP-SAT oracle, greedy baselines, one registry.

Imports neither torch nor transformers (ARCHITECTURE.md).
"""

from specfit.solvers.api import select
from specfit.solvers.base import STATUSES, Selection, Solver, available_solvers, get_solver, solver_class

__all__ = ["STATUSES", "Selection", "Solver", "available_solvers", "get_solver", "select", "solver_class"]
