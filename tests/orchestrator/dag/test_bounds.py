"""The makespan bounds hold against exhaustive optima, and what they add over the plain critical path."""

import dataclasses
import math

import numpy as np
import pytest

from orchestrator.dag import exhaustive, heft, milp, problem_from_costs, random_problem
from orchestrator.dag._bounds import heads, load_bound, lower_bound, path_bound, propagate, tails
from orchestrator.dag._local_search import search
from orchestrator.dag._milp import _Model
from orchestrator.solver import solve


def varied(seed: int):
    """Small random problems, some with two slots on a device and some with devices a task may not use."""
    tasks = 5 + seed % 4
    problem = random_problem(tasks=tasks, devices=3, ccr=(0.5, 1.0, 5.0)[seed % 3], seed=100 + seed)
    rng = np.random.default_rng(seed)
    exec_s = dict(problem.exec_s)
    if seed % 2:
        for t in problem.tasks:
            if rng.random() < 0.3:
                times = list(exec_s[t])
                times[int(rng.integers(0, 3))] = math.inf
                exec_s[t] = tuple(times)
    slots = (2, 1, 1) if seed % 3 == 0 else problem.slots
    return dataclasses.replace(problem, exec_s=exec_s, slots=slots)


@pytest.mark.parametrize("seed", range(24))
def test_bounds_hold_for_the_optimal_schedule(seed):
    problem = varied(seed)
    best = exhaustive(problem, max_tasks=10)
    head, tail = heads(problem), tails(problem)
    for t, p in best.placements.items():  # each optimal start and finish respects its device's head and tail
        assert p.start_s >= head[t][p.device] - 1e-9
        assert best.makespan - p.finish_s >= tail[t][p.device] - 1e-9
    assert path_bound(problem, head, tail) <= best.makespan + 1e-9
    assert load_bound(problem, head, tail) <= best.makespan + 1e-9
    assert lower_bound(problem, upper=heft(problem).makespan) <= best.makespan + 1e-9
    assert not propagate(problem, best.makespan * (1 + 1e-9)).refuted


def test_a_join_pays_a_transfer_or_waits_for_its_inputs_in_turn():
    # c needs a and b; on one device they run in turn (4 + 1), apart one transfer costs 5 (2 + 5 + 1)
    problem = problem_from_costs({"a": [2, 3], "b": [2, 3], "c": [1, 1]}, {("a", "c"): 5, ("b", "c"): 5})
    head, tail = heads(problem), tails(problem)
    assert head["c"] == (4.0, 6.0)
    assert tail["a"] == (1.0, 1.0)  # c right after a on a's device
    assert lower_bound(problem) == 5.0 == exhaustive(problem).makespan
    critical_path = 2 + 1  # each task at its fastest device, communication ignored
    assert lower_bound(problem) > critical_path


def test_refutation_raises_the_bound_and_stays_below_the_optimum():
    problem = random_problem(tasks=10, devices=3, ccr=5.0, seed=47)
    best = exhaustive(problem).makespan
    plain = lower_bound(problem)
    refuted = lower_bound(problem, upper=heft(problem).makespan, time_limit_s=5)
    assert plain < refuted <= best + 1e-9


def test_search_starts_at_heft_and_never_ends_worse():
    for seed in range(5):
        problem = random_problem(tasks=40, devices=4, ccr=1.0, seed=seed)
        found = search(problem, time_limit_s=0.3)
        found.validate()
        assert found.makespan <= heft(problem).makespan + 1e-9
        assert search(problem, time_limit_s=0.0).makespan == pytest.approx(heft(problem).makespan)


def test_bulk_load_hands_highs_the_same_model():
    problem = random_problem(tasks=10, devices=3, ccr=1.0, seed=3)
    start = heft(problem)
    results = []
    for bulk in (False, True):
        model = _Model(problem, propagate(problem, start.makespan * (1 + 1e-9)))
        model.add_assignment()
        model.add_precedence()
        model.add_order()
        model.add_makespan(lower_bound(problem))
        model.add_load()
        model.start_from(start)
        result = solve(model.lp, time_limit_s=20, gap=1e-6, use_start=True, bulk_load=bulk)
        results.append((result.status, result.objective, result.bound))
    assert results[0][0] == results[1][0] == "Optimal"
    assert results[0][1:] == pytest.approx(results[1][1:], rel=1e-9)
    assert results[1][1] == pytest.approx(exhaustive(problem).makespan)


def test_hundred_jobs_on_eight_devices_come_back_valid_with_a_certified_gap():
    """How close a time-limited solve gets at this size depends on the machine: ``orchestrator bench dag``
    reports its gap and solve time (instance ``random v=100 p=8 ccr=1 seed=0``)."""
    problem = random_problem(tasks=100, devices=8, ccr=1.0, seed=0)
    found = milp(problem, time_limit_s=10)
    found.validate()
    assert found.makespan <= heft(problem).makespan
    assert lower_bound(problem) <= found.bound <= found.makespan  # at least the bound without refutation
    assert found.gap == pytest.approx((found.makespan - found.bound) / found.makespan)
