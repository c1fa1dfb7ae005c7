"""``orchestrator train`` and ``orchestrator resume``: checkpointed runs on the local devices.

``train`` creates RUN_DIR (run.json + orbax checkpoints) and trains; ``resume RUN_DIR`` continues
from the latest checkpoint, on the same plan or, with ``--cluster``/``--devices``/``--plan``, on
another one (parameters and optimizer state are resharded on restore). See
:func:`integrations.flax.train` for what a run directory holds.

The recipe is resolved here, the top layer: run.json's metadata holds the
:class:`recipes.RecipeRun` (recipe, batch shape, seed, learning rate), and every call of
``integrations.flax.train`` gets the step, the initial state and the batches built from it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from orchestrator.cli._common import fail

_FLAG = "--xla_force_host_platform_device_count"


def _ask_devices(default: int, need: int) -> None:
    """Start jax with ``default`` virtual CPU devices unless it is imported or XLA_FLAGS chooses; check ``need``."""
    if "jax" not in sys.modules and _FLAG not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}={default}".strip()
    import jax

    if len(jax.devices()) < need:
        fail(f"this needs {need} jax devices, found {len(jax.devices())}: set XLA_FLAGS={_FLAG}={need} before starting")


def _unavailable(cluster_name: str, devices: int | None) -> tuple[str, ...]:
    """Refs of the cluster's devices beyond the first ``devices`` (all in service if None)."""
    from orchestrator.cluster import ClusterError, load_cluster

    try:
        cluster = load_cluster(cluster_name)
    except ClusterError as error:
        fail(str(error))
    refs = [d.ref for d in cluster.all_devices()]
    if devices is not None and devices > len(refs):
        fail(f"--devices {devices}: cluster {cluster.name!r} has {len(refs)} devices")
    return tuple(refs[devices:]) if devices is not None else ()


def _load_plan(path: Path | None):
    if path is None:
        return None
    from orchestrator.planner import Plan

    try:
        return Plan.load(path)
    except FileNotFoundError:
        fail(f"{path}: no such file")
    except (json.JSONDecodeError, TypeError, KeyError) as error:
        fail(f"{path} is not a plan: {error}")


def _cluster_arg(cluster: str) -> str:
    """A YAML path made absolute (the run may resume from another directory); names unchanged."""
    path = Path(cluster)
    return str(path.absolute()) if path.suffix and path.exists() else cluster


def _run(run_dir: Path, config) -> None:
    """Train the run in ``run_dir`` (saved as ``config``), a spinner on stderr, a few lines on stdout."""
    from integrations.callbacks import Callback
    from integrations.flax import train
    from orchestrator.cluster import ClusterError
    from orchestrator.planner import PlanInfeasible, PlanNotFound
    from recipes import RecipeRun

    try:
        recipe = RecipeRun.from_json(config.metadata)
    except (KeyError, TypeError, ValueError) as error:
        fail(f"{run_dir / 'run.json'} holds no recipe run: {str(error).splitlines()[0]}")

    class Progress(Callback):
        def on_step_begin(self, step: int) -> None:
            status.update(f"step {step}")

    out = Console(soft_wrap=True)
    with Console(stderr=True).status("capturing and placing the step") as status:
        try:
            model = (recipe.train_step, recipe.init_state, recipe.batch)
            result = train(
                *model, run_dir=run_dir, param_axes=recipe.param_axes(), callbacks=[Progress()], log=out.print
            )
        except (ClusterError, PlanInfeasible, PlanNotFound, ValueError) as error:
            fail(str(error).splitlines()[0])
    ran = result.steps - result.first_step
    loss = "" if result.loss is None else f", loss {result.loss:.4f}"
    if ran:
        out.print(
            f"at step {result.steps}{loss}: ran steps {result.first_step}–{result.steps - 1} in {result.seconds:.1f} s"
        )
    else:
        out.print(f"already at step {result.steps}; resume with --steps N to train further")
    out.print(f"checkpoints in {run_dir / 'ckpt'}")


def train_command(
    run_dir: Annotated[Path, typer.Option("--run-dir", help="New directory for run.json and checkpoints.")],
    recipe: Annotated[str, typer.Option(help="Recipe to train.")] = "gpt-tiny",
    cluster: Annotated[str, typer.Option(help="Cluster to plan for; its devices must be jax's.")] = "local",
    devices: Annotated[int | None, typer.Option(min=1, help="Use only the cluster's first K devices.")] = None,
    steps: Annotated[int, typer.Option(min=1, help="Total training steps.")] = 100,
    batch: Annotated[int | None, typer.Option(min=1, help="Global batch (default: the recipe's).")] = None,
    seq: Annotated[int | None, typer.Option(min=1, help="Sequence length (default: the recipe's).")] = None,
    seed: Annotated[int, typer.Option(help="Seeds the initial state and every batch.")] = 0,
    checkpoint_every: Annotated[int, typer.Option(min=1, help="Checkpoint after every N steps.")] = 10,
    keep: Annotated[int, typer.Option(min=1, help="Checkpoints kept.")] = 3,
    plan: Annotated[Path | None, typer.Option(help="Execute this plan (JSON) instead of planning.")] = None,
    time_limit_s: Annotated[float, typer.Option(min=0.1, help="Planner time budget.")] = 10.0,
) -> None:
    """Plan and train a recipe with asynchronous orbax checkpoints; continue later with ``orchestrator resume``."""
    if (run_dir / "run.json").exists():
        fail(f"{run_dir} already holds a run; continue it with: orchestrator resume {run_dir}")
    _ask_devices(max(8, devices or 0), devices or 1)  # before anything imports jax
    from integrations.flax import RunConfig
    from recipes import RECIPES, RecipeRun

    if recipe not in RECIPES:
        fail(f"unknown recipe {recipe!r}; choose one of: {', '.join(RECIPES)}")

    spec = RECIPES[recipe]
    run = RecipeRun(recipe=recipe, global_batch=batch or spec.batch_size, seq_len=seq or spec.seq_len, seed=seed)
    config = RunConfig(
        steps=steps,
        checkpoint_every=checkpoint_every,
        keep=keep,
        cluster=_cluster_arg(cluster),
        unavailable=_unavailable(cluster, devices),
        time_limit_s=time_limit_s,
        plan=_load_plan(plan),
        metadata=run.to_json(),
    )
    config.save(run_dir)
    _run(run_dir, config)


def resume_command(
    run_dir: Annotated[Path, typer.Argument(help="Directory of a run started with orchestrator train.")],
    cluster: Annotated[
        str | None, typer.Option(help="Move the run to this cluster (re-plans if its plan no longer fits).")
    ] = None,
    devices: Annotated[
        int | None, typer.Option(min=1, help="Use only the cluster's first K devices (re-plans if needed).")
    ] = None,
    steps: Annotated[int | None, typer.Option(min=1, help="New total number of steps.")] = None,
    plan: Annotated[Path | None, typer.Option(help="Continue under this plan (JSON).")] = None,
    time_limit_s: Annotated[float | None, typer.Option(min=0.1, help="Planner time budget.")] = None,
) -> None:
    """Continue a run from its latest checkpoint, on its plan or (resharded) on another cluster or device count."""
    path = run_dir / "run.json"
    if not path.is_file():
        fail(f"{run_dir} holds no run ({path.name} is missing); start one with: orchestrator train --run-dir DIR")
    try:
        stored = json.loads(path.read_text())
        size = int(stored.get("cluster_size") or 0)
    except (json.JSONDecodeError, AttributeError, TypeError, ValueError) as error:
        fail(f"{path} is not a run configuration: {error}")
    _ask_devices(devices or size or 8, devices or 1)
    import dataclasses

    from integrations.flax import RunConfig, latest_checkpoint

    try:
        config = RunConfig.load(run_dir)
    except ValueError as error:
        fail(str(error))
    latest = latest_checkpoint(run_dir)
    if steps is not None and latest is not None and steps < latest + 1:
        fail(f"--steps {steps}: the run is already at step {latest + 1}")
    changes: dict = {}
    if cluster is not None or devices is not None:
        name = _cluster_arg(cluster) if cluster is not None else config.cluster
        changes.update(cluster=name, unavailable=_unavailable(name, devices))
    if steps is not None:
        changes["steps"] = steps
    if time_limit_s is not None:
        changes["time_limit_s"] = time_limit_s
    new_plan = _load_plan(plan)
    if new_plan is not None:
        changes["plan"] = new_plan
    try:
        config = dataclasses.replace(config, **changes)
    except ValueError as error:
        fail(str(error))
    config.save(run_dir)
    _run(run_dir, config)
