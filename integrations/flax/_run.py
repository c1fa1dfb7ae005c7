"""A training run that survives being killed, losing devices, and moving to another cluster.

:func:`train` takes the model as a step, an initial state and a batch function, and a run
directory::

    RUN_DIR/run.json   the RunConfig: total steps, checkpoint cadence, the cluster and its devices
                       out of service, the plan being executed, and the caller's metadata
    RUN_DIR/ckpt/<k>   orbax checkpoint of the state after step k (0-based; ``state.step == k + 1``)

Decisions:

* **Data is addressed by step**: ``batches(k)`` is the batch of step k, and must be a pure function
  of k, so a resumed or recovered run, which runs steps again from a checkpoint, sees every batch
  exactly once. An iterator could not be rewound to a checkpoint.
* **The model comes from the caller; run.json records what a resume needs**: the step, state and
  batches are arguments of every :func:`train` call, never stored; ``RunConfig.metadata`` holds
  whatever the caller needs to build them again (``orchestrator train`` stores its recipe, batch
  shape and seed there), and :func:`train` never reads it.
* **``state.step`` is the truth.** Checkpoint k holds the state after step k; resuming reads the
  latest one and continues at ``state.step`` (checked to be k + 1). With no checkpoint the run
  starts again from ``init_state``, a pure function too, so no checkpoint of step −1 is written.
  A checkpoint that does not read back (files cut short) is reported in one line, renamed
  ``<k>.unreadable``, and the previous kept one is restored; the steps after it run again.
* **Restoring reshards**: zeros shaped like the state are placed under the plan being executed
  (:func:`~integrations.flax.orchestrate`) and the checkpoint is read into their shardings, so
  parameters and optimizer state land on the new plan's meshes whatever plan wrote them.
* **Plans are kept unless they no longer fit**: :func:`train` executes the plan in run.json while
  all its devices are in service; otherwise (another cluster, fewer devices) it calls
  :func:`~orchestrator.planner.replan` with the old plan, and saves the new one.
* **Lost devices** are reported by raising :class:`DevicesLost` anywhere inside a step (the step
  function or a callback; :class:`LoseDevices` injects it). The step's result is discarded (its
  donated buffers may live on the lost devices), the devices are taken out of service, the old
  plan is re-planned on the rest, and the last checkpoint is restored into the new shardings.
  The steps after that checkpoint are run again on the new plan; each batch still enters the
  final state once.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from integrations.callbacks import Callback, Checkpointer

if TYPE_CHECKING:
    from orchestrator.planner import Plan

CONFIG_FILE = "run.json"
CHECKPOINT_DIR = "ckpt"


class DevicesLost(RuntimeError):
    """A step failed because devices left; ``devices`` holds their refs (``host/index``)."""

    def __init__(self, devices: Iterable[str]):
        self.devices = frozenset(devices)
        super().__init__(f"devices lost: {', '.join(sorted(self.devices))}")


class LoseDevices(Callback):
    """Fault injection: raises :class:`DevicesLost` at the end of step ``at_step``, once.

    Put it before the :class:`~integrations.callbacks.Checkpointer` (as :func:`train` does with its
    ``callbacks``), so the failing step's state is never saved: the step is lost as if a device
    had died while running it.
    """

    def __init__(self, devices: Iterable[str], *, at_step: int):
        self.devices, self.at_step, self.fired = frozenset(devices), at_step, False

    def on_step_end(self, step: int, metrics, *, state=None) -> None:
        if step == self.at_step and not self.fired:
            self.fired = True
            raise DevicesLost(self.devices)


@dataclass(frozen=True, slots=True, kw_only=True)
class RunConfig:
    """What a run is; saved as ``RUN_DIR/run.json``.

    Attributes:
      steps: total number of training steps of the run.
      checkpoint_every, keep: checkpoint after every ``checkpoint_every`` steps, keep the last ``keep``.
      cluster: cluster preset name, YAML path, or ``"local"``.
      cluster_size: devices of that cluster, in service or not (how many jax devices a resume asks for).
      unavailable: refs of the cluster's devices out of service.
      time_limit_s: planner time budget for (re-)plans.
      plan: the plan executed (None until the first plan is made).
      metadata: JSON the caller keeps with the run to build its step, state and batches again on
        resume (``orchestrator train`` keeps a :class:`recipes.RecipeRun` here); :func:`train`
        saves it and never reads it.
    """

    steps: int
    checkpoint_every: int = 10
    keep: int = 3
    cluster: str = "local"
    cluster_size: int = 0
    unavailable: tuple[str, ...] = ()
    time_limit_s: float = 10.0
    plan: Plan | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # run.json is a file people edit: every field is checked, so a bad one fails here in one line
        for name in ("steps", "checkpoint_every", "keep", "cluster_size"):
            value, least = getattr(self, name), 0 if name == "cluster_size" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"RunConfig.{name} must be a whole number >= {least}, got {value!r}")
        limit = self.time_limit_s
        if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not 0 < limit < math.inf:
            raise ValueError(f"RunConfig.time_limit_s must be a finite number > 0, got {limit!r}")
        if not isinstance(self.cluster, str) or not all(isinstance(ref, str) for ref in self.unavailable):
            raise ValueError("RunConfig.cluster and RunConfig.unavailable hold names (strings)")
        if not isinstance(self.metadata, Mapping):
            raise ValueError(f"RunConfig.metadata must be a JSON object, got {type(self.metadata).__name__}")

    def to_json(self) -> dict:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["unavailable"] = sorted(self.unavailable)
        data["plan"] = None if self.plan is None else self.plan.to_json()
        data["metadata"] = dict(self.metadata)
        return data

    @classmethod
    def from_json(cls, data: dict) -> RunConfig:
        from orchestrator.planner import Plan

        plan = data.get("plan")
        return cls(
            **{
                **data,
                "unavailable": tuple(data.get("unavailable", ())),
                "plan": None if plan is None else Plan.from_json(plan),
            }
        )

    def save(self, run_dir: str | Path) -> None:
        """Write ``run_dir/run.json`` atomically (a kill mid-write leaves the old file)."""
        path = Path(run_dir) / CONFIG_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=2))
        os.replace(tmp, path)

    @classmethod
    def load(cls, run_dir: str | Path) -> RunConfig:
        """Read ``run_dir/run.json``.

        Raises:
          FileNotFoundError: ``run_dir`` holds no run.
          ValueError: run.json is not a run configuration.
        """
        path = Path(run_dir) / CONFIG_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{run_dir} holds no run ({CONFIG_FILE} is missing)")
        try:
            return cls.from_json(json.loads(path.read_text()))
        except (TypeError, KeyError, ValueError, AttributeError) as error:  # ValueError: bad JSON, a bad plan
            raise ValueError(f"{path} is not a run configuration: {error}") from None

    def load_cluster(self):
        """The cluster with this run's devices out of service."""
        from orchestrator.cluster import load_cluster

        cluster = load_cluster(self.cluster)
        refs = {d.ref for d in cluster.all_devices()}
        return dataclasses.replace(cluster, unavailable=frozenset(self.unavailable) & refs)


@dataclass(frozen=True, slots=True, kw_only=True)
class Recovery:
    """One recovery from lost devices.

    Attributes:
      failed_step: the step that raised :class:`DevicesLost` (its result was discarded).
      restored_step: the checkpoint restored (−1: none yet, restarted from the initial state).
      lost: refs of the devices taken out of service.
      plan: the plan the run continued on.
      replan_s: time of :func:`~orchestrator.planner.replan`.
      restore_s: time to capture the step, place a state under the new plan and read the checkpoint into
        it (the new plan's step compiles at its first call, after this).
    """

    failed_step: int
    restored_step: int
    lost: tuple[str, ...]
    plan: Plan
    replan_s: float
    restore_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class RunResult:
    """What one :func:`train` call did.

    Attributes:
      state: the final (sharded) state.
      plan: the plan the run ended on.
      first_step: the step this call started at (0 for a fresh run, latest checkpoint + 1 on resume).
      steps: the run's total steps (``state.step`` at the end).
      loss: the last step's loss (None if no step ran).
      recoveries: device losses recovered from, in order.
      seconds: wall time of the call.
    """

    state: object
    plan: Plan
    first_step: int
    steps: int
    loss: float | None
    recoveries: tuple[Recovery, ...]
    seconds: float


def latest_checkpoint(run_dir: str | Path) -> int | None:
    """The step of the run's latest complete checkpoint (None if it has none)."""
    directory = Path(run_dir).absolute() / CHECKPOINT_DIR
    if not directory.is_dir():
        return None
    checkpoints = Checkpointer(directory)
    try:
        return checkpoints.latest_step()
    finally:
        checkpoints.close()


@dataclass(frozen=True, slots=True, kw_only=True)
class _Model:
    """What :func:`train` trains: the step, the initial state, the batches, their shape, the logical axes."""

    train_step: Callable
    init_state: Callable[[], Any]
    batches: Callable[[int], Any]
    batch_spec: Any  # shapes and dtypes of a batch
    global_batch: int
    param_axes: Mapping | None

    @classmethod
    def of(cls, train_step: Callable, init_state, batches: Callable[[int], Any], param_axes: Mapping | None):
        """The model of a :func:`train` call; its batch shape is step 0's.

        Raises:
          ValueError: the batch's leaves disagree on the leading (batch) dim.
        """
        from integrations.flax._orchestrate import global_batch_of

        spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batches(0))
        return cls(
            train_step=train_step,
            init_state=init_state if callable(init_state) else lambda: init_state,
            batches=batches,
            batch_spec=spec,
            global_batch=global_batch_of(spec),
            param_axes=param_axes,
        )

    def placeholder_state(self):
        """Zeros shaped like the state, as host arrays: a target that a checkpoint overwrites (nothing to compile).

        Shaped by ``init_state`` itself (``jax.eval_shape``), so a jitted init gives it the same static
        fields (``apply_fn``, ``tx``) as the initial state, and steps compiled for one serve the other.
        """
        abstract = jax.eval_shape(self.init_state)
        return jax.tree.map(lambda leaf: np.zeros(leaf.shape, leaf.dtype), abstract)


def plan_fits(plan, cluster, global_batch: int) -> bool:
    """Whether ``plan`` can run on ``cluster`` as it is: every device in service, of the type it names."""
    types = {d.ref: d.device_type for d in cluster.devices()}
    return plan.global_batch == global_batch and all(
        types.get(ref) == stage.device_type for stage in plan.stages for ref in stage.devices
    )


def _cost_model(model: _Model, cluster):
    """The cost model of the run's step on ``cluster`` (captured and, on ``local``, profiled)."""
    from integrations.flax._orchestrate import cost_model

    state = jax.eval_shape(model.init_state)
    return cost_model(model.train_step, state, model.batch_spec, cluster, param_axes=model.param_axes)


def _replan(previous, cost_model, config: RunConfig, global_batch: int, state):
    """A plan on ``cost_model``'s cluster: re-planned from ``previous``, or a first plan if there is none;
    one stage for a ``state`` whose update does not split by stage, as in :func:`orchestrate`."""
    from integrations.flax._stagewise import why_not_stagewise
    from orchestrator.planner import plan, replan

    options = dict(global_batch=global_batch, time_limit_s=config.time_limit_s, mixed_stages=False)
    if why_not_stagewise(state) is not None:
        options["max_stages"] = 1
    return plan(cost_model, **options) if previous is None else replan(previous, cost_model, **options)


def _restore(checkpoints: Checkpointer, placed, latest: int | None, say: Callable[[str], None]) -> tuple[object, int]:
    """(the newest readable checkpoint read into ``placed``'s shardings, the next step); ``placed`` and 0 if
    there is no checkpoint (``latest`` None).

    A checkpoint that does not read back is reported through ``say`` and the previous kept one is used.

    Raises:
      ValueError: no kept checkpoint reads back, or one's ``state.step`` is not its step number + 1.
    """
    if latest is None:
        return placed, 0
    found = checkpoints.restore_newest(placed, report=say)
    if found is None:
        raise ValueError(f"no checkpoint in {checkpoints.directory} reads back; start the run again in a new directory")
    state, step = found
    next_step = int(jax.device_get(state.step))
    if next_step != step + 1:
        raise ValueError(f"checkpoint {step} holds state.step {next_step}, expected {step + 1}")
    return state, next_step


def train(
    train_step: Callable,
    init_state,
    batches: Callable[[int], Any],
    *,
    run_dir: str | Path,
    param_axes: Mapping | None = None,
    callbacks: Iterable[Callback] = (),
    log: Callable[[str], None] | None = None,
) -> RunResult:
    """Train the run in ``run_dir`` up to ``config.steps``, resuming from its latest checkpoint.

    Create the run with :meth:`RunConfig.save` first (``plan=None`` plans on the first call), and
    call :func:`train` again with the same step, state and batches to resume it (a kill loses at most
    the steps after the last checkpoint). See the module docstring for how plans, checkpoints and
    lost devices are handled; any other error in a step propagates (the checkpoints on disk stay
    valid for a later resume).

    Args:
      train_step: ``train_step(state, batch) -> (state, metrics)``; metrics hold ``"loss"``.
      init_state: the state before step 0 (a Flax ``TrainState``), or a function of no arguments
        returning it; a function is only called when there is no checkpoint to restore (a jitted one
        avoids seconds of eager dispatch).
      batches: ``batches(step)``, the batch of step ``step`` at the global batch size; a pure
        function of ``step``, since steps after a checkpoint run again on resume and recovery.
      run_dir: the run directory (run.json, ckpt/).
      param_axes: logical axis names by parameter path (``integrations.flax.param_logical_axes``);
        enables tensor parallelism.
      callbacks: run around every step, before the checkpointer; raising :class:`DevicesLost`
        from one (or from the step) triggers a recovery.
      log: called with one line per event (start or resume, re-plan, recovery).

    Returns:
      A :class:`RunResult`.

    Raises:
      FileNotFoundError: no run.json in ``run_dir``.
      ValueError: the latest checkpoint is past ``config.steps``, does not hold its step, or no kept
        checkpoint reads back.
      orchestrator.planner.PlanInfeasible, PlanNotFound: no plan for the devices left.

    Example:
      >>> run = recipes.RecipeRun(recipe="gpt-tiny", global_batch=16, seq_len=16)  # doctest: +SKIP
      >>> RunConfig(steps=20, metadata=run.to_json()).save("/tmp/run")  # doctest: +SKIP
      >>> result = train(run.train_step, run.init_state, run.batch, run_dir="/tmp/run")  # doctest: +SKIP
      >>> int(result.state.step)  # doctest: +SKIP
      20
    """
    started = time.perf_counter()
    say = log or (lambda line: None)
    model = _Model.of(train_step, init_state, batches, param_axes)
    global_batch = model.global_batch
    run_dir = Path(run_dir).absolute()
    config = RunConfig.load(run_dir)
    cluster = config.load_cluster()
    config = dataclasses.replace(config, cluster_size=len(cluster.all_devices()))
    if config.plan is not None and not plan_fits(config.plan, cluster, global_batch):
        t0 = time.perf_counter()
        config = dataclasses.replace(
            config,
            plan=_replan(
                config.plan, _cost_model(model, cluster), config, global_batch, jax.eval_shape(model.init_state)
            ),
        )
        # replan's first note: what was lost, how the plan changed, the predicted step before and after
        why = next((f" {n.removeprefix('re-planned ')}" for n in config.plan.notes if n.startswith("re-planned")), "")
        say(f"re-planned for {_describe_cluster(cluster)} in {time.perf_counter() - t0:.2f} s{why}")
    config.save(run_dir)

    checkpoints = Checkpointer(run_dir / CHECKPOINT_DIR, every=config.checkpoint_every, keep=config.keep)
    recoveries: list[Recovery] = []
    first_step, metrics, lost = None, None, None
    try:
        while True:
            t0 = time.perf_counter()
            run, next_step = _place(model, config, cluster, [*callbacks, checkpoints], checkpoints, say)
            if config.plan is None:
                config = dataclasses.replace(config, plan=run.plan)
                config.save(run_dir)
            if lost is not None:
                recoveries.append(dataclasses.replace(lost, restore_s=time.perf_counter() - t0))
                say(
                    f"step {lost.failed_step} lost {len(lost.lost)} device(s); re-planned in {lost.replan_s:.2f} s "
                    f"onto {describe_plan(run.plan)}; restored checkpoint {lost.restored_step} "
                    f"in {recoveries[-1].restore_s:.2f} s"
                )
            else:
                resumed = f"resumed from checkpoint {next_step - 1} at step {next_step}" if next_step else "started"
                say(f"{resumed}: {describe_plan(run.plan)}")
            first_step = next_step if first_step is None else first_step
            try:
                for step in range(next_step, config.steps):
                    metrics = run.step(model.batches(step))
            except DevicesLost as error:
                cluster = dataclasses.replace(cluster, unavailable=cluster.unavailable | error.devices)
                config, lost = _recover(run, error, config, cluster, checkpoints, global_batch)
                config.save(run_dir)
                continue
            run.close()  # the final checkpoint, then wait for the writes
            break
    finally:
        checkpoints.close()
    return RunResult(
        state=run.state,
        plan=run.plan,
        first_step=first_step,
        steps=config.steps,
        loss=None if metrics is None else float(metrics["loss"]),
        recoveries=tuple(recoveries),
        seconds=time.perf_counter() - started,
    )


def _place(model: _Model, config: RunConfig, cluster, callbacks: list[Callback], checkpoints: Checkpointer, say):
    """(the step compiled and the state placed per ``config.plan`` — planned if None —, the next step).

    The state is the newest readable checkpoint read into the plan's shardings, or the initial state.
    """
    from integrations.flax._orchestrate import orchestrate

    checkpoints.wait()
    latest = checkpoints.latest_step()
    run = orchestrate(
        # with a checkpoint to restore, the placed values are overwritten: skip initialising them
        model.placeholder_state() if latest is not None else model.init_state(),
        model.train_step,
        cluster,
        batch=model.batch_spec,
        param_axes=model.param_axes,
        plan=config.plan,
        callbacks=callbacks,
        time_limit_s=config.time_limit_s,
    )
    run.state, next_step = _restore(checkpoints, run.state, latest, say)
    if next_step > config.steps:
        raise ValueError(f"the run is at step {next_step}, past its {config.steps} steps")
    run.steps_done = next_step  # callbacks (the checkpointer) see global step numbers
    return run, next_step


def _recover(run, error: DevicesLost, config: RunConfig, cluster, checkpoints: Checkpointer, global_batch: int):
    """(the config re-planned on ``cluster`` without the lost devices, the :class:`Recovery` so far)."""
    started = time.perf_counter()
    cost_model = run.cost_model.with_cluster(cluster)  # graph-derived tables are reused, not recomputed
    plan = _replan(run.plan, cost_model, config, global_batch, run.state)
    replan_s = time.perf_counter() - started
    checkpoints.wait()
    latest = checkpoints.latest_step()
    config = dataclasses.replace(config, unavailable=tuple(sorted(cluster.unavailable)), plan=plan)
    recovery = Recovery(
        failed_step=run.steps_done,  # not counted: the step raised before it ended
        restored_step=-1 if latest is None else latest,
        lost=tuple(sorted(error.devices)),
        plan=plan,
        replan_s=replan_s,
        restore_s=0.0,
    )
    return config, recovery


def _describe_cluster(cluster) -> str:
    return f"{cluster.name} ({len(cluster.devices())} of {len(cluster.all_devices())} devices in service)"


def describe_plan(plan) -> str:
    """One line: the stages as ``DP×TP``, how many devices, microbatches, the predicted step time if known."""
    stages = " | ".join(f"DP{s.dp}×TP{s.tp}" for s in plan.stages)
    devices = sum(len(s.devices) for s in plan.stages)
    line = f"{len(plan.stages)} stage(s) [{stages}] on {devices} devices, {plan.microbatches} microbatch(es)"
    return line + (f", predicted {plan.iteration_s * 1e3:.1f} ms/step" if plan.iteration_s > 0 else "")
