"""Memory headroom: a plan fills at most capacity × (1 − headroom) of each device, 10% kept free by default."""

import dataclasses

import pytest

from orchestrator.bench._synthetic import SyntheticCosts, SyntheticLayer, synthetic_cluster
from orchestrator.planner import MEMORY_HEADROOM, PlanInfeasible, plan, replan, usable_memory_bytes

# 2 GB of parameters: 8 GB with gradients and two optimizer states, on one device
BLOCK = SyntheticLayer(flops=4e12, param_bytes=2e9, activation_per_sample=0.5e9, output_per_sample=0.05e9)


def _one_device(memory_gb: float) -> SyntheticCosts:
    return SyntheticCosts([BLOCK], synthetic_cluster({"gpu": (20.0, memory_gb)}, per_host=1))


def test_usable_memory_is_the_capacity_less_the_headroom():
    assert MEMORY_HEADROOM == 0.10
    assert usable_memory_bytes(80e9, 0.1) == pytest.approx(72e9)
    with pytest.raises(ValueError, match="headroom"):
        usable_memory_bytes(80e9, 1.0)


def test_a_plan_that_fits_without_headroom_does_not_fit_with_the_default():
    model = _one_device(8.9)  # 8 GB of state and 0.55 GB of activations at batch 1: 8.55 GB of 8.9 GB
    fits = plan(model, global_batch=1, memory_headroom=0.0, time_limit_s=10)
    assert 8.0e9 < fits.stages[0].memory_bytes <= 8.9e9
    with pytest.raises(PlanInfeasible, match="memory constraint binds"):
        plan(model, global_batch=1, time_limit_s=10)  # 8.01 GB usable: even recomputing needs 8.1
    with pytest.raises(ValueError, match="memory_headroom"):
        plan(model, global_batch=1, memory_headroom=-0.1)


def test_every_stage_of_a_default_plan_stays_within_the_usable_memory():
    model = SyntheticCosts([BLOCK] * 8, synthetic_cluster({"gpu": (20.0, 40.0)}, per_host=4, intra_gbps=300.0))
    found = plan(model, global_batch=64, time_limit_s=10)
    for stage in found.stages:
        assert stage.memory_bytes <= usable_memory_bytes(40e9, MEMORY_HEADROOM) * (1 + 1e-9)


def test_a_replan_keeps_the_headroom_its_previous_plan_was_made_with():
    model = _one_device(8.9)
    fits = dataclasses.replace(
        plan(model, global_batch=1, memory_headroom=0.0, time_limit_s=10), source={"memory_headroom": 0.0}
    )
    again = replan(fits, model, time_limit_s=10)
    assert 8.0e9 < again.stages[0].memory_bytes <= 8.9e9
    with pytest.raises(PlanInfeasible, match="memory constraint binds"):
        replan(fits, model, time_limit_s=10, memory_headroom=MEMORY_HEADROOM)
    unrecorded = dataclasses.replace(fits, source={})  # no record: the default headroom
    with pytest.raises(PlanInfeasible, match="memory constraint binds"):
        replan(unrecorded, model, time_limit_s=10)
