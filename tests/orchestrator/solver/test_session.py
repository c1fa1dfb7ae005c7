"""HighsSession: one model, many solves under temporary bounds, each agreeing with a fresh solve."""

import math

import pulp
import pytest

from orchestrator.solver import HighsSession, solve


def knapsack(count_upper: float = 3):
    """max 5a + 4b + 3c s.t. 2a + 3b + c ≤ 5 and a + b + c ≤ count_upper, as a minimisation."""
    lp = pulp.LpProblem("knapsack", pulp.LpMinimize)
    x = {name: lp.add_variable(name, cat="Binary") for name in "abc"}
    lp += -(5 * x["a"] + 4 * x["b"] + 3 * x["c"]), "value"
    lp += 2 * x["a"] + 3 * x["b"] + x["c"] <= 5, "capacity"
    lp += x["a"] + x["b"] + x["c"] <= count_upper, "count"
    return lp, x


def fresh_objective(fix: dict[str, float], count_upper: float = 3) -> float:
    lp, x = knapsack(count_upper)
    for name, value in fix.items():
        lp += x[name] == value, f"fix_{name}"
    result = solve(lp, time_limit_s=10, gap=0.0)
    return result.objective if result.has_solution else math.inf


def test_solves_under_changed_bounds_match_fresh_models_and_the_bounds_come_back():
    lp, x = knapsack()
    session = HighsSession(lp)
    plain = session.solve(time_limit_s=10, gap=0.0)
    assert plain.status == "Optimal" and plain.objective == pytest.approx(fresh_objective({}))
    for name in "abc":
        for value in (0.0, 1.0):
            result = session.solve(columns={x[name]: (value, value)}, time_limit_s=10, gap=0.0)
            assert result.objective == pytest.approx(fresh_objective({name: value}))
            session.assign(result)
            assert x[name].varValue == pytest.approx(value)
    only_one = session.solve(rows={"count": (None, 1.0)}, time_limit_s=10, gap=0.0)
    assert only_one.objective == pytest.approx(fresh_objective({}, count_upper=1))
    # every change was undone: the first solve again
    assert session.solve(time_limit_s=10, gap=0.0).objective == pytest.approx(plain.objective)


def test_cutoff_proves_nothing_better_exists_and_relaxation_bounds_the_optimum():
    lp, _ = knapsack()
    session = HighsSession(lp)
    optimum = session.solve(time_limit_s=10, gap=0.0).objective
    assert session.solve(time_limit_s=10, gap=0.0, cutoff=optimum - 1e-6).status == "Infeasible"
    relaxed = session.relaxation_bound(time_limit_s=10)
    assert relaxed <= optimum + 1e-9
    assert relaxed < optimum  # the fractional knapsack is strictly better here


def multi_knapsack(items: int = 30, seed: int = 0):
    """A 0-1 knapsack with three capacity rows: enough branch and bound for HiGHS's callbacks to run."""
    import random

    rng = random.Random(seed)
    lp = pulp.LpProblem("multi_knapsack", pulp.LpMinimize)
    x = [lp.add_variable(f"x{i}", cat="Binary") for i in range(items)]
    lp += -pulp.lpSum(rng.randint(10, 60) * v for v in x), "value"
    for row in range(3):
        weights = [rng.randint(5, 40) for _ in x]
        lp += pulp.lpSum(w * v for w, v in zip(weights, x)) <= sum(weights) // 3, f"capacity_{row}"
    return lp


def test_a_reused_session_is_not_stopped_by_an_earlier_deadline():
    """HiGHS keeps its interrupt flag and its clock across runs; each solve must get its own time."""
    session = HighsSession(multi_knapsack(), options={"presolve": "off"})
    for _ in range(3):
        stopped = session.solve(time_limit_s=1e-4, gap=0.0)
        assert stopped.status == "Time limit reached"
    assert session.solve(time_limit_s=20, gap=0.0).status == "Optimal"


def test_a_stopped_session_stops_every_solve_at_once():
    """``stop()`` (a search leaving a solve behind) ends this solve and any the job would run after."""
    session = HighsSession(multi_knapsack(items=60, seed=3))
    assert session.solve(time_limit_s=20, gap=0.0).status == "Optimal"
    session.stop()
    for _ in range(2):
        stopped = session.solve(time_limit_s=20, gap=0.0)
        assert stopped.status == "Time limit reached"
        # stopped before any work: not even the root relaxation gave a bound
        assert not stopped.has_solution and stopped.bound == -math.inf


def test_two_sessions_of_one_problem_solve_on_two_threads_without_touching_its_variables():
    """Solutions come back as values; the variables change only when :meth:`assign` writes them."""
    from concurrent.futures import ThreadPoolExecutor

    lp = multi_knapsack(items=24, seed=1)
    first, second = HighsSession(lp), HighsSession(lp)
    for v in lp.variables():
        v.varValue = None
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda s: s.solve(time_limit_s=20, gap=0.0), (first, second)))
    assert all(v.varValue is None for v in lp.variables())
    assert results[0].objective == pytest.approx(results[1].objective)
    assert results[0].objective == pytest.approx(
        solve(multi_knapsack(items=24, seed=1), time_limit_s=20, gap=0.0).objective
    )
    first.assign(results[0])
    assert pulp.value(lp.objective) == pytest.approx(results[0].objective)
    restarted = second.solve(time_limit_s=20, gap=0.0, start=second.current())
    assert restarted.objective == pytest.approx(results[0].objective)
