"""The best one-stage plan (``_starts.single_stage``), which joins the planner's first incumbent, against
pricing every group at every M: skipping the groups whose state alone overflows loses no plan, and
each M's least one-stage time (the bound of the ILP's one-stage piece of that M) is that M's optimum."""

import math

import pytest

from orchestrator.bench._synthetic import random_instance
from orchestrator.planner._evaluate import evaluate
from orchestrator.planner._space import search_space
from orchestrator.planner._starts import single_stage, state_overflows

BATCH, CANDIDATES = 8, (8, 4, 2, 1)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_single_stage_is_the_best_one_stage_plan(schedule):
    skipped = compared = 0
    for seed in range(12):
        model = random_instance(seed)
        space = search_space(model, BATCH, recompute=True, mixed=True)
        layers = list(range(space.layers))
        priced = [
            (evaluate([layers], [g], M, table=space.table, infos=space.infos, schedule=schedule, links=space.links,
                      report_infeasible=False), g, M)
            for g in space.groups
            for M in CANDIDATES
            if space.table.microbatch(g, M) is not None
        ]  # fmt: skip
        fitting = [ev.iteration_s for ev, _, _ in priced if ev.feasible]
        skipped += sum(state_overflows(space.table, layers, g, M) for _, g, M in priced)
        one = single_stage(space, CANDIDATES, schedule, deadline=math.inf)
        assert one.complete
        for M in CANDIDATES:
            at_m = [ev.iteration_s for ev, _, m in priced if m == M and ev.feasible]
            assert one.least_s[M] == pytest.approx(min(at_m, default=math.inf), rel=1e-12), f"seed {seed}, M={M}"
        found = one.best
        if not fitting:
            assert found is None, f"seed {seed}: a one-stage plan was returned where none fits"
            continue
        assert found is not None, f"seed {seed}: no one-stage plan found where {len(fitting)} fit"
        assert found.score == found.evaluation.iteration_s == pytest.approx(min(fitting), rel=1e-12), f"seed {seed}"
        assert found.stages == [layers] and len(found.groups) == 1
        compared += 1
    assert compared >= 6
    assert skipped > 0, "no instance exercised the state-overflow skip"


def test_a_deadline_leaves_the_pricing_incomplete():
    space = search_space(random_instance(0), BATCH, recompute=True, mixed=True)
    one = single_stage(space, CANDIDATES, "1f1b", deadline=0.0)
    assert not one.complete and one.best is None
