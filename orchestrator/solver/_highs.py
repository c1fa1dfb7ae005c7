"""Solve a PuLP model with HiGHS (in process, through highspy), or CBC where highspy is missing.

PuLP's own HiGHS interface takes no starting solution and does not report
the dual bound. :class:`HighsWithStart` adds both: variables whose
``varValue`` is set before the solve are handed to HiGHS as a starting
solution (``Highs.setSolution``), and after the solve the MIP's dual bound and
gap are read from ``Highs.getInfo()``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import pulp


@dataclass(frozen=True, slots=True, kw_only=True)
class SolveResult:
    """What a solve returned.

    Attributes:
      solver: "HiGHS" or "CBC".
      status: the solver's own status ("Optimal", "Time limit reached", "Infeasible", ...);
        PuLP reports a time-limited MIP as "Optimal", so its name is not used.
      has_solution: a feasible solution was found (optimal or not).
      objective: its objective value (inf without a solution).
      bound: the proven lower bound (minimisation).
      gap: (objective − bound) / objective; 0 when proven optimal.
      solve_s: wall-clock seconds in the solver.
    """

    solver: str
    status: str
    has_solution: bool
    objective: float
    bound: float
    gap: float
    solve_s: float


class HighsWithStart(pulp.HiGHS):
    """pulp.HiGHS that passes a starting solution and records the dual bound."""

    def __init__(self, *, use_start: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.use_start = use_start
        self.info = None
        self.model_status = ""

    def callSolver(self, lp):
        import highspy

        if self.use_start:
            values = [v.varValue if v.varValue is not None else 0.0 for v in lp.variables()]
            start = highspy.HighsSolution()
            start.col_value = values
            start.value_valid = True
            lp.solverModel.setSolution(start)
        lp.solverModel.run()
        self.info = lp.solverModel.getInfo()
        self.model_status = lp.solverModel.modelStatusToString(lp.solverModel.getModelStatus())


def highs_available() -> bool:
    return "HiGHS" in pulp.listSolvers(onlyAvailable=True)


def solve(
    problem: pulp.LpProblem,
    *,
    time_limit_s: float,
    gap: float,
    use_start: bool = False,
    msg: bool = False,
    threads: int = 1,
    objective_cutoff: float | None = None,
    options: dict | None = None,
) -> SolveResult:
    """Solve ``problem`` (a minimisation) with explicit options; never unbounded in time.

    ``objective_cutoff``: only solutions better than this are wanted (HiGHS's
    ``objective_bound``); when none exists the status is "Infeasible".
    """
    start = time.perf_counter()
    if highs_available():
        options = dict(options or {})
        if objective_cutoff is not None:
            options["objective_bound"] = objective_cutoff
        solver = HighsWithStart(
            use_start=use_start, msg=msg, timeLimit=time_limit_s, gapRel=gap, threads=threads, **options
        )
        name = "HiGHS"
    else:  # pragma: no cover - highspy is a dependency; CBC is the documented fallback
        solver = pulp.PULP_CBC_CMD(msg=msg, timeLimit=time_limit_s, gapRel=gap, warmStart=use_start, threads=threads)
        name = "CBC"
    status = problem.solve(solver)
    elapsed = time.perf_counter() - start
    objective = pulp.value(problem.objective)
    has_solution = objective is not None and problem.sol_status in (
        pulp.LpSolutionOptimal,
        pulp.LpSolutionIntegerFeasible,
    )
    objective = float(objective) if has_solution else math.inf
    bound = -math.inf
    info = getattr(solver, "info", None)
    model_status = getattr(solver, "model_status", "")
    if info is not None:
        # only a proven optimum certifies its own objective; otherwise HiGHS's dual bound
        # (which is ±inf when the search never got that far) is all we know
        dual = float(info.mip_dual_bound) if problem.isMIP() else objective
        proven = math.isfinite(dual) and dual <= objective * (1 + 1e-9) + 1e-12
        if model_status == "Optimal":
            bound = dual if proven else objective
        else:
            bound = dual if proven else -math.inf
    elif pulp.LpStatus[status] == "Optimal":
        bound = objective
    if has_solution and math.isfinite(bound):
        bound = min(bound, objective)
        gap_value = 0.0 if objective == 0 else max(0.0, (objective - bound) / abs(objective))
    else:
        gap_value = math.inf
    return SolveResult(
        solver=name,
        status=getattr(solver, "model_status", "") or pulp.LpStatus[status],
        has_solution=has_solution,
        objective=objective,
        bound=bound,
        gap=gap_value,
        solve_s=elapsed,
    )
