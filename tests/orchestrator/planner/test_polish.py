"""The local search that polishes the planner's first incumbent."""

import dataclasses
import time

import pytest

from orchestrator.baselines import BASELINES
from orchestrator.bench._synthetic import random_instance
from orchestrator.planner._evaluate import evaluate
from orchestrator.planner._exhaustive import exhaustive_plan
from orchestrator.planner._polish import polish
from orchestrator.planner._search import search_space

SETTINGS = {"global_batch": 8, "microbatch_candidates": (1, 2, 4), "max_stages": 3}


def _polish(model, start, *, seconds=5.0):
    space = search_space(model, SETTINGS["global_batch"], recompute=True)
    found = polish(
        start.stages,
        start.groups,
        start.microbatches,
        space=space,
        schedule="1f1b",
        candidates=[4, 2, 1],
        max_stages=min(SETTINGS["max_stages"], space.layers),
        score=lambda ev, stages, groups: ev.iteration_s,
        deadline=time.perf_counter() + seconds,
    )
    return space, found


def test_polish_reaches_the_enumerated_optimum_from_the_uniform_plan():
    """From the uniform baseline's plan (up to 3.4× the optimum here) to the optimum on every
    random instance, and the plan it returns is priced as it says."""
    reached = 0
    for seed in range(16):
        model = random_instance(seed)
        truth = exhaustive_plan(model, **SETTINGS)
        start = BASELINES["uniform"](model, **SETTINGS)
        if truth is None or start is None:
            continue
        space, found = _polish(model, start)
        assert found.score <= start.iteration_s
        again = evaluate(
            found.stages,
            found.groups,
            found.microbatches,
            table=space.table,
            infos=space.infos,
            schedule="1f1b",
            links=space.links,
        )
        assert again.feasible and again.iteration_s == pytest.approx(found.score, rel=1e-12)
        assert sorted(layer for stage in found.stages for layer in stage) == list(range(space.layers))
        assert found.score == pytest.approx(truth.iteration_s, rel=1e-3), f"seed {seed}"
        reached += 1
    assert reached >= 15


def test_polish_past_its_deadline_returns_the_start_and_none_for_a_plan_that_does_not_fit():
    model = random_instance(2)
    start = BASELINES["uniform"](model, **SETTINGS)
    _, found = _polish(model, start, seconds=0.0)
    assert (found.stages, found.groups, found.microbatches) == (start.stages, start.groups, start.microbatches)
    # a group far bigger than the cluster: the start does not fit
    too_big = dataclasses.replace(start.groups[0], size=start.groups[0].size * 10**6)
    _, found = _polish(model, dataclasses.replace(start, groups=[too_big] * len(start.groups)))
    assert found is None
