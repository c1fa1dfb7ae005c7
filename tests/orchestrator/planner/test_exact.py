"""The ILP against enumeration on random instances, and against every baseline."""

import pytest

from orchestrator.bench._synthetic import random_instance
from orchestrator.planner import PlanInfeasible, plan
from orchestrator.planner.baselines import BASELINES, exhaustive_plan

SETTINGS = {"global_batch": 8, "microbatch_candidates": (1, 2, 4), "max_stages": 3}


def test_ilp_equals_enumeration_on_random_instances():
    solved = 0
    for seed in range(36):  # 30 of them have a plan with the default memory headroom
        model = random_instance(seed)
        truth = exhaustive_plan(model, **SETTINGS)
        if truth is None:
            with pytest.raises(PlanInfeasible):
                plan(model, time_limit_s=20, gap=1e-6, **SETTINGS)
            continue
        found = plan(model, time_limit_s=20, gap=1e-6, **SETTINGS)
        assert found.iteration_s == pytest.approx(truth.iteration_s, rel=1e-3), f"seed {seed}"
        assert found.gap <= 1e-3
        for name, baseline in BASELINES.items():
            result = baseline(model, **SETTINGS)
            assert result is None or result.iteration_s >= found.iteration_s * (1 - 1e-9), f"{name} beat the ILP"
        solved += 1
    assert solved >= 30


def test_zero_plans_equal_enumeration_and_shard_where_data_parallel():
    """``zero=True``: the ILP still equals enumeration over the same (ZeRO-1) costs, every stage with
    data parallelism says so, and no plan is slower than without (the update is split, the sync
    costs what the all-reduce did); on most of these instances it is faster."""
    compared = faster = 0
    for seed in range(12):
        model = random_instance(seed)
        truth = exhaustive_plan(model, zero=True, **SETTINGS)
        if truth is None:
            continue
        found = plan(model, time_limit_s=20, gap=1e-6, zero=True, **SETTINGS)
        assert found.iteration_s == pytest.approx(truth.iteration_s, rel=1e-3), f"seed {seed}"
        assert all(stage.zero == (stage.dp > 1) for stage in found.stages)
        plain = exhaustive_plan(model, **SETTINGS)
        assert truth.iteration_s <= plain.iteration_s * (1 + 1e-9)
        faster += truth.iteration_s < plain.iteration_s * (1 - 1e-4)
        compared += 1
    assert compared >= 8 and faster >= compared // 2
