"""The per-type capacity bound against enumeration: never above the best plan of its M, never below
the solve-free capacity cut, +inf only where no plan of that M fits, and tighter where types differ."""

import math

import pytest

from orchestrator.bench._synthetic import random_instance
from orchestrator.planner._capacity import capacity_bound_s
from orchestrator.planner._ilp import simple_bound_s
from orchestrator.planner._space import search_space
from orchestrator.planner.baselines import exhaustive_plan

BATCH, STAGES = 8, 3
# one and two device types, some where nothing fits; the others take enumeration seconds each
SEEDS = (0, 1, 4, 5, 6, 7, 8, 11, 12, 13, 14, 15, 16, 18, 19)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_capacity_bound_never_exceeds_the_best_plan_of_its_microbatch_count(schedule):
    compared = tighter = empty = 0
    for seed in SEEDS:
        model = random_instance(seed)
        space = search_space(model, BATCH, recompute=True)
        for M in (1, 2, 4):
            bound = capacity_bound_s(space.runs, space.groups, space.table, space.infos, M, schedule)
            simple = simple_bound_s(space.runs, space.groups, space.table, space.infos, M)
            assert bound >= simple
            truth = exhaustive_plan(
                model, global_batch=BATCH, schedule=schedule, microbatch_candidates=(M,), max_stages=STAGES
            )
            if truth is None:
                empty += bound == math.inf
                continue
            assert bound <= truth.iteration_s * (1 + 1e-6), f"seed {seed}, M={M}: {bound} > {truth.iteration_s}"
            compared += 1
            tighter += bound > simple * 1.01
    assert compared >= 30
    assert tighter >= compared // 4, f"tighter than the capacity cut on only {tighter} of {compared}"
    assert empty >= 3, "the memory rows prove no microbatch count empty"


def test_without_memory_rows_the_bound_is_the_compute_one():
    """The diagnosis variant (memory may grow) keeps only the compute rows: never above the bound with them."""
    for seed in range(8):
        model = random_instance(seed)
        space = search_space(model, BATCH, recompute=True)
        for M in (1, 4):
            args = (space.runs, space.groups, space.table, space.infos, M, "1f1b")
            assert capacity_bound_s(*args, memory=False) <= capacity_bound_s(*args) * (1 + 1e-9)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_stage_count_rows_never_exceed_the_best_plan_of_at_most_that_many_stages(schedule):
    """With the deepest pipeline given (Σ_s c_s ≤ S·T, at most S stages' memory, the fill α(S)·Σ_s c_s)
    and with a cutoff just above the optimum (every stage within cutoff / M), the bound stays at or
    below the best plan of at most S stages; with no plan below a cutoff it may reach the cutoff."""
    compared = lifted = 0
    for seed in range(12):
        model = random_instance(seed)
        space = search_space(model, BATCH, recompute=True)
        for stages in (1, 2, STAGES):
            for M in (1, 2, 4, 8):
                args = (space.runs, space.groups, space.table, space.infos, M, schedule)
                truth = exhaustive_plan(
                    model, global_batch=BATCH, schedule=schedule, microbatch_candidates=(M,), max_stages=stages
                )
                bound = capacity_bound_s(*args, max_stages=stages)
                if truth is None:
                    continue
                optimum = truth.iteration_s
                assert bound <= optimum * (1 + 1e-6), f"seed {seed}, M={M}, S={stages}: {bound} > {optimum}"
                above = capacity_bound_s(*args, max_stages=stages, below_s=optimum * 1.001)
                assert above <= optimum * (1 + 1e-6), f"seed {seed}, M={M}, S={stages}: {above} > {optimum}"
                assert capacity_bound_s(*args, max_stages=stages, below_s=optimum * 0.999) <= optimum * 0.999
                compared += 1
                lifted += bound > capacity_bound_s(*args) * 1.01
    assert compared >= 36
    assert lifted >= compared // 10, f"the stage rows lift the bound on only {lifted} of {compared}"
