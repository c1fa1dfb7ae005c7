"""Solve a PuLP model with HiGHS (in process, through highspy), or CBC where highspy is missing.

PuLP's own HiGHS interface takes no starting solution and does not report
the dual bound. :class:`HighsWithStart` adds both: variables whose
``varValue`` is set before the solve are handed to HiGHS as a starting
solution (``Highs.setSolution``), and after the solve the MIP's dual bound and
gap are read from ``Highs.getInfo()``.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
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
      solve_s: seconds in the solver (on the work clock while it counts, ``work``).
      values: the solution's column values, from a :class:`HighsSession` (in the order of its
        ``variables``; ``HighsSession.assign`` writes them to the variables); None otherwise.
    """

    solver: str
    status: str
    has_solution: bool
    objective: float
    bound: float
    gap: float
    solve_s: float
    values: tuple[float, ...] | None = None


class HighsWithStart(pulp.HiGHS):
    """pulp.HiGHS that passes a starting solution and records the dual bound."""

    def __init__(self, *, use_start: bool = False, deadline_s: float | None = None, bulk_load: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.use_start = use_start
        self.deadline_s = deadline_s
        self.bulk_load = bulk_load
        self.info = None
        self.model_status = ""

    def createAndConfigureSolver(self, lp):
        with _captured_banner():
            super().createAndConfigureSolver(lp)

    def buildSolverModel(self, lp):
        """PuLP's model into HiGHS: row by row (PuLP's own), or with ``bulk_load`` in one call per kind.

        Both give HiGHS the same columns and rows in the same order, and set the
        ``index`` of each variable and constraint as PuLP reads the solution by them.
        """
        if not self.bulk_load:
            return super().buildSolverModel(lp)
        load_model(lp.solverModel, lp, integer=self.mip)
        return None

    def callSolver(self, lp):
        import highspy

        if self.use_start:
            values = [v.varValue if v.varValue is not None else 0.0 for v in lp.variables()]
            start = highspy.HighsSolution()
            start.col_value = values
            start.value_valid = True
            lp.solverModel.setSolution(start)
        if self.deadline_s is not None:  # PuLP's row-by-row hand-over has used part of the time
            left = max(0.01, self.deadline_s - time.perf_counter())
            limit = left if self.timeLimit is None else min(float(self.timeLimit), left)
            lp.solverModel.setOptionValue("time_limit", limit)
            _interrupt_at(lp.solverModel, self.deadline_s)
        lp.solverModel.run()
        self.info = lp.solverModel.getInfo()
        self.model_status = lp.solverModel.modelStatusToString(lp.solverModel.getModelStatus())
        if self.model_status == "Interrupted by user":  # only our deadline interrupts
            self.model_status = "Time limit reached"


def load_model(highs, lp: pulp.LpProblem, *, integer: bool = True) -> list:
    """Hand ``lp`` to ``highs`` in one call per kind (columns, integrality, rows); returns the
    variables in column order and sets the ``index`` of each variable and constraint, as
    PuLP reads a solution by them."""
    import highspy
    import numpy as np

    inf = highspy.kHighsInf
    sign = -1 if lp.sense == pulp.LpMaximize else 1
    variables = lp.variables()
    for i, var in enumerate(variables):
        var.index = i
    cost = np.array([sign * lp.objective.get(var, 0.0) for var in variables], dtype=np.float64)
    lower = np.array([-inf if v.lowBound is None else v.lowBound for v in variables], dtype=np.float64)
    upper = np.array([inf if v.upBound is None else v.upBound for v in variables], dtype=np.float64)
    empty = np.zeros(0, dtype=np.int32)
    highs.addCols(len(variables), cost, lower, upper, 0, empty, empty, np.zeros(0))
    if integer:
        columns = np.array([v.index for v in variables if v.cat == pulp.LpInteger], dtype=np.int32)
        if len(columns):
            kind = np.full(len(columns), int(highspy.HighsVarType.kInteger), dtype=np.uint8)
            highs.changeColsIntegrality(len(columns), columns, kind)
    starts, index, value, row_lower, row_upper = [], [], [], [], []
    for i, constraint in enumerate(lp._constraints.values()):
        constraint.index = i
        starts.append(len(index))
        for var, coefficient in constraint.items():
            if coefficient != 0:
                index.append(var.index)
                value.append(coefficient)
        lb, ub = constraint.getLb(), constraint.getUb()
        row_lower.append(-inf if lb is None else lb)
        row_upper.append(inf if ub is None else ub)
    highs.addRows(
        len(starts),
        np.array(row_lower, dtype=np.float64),
        np.array(row_upper, dtype=np.float64),
        len(index),
        np.array(starts, dtype=np.int32),
        np.array(index, dtype=np.int32),
        np.array(value, dtype=np.float64),
    )
    return variables


_banner_shown = False
_banner_lock = threading.Lock()
_banner = ""


def solver_banner() -> str:
    """What HiGHS wrote to stdout while this process built its first ``Highs()`` (its copyright banner),
    or "" before that; ``orchestrator --verbose`` shows it."""
    return _banner


@contextlib.contextmanager
def _captured_banner():
    """Capture what C++ writes to stdout while the first ``Highs()`` of the process is built.

    highspy 1.16 prints its copyright banner on file descriptor 1 when the first ``Highs``
    object is constructed, before PuLP can set ``output_flag``: on stdout it would corrupt
    ``orchestrator ... --json``, and on stderr it would repeat in every process of a planner's
    workers. It is kept for :func:`solver_banner` instead.
    """
    global _banner_shown, _banner
    if _banner_shown:
        yield
        return
    with _banner_lock:  # two threads swapping descriptor 1 at once could leave stdout redirected
        if _banner_shown:
            yield
            return
        sys.stdout.flush()
        saved = os.dup(1)
        with tempfile.TemporaryFile() as sink:
            try:
                os.dup2(sink.fileno(), 1)
                yield
            finally:
                os.dup2(saved, 1)
                os.close(saved)
                _banner_shown = True
                sink.seek(0)
                _banner = sink.read().decode("utf-8", "replace")


def _interrupt_at(highs, deadline_s: float | Callable[[], float]) -> None:
    """Make ``deadline_s`` (a ``time.perf_counter()`` value, or a function giving the current
    one) hard: HiGHS checks its ``time_limit`` only between nodes, so on a large model it
    overruns the limit by up to several times a short one; its interrupt callbacks come inside
    the simplex and MIP loops, so stopping there keeps to the deadline."""
    deadline = deadline_s if callable(deadline_s) else (lambda: deadline_s)

    def stop_when_late(event) -> None:
        # set, not only raise: the flag outlives the run, and a reused instance would stop at once
        event.interrupt(time.perf_counter() >= deadline())

    highs.cbSimplexInterrupt += stop_when_late
    highs.cbIpmInterrupt += stop_when_late
    highs.cbMipInterrupt += stop_when_late


def certified(optimal: bool, has_solution: bool, objective: float, dual: float) -> tuple[float, float]:
    """(bound, gap) of a minimisation from its status, objective (inf without a solution) and the
    solver's dual bound: only a proven optimum certifies its own objective; otherwise the dual
    bound, when finite and not above the objective, is all that is known."""
    proven = math.isfinite(dual) and dual <= objective * (1 + 1e-9) + 1e-12
    bound = dual if proven else (objective if optimal else -math.inf)
    if has_solution and math.isfinite(bound):
        bound = min(bound, objective)
        return bound, 0.0 if objective == 0 else max(0.0, (objective - bound) / abs(objective))
    return bound, math.inf


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
    deadline_s: float | None = None,
    bulk_load: bool = False,
) -> SolveResult:
    """Solve ``problem`` (a minimisation) with explicit options; never unbounded in time.

    ``objective_cutoff``: only solutions better than this are wanted (HiGHS's
    ``objective_bound``); when none exists the status is "Infeasible".
    ``deadline_s``: a ``time.perf_counter()`` value by which HiGHS must stop; its
    time limit is cut, once the model has been handed over, to what is left.
    ``bulk_load``: hand the model to HiGHS in one call per kind rather than row
    by row (the same model, loaded several times faster).
    """
    start = time.perf_counter()
    if highs_available():
        options = dict(options or {})
        if objective_cutoff is not None:
            options["objective_bound"] = objective_cutoff
        solver = HighsWithStart(
            use_start=use_start,
            deadline_s=deadline_s,
            bulk_load=bulk_load,
            msg=msg,
            timeLimit=time_limit_s,
            gapRel=gap,
            threads=threads,
            **options,
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
    info = getattr(solver, "info", None)
    model_status = getattr(solver, "model_status", "")
    if info is not None:
        # only a proven optimum certifies its own objective; otherwise HiGHS's dual bound
        # (which is ±inf when the search never got that far) is all we know
        dual = float(info.mip_dual_bound) if problem.isMIP() else objective
        bound, gap_value = certified(model_status == "Optimal", has_solution, objective, dual)
    else:
        bound, gap_value = certified(pulp.LpStatus[status] == "Optimal", has_solution, objective, -math.inf)
    return SolveResult(
        solver=name,
        status=getattr(solver, "model_status", "") or pulp.LpStatus[status],
        has_solution=has_solution,
        objective=objective,
        bound=bound,
        gap=gap_value,
        solve_s=elapsed,
    )


def highs_lp(cost, upper, rows: list) -> object:
    """A quiet one-thread HiGHS instance holding min cost·x, 0 ≤ x ≤ ``upper``, and ``rows``: each
    (columns, coefficients, lower, upper) of one row (±inf where open). For LPs built straight from
    arrays, without PuLP (the planner's packing and column bounds)."""
    import highspy
    import numpy as np

    inf = highspy.kHighsInf
    with _captured_banner():
        highs = highspy.Highs()
    highs.setOptionValue("output_flag", False)
    highs.setOptionValue("threads", 1)
    n = len(cost)
    empty = np.zeros(0, dtype=np.int32)
    highs.addCols(
        n,
        np.asarray(cost, dtype=float),
        np.zeros(n),
        np.minimum(np.asarray(upper, dtype=float), inf),
        0,
        empty,
        empty,
        [],
    )
    starts = np.cumsum([0] + [len(cols) for cols, *_ in rows[:-1]]).astype(np.int32)
    highs.addRows(
        len(rows),
        np.array([max(lo, -inf) for *_, lo, _ in rows]),
        np.array([min(hi, inf) for *_, hi in rows]),
        int(sum(len(cols) for cols, *_ in rows)),
        starts,
        np.concatenate([cols for cols, *_ in rows]).astype(np.int32),
        np.concatenate([vals for _, vals, *_ in rows]).astype(np.float64),
    )
    return highs
