"""A training run that survives being killed, losing devices, and moving to another cluster.

A run lives in a directory::

    RUN_DIR/run.json   the RunConfig: recipe, batch, seed, total steps, checkpoint cadence,
                       cluster and the devices out of service, and the plan being executed
    RUN_DIR/ckpt/<k>   orbax checkpoint of the state after step k (0-based; ``state.step == k + 1``)

Decisions:

* **Data order is a pure function of (seed, step)**: the batch of step k is
  ``synthetic_batch(fold_in(data_key, k), ...)`` with ``data_key`` split from ``key(seed)``
  (:func:`batch_for_step`), so a resumed or recovered run sees every batch exactly once.
* **``state.step`` is the truth.** Checkpoint k holds the state after step k; resuming reads the
  latest one and continues at ``state.step`` (checked to be k + 1). With no checkpoint the run
  starts again from the initial state, which is a pure function of the seed too, so no
  checkpoint of step −1 is written.
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
import functools
import json
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

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
      recipe: recipe name (:func:`recipes.get_recipe`).
      steps: total number of training steps of the run.
      global_batch, seq_len: batch shape of every step.
      seed: the initial state and every batch derive from it.
      learning_rate: AdamW's.
      checkpoint_every, keep: checkpoint after every ``checkpoint_every`` steps, keep the last ``keep``.
      cluster: cluster preset name, YAML path, or ``"local"``.
      cluster_size: devices of that cluster, in service or not (how many jax devices a resume asks for).
      unavailable: refs of the cluster's devices out of service.
      time_limit_s: planner time budget for (re-)plans.
      plan: the plan executed (None until the first plan is made).
    """

    recipe: str
    steps: int
    global_batch: int
    seq_len: int
    seed: int = 0
    learning_rate: float = 3e-4
    checkpoint_every: int = 10
    keep: int = 3
    cluster: str = "local"
    cluster_size: int = 0
    unavailable: tuple[str, ...] = ()
    time_limit_s: float = 10.0
    plan: Plan | None = None

    def __post_init__(self) -> None:
        for name in ("steps", "global_batch", "seq_len", "checkpoint_every", "keep"):
            if getattr(self, name) < 1:
                raise ValueError(f"RunConfig.{name} must be >= 1, got {getattr(self, name)}")

    def to_json(self) -> dict:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["unavailable"] = sorted(self.unavailable)
        data["plan"] = None if self.plan is None else self.plan.to_json()
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
        except (json.JSONDecodeError, TypeError, KeyError) as error:
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
        return checkpoints.manager.latest_step()
    finally:
        checkpoints.close()


def batch_for_step(config: RunConfig, step: int) -> dict:
    """The batch of step ``step``: a pure function of ``(config.seed, step)`` and the batch shape."""
    from recipes import get_recipe

    vocab = get_recipe(config.recipe).config.vocab_size
    return _batch(config.seed, step, config.global_batch, config.seq_len, vocab)


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _batch(seed, step, batch_size: int, seq_len: int, vocab_size: int) -> dict:
    # one dispatch per step: the key derivation runs eagerly op by op otherwise
    from recipes import synthetic_batch

    data_key = jax.random.split(jax.random.key(seed))[1]
    return synthetic_batch(jax.random.fold_in(data_key, step), batch_size, seq_len, vocab_size)


def initial_state(config: RunConfig):
    """The state before step 0 (on the default device): a pure function of ``config.seed``."""
    init_key = jax.random.split(jax.random.key(config.seed))[0]
    return _jitted_init(config.recipe, config.learning_rate)(init_key)


@functools.cache
def _jitted_init(recipe_name: str, learning_rate: float):
    """The recipe's ``create_state`` under ``jax.jit`` (eager init costs seconds of dispatch), once per process."""
    from recipes import get_recipe

    recipe = get_recipe(recipe_name)
    return jax.jit(lambda key: recipe.create_state(key, learning_rate=learning_rate))


def _placeholder_state(config: RunConfig):
    """Zeros shaped like the state, as host arrays: a target that a checkpoint overwrites (nothing to compile).

    Shaped by the same jitted init as :func:`initial_state`, so its static fields (``apply_fn``, ``tx``)
    are the same objects and steps compiled for one state are reused for the other.
    """
    init = _jitted_init(config.recipe, config.learning_rate)
    abstract = jax.eval_shape(init, jax.random.key(config.seed))
    return jax.tree.map(lambda leaf: np.zeros(leaf.shape, leaf.dtype), abstract)


def plan_fits(plan, cluster, global_batch: int) -> bool:
    """Whether ``plan`` can run on ``cluster`` as it is: every device in service, of the type it names."""
    types = {d.ref: d.device_type for d in cluster.devices()}
    return plan.global_batch == global_batch and all(
        types.get(ref) == stage.device_type for stage in plan.stages for ref in stage.devices
    )


@functools.cache
def _param_axes(recipe_name: str):
    """The recipe's logical axes (tensor parallelism) for GPTs; None for the others. Cached: it traces the init."""
    from recipes import get_recipe

    recipe = get_recipe(recipe_name)
    return recipe.param_axes() if recipe.family == "gpt" else None


def _cost_model(config: RunConfig, cluster, *, graph=None, layers=None, measured=None):
    """The cost model of the run's step on ``cluster`` (captured and, on ``local``, profiled unless given)."""
    from integrations.flax._capture import capture
    from orchestrator.coarsen import coarsen
    from orchestrator.costs import CostModel
    from recipes import get_recipe

    recipe = get_recipe(config.recipe)
    if graph is None:
        state = recipe.abstract_state(learning_rate=config.learning_rate)
        spec = recipe.batch_spec(config.global_batch, config.seq_len)
        graph = capture(recipe.train_step, state, spec)
        layers = coarsen(graph)
        if cluster.name == "local":
            from integrations.flax._profile import profile_layers

            measured = profile_layers(recipe.train_step, state, spec, graph=graph, layers=layers)
    return CostModel(
        graph, layers, cluster, batch_size=config.global_batch, param_axes=_param_axes(config.recipe), measured=measured
    )


def _replan(previous, model, config: RunConfig):
    """A plan on ``model``'s cluster: re-planned from ``previous``, or a first plan if there is none."""
    from orchestrator.planner import plan, replan

    if previous is None:
        return plan(model, global_batch=config.global_batch, time_limit_s=config.time_limit_s, mixed_stages=False)
    return replan(
        previous, model, global_batch=config.global_batch, time_limit_s=config.time_limit_s, mixed_stages=False
    )


def _restore(checkpoints: Checkpointer, placed, latest: int | None) -> tuple[object, int]:
    """(checkpoint ``latest`` read into ``placed``'s shardings, the next step); ``placed`` and 0 if None.

    Raises:
      ValueError: the checkpoint's ``state.step`` is not its step number + 1.
    """
    if latest is None:
        return placed, 0
    state = checkpoints.restore(placed, step=latest)
    next_step = int(jax.device_get(state.step))
    if next_step != latest + 1:
        raise ValueError(f"checkpoint {latest} holds state.step {next_step}, expected {latest + 1}")
    return state, next_step


def train(
    run_dir: str | Path,
    *,
    callbacks: Iterable[Callback] = (),
    log: Callable[[str], None] | None = None,
) -> RunResult:
    """Train the run in ``run_dir`` up to ``config.steps``, resuming from its latest checkpoint.

    Create the run with :meth:`RunConfig.save` first (``plan=None`` plans on the first call).
    See the module docstring for how plans, checkpoints and lost devices are handled; any other
    error in a step propagates (the checkpoints on disk stay valid for a later resume).

    Args:
      run_dir: the run directory (run.json, ckpt/).
      callbacks: run around every step, before the checkpointer; raising :class:`DevicesLost`
        from one (or from the step) triggers a recovery.
      log: called with one line per event (start or resume, re-plan, recovery).

    Returns:
      A :class:`RunResult`.

    Raises:
      FileNotFoundError: no run.json in ``run_dir``.
      ValueError: the latest checkpoint is past ``config.steps``, or does not hold its step.
      orchestrator.planner.PlanInfeasible, PlanNotFound: no plan for the devices left.

    Example:
      >>> RunConfig(recipe="gpt-tiny", steps=20, global_batch=16, seq_len=16).save("/tmp/run")  # doctest: +SKIP
      >>> result = train("/tmp/run")  # doctest: +SKIP
      >>> int(result.state.step)  # doctest: +SKIP
      20
    """
    started = time.perf_counter()
    say = log or (lambda line: None)
    run_dir = Path(run_dir).absolute()
    config = RunConfig.load(run_dir)
    cluster = config.load_cluster()
    config = dataclasses.replace(config, cluster_size=len(cluster.all_devices()))
    if config.plan is not None and not plan_fits(config.plan, cluster, config.global_batch):
        t0 = time.perf_counter()
        config = dataclasses.replace(config, plan=_replan(config.plan, _cost_model(config, cluster), config))
        say(f"re-planned for {_describe_cluster(cluster)} in {time.perf_counter() - t0:.2f} s")
    config.save(run_dir)

    checkpoints = Checkpointer(run_dir / CHECKPOINT_DIR, every=config.checkpoint_every, keep=config.keep)
    recoveries: list[Recovery] = []
    first_step, metrics, lost = None, None, None
    try:
        while True:
            t0 = time.perf_counter()
            run, next_step = _place(config, cluster, [*callbacks, checkpoints], checkpoints)
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
                    metrics = run.step(batch_for_step(config, step))
            except DevicesLost as error:
                cluster = dataclasses.replace(cluster, unavailable=cluster.unavailable | error.devices)
                config, lost = _recover(run, error, config, cluster, checkpoints)
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


def _place(config: RunConfig, cluster, callbacks: list[Callback], checkpoints: Checkpointer):
    """(the step compiled and the state placed per ``config.plan`` — planned if None —, the next step).

    The state is the latest checkpoint read into the plan's shardings, or the initial state.
    """
    from integrations.flax._orchestrate import orchestrate
    from recipes import get_recipe

    recipe = get_recipe(config.recipe)
    checkpoints.wait()
    latest = checkpoints.manager.latest_step()
    run = orchestrate(
        # with a checkpoint to restore, the placed values are overwritten: skip initialising them
        _placeholder_state(config) if latest is not None else initial_state(config),
        recipe.train_step,
        cluster,
        batch=recipe.batch_spec(config.global_batch, config.seq_len),
        param_axes=_param_axes(config.recipe),
        plan=config.plan,
        callbacks=callbacks,
        time_limit_s=config.time_limit_s,
    )
    run.state, next_step = _restore(checkpoints, run.state, latest)
    if next_step > config.steps:
        raise ValueError(f"the run is at step {next_step}, past its {config.steps} steps")
    run.steps_done = next_step  # callbacks (the checkpointer) see global step numbers
    return run, next_step


def _recover(run, error: DevicesLost, config: RunConfig, cluster, checkpoints: Checkpointer):
    """(the config re-planned on ``cluster`` without the lost devices, the :class:`Recovery` so far)."""
    started = time.perf_counter()
    model = run.cost_model.with_cluster(cluster)  # graph-derived tables are reused, not recomputed
    plan = _replan(run.plan, model, config)
    replan_s = time.perf_counter() - started
    checkpoints.wait()
    latest = checkpoints.manager.latest_step()
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
