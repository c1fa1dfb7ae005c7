"""The executor bench's communication cases: what a plan is predicted to communicate vs the
collectives XLA compiled for it.

Per stage s with M microbatches, the cost model's prediction per device is

    all-reduce bytes = M · Σ_{ℓ ∈ s} tp_allreduce_bytes(ℓ, tp, m)  +  Σ_{ℓ ∈ s} dp_sync_bytes(ℓ, tp, dp)

(``tp_allreduce_bytes`` is per microbatch, forward and backward; the gradient
sync once per step, of the full gradients a multi-stage plan's pipeline
accumulates, of the backward's own for a single-stage plan's one program),
and no other collective kind. The measured side is the
operand bytes of the collectives in each stage's optimized HLO
(:func:`~integrations.flax.hlo_collective_bytes`), the forward and backward
programs counted M times.
"""

from __future__ import annotations

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")


def predicted_collectives(plan, model, device_type: str) -> list[dict[str, float]]:
    """Per stage, predicted collective bytes per device per step, by kind."""
    from orchestrator.costs import ParallelConfig

    out = []
    for stage in plan.stages:
        # without logical axis names nothing is tensor-parallel: the executor replicates over "model"
        degree = stage.tp if model.tensor_parallel else 1
        config = ParallelConfig(
            tp=degree,
            dp=stage.dp,
            microbatch_size=stage.microbatch_size,
            accumulate_gradients=len(plan.stages) > 1,
        )
        tp = dp = 0.0
        for index in stage.layers:
            cost = model.layer_cost(index, device_type, config)
            tp += cost.tp_allreduce_bytes
            dp += cost.dp_sync_bytes
        out.append({**dict.fromkeys(KINDS, 0.0), "all-reduce": plan.microbatches * tp + dp})
    return out


def measured_collectives(step, state, batch) -> tuple[list[dict[str, int]], object]:
    """Per stage, collective bytes per device per step in the compiled programs, and the state after one step."""
    from integrations.flax import Pipeline, hlo_collective_bytes

    if isinstance(step, Pipeline):
        return step.collective_bytes(state, batch)
    measured = hlo_collective_bytes(step.compiled(state, batch).as_text())
    return [measured], state
