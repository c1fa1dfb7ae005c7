"""Explicit MILP solving: HiGHS in process with starting solutions and certified gaps."""

from orchestrator.solver import _work as work
from orchestrator.solver._highs import HighsWithStart, SolveResult, highs_available, highs_lp, solve, solver_banner
from orchestrator.solver._session import HighsSession

__all__ = [
    "HighsSession",
    "HighsWithStart",
    "SolveResult",
    "highs_available",
    "highs_lp",
    "solve",
    "solver_banner",
    "work",
]
