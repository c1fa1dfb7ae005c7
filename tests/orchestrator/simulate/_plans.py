"""Real plans for the simulator's tests: gpt-tiny's captured step on a small mixed cluster.

``hand_plan`` fixes a placement the planner would not necessarily choose
(tensor and data parallelism across two hosts per stage, so transfers split
over several links and gradient syncs use rings) and prices it with the cost
model exactly as the planner's table does; ``planner_plan`` asks the planner.
"""

from __future__ import annotations

import functools

from orchestrator.cluster import parse_cluster
from orchestrator.costs import CostModel, ParallelConfig, all_reduce_s, p2p_s
from orchestrator.planner import Plan, Stage, plan
from orchestrator.planner._closed_form import step_time

GLOBAL_BATCH = 8


def small_cluster(memory_bytes: int = 2**34):
    """Types ``a`` (10 TFLOP/s) and ``b`` (5 TFLOP/s), two hosts of two devices each, 10 GB/s between hosts."""
    return parse_cluster(
        {
            "name": "small-mixed",
            "device_types": {
                name: {"peak_tflops": {"float32": tflops}, "memory_bytes": memory_bytes, "memory_bandwidth_gbps": 1000}
                for name, tflops in (("a", 10.0), ("b", 5.0))
            },
            "hosts": [
                {
                    "name": f"{name}-{i}",
                    "device_type": name,
                    "count": 2,
                    "rack": "r",
                    "intra_link": {"bandwidth_gbps": 100, "latency_us": 2},
                }
                for name in ("a", "b")
                for i in range(2)
            ],
            "network": {"rack": {"bandwidth_gbps": 10, "latency_us": 5}},
        }
    )


@functools.cache
def _captured():
    from integrations.flax import capture
    from orchestrator.coarsen import coarsen
    from recipes import get_recipe

    recipe = get_recipe("gpt-tiny")
    graph = capture(recipe.train_step, recipe.abstract_state(), recipe.batch_spec(8, 64))
    return recipe, graph, coarsen(graph)


def tiny_model(memory_bytes: int = 2**34) -> CostModel:
    recipe, graph, layers = _captured()
    return CostModel(graph, layers, small_cluster(memory_bytes), batch_size=8, param_axes=recipe.param_axes())


def hand_plan(model: CostModel, schedule: str = "1f1b", microbatches: int = 4) -> Plan:
    """Layers 0–1 on the four ``a`` devices, 2–3 on the four ``b`` devices, both TP 2 × DP 2 across two hosts."""
    cluster = model.cluster
    devices = {d.ref: d for d in cluster.devices()}
    placement = [
        ((0, 1), "a", ("a-0/0", "a-0/1", "a-1/0", "a-1/1")),
        ((2, 3), "b", ("b-0/0", "b-0/1", "b-1/0", "b-1/1")),
    ]
    S, M = len(placement), microbatches
    stages, layer_backward, layer_sync = [], [], []
    for s, (layers, dtype, refs) in enumerate(placement):
        tp, dp = 2, 2
        tp_link = cluster.link(devices[refs[0]], devices[refs[1]])
        dp_link = cluster.link(devices[refs[0]], devices[refs[2]])
        config = ParallelConfig(tp=tp, dp=dp, microbatch_size=GLOBAL_BATCH // M // dp, recompute=False)
        costs = [model.layer_cost(layer, dtype, config, tp_link=tp_link, dp_link=dp_link) for layer in layers]
        send = 0.0
        if s + 1 < S:
            nbytes = model.layers[layers[-1]].activation_bytes * (GLOBAL_BATCH / M) / model.batch_size
            send = p2p_s(nbytes, cluster.link(devices[refs[0]], devices[placement[s + 1][2][0]]))
        in_flight = M if schedule == "gpipe" else min(M, S - s)
        tp_forward = [all_reduce_s(c.breakdown.get("tp_forward_bytes", 0.0), tp, tp_link) for c in costs]
        layer_backward.append([c.backward_s + c.tp_comm_s - t for c, t in zip(costs, tp_forward)])
        layer_sync.append([c.dp_sync_s for c in costs])
        stages.append(
            Stage(
                layers=layers,
                device_type=dtype,
                devices=refs,
                tp=tp,
                dp=dp,
                recompute=False,
                microbatch_size=config.microbatch_size,
                time_s=sum(c.forward_s + c.backward_s + c.tp_comm_s for c in costs) + 2 * send,
                forward_s=sum(
                    c.forward_s + all_reduce_s(c.breakdown.get("tp_forward_bytes", 0.0), tp, tp_link) for c in costs
                ),
                send_s=send,
                dp_sync_s=sum(c.dp_sync_s for c in costs),
                optimizer_s=sum(c.optimizer_s for c in costs),
                memory_bytes=sum(
                    c.param_bytes + c.grad_bytes + c.optimizer_bytes + in_flight * c.activation_bytes for c in costs
                )
                + max(c.transient_bytes for c in costs),
            )
        )
    closed = step_time(
        [x.forward_s for x in stages],
        layer_backward,
        [x.send_s for x in stages],
        layer_sync,
        [x.optimizer_s for x in stages],
        M,
        schedule,
    )
    return Plan(
        stages=tuple(stages),
        schedule=schedule,  # type: ignore[arg-type]
        microbatches=M,
        global_batch=GLOBAL_BATCH,
        iteration_s=closed.step_s,
        breakdown=closed.breakdown,
    )


@functools.cache
def planner_plan(schedule: str) -> tuple[CostModel, Plan]:
    """The planner's plan when memory is tight enough (2.5 MB per device) to need more than one stage."""
    model = tiny_model(memory_bytes=2_500_000)
    found = plan(
        model,
        global_batch=GLOBAL_BATCH,
        schedule=schedule,
        microbatch_candidates=(1, 2, 4),
        max_stages=3,
        time_limit_s=20,
    )
    return model, found
