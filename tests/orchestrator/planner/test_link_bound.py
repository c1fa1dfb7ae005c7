"""The solve-free link bound against enumeration: every plan of exactly S stages at M microbatches
takes at least ``link_bound_s(M, S)``, under both schedules."""

import itertools

import pytest

from orchestrator.bench._synthetic import random_instance
from orchestrator.planner._evaluate import evaluate
from orchestrator.planner._ilp import link_bound_s
from orchestrator.planner._space import search_space
from orchestrator.planner.baselines._exhaustive import _partitions

BATCH, STAGES = 8, 3


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_link_bound_never_exceeds_a_plan_of_its_stage_count(schedule):
    checked = tight = 0
    for seed in range(8):
        model = random_instance(seed)
        space = search_space(model, BATCH, recompute=True)
        for M, S in itertools.product((1, 2, 4), range(2, STAGES + 1)):
            if S > space.layers:
                continue
            bound = link_bound_s(space.runs, space.groups, space.table, space.links, M, S, schedule)
            valid = [g for g in space.groups if space.table.microbatch(g, M) is not None]
            least = min(
                (
                    evaluate(stages, list(chosen), M, table=space.table, infos=space.infos, schedule=schedule,
                             links=space.links).iteration_s
                    for stages in _partitions(space.layers, S)
                    for chosen in itertools.product(valid, repeat=S)
                ),
                default=None,
            )  # fmt: skip
            if least is None:
                continue
            assert bound <= least * (1 + 1e-9), f"seed {seed}, M={M}, S={S}: {bound} > {least}"
            checked += 1
            tight += bound >= 0.5 * least
    assert checked >= 30
    assert tight >= checked // 4, f"the bound reached half the best plan on only {tight} of {checked}"
