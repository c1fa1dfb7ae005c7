"""Textbook answers the planner must give back."""

from orchestrator.bench._synthetic import SyntheticCosts, SyntheticLayer, synthetic_cluster
from orchestrator.planner import plan

BLOCK = SyntheticLayer(flops=4e12, param_bytes=2e9, activation_per_sample=0.5e9, output_per_sample=0.05e9)


def test_ample_memory_and_fast_links_give_pure_data_parallelism():
    cluster = synthetic_cluster({"gpu": (20.0, 1000.0)}, per_host=8, intra_gbps=300.0)  # NVLink class
    # a large batch: activation traffic (TP) outweighs the once-per-step gradient sync (DP)
    found = plan(SyntheticCosts([BLOCK] * 6, cluster), global_batch=512, time_limit_s=30)
    assert len(found.stages) == 1
    assert (found.stages[0].tp, found.stages[0].dp) == (1, 8)


def test_twice_as_fast_type_gets_about_twice_the_layers():
    cluster = synthetic_cluster({"fast": (40.0, 1000.0), "slow": (20.0, 1000.0)}, per_host=1, network_gbps=1e6)
    found = plan(SyntheticCosts([BLOCK] * 12, cluster), global_batch=32, time_limit_s=30)
    layers = {s.device_type: len(s.layers) for s in found.stages}
    assert layers == {"fast": 8, "slow": 4}


def test_tight_memory_gives_more_stages_or_tensor_parallelism():
    model = [BLOCK] * 8
    roomy = plan(
        SyntheticCosts(model, synthetic_cluster({"gpu": (20.0, 1000.0)}, per_host=4, intra_gbps=300.0)),
        global_batch=512,
    )
    # 8 blocks × 2 GB × 4 (weights, gradients, 2 optimizer states) = 64 GB: more than one 40 GB device holds
    tight = plan(
        SyntheticCosts(model, synthetic_cluster({"gpu": (20.0, 40.0)}, per_host=4, intra_gbps=300.0)), global_batch=512
    )
    assert len(roomy.stages) == 1 and roomy.stages[0].tp == 1
    assert len(tight.stages) > 1 or max(s.tp for s in tight.stages) > 1
    for stage in tight.stages:
        assert stage.memory_bytes <= 40e9


def test_no_tensor_parallelism_across_a_slow_host_link():
    cluster = synthetic_cluster({"gpu": (20.0, 40.0)}, hosts_per_type=2, per_host=2, network_gbps=0.5)
    found = plan(SyntheticCosts([BLOCK] * 8, cluster), global_batch=16, time_limit_s=30)
    hosts = {d.ref: d.host for d in cluster.devices()}
    for stage in found.stages:
        # devices are listed tensor-parallel-major: each run of tp devices is one TP group
        for first in range(0, len(stage.devices), stage.tp):
            group = stage.devices[first : first + stage.tp]
            assert len({hosts[d] for d in group}) == 1, stage


def test_infeasible_names_memory_and_the_least_extra_that_makes_a_plan_exist():
    import re

    import pytest

    from orchestrator.planner import PlanInfeasible

    model = [BLOCK] * 4  # 8 GB of weights, 32 GB with gradients and optimizer state
    with pytest.raises(PlanInfeasible, match="memory constraint binds") as info:
        plan(SyntheticCosts(model, synthetic_cluster({"gpu": (20.0, 6.0)}, per_host=2)), global_batch=8)
    extra_gb = float(re.search(r"least extra memory that makes a plan exist is ([0-9.e+-]+) GB", str(info.value))[1])
    assert extra_gb > 0
    enough = synthetic_cluster({"gpu": (20.0, 6.0 + extra_gb)}, per_host=2)
    assert plan(SyntheticCosts(model, enough), global_batch=8).iteration_s > 0
    too_little = synthetic_cluster({"gpu": (20.0, 6.0 + extra_gb * 0.98)}, per_host=2)
    with pytest.raises(PlanInfeasible):
        plan(SyntheticCosts(model, too_little), global_batch=8)
