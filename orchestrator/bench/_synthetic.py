"""Random planning instances small enough to enumerate: layer chains with closed-form costs.

A synthetic layer ℓ has forward FLOPs f_ℓ per sample, parameter bytes p_ℓ, activation bytes
a_ℓ per sample kept for the backward pass and output bytes o_ℓ per sample. On a device of
peak F under tensor parallelism t and microbatch m:

    forward = f_ℓ·m / (F·t),  backward = 2·forward (+ forward again under recompute)
    TP all-reduce of o_ℓ·m per direction when t > 1;  DP all-reduce of p_ℓ / t
    parameters = gradients = p_ℓ / t,  optimizer state = 2·p_ℓ / t,  optimizer = 4·p_ℓ / (t·BW)
    activations = a_ℓ·m / t  (o_ℓ·m under recompute);  transient = o_ℓ·m

The planner only reads what a :class:`~orchestrator.costs.CostModel` offers (``cluster``,
``layers``, ``batch_size``, ``tensor_parallel``, ``layer_cost``), so these instances exercise
the same ILP, enumeration and baselines as captured models, at sizes enumeration can solve.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from orchestrator.cluster import Cluster, Link, parse_cluster
from orchestrator.costs import LayerCost, ParallelConfig, all_gather_s, all_reduce_s, reduce_scatter_s


@dataclass(frozen=True, slots=True)
class SyntheticLayer:
    flops: float
    param_bytes: float
    activation_per_sample: float
    output_per_sample: float

    @property
    def signature(self) -> str:
        return f"{self.flops:.6g}/{self.param_bytes:.6g}/{self.activation_per_sample:.6g}/{self.output_per_sample:.6g}"

    @property
    def activation_bytes(self) -> float:  # what the layer sends on, for the captured batch of 1
        return self.output_per_sample


class SyntheticCosts:
    """The cost-model interface the planner reads, from the closed forms above."""

    batch_size = 1
    tensor_parallel = True

    def __init__(self, layers: list[SyntheticLayer], cluster: Cluster):
        self.layers, self.cluster = layers, cluster

    def layer_cost(self, index: int, device_type: str, config: ParallelConfig, *, tp_link: Link, dp_link: Link):
        layer, kind = self.layers[index], self.cluster.device_types[device_type]
        m, t = config.microbatch_size, config.tp
        forward = layer.flops * m / (kind.peak("float32") * t)
        backward = 2 * forward + (forward if config.recompute else 0.0)
        tp_bytes = layer.output_per_sample * m if t > 1 else 0.0
        tp_forward, tp_backward = tp_bytes, tp_bytes * (2 if config.recompute else 1)
        params = layer.param_bytes / t
        shards = config.dp if config.zero else 1  # ZeRO-1: optimizer state and update split over replicas
        sync = (
            reduce_scatter_s(params, config.dp, dp_link) + all_gather_s(params, config.dp, dp_link)
            if config.zero
            else all_reduce_s(params, config.dp, dp_link)
        )
        return LayerCost(
            forward_s=forward,
            backward_s=backward,
            optimizer_s=4 * params / kind.memory_bandwidth_bytes_per_s / shards,
            tp_comm_s=all_reduce_s(tp_forward, t, tp_link) + all_reduce_s(tp_backward, t, tp_link),
            dp_sync_s=sync,
            tp_allreduce_bytes=tp_forward + tp_backward,
            dp_sync_bytes=params if config.dp > 1 else 0.0,
            param_bytes=params,
            grad_bytes=params,
            optimizer_bytes=2 * params / shards,
            activation_bytes=(layer.output_per_sample * m) if config.recompute else layer.activation_per_sample * m / t,
            transient_bytes=layer.output_per_sample * m,
            output_activation_bytes=layer.output_per_sample * m,
            breakdown={"tp_forward_bytes": tp_forward, "tp_backward_bytes": tp_backward},
        )


def synthetic_cluster(
    types: dict[str, tuple[float, float]],
    *,
    hosts_per_type: int = 1,
    per_host: int = 2,
    intra_gbps: float = 100.0,
    network_gbps: float = 10.0,
) -> Cluster:
    """Device types by (TFLOP/s, memory GB); ``hosts_per_type`` hosts of ``per_host`` devices each."""
    return parse_cluster(
        {
            "name": "synthetic",
            "device_types": {
                name: {
                    "peak_tflops": {"float32": tflops},
                    "memory_bytes": int(memory_gb * 1e9),
                    "memory_bandwidth_gbps": 1000,
                }
                for name, (tflops, memory_gb) in types.items()
            },
            "hosts": [
                {
                    "name": f"{name}-{i}",
                    "device_type": name,
                    "count": per_host,
                    "rack": "rack",
                    "intra_link": {"bandwidth_gbps": intra_gbps, "latency_us": 2},
                }
                for name in types
                for i in range(hosts_per_type)
            ],
            "network": {"rack": {"bandwidth_gbps": network_gbps, "latency_us": 5}},
        }
    )


def random_instance(seed: int) -> SyntheticCosts:
    """2–5 layers (some repeated), one or two device types of two devices each, memory from ample to tight."""
    rng = random.Random(seed)
    kinds = [
        SyntheticLayer(
            rng.uniform(1, 8) * 1e12,
            rng.uniform(0.2, 4) * 1e9,
            rng.uniform(0.05, 1) * 1e9,
            rng.uniform(0.01, 0.2) * 1e9,
        )
        for _ in range(3)
    ]
    layers = [rng.choice(kinds) for _ in range(rng.randint(2, 5))]
    types = {"fast": (rng.choice([10.0, 20.0, 40.0]), rng.choice([16.0, 32.0, 64.0]))}
    if rng.random() < 0.6:
        types["slow"] = (rng.choice([5.0, 10.0]), rng.choice([16.0, 32.0, 64.0]))
    cluster = synthetic_cluster(types, network_gbps=rng.choice([1.0, 10.0, 50.0]))
    return SyntheticCosts(layers, cluster)
