"""Cost model: per-layer time, memory and communication on each device type and parallel configuration."""

from orchestrator.costs._collectives import all_gather_s, all_reduce_s, p2p_s, reduce_scatter_s
from orchestrator.costs._context import (
    ContextParallelChoice,
    ContextParallelCost,
    Form,
    ScanCarryCost,
    block_bytes,
    choose_context_parallel,
    context_parallel_cost,
    ring_permute_bytes,
    scan_carry_bytes,
    scan_carry_cost,
    scan_state_bytes,
)
from orchestrator.costs._gradients import batch_independent_ops, synced_gradient_bytes
from orchestrator.costs._liveness import Liveness, liveness, traffic_bytes
from orchestrator.costs._model import CostModel, LayerCost, ParallelConfig
from orchestrator.costs._roofline import EFFICIENCY_CLASSES, Efficiency, op_terms, op_time_s
from orchestrator.costs._sharding import (
    DEFAULT_LOGICAL_AXIS_RULES,
    MODEL_AXIS,
    LogicalAxisRules,
    TensorParallelTraits,
    logical_to_mesh_axes,
    param_role,
    sharded_dim,
    tensor_parallel_axes,
    tensor_parallel_traits,
)

__all__ = [
    "DEFAULT_LOGICAL_AXIS_RULES",
    "EFFICIENCY_CLASSES",
    "MODEL_AXIS",
    "ContextParallelChoice",
    "ContextParallelCost",
    "CostModel",
    "Efficiency",
    "Form",
    "LayerCost",
    "Liveness",
    "LogicalAxisRules",
    "ParallelConfig",
    "ScanCarryCost",
    "TensorParallelTraits",
    "all_gather_s",
    "all_reduce_s",
    "batch_independent_ops",
    "block_bytes",
    "choose_context_parallel",
    "context_parallel_cost",
    "liveness",
    "logical_to_mesh_axes",
    "op_terms",
    "op_time_s",
    "p2p_s",
    "param_role",
    "reduce_scatter_s",
    "ring_permute_bytes",
    "scan_carry_bytes",
    "scan_carry_cost",
    "scan_state_bytes",
    "sharded_dim",
    "synced_gradient_bytes",
    "tensor_parallel_axes",
    "tensor_parallel_traits",
    "traffic_bytes",
]
