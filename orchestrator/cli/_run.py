"""``orchestrator train`` and ``orchestrator resume``: checkpointed runs on the local devices.

``train`` creates RUN_DIR (run.json + orbax checkpoints) and trains; ``resume RUN_DIR`` continues
from the latest checkpoint, on the same plan or, with ``--cluster``/``--devices``/``--plan``, on
another one (parameters and optimizer state are resharded on restore). See
:func:`integrations.flax.train` for what a run directory holds.

Runs are transactional: ``train`` checks everything it can (recipe, shape, cluster, the devices
present, a ``--plan`` against the model, cluster and devices) before it writes RUN_DIR, and takes
run.json away again if the run fails before its first checkpoint, so a corrected retry starts
cleanly. Devices are never made up: a run uses the jax devices there are (8 virtual CPU devices
unless ``XLA_FLAGS`` chooses), and asking for more is refused.

The recipe is resolved here, the top layer: run.json's metadata holds the
:class:`recipes.RecipeRun` (recipe, batch shape, seed, learning rate), and every call of
``integrations.flax.train`` gets the step, the initial state and the batches built from it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from orchestrator.cli._common import (
    MAX_GLOBAL_BATCH,
    MAX_SEQ,
    MAX_TIME_LIMIT_S,
    cluster_or_fail,
    fail,
    plan_or_fail,
    recipe_or_fail,
    seq_or_fail,
)
from orchestrator.cli._progress import Progress, show_steps
from orchestrator.cli._user_model import UserModelOption, trainable_or_fail, user_model_or_fail

_FLAG = "--xla_force_host_platform_device_count"
_MAX_VIRTUAL = 512  # virtual CPU devices a resume asks for on its own


def _ask_devices(default: int, need: int) -> int:
    """Start jax with ``default`` virtual CPU devices unless it is imported or XLA_FLAGS chooses; check ``need``.

    Returns:
      how many jax devices there are.
    """
    if "jax" not in sys.modules and _FLAG not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}={default}".strip()
    import jax

    present = len(jax.devices())
    if present < need:
        fail(
            f"--devices {need}: there are {present} jax devices here "
            f"(to simulate more on the CPU, start with XLA_FLAGS={_FLAG}={need})"
        )
    return present


def _unavailable(cluster, devices: int | None) -> tuple[str, ...]:
    """Refs of ``cluster``'s devices beyond the first ``devices`` (all in service if None)."""
    refs = [d.ref for d in cluster.all_devices()]
    if devices is not None and devices > len(refs):
        fail(f"--devices {devices}: cluster {cluster.name!r} has {len(refs)} devices")
    return tuple(refs[devices:]) if devices is not None else ()


def _cluster_on_jax(cluster, present: int):
    """``cluster`` if jax has one device for each of its devices (the ``local`` cluster always does)."""
    count = len(cluster.all_devices())
    if count != present:
        fail(
            f"cluster {cluster.name!r} has {count} devices and there are {present} jax devices here; "
            f"use --cluster local, or start with XLA_FLAGS={_FLAG}={count} to play its devices on the CPU"
        )
    return cluster


def _plan_mismatch(plan, cluster, *, recipe: str, seq: int, global_batch: int, model: str | None = None) -> str | None:
    """Why ``plan`` cannot run this run as it is (another model, cluster or devices), or None if it can.

    ``model`` is the ``--model`` spec of a run of the user's own step (then ``recipe`` and ``seq`` are unused).
    """
    from orchestrator.cluster import ClusterError, parse_cluster

    source = plan.source
    runs = f"the model {model!r}" if model is not None else f"the recipe {recipe!r}"
    if "model" in source and source["model"] != model:
        return f"it was made for the model {source['model']!r}, and this run trains {runs}"
    if isinstance(source.get("recipe"), str) and (model is not None or source["recipe"] != recipe):
        return f"it was made for recipe {source['recipe']!r}, and this run trains {runs if model else repr(recipe)}"
    if model is None and isinstance(source.get("seq"), int) and source["seq"] != seq:
        return f"it was made for sequence length {source['seq']}, and this run's is {seq}"
    if plan.global_batch != global_batch:
        return f"it plans a global batch of {plan.global_batch}, and this run's is {global_batch} (--batch)"
    if "cluster_spec" in source:
        try:
            made_for = parse_cluster(source["cluster_spec"], "its cluster")
        except ClusterError as error:
            return str(error)
        kinds = [(d.ref, d.device_type) for d in made_for.all_devices()]
        if made_for.name != cluster.name or kinds != [(d.ref, d.device_type) for d in cluster.all_devices()]:
            return (
                f"it was made for cluster {made_for.name!r} ({len(kinds)} devices), "
                f"and this run is on {cluster.name!r} ({len(cluster.all_devices())} devices)"
            )
    in_service = {d.ref: d.device_type for d in cluster.devices()}
    for i, stage in enumerate(plan.stages):
        for ref in stage.devices:
            if ref not in in_service:
                return f"stage {i} uses device {ref!r}, which is not in service on {cluster.name!r}"
            if in_service[ref] not in stage.device_type.split("+"):
                return f"stage {i} wants {stage.device_type} devices, and {ref} is a {in_service[ref]}"
    return None


def _load_plan(path: Path | None):
    if path is None:
        return None
    return plan_or_fail(path)


def _cluster_arg(cluster: str) -> str:
    """A YAML path made absolute (the run may resume from another directory); names unchanged."""
    path = Path(cluster)
    return str(path.absolute()) if path.suffix and path.exists() else cluster


def _run(run_dir: Path, config) -> None:
    """Train the run in ``run_dir`` (saved as ``config``): its progress on stderr (each step's loss, measured
    and predicted time), a few lines on stdout."""
    from integrations.flax import train
    from orchestrator.cluster import ClusterError
    from orchestrator.planner import PlanInfeasible, PlanNotFound
    from recipes import RecipeRun

    own = config.metadata.get("model")
    if isinstance(own, str):  # orchestrator train --model: the factory is imported again (from this directory)
        user = trainable_or_fail(user_model_or_fail(own))
        model = (user.train_step, user.initial_state, lambda step: user.example_batch)
        param_axes = None
    else:
        try:
            recipe = RecipeRun.from_json(config.metadata)
        except (KeyError, TypeError, ValueError) as error:
            fail(f"{run_dir / 'run.json'} holds no recipe run: {str(error).splitlines()[0]}")
        model, param_axes = (recipe.train_step, recipe.init_state, recipe.batch), recipe.param_axes()

    out = Console(soft_wrap=True)
    with Progress("capturing and placing the step") as shown:
        steps = show_steps(shown, config.steps)
        try:
            result = train(*model, run_dir=run_dir, param_axes=param_axes, callbacks=[steps], log=out.print)
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
    ctx: typer.Context,
    run_dir: Annotated[Path, typer.Option("--run-dir", help="New directory for run.json and checkpoints.")],
    recipe: Annotated[str | None, typer.Option(help="Recipe to train (default: the --plan's, else gpt-tiny).")] = None,
    user_model: UserModelOption = None,
    cluster: Annotated[
        str | None,
        typer.Option(help="Cluster to plan for; its devices must be jax's (default: the --plan's, else local)."),
    ] = None,
    devices: Annotated[int | None, typer.Option(min=1, help="Use only the cluster's first K devices.")] = None,
    steps: Annotated[int, typer.Option(min=1, help="Total training steps.")] = 100,
    batch: Annotated[
        int | None,
        typer.Option(min=1, max=MAX_GLOBAL_BATCH, help="Global batch (default: the --plan's, else the recipe's)."),
    ] = None,
    seq: Annotated[
        int | None,
        typer.Option(min=1, max=MAX_SEQ, help="Sequence length (default: the --plan's, else the recipe's)."),
    ] = None,
    seed: Annotated[int, typer.Option(help="Seeds the initial state and every batch.")] = 0,
    checkpoint_every: Annotated[int, typer.Option(min=1, help="Checkpoint after every N steps.")] = 10,
    keep: Annotated[int, typer.Option(min=1, help="Checkpoints kept.")] = 3,
    plan: Annotated[Path | None, typer.Option(help="Execute this plan (JSON) instead of planning.")] = None,
    time_limit_s: Annotated[float, typer.Option(min=0.1, max=MAX_TIME_LIMIT_S, help="Planner time budget.")] = 10.0,
) -> None:
    """Plan and train a recipe (or your --model's step, on its batch every step) with asynchronous orbax
    checkpoints; continue later with ``orchestrator resume``."""
    if (run_dir / "run.json").exists():
        fail(f"{run_dir} already holds a run; continue it with: orchestrator resume {run_dir}")
    if run_dir.exists() and not run_dir.is_dir():
        fail(f"{run_dir} is a file; --run-dir takes a directory")
    present = _ask_devices(8, devices or 1)  # before anything imports jax
    from integrations.flax import RunConfig
    from recipes import RecipeRun

    loaded = _load_plan(plan)
    # what the command line leaves out comes from the plan (it names its recipe and shape and embeds its
    # cluster), so `train --plan FILE` runs what `orchestrator plan` planned, from any directory
    made_for = _plan_defaults(loaded, plan)
    user_model = user_model or (made_for.get("model") if recipe is None else None)
    if user_model is not None:  # the factory's batch sets the shapes; the recipe's options do not apply
        own = trainable_or_fail(user_model_or_fail(user_model, ctx, recipe_options=("recipe", "batch", "seq", "seed")))
        global_batch = own.batch_size
    else:
        recipe = recipe or made_for.get("recipe") or "gpt-tiny"
        spec = recipe_or_fail(recipe)
        seq = seq_or_fail(spec, seq or made_for.get("seq"))
        global_batch = batch or made_for.get("global_batch") or spec.batch_size
    embedded = made_for.get("cluster") if cluster is None else None
    spec_cluster = _cluster_on_jax(embedded or cluster_or_fail(cluster or "local"), present)
    unavailable = _unavailable(spec_cluster, devices)
    if loaded is not None:
        in_service = dataclasses.replace(spec_cluster, unavailable=spec_cluster.unavailable | set(unavailable))
        why = _plan_mismatch(loaded, in_service, recipe=recipe, seq=seq, global_batch=global_batch, model=user_model)
        if why is not None:
            fail(f"--plan {plan}: {why}")
    try:
        if user_model is None:
            metadata = RecipeRun(recipe=recipe, global_batch=global_batch, seq_len=seq, seed=seed).to_json()
        else:
            metadata = {"model": user_model, "global_batch": global_batch}
        config = RunConfig(
            steps=steps,
            checkpoint_every=checkpoint_every,
            keep=keep,
            cluster=str((run_dir / "cluster.yaml").absolute()) if embedded else _cluster_arg(cluster or "local"),
            unavailable=unavailable,
            time_limit_s=time_limit_s,
            plan=loaded,
            metadata=metadata,
        )
    except (KeyError, ValueError) as error:
        fail(str(error).splitlines()[0])
    created = not run_dir.exists()
    if embedded:
        import yaml

        from orchestrator.cluster import cluster_to_dict

        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "cluster.yaml").write_text(yaml.safe_dump(cluster_to_dict(embedded), sort_keys=False))
    config.save(run_dir)
    try:
        _run(run_dir, config)
    except typer.Exit as failed:
        if failed.exit_code != 0:
            _discard(run_dir, created)
        raise
    except Exception:
        _discard(run_dir, created)
        raise


def _plan_defaults(plan, path) -> dict:
    """The recipe, seq, global batch and cluster ``plan`` was made for, those it records (none without a plan).

    The ``local`` cluster is not taken from the plan: it is this machine's, measured now.
    """
    if plan is None:
        return {}
    source = plan.source
    found: dict = {"global_batch": plan.global_batch}
    if isinstance(source.get("recipe"), str):
        found["recipe"] = source["recipe"]
    if isinstance(source.get("model"), str):
        found["model"] = source["model"]
    if isinstance(source.get("seq"), int) and not isinstance(source["seq"], bool):
        found["seq"] = source["seq"]
    if isinstance(source.get("cluster_spec"), dict) and source["cluster_spec"].get("name") != "local":
        from orchestrator.cluster import ClusterError, parse_cluster

        try:
            found["cluster"] = parse_cluster(source["cluster_spec"], f"{path}: source.cluster_spec")
        except ClusterError as error:
            fail(str(error))
    return found


def _discard(run_dir: Path, created: bool) -> None:
    """Take a run that failed before its first checkpoint away again, so the corrected command can be rerun."""
    import shutil

    from integrations.flax import latest_checkpoint

    if latest_checkpoint(run_dir) is not None:
        return  # it made progress: resume it
    (run_dir / "run.json").unlink(missing_ok=True)
    (run_dir / "cluster.yaml").unlink(missing_ok=True)
    shutil.rmtree(run_dir / "ckpt", ignore_errors=True)
    if created:
        shutil.rmtree(run_dir, ignore_errors=True)


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
    time_limit_s: Annotated[
        float | None, typer.Option(min=0.1, max=MAX_TIME_LIMIT_S, help="Planner time budget.")
    ] = None,
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
    # the devices the run was made on, unless XLA_FLAGS chooses (a count past what a CPU can play is refused
    # below, as a cluster that does not match the devices here)
    present = _ask_devices(min(size, _MAX_VIRTUAL) or 8, devices or 1)
    from integrations.flax import RunConfig, latest_checkpoint
    from orchestrator.cluster import ClusterError

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
        changes.update(cluster=name, unavailable=_unavailable(cluster_or_fail(name), devices))
    if steps is not None:
        changes["steps"] = steps
    if time_limit_s is not None:
        changes["time_limit_s"] = time_limit_s
    new_plan = _load_plan(plan)
    if new_plan is not None:
        changes["plan"] = new_plan
    try:
        config = dataclasses.replace(config, **changes)
        here = config.load_cluster()
    except (ValueError, ClusterError) as error:
        fail(str(error).splitlines()[0])
    _cluster_on_jax(here, present)
    if config.plan is not None:
        recipe = config.metadata.get("recipe") if isinstance(config.metadata, dict) else None
        own = config.metadata.get("model") if isinstance(config.metadata, dict) else None
        why = _plan_mismatch(
            config.plan,
            here,
            recipe=recipe or "",
            seq=config.metadata.get("seq_len", 0),
            global_batch=config.metadata.get("global_batch", config.plan.global_batch),
            model=own if isinstance(own, str) else None,
        )
        if why is not None and new_plan is not None:
            fail(f"--plan {plan}: {why}")
        if why is not None:
            # the devices present are not the ones the plan was made for: train() re-plans onto them
            Console(stderr=True).print(f"the stored plan does not fit the {present} devices here ({why}); re-planning")
    config.save(run_dir)
    _run(run_dir, config)
