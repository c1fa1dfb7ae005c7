"""The packing bound against enumeration: never above the best plan of its M, +inf only when no
plan of that M fits (or beats the incumbent it was given), and tighter than the capacity cut."""

import math

import pytest

from orchestrator.bench._synthetic import random_instance
from orchestrator.planner._ilp import simple_bound_s, undominated
from orchestrator.planner._packing import PackingBound
from orchestrator.planner._space import search_space
from orchestrator.planner.baselines import exhaustive_plan

BATCH, STAGES = 8, 3


def _bound(space, M, schedule, stages):
    groups = undominated(
        [g for g in space.groups if space.table.microbatch(g, M) is not None], space.runs, space.table, M
    )
    packing = PackingBound(space, groups, microbatches=M, max_stages=stages, schedule=schedule)
    return packing, simple_bound_s(space.runs, groups, space.table, space.infos, M)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_packing_bound_never_exceeds_the_best_plan_of_its_microbatch_count(schedule):
    compared = tighter = 0
    for seed in range(16):
        model = random_instance(seed)
        space = search_space(model, BATCH, recompute=True)
        for M in (1, 2, 4):
            truth = exhaustive_plan(
                model, global_batch=BATCH, schedule=schedule, microbatch_candidates=(M,), max_stages=STAGES
            )
            packing, capacity = _bound(space, M, schedule, STAGES)
            bound = packing.bound_s(above_s=capacity)
            if truth is None:
                continue
            assert bound <= truth.iteration_s * (1 + 1e-6), f"seed {seed}, M={M}: {bound} > {truth.iteration_s}"
            # an incumbent just above the optimum must not be pruned; one below it may be
            assert packing.bound_s(above_s=capacity, below_s=truth.iteration_s * 1.001) < math.inf
            compared += 1
            tighter += bound > capacity * 1.01
    assert compared >= 30
    assert tighter >= compared // 2, f"tighter than the capacity cut on only {tighter} of {compared}"


def test_packing_bound_holds_per_stage_count_and_proves_empty_microbatch_counts():
    """``bound_s(stages=S)`` bounds every plan with at most S stages; +inf means no such plan fits."""
    checked = empty = 0
    for seed in range(12):
        model = random_instance(seed)
        space = search_space(model, BATCH, recompute=True)
        for M in (1, 4):
            packing, capacity = _bound(space, M, "1f1b", STAGES)
            for S in range(1, STAGES + 1):
                truth = exhaustive_plan(model, global_batch=BATCH, microbatch_candidates=(M,), max_stages=S)
                bound = packing.bound_s(S, above_s=capacity)
                if truth is None:
                    empty += bound == math.inf
                    continue
                assert bound <= truth.iteration_s * (1 + 1e-6), f"seed {seed}, M={M}, S={S}"
                checked += 1
    assert checked >= 40
    assert empty >= 1, "no instance where the bound proved a microbatch count empty"


def test_a_probe_ends_after_one_undecided_solve_and_keeps_the_bound_it_was_given(monkeypatch):
    # a probe (infinite tolerance) whose one solve ends undecided keeps ``above_s`` rather than
    # retrying (the M's whole-stage LPs bound it next); a search to a finite tolerance retries
    from orchestrator.planner import _packing

    space = search_space(random_instance(0), BATCH, recompute=True)
    runs = []
    real = _packing.work.run
    monkeypatch.setattr(_packing.work, "run", lambda highs: (runs.append(1), real(highs)))
    for tolerance in (math.inf, 1e-2):
        packing, capacity = _bound(space, 1, "1f1b", STAGES)
        packing.least_step_s(1.0)  # (loads the LP)
        lp = packing._lps[STAGES]
        lp.highs.setOptionValue("simplex_iteration_limit", 0)  # every solve ends undecided
        lp.highs.clearSolver()
        lp.last_s = None
        runs.clear()
        bound = packing.bound_s(above_s=capacity * 0.5, below_s=1e9, tolerance=tolerance)
        if tolerance == math.inf:
            assert len(runs) == 1 and bound == pytest.approx(capacity * 0.5), (runs, bound, capacity)
        else:
            assert len(runs) > 1  # (the retries)
