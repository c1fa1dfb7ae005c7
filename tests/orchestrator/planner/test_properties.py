"""Property: on random layer chains and clusters, every plan is valid or PlanInfeasible is raised."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.bench._synthetic import SyntheticCosts, SyntheticLayer, synthetic_cluster
from orchestrator.costs import ParallelConfig
from orchestrator.planner import PlanInfeasible, plan
from orchestrator.planner._groups import GroupConfig, group_links, type_infos
from orchestrator.planner._ilp import in_flight

layer = st.builds(
    SyntheticLayer,
    flops=st.floats(1e11, 1e13),
    param_bytes=st.floats(1e8, 8e9),
    activation_per_sample=st.floats(1e7, 2e9),
    output_per_sample=st.floats(1e6, 2e8),
)
device_type = st.tuples(st.floats(5.0, 50.0), st.sampled_from([4.0, 16.0, 40.0, 80.0]))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layers=st.lists(layer, min_size=1, max_size=6),
    types=st.lists(device_type, min_size=1, max_size=2),
    hosts=st.integers(1, 2),
    per_host=st.sampled_from([1, 2, 4]),
    batch=st.sampled_from([4, 8, 16]),
)
def test_every_plan_is_valid(layers, types, hosts, per_host, batch):
    cluster = synthetic_cluster(
        {f"t{i}": spec for i, spec in enumerate(types)}, hosts_per_type=hosts, per_host=per_host
    )
    model = SyntheticCosts(layers, cluster)
    try:
        found = plan(model, global_batch=batch, max_stages=3, time_limit_s=10)
    except PlanInfeasible as error:
        assert "no plan fits" in str(error)
        return
    assert [l for s in found.stages for l in s.layers] == list(range(len(layers)))  # each once, in order
    devices = [d for s in found.stages for d in s.devices]
    assert len(devices) == len(set(devices))  # no device in two stages
    known = {d.ref: d for d in cluster.devices()}
    infos = type_infos(cluster)
    for index, stage in enumerate(found.stages):
        assert len(stage.devices) == stage.tp * stage.dp
        # a stage on two types lists each part's devices in turn, each part's replicas with its own share
        parts = stage.parts or ((stage.device_type, len(stage.devices)),)
        shares = stage.shares or (stage.microbatch_size,)
        assert [known[d].device_type for d in stage.devices] == [kind for kind, n in parts for _ in range(n)]
        assert sum(n // stage.tp * b for (_, n), b in zip(parts, shares)) * found.microbatches == batch
        # memory recomputed from the cost model, independently of the planner's own bookkeeping
        for (kind, n), samples in zip(parts, shares):
            group = GroupConfig(device_type=kind, size=n, tp=stage.tp, recompute=stage.recompute)
            tp_link, dp_link = group_links(group, infos[kind])
            config = ParallelConfig(tp=stage.tp, dp=stage.dp, microbatch_size=samples, recompute=stage.recompute)
            costs = [model.layer_cost(l, kind, config, tp_link=tp_link, dp_link=dp_link) for l in stage.layers]
            k = in_flight(found.schedule, found.microbatches, len(found.stages), index)
            memory = sum(c.param_bytes + c.grad_bytes + c.optimizer_bytes + c.activation_bytes * k for c in costs)
            memory += max(c.transient_bytes for c in costs)
            assert memory <= cluster.device_types[kind].memory_bytes * (1 + 1e-9)
