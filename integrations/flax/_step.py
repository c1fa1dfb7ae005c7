"""Compile a train step that executes a :class:`~orchestrator.planner.Plan`.

A single-stage plan is one ``jax.jit`` of the user's step with the state's
shardings as in- and out-shardings (state donated) and the batch split over
the ``"data"`` axis: XLA's SPMD partitioner then inserts the tensor-parallel
all-reduces and the data-parallel gradient all-reduce. The plan's microbatch
count is not used for a single stage: the whole batch is one program
(gradient accumulation would only change the summation order).

A stage that says ``fsdp`` keeps its parameters split over ``"data"`` too
(:mod:`integrations.flax._shard`); one that says ``sequence_parallel`` or
``selective_recompute`` runs the step rewritten per batch shape
(:mod:`integrations.flax._options`), with the same shardings.

A multi-stage plan runs as an MPMD pipeline (:mod:`integrations.flax._pipeline`), with its
virtual stages (interleaved 1F1B) when it has them, and each stage's options (FSDP, sequence
parallelism, selective recompute) inside its programs.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from integrations.flax._shard import batch_sharding, device_map, stage_mesh, state_shardings


class StepFunction:
    """``step(state, batch) -> (state, metrics)`` for a plan; ``lowered(...)`` exposes XLA's program.

    Attributes:
      plan: the plan it executes.
      meshes: one mesh per stage.
    """

    def __init__(self, plan, fn: Callable, meshes, state_shardings, *, state=None, param_axes=None, axis_rules=None):
        self.plan, self.fn, self.meshes = plan, fn, meshes
        self.state_shardings = state_shardings
        self.param_axes, self.axis_rules = param_axes, axis_rules
        self.abstract_state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
        self._jitted = {}

    def _program(self, batch) -> Callable:
        """The step as run for batches shaped like ``batch``: rewritten where the stage's options ask."""
        [stage] = self.plan.stages
        if not (stage.sequence_parallel and stage.tp > 1) and not (stage.selective_recompute and not stage.recompute):
            return self.fn
        from integrations.flax._options import rewrite_step

        return rewrite_step(
            self.fn,
            self.abstract_state,
            jax.tree.map(lambda x: jax.ShapeDtypeStruct(jax.numpy.shape(x), x.dtype), batch),
            stage=stage,
            mesh=self.meshes[0],
            param_axes=self.param_axes,
            axis_rules=self.axis_rules,
        )

    def jitted(self, batch):
        """The ``jax.jit`` of the step for batches shaped like ``batch``."""
        shardings = batch_sharding(batch, self.meshes[0])
        key = str(jax.tree.map(lambda leaf, s: (tuple(leaf.shape), str(leaf.dtype), s.spec), batch, shardings))
        if key not in self._jitted:
            self._jitted[key] = jax.jit(
                self._program(batch),
                in_shardings=(self.state_shardings, shardings),
                out_shardings=(self.state_shardings, NamedSharding(self.meshes[0], P())),
                donate_argnums=(0,),
            )
        return self._jitted[key]

    def __call__(self, state, batch):
        return self.jitted(batch)(state, batch)

    def compiled(self, state, batch):
        """The compiled XLA executable for these (abstract or concrete) arguments."""
        return self.jitted(batch).lower(state, batch).compile()


def compile_step(
    plan,
    train_step: Callable,
    state,
    *,
    param_axes=None,
    layers=None,
    cluster=None,
    zero: bool = False,
    axis_rules=None,
    **pipeline,
):
    """A step function executing ``plan``.

    Args:
      plan: the plan.
      train_step: ``train_step(state, batch) -> (state, metrics)`` (a Flax TrainState step).
      state: the state as :func:`~integrations.flax.shard` placed it (or abstract, same structure).
      param_axes, layers, cluster, zero, axis_rules: as for :func:`~integrations.flax.shard`.
      **pipeline: for multi-stage plans, passed to :class:`~integrations.flax.Pipeline`
        (``observers``); single-stage plans ignore them.

    Returns:
      ``step(state, batch) -> (state, metrics)``.

    Example:
      >>> step = compile_step(plan, recipe.train_step, sharded)  # doctest: +SKIP
      >>> sharded, metrics = step(sharded, batch)  # doctest: +SKIP
    """
    mixed = [s for s, stage in enumerate(plan.stages) if stage.parts]
    if mixed:
        raise ValueError(
            f"stage {mixed[0]} of the plan spans two device types with uneven batch shares, which one SPMD "
            "program cannot run: plan with mixed_stages=False to execute it"
        )
    if plan.virtual_stages > 1 and (len(plan.stages) == 1 or any(stage.cp > 1 for stage in plan.stages)):
        raise ValueError(
            f"the plan interleaves {plan.virtual_stages} virtual stages on "
            f"{'one stage' if len(plan.stages) == 1 else 'context-parallel stages'}, which no executor runs: "
            "plan with virtual_stages=False (the default) to execute it"
        )
    if any(stage.cp > 1 for stage in plan.stages):  # the sequence split: ring attention (_context)
        from integrations.flax._context import ContextParallelStep

        return ContextParallelStep(
            plan, train_step, cluster=cluster, param_axes=param_axes, axis_rules=axis_rules, zero=zero
        )
    if len(plan.stages) > 1:
        from integrations.flax._pipeline import Pipeline

        if layers is None:
            raise ValueError("a multi-stage plan needs layers= (the coarsened layers its stages index)")
        return Pipeline(
            plan,
            train_step,
            state,
            layers=layers,
            param_axes=param_axes,
            cluster=cluster,
            axis_rules=axis_rules,
            **pipeline,
        )
    [stage] = plan.stages
    mesh = stage_mesh(stage, device_map(cluster))
    shardings = state_shardings(plan, state, param_axes=param_axes, cluster=cluster, zero=zero, axis_rules=axis_rules)
    return StepFunction(plan, train_step, [mesh], shardings, state=state, param_axes=param_axes, axis_rules=axis_rules)
