"""The baselines: each returns a plan priced as it says, that fits, and is never better than the optimum."""

import pytest

from orchestrator.bench._synthetic import random_instance
from orchestrator.planner._evaluate import evaluate
from orchestrator.planner._space import search_space
from orchestrator.planner.baselines import BASELINES, balanced, exhaustive, exhaustive_plan

SETTINGS = {"global_batch": 8, "microbatch_candidates": (1, 2, 4), "max_stages": 3}


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_every_baseline_is_priced_as_it_says_and_never_beats_the_optimum(schedule):
    found = 0
    for seed in range(6):
        model = random_instance(seed)
        truth = exhaustive_plan(model, schedule=schedule, **SETTINGS)
        space = search_space(model, SETTINGS["global_batch"], recompute=True)
        for name, run in {**BASELINES, "balanced": balanced}.items():
            result = run(model, schedule=schedule, **SETTINGS)
            if result is None:
                continue
            assert truth is not None, f"seed {seed}: {name} found a plan where none fits"
            assert result.name == name and result.microbatches in SETTINGS["microbatch_candidates"]
            assert sorted(layer for stage in result.stages for layer in stage) == list(range(space.layers))
            again = evaluate(
                result.stages,
                result.groups,
                result.microbatches,
                table=space.table,
                infos=space.infos,
                schedule=schedule,
                links=space.links,
            )
            assert again.feasible and again.iteration_s == pytest.approx(result.iteration_s, rel=1e-12)
            assert result.iteration_s >= truth.iteration_s * (1 - 1e-9), f"seed {seed}: {name} beat the optimum"
            found += 1
    assert found >= 20


def test_a_past_deadline_returns_no_plan_and_exhaustive_wraps_the_optimum():
    model = random_instance(0)
    assert balanced(model, deadline=0.0, **SETTINGS) is None
    assert all(run(model, deadline=0.0, **SETTINGS) is None for run in BASELINES.values())
    truth = exhaustive_plan(model, **SETTINGS)
    assert exhaustive(model, **SETTINGS).iteration_s == truth.iteration_s
    with pytest.raises(TypeError):
        balanced(model, global_batch=8, stages=3)  # an unknown setting is an error, not ignored
