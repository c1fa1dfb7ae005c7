"""One PuLP model loaded into HiGHS once and solved many times under different bounds.

The planner splits each microbatch count's ILP by stage count S (positions ≥ S
closed, position S − 1 open): the pieces have far tighter relaxations than the
whole, and loading the model once keeps the split cheap: closing a few hundred
columns in place and opening them again takes milliseconds, where rebuilding a
PuLP model per S takes a tenth of a second or more.

A session never writes the problem's variables while it solves: the solution comes back in
``SolveResult.values`` and :meth:`HighsSession.assign` writes it, so several sessions of one
problem can solve on different threads (highspy releases the GIL in ``Highs.run``) while
the caller reads and writes the variables on its own.
"""

from __future__ import annotations

import math
import time

import pulp

from orchestrator.solver import _work as work
from orchestrator.solver._highs import SolveResult, _captured_banner, _interrupt_at, certified, load_model


class HighsSession:
    """``problem`` (a minimisation MIP) in a HiGHS instance; :meth:`solve` under temporary bounds."""

    def __init__(self, problem: pulp.LpProblem, *, threads: int = 1, options: dict | None = None):
        import highspy

        with _captured_banner():
            self.highs = highspy.Highs()
        self.highs.setOptionValue("output_flag", False)
        self.highs.setOptionValue("threads", threads)
        for key, value in (options or {}).items():
            self.highs.setOptionValue(key, value)
        self.problem = problem
        self._deadline = math.inf
        self._stopped = False
        _interrupt_at(self.highs, lambda: -math.inf if self._stopped else self._deadline)
        self.variables = load_model(self.highs, problem)
        self.rows = {name: c.index for name, c in problem._constraints.items()}
        self._col_bounds = {v.index: (v.lowBound, v.upBound) for v in self.variables}
        self._row_bounds = {name: (c.getLb(), c.getUb()) for name, c in problem._constraints.items()}

    def solve(
        self,
        *,
        columns: dict[pulp.LpVariable, tuple[float, float]] | None = None,
        rows: dict[str, tuple[float | None, float | None]] | None = None,
        time_limit_s: float,
        gap: float,
        cutoff: float | None = None,
        start: list[float] | None = None,
        options: dict | None = None,
    ) -> SolveResult:
        """Solve with ``columns`` (variable → (lower, upper)) and ``rows`` (name → (lower,
        upper)) changed for this solve only; ``cutoff``: only solutions with a smaller
        objective are wanted (none: status "Infeasible"). The solution, if any, is returned in
        ``values`` (:meth:`assign` writes it to the variables); ``start``: a starting solution,
        one value per variable (:meth:`current` reads the variables' values);
        ``options``: HiGHS options for this solve only."""
        import highspy

        inf = highspy.kHighsInf
        h = self.highs
        columns, rows = columns or {}, rows or {}
        for var, (lo, hi) in columns.items():
            h.changeColBounds(var.index, lo, hi)
        for name, (lo, hi) in rows.items():
            h.changeRowBounds(self.rows[name], -inf if lo is None else lo, inf if hi is None else hi)
        # counting work (``work``), the solve ends by its node limit, and wall-clock only caps it
        options = {**work.limits(time_limit_s), **(options or {})}
        wall_s = work.wall_limit_s(max(0.01, float(time_limit_s)))
        saved = {key: h.getOptionValue(key)[1] for key in options}
        for key, value in options.items():
            h.setOptionValue(key, value)
        # HiGHS measures ``time_limit`` on one clock for the instance's whole life (highspy has no
        # way to reset it): the limit of this solve is its run time so far plus the budget
        h.setOptionValue("time_limit", h.getRunTime() + wall_s)
        h.setOptionValue("mip_rel_gap", float(gap))
        h.setOptionValue("objective_bound", inf if cutoff is None else float(cutoff))
        if start is not None:
            solution = highspy.HighsSolution()
            solution.col_value = list(start)
            solution.value_valid = True
            h.setSolution(solution)
        began = work.now()
        self._deadline = time.perf_counter() + wall_s
        try:
            work.run(h)
            status = h.modelStatusToString(h.getModelStatus())
            if status == "Interrupted by user":  # only the deadline interrupts
                status = "Time limit reached"
            info = h.getInfo()
            has_solution = info.primal_solution_status == 2  # kSolutionStatusFeasible
            objective = float(info.objective_function_value) if has_solution else math.inf
            values = tuple(h.getSolution().col_value) if has_solution else None
            dual = float(info.mip_dual_bound)
        finally:
            for var in columns:
                lo, hi = self._col_bounds[var.index]
                h.changeColBounds(var.index, -inf if lo is None else lo, inf if hi is None else hi)
            for name in rows:
                lo, hi = self._row_bounds[name]
                h.changeRowBounds(self.rows[name], -inf if lo is None else lo, inf if hi is None else hi)
            for key, value in saved.items():
                h.setOptionValue(key, value)
            h.clearSolver()
        bound, gap_value = certified(status == "Optimal", has_solution, objective, dual)
        return SolveResult(
            solver="HiGHS",
            status=status,
            has_solution=has_solution,
            objective=objective,
            bound=bound,
            gap=gap_value,
            solve_s=work.now() - began,
            values=values,
        )

    def stop(self) -> None:
        """Make the solve under way, and every later one, stop at HiGHS's next interrupt check
        (any thread may call it: a search leaving a solve behind at its deadline)."""
        self._stopped = True

    def current(self) -> list[float]:
        """The variables' values now (0 where unset): a ``start`` for :meth:`solve`."""
        return [v.varValue if v.varValue is not None else 0.0 for v in self.variables]

    def assign(self, result: SolveResult) -> None:
        """Write a solve's solution to the variables' ``varValue`` (nothing without one)."""
        if result.values is not None:
            for var, value in zip(self.variables, result.values):
                var.varValue = value

    def relaxation_bound(self, *, columns: dict | None = None, rows: dict | None = None, time_limit_s: float) -> float:
        """The LP relaxation's optimum under ``columns`` and ``rows`` (as in :meth:`solve`):
        +inf if infeasible (so is the MIP), −inf if out of time."""
        result = self.solve(
            columns=columns, rows=rows, time_limit_s=time_limit_s, gap=0.0, options={"solve_relaxation": True}
        )
        if result.status == "Infeasible":
            return math.inf
        return result.objective if result.status == "Optimal" else -math.inf
