"""HEFT, CPOP, the MILP and exhaustive search on hand-computed and random instances."""

import math

import pytest

from orchestrator.dag import (
    cpop,
    downward_ranks,
    exhaustive,
    heft,
    milp,
    problem_from_costs,
    random_problem,
    upward_ranks,
)

# Topcuoglu, Hariri & Wu (2002), Fig. 2: 10 tasks on 3 processors.
W = {1: (14, 16, 9), 2: (13, 19, 18), 3: (11, 13, 19), 4: (13, 8, 17), 5: (12, 13, 10),
     6: (13, 16, 9), 7: (7, 15, 11), 8: (5, 11, 14), 9: (18, 12, 20), 10: (21, 7, 16)}  # fmt: skip
C = {(1, 2): 18, (1, 3): 12, (1, 4): 9, (1, 5): 11, (1, 6): 14, (2, 8): 19, (2, 9): 16, (3, 7): 23,
     (4, 8): 27, (4, 9): 23, (5, 9): 13, (6, 8): 15, (7, 10): 17, (8, 10): 11, (9, 10): 13}  # fmt: skip


@pytest.fixture(scope="module")
def paper():
    return problem_from_costs({f"n{k}": v for k, v in W.items()}, {(f"n{a}", f"n{b}"): c for (a, b), c in C.items()})


def test_ranks_match_the_paper(paper):
    up = upward_ranks(paper)
    expected = {1: 108.0, 2: 77.0, 3: 80.0, 4: 80.0, 5: 69.0, 6: 63.333, 7: 42.667, 8: 35.667, 9: 44.333, 10: 14.667}
    for k, value in expected.items():
        assert up[f"n{k}"] == pytest.approx(value, abs=1e-3)
    down = downward_ranks(paper)
    assert down["n1"] == 0
    assert up["n1"] + down["n1"] == pytest.approx(108.0)  # the critical path length


def test_heft_and_cpop_reproduce_the_paper(paper):
    h, c = heft(paper), cpop(paper)
    h.validate()
    c.validate()
    assert h.makespan == 80.0
    assert c.makespan == 86.0


def test_milp_proves_the_optimum_of_the_paper_example(paper):
    m, e = milp(paper, time_limit_s=30), exhaustive(paper)
    m.validate()
    e.validate()
    assert m.makespan == pytest.approx(e.makespan) == pytest.approx(73.0)
    assert m.gap <= 1e-4 and m.bound == pytest.approx(73.0)


@pytest.mark.parametrize("seed", range(32))
def test_milp_equals_exhaustive_on_random_small_instances(seed):
    tasks = 6 + seed % 5  # 6..10 jobs
    ccr = (0.5, 1.0, 5.0)[seed % 3]
    problem = random_problem(tasks=tasks, devices=3, ccr=ccr, seed=seed)
    best = exhaustive(problem, max_tasks=10)
    found = milp(problem, time_limit_s=30)
    found.validate()
    assert found.makespan == pytest.approx(best.makespan, rel=1e-6)
    assert found.makespan <= heft(problem).makespan + 1e-9


def test_time_limited_milp_is_never_worse_than_heft_and_reports_its_gap():
    problem = random_problem(tasks=30, devices=4, ccr=1.0, seed=7)
    found = milp(problem, time_limit_s=2)
    found.validate()
    assert found.makespan <= heft(problem).makespan + 1e-9
    assert 0 <= found.gap < 1 and 0 < found.bound <= found.makespan


def test_slots_let_a_device_run_jobs_side_by_side():
    problem = problem_from_costs({"a": [1.0], "b": [5.0], "c": [5.0]}, {("a", "b"): 0, ("a", "c"): 0}, slots=[2])
    for schedule in (heft(problem), milp(problem), exhaustive(problem)):
        schedule.validate()
        assert schedule.makespan == 6.0


def test_disallowed_devices_are_respected():
    problem = problem_from_costs({"a": [1.0, math.inf], "b": [math.inf, 1.0]}, {("a", "b"): 3.0})
    for schedule in (heft(problem), cpop(problem), milp(problem), exhaustive(problem)):
        schedule.validate()
        assert schedule.device_of("a") == "p1" and schedule.device_of("b") == "p2"
        assert schedule.makespan == 5.0


def test_bad_problems_are_refused():
    with pytest.raises(ValueError, match="cannot run on any device"):
        problem_from_costs({"a": [math.inf]}, {})
    with pytest.raises(ValueError, match="cycle"):
        problem_from_costs({"a": [1.0], "b": [1.0]}, {("a", "b"): 1, ("b", "a"): 1})
    with pytest.raises(ValueError, match="at most"):
        exhaustive(random_problem(tasks=12, devices=2, seed=0))


def test_a_one_second_limit_still_leaves_the_solver_its_time():
    problem = random_problem(tasks=7, devices=3, ccr=1.0, seed=1)
    best = exhaustive(problem)
    assert heft(problem).makespan > 1.05 * best.makespan  # the start alone is not optimal: the solver must run
    found = milp(problem, time_limit_s=1)
    assert found.status == "Optimal"  # HiGHS's own proof, not the bound meeting the start
    assert found.makespan == pytest.approx(best.makespan, rel=1e-6)
