"""``orchestrate``: capture, cost, plan, shard and compile a Flax train step in one call.

    capture(train_step, state, batch) → coarsen → CostModel (layer times
    profiled on the local device when planning for ``local``) → plan →
    shard(state) → compile_step

The result keeps the placed state; the user's loop calls ``step(batch)`` and
reads the metrics it returns, and the callbacks (``integrations.callbacks``)
run around every step.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable, Iterable, Mapping

import jax

from integrations.callbacks import Callback, CallbackList
from integrations.flax._capture import capture
from integrations.flax._shard import device_map, shard
from integrations.flax._stagewise import why_not_stagewise
from integrations.flax._step import compile_step


class OrchestratedTrainState:
    """A train state placed and compiled per a plan.

    Attributes:
      state: the current (sharded) state.
      plan: the plan being executed.
      graph, layers, cost_model: what the plan was made from.
      step_fn: ``step_fn(state, batch) -> (state, metrics)`` (pure; ``step`` wraps it).
      callbacks: run around each ``step``.
      steps_done: number of steps run.
      train_step, param_axes, cluster, zero, axis_rules: what ``step_fn`` was compiled from (``switch``
        compiles again).
      pipeline_options: keyword arguments for the pipeline executor of every multi-stage plan this
        run compiles, now and after a ``switch`` (``observers``: see ``Pipeline``).
    """

    def __init__(
        self,
        *,
        state,
        plan,
        graph,
        layers,
        cost_model,
        step_fn,
        callbacks: CallbackList,
        train_step: Callable | None = None,
        param_axes: Mapping | None = None,
        cluster=None,
        zero: bool = False,
        pipeline_options: Mapping | None = None,
        axis_rules=None,
    ):
        self.state, self.plan = state, plan
        self.axis_rules = axis_rules
        self.graph, self.layers, self.cost_model = graph, layers, cost_model
        self.step_fn, self.callbacks = step_fn, callbacks
        self.train_step, self.param_axes, self.cluster, self.zero = train_step, param_axes, cluster, zero
        self.pipeline_options = dict(pipeline_options or {})
        self.steps_done = 0
        self._begun = False

    def step(self, batch) -> Mapping:
        """Run one training step on ``batch`` under the plan; returns the step's metrics."""
        if not self._begun:
            self.callbacks.on_train_begin(state=self.state, plan=self.plan)
            self._begun = True
        self.callbacks.on_step_begin(self.steps_done)
        self.state, metrics = self.step_fn(self.state, batch)
        self.callbacks.on_step_end(self.steps_done, metrics, state=self.state)
        self.steps_done += 1
        return metrics

    __call__ = step

    def switch(self, plan, *, cluster=None, cost_model=None) -> float:
        """Execute ``plan`` from the next step on, continuing from the current state.

        The state is resharded onto the new plan's devices (parameters and optimizer state
        move; nothing is reset) and its step is built; XLA compiles it in the next step.

        Args:
          plan: the new plan.
          cluster: the cluster its device refs name (default: this run's).
          cost_model: the cost model it was made with (kept as ``cost_model``).

        Returns:
          Seconds the reshard took.
        """
        if self.train_step is None:
            raise ValueError("this run was built without its train_step; build it with orchestrate() to switch plans")
        cluster = cluster if cluster is not None else self.cluster
        started = time.perf_counter()
        placed = shard(
            plan, self.state, param_axes=self.param_axes, layers=self.layers, cluster=cluster, zero=self.zero,
            axis_rules=self.axis_rules,
        )  # fmt: skip
        placed = jax.block_until_ready(placed)
        seconds = time.perf_counter() - started
        self.step_fn = compile_step(
            plan, self.train_step, placed, param_axes=self.param_axes, layers=self.layers, cluster=cluster,
            zero=self.zero, axis_rules=self.axis_rules, **self.pipeline_options,
        )  # fmt: skip
        self.state, self.plan, self.cluster = placed, plan, cluster
        if cost_model is not None:
            self.cost_model = cost_model
        return seconds

    def close(self) -> None:
        """Signal the end of training to the callbacks (final checkpoint, ...)."""
        if self._begun:
            self.callbacks.on_train_end(state=self.state)


def _conductor(train_step: Callable, policy) -> Callable:
    """``train_step`` with the conductor's kernel rewrites (imported here, so plain runs never load it)."""
    import conductor

    return conductor.optimize(train_step, policy=None if policy is True else policy)


def global_batch_of(batch) -> int:
    """The leading (batch) dim that every leaf of ``batch`` shares.

    Raises:
      ValueError: the leaves disagree.
    """
    sizes = {x.shape[0] for x in jax.tree.leaves(batch)}
    if len(sizes) != 1:
        raise ValueError(f"every batch leaf needs the same leading (batch) dim, got {sorted(sizes)}")
    return sizes.pop()


def cost_model(
    train_step: Callable,
    state,
    batch,
    cluster,
    *,
    param_axes: Mapping | None = None,
    profile: bool = True,
    axis_rules=None,
):
    """The :class:`~orchestrator.costs.CostModel` of ``train_step`` on ``cluster``: captured, coarsened and,
    when planning for ``local`` with ``profile``, priced by layer times measured on the local device.

    ``state`` and ``batch`` may be arrays or ``jax.ShapeDtypeStruct``; the batch is the global one.
    """
    from orchestrator.coarsen import coarsen
    from orchestrator.costs import CostModel

    spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    graph = capture(train_step, abstract, spec)
    layers = coarsen(graph)
    global_batch = global_batch_of(spec)
    measured = None
    if profile and cluster.name == "local":
        from integrations.flax._profile import profile_layers

        measured = profile_layers(train_step, abstract, spec, graph=graph, layers=layers)
    return CostModel(
        graph, layers, cluster, batch_size=global_batch, param_axes=param_axes, measured=measured, axis_rules=axis_rules
    )


def _as_arrays(state):
    """``state`` with its Python scalars as jax arrays (the leaves a jitted step returns as arrays)."""
    return jax.tree.map(lambda x: jax.numpy.asarray(x) if isinstance(x, int | float | bool) else x, state)


def orchestrate(
    state,
    train_step: Callable,
    cluster="local",
    *,
    batch,
    param_axes: Mapping | None = None,
    plan=None,
    callbacks: Iterable[Callback] = (),
    conductor=False,
    profile: bool = True,
    max_stages: int | None = None,
    time_limit_s: float = 10.0,
    zero: bool = False,
    pipeline_options: Mapping | None = None,
    axis_rules=None,
) -> OrchestratedTrainState:
    """Capture, plan, shard and compile ``train_step`` for ``cluster``.

    Args:
      state: the Flax ``TrainState``; Python scalars in it (``TrainState.create`` leaves ``step`` an
        int) become arrays, since a jitted step returns them as arrays.
      train_step: ``train_step(state, batch) -> (state, metrics)``; metrics hold ``"loss"`` (needed by pipelines).
      cluster: a :class:`~orchestrator.cluster.Cluster` or a preset name; execution needs its devices to be
        jax's devices (``"local"``).
      batch: an example batch (arrays or ``jax.ShapeDtypeStruct``), at the global batch size.
      param_axes: logical axis names by parameter path (:func:`~integrations.flax.param_logical_axes`
        of the model's boxed parameters); enables tensor parallelism.
      plan: execute this plan instead of planning.
      callbacks: run around every step.
      conductor: rewrite the step with :mod:`conductor` kernels first (``conductor.optimize``): True for
        the default policy, or a ``conductor.Policy``.
      profile: time the layers on the local device and use those times (``local`` cluster only).
      max_stages, time_limit_s: passed to :func:`orchestrator.planner.plan`. A state whose update does not
        split by pipeline stage (no ``apply_gradients``, as :func:`~integrations.flax.from_nnx` states; an
        optimizer across parameters, as ``optax.clip_by_global_norm``) is planned on one stage, and so is a
        step whose plan splits the sequence over several stages (context-parallel stages run on one
        stage only); the plan's notes say why.
      zero: plan with ZeRO-1 and shard optimizer moments over data-parallel replicas.
      pipeline_options: keyword arguments for the pipeline executor of multi-stage plans
        (``observers``), kept for plans the run switches to.
      axis_rules: ``(logical axis name, mesh axis or None)`` pairs saying which parameter dims tensor
        parallelism splits, used alike to price the plan and to place the state
        (:data:`orchestrator.costs.DEFAULT_LOGICAL_AXIS_RULES` if None).

    Returns:
      An :class:`OrchestratedTrainState`; call ``.step(batch)`` in the loop.

    Example:
      >>> axes = param_logical_axes(jax.eval_shape(model.init, key, tokens)["params"])  # doctest: +SKIP
      >>> run = orchestrate(state, train_step, "local", batch=batch, param_axes=axes)  # doctest: +SKIP
      >>> metrics = run.step(batch)  # doctest: +SKIP
    """
    from orchestrator.cluster import load_cluster

    if callable(state) and not callable(train_step):
        raise TypeError("orchestrate(state, train_step, cluster, batch=...) takes the state first, then the step")
    if isinstance(cluster, str):
        cluster = load_cluster(cluster)
    device_map(cluster)  # a cluster jax cannot run fails here, before the capture and the plan
    if cluster.name == "local" and len(jax.devices()) == 1 and jax.devices()[0].platform == "cpu":
        warnings.warn(
            "planning for 1 local CPU device; for N virtual devices set "
            "XLA_FLAGS=--xla_force_host_platform_device_count=N before jax starts",
            stacklevel=2,
        )
    if conductor:
        train_step = _conductor(train_step, conductor)
    state = _as_arrays(state)
    # a state whose update does not split by stage (an nnx state, a global-norm clip) is planned on one stage
    one_stage = why_not_stagewise(state)
    if plan is not None and len(plan.stages) > 1 and one_stage is not None:
        raise ValueError(f"this plan has {len(plan.stages)} stages, and the step runs on one stage only: {one_stage}")
    model = cost_model(train_step, state, batch, cluster, param_axes=param_axes, profile=profile, axis_rules=axis_rules)
    graph, layers, global_batch = model.graph, model.layers, model.batch_size
    if plan is None:
        from orchestrator.planner import plan as make_plan

        plan = make_plan(  # one device type per stage: what one SPMD program per stage can run
            model,
            global_batch=global_batch,
            max_stages=1 if one_stage is not None else max_stages,
            time_limit_s=time_limit_s,
            zero=zero,
            mixed_stages=False,
        )
        if one_stage is None and len(plan.stages) > 1 and any(stage.cp > 1 for stage in plan.stages):
            # the context-parallel step runs one stage; a pipeline of context-parallel stages is not run
            one_stage = "the sequence is split (context parallelism), which runs on one stage"
            plan = make_plan(
                model,
                global_batch=global_batch,
                max_stages=1,
                time_limit_s=time_limit_s,
                zero=zero,
                mixed_stages=False,
            )
        if one_stage is not None:
            plan = dataclasses.replace(plan, notes=(f"one stage: {one_stage}", *plan.notes))
    placed = shard(plan, state, param_axes=param_axes, layers=layers, cluster=cluster, zero=zero, axis_rules=axis_rules)
    options = dict(pipeline_options or {})
    step_fn = compile_step(
        plan, train_step, placed, param_axes=param_axes, layers=layers, cluster=cluster, zero=zero,
        axis_rules=axis_rules, **options,
    )  # fmt: skip
    return OrchestratedTrainState(
        state=placed,
        plan=plan,
        graph=graph,
        layers=layers,
        cost_model=model,
        step_fn=step_fn,
        callbacks=CallbackList(callbacks),
        train_step=train_step,
        param_axes=param_axes,
        cluster=cluster,
        zero=zero,
        pipeline_options=options,
        axis_rules=axis_rules,
    )
