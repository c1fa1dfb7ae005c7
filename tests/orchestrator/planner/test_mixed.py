"""Stages on two device types: per-type batch shares, exact in the ILP, shown, simulated, refused by the executor."""

import pytest

from orchestrator.bench._synthetic import SyntheticCosts, SyntheticLayer, random_instance, synthetic_cluster
from orchestrator.planner import Plan, plan
from orchestrator.planner._groups import GroupConfig
from orchestrator.planner._space import search_space
from orchestrator.planner.baselines import exhaustive_plan

BLOCK = SyntheticLayer(flops=4e12, param_bytes=1e8, activation_per_sample=2e8, output_per_sample=1e7)


def _two_speeds(network_gbps: float, block: SyntheticLayer = BLOCK) -> SyntheticCosts:
    """Four blocks on one host of 2 devices at 40 TFLOP/s and one of 2 at 20, memory ample."""
    cluster = synthetic_cluster(
        {"fast": (40.0, 80.0), "slow": (20.0, 80.0)}, per_host=2, intra_gbps=100.0, network_gbps=network_gbps
    )
    return SyntheticCosts([block] * 4, cluster)


def test_shares_give_the_faster_type_more_samples_and_cover_the_microbatch():
    model = _two_speeds(100.0)
    space = search_space(model, 48, recompute=False)
    mixed = next(g for g in space.groups if g.mixed and g.tp == 1)
    assert mixed.by_type == {"fast": 2, "slow": 2}
    for M in (1, 2, 4):
        fast, slow = space.table.shares(mixed, M)
        assert 2 * fast + 2 * slow == 48 // M  # every sample of the microbatch on one replica
        assert fast == 2 * slow  # twice the speed, twice the samples (the layers scale linearly here)


def test_fast_links_give_one_data_parallel_stage_over_both_types():
    found = plan(_two_speeds(400.0), global_batch=48, microbatch_candidates=(1, 2, 4), time_limit_s=30, gap=1e-6)
    [stage] = found.stages
    fast, slow = stage.shares
    assert stage.parts == (("fast", 2), ("slow", 2)) and fast == 2 * slow
    assert (2 * fast + 2 * slow) * found.microbatches == 48
    assert stage.device_type == "fast+slow" and stage.dp == 4
    assert found.gap <= 1e-6
    # one type per stage (what the executor runs) is slower here
    single = plan(_two_speeds(400.0), global_batch=48, microbatch_candidates=(1, 2, 4), mixed_stages=False)
    assert found.iteration_s < single.iteration_s * 0.95


def test_a_slow_link_between_the_types_keeps_data_parallelism_off_it():
    # gradients of 4 GB a step would cross a 0.5 GB/s link: far longer than the compute they would share
    heavy = SyntheticLayer(flops=1e11, param_bytes=1e9, activation_per_sample=2e8, output_per_sample=1e6)
    model = _two_speeds(0.5, heavy)
    found = plan(model, global_batch=48, microbatch_candidates=(1, 2, 4), time_limit_s=30, gap=1e-6)
    assert not any(stage.parts for stage in found.stages)
    fast = _two_speeds(400.0, heavy)  # the same model with a fast link does join the types
    assert any(stage.parts for stage in plan(fast, global_batch=48, microbatch_candidates=(1, 2, 4)).stages)


@pytest.mark.parametrize("seed", [11, 20, 25, 27, 36])
def test_ilp_equals_enumeration_where_the_optimum_is_mixed(seed):
    model = random_instance(seed)
    settings = {"global_batch": 8, "microbatch_candidates": (1, 2, 4), "max_stages": 3}
    found = plan(model, time_limit_s=30, gap=1e-6, **settings)
    truth = exhaustive_plan(model, **settings)
    assert found.iteration_s == pytest.approx(truth.iteration_s, rel=1e-6)
    assert any(stage.parts for stage in found.stages)  # these seeds' optima span both types
    assert found.iteration_s < exhaustive_plan(model, mixed_stages=False, **settings).iteration_s


def test_a_mixed_plan_round_trips_explains_and_simulates_as_predicted():
    from orchestrator.simulate import compare

    model = _two_speeds(400.0)
    found = plan(model, global_batch=48, microbatch_candidates=(1, 2, 4), time_limit_s=30)
    assert Plan.from_json(found.to_json()) == found
    text = found.explain()
    shares = "/".join(map(str, found.stages[0].shares))
    assert "2 × fast + 2 × slow" in text and shares in text and "each microbatch is split" in text
    predicted, simulated = compare(found, model)[:2]
    assert simulated == pytest.approx(predicted, rel=0.05)


def test_the_executor_refuses_uneven_shares_with_a_fix():
    from integrations.flax import compile_step

    found = plan(_two_speeds(400.0), global_batch=48, microbatch_candidates=(1, 2, 4), time_limit_s=30)
    with pytest.raises(ValueError, match="mixed_stages=False"):
        compile_step(found, lambda state, batch: (state, {}), None)


def test_a_mixed_group_counts_its_devices_on_each_type():
    group = GroupConfig(device_type="a+b", size=24, tp=2, recompute=False, parts=(("a", 8), ("b", 16)))
    assert group.mixed and group.dp == 12 and group.by_type == {"a": 8, "b": 16}
