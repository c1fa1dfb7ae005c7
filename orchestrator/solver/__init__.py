"""Explicit MILP solving: HiGHS in process with starting solutions and certified gaps."""

from orchestrator.solver._highs import HighsWithStart, SolveResult, highs_available, solve

__all__ = ["HighsWithStart", "SolveResult", "highs_available", "solve"]
