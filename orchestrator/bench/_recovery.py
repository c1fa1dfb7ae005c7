"""Runtime evidence for ``orchestrator bench replan --runtime``: a SIGKILLed run resumes, a run that
loses 4 of 8 devices re-plans and continues.

Both compare against a reference trained without checkpoints, the run loop or the CLI: ``shard`` +
``compile_step`` over the same batches (the run's :class:`recipes.RecipeRun`), switching plans by
copying the state to the host and placing it under the next plan. gpt-tiny, global batch 16 × 16
tokens, the ``local`` cluster (jax's devices; 8 virtual CPU devices under ``make``).
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from recipes import RecipeRun

ROOT = Path(__file__).resolve().parents[2]
BATCH, SEQ = 16, 16
LOST = tuple(f"localhost/{i}" for i in range(4, 8))
RUN = RecipeRun(recipe="gpt-tiny", global_batch=BATCH, seq_len=SEQ)


@functools.cache
def _layers_and_axes(run: RecipeRun):
    from integrations.flax import capture
    from orchestrator.coarsen import coarsen

    state, spec = jax.eval_shape(run.init_state), jax.eval_shape(run.batch, 0)
    return coarsen(capture(run.train_step, state, spec)), run.param_axes()


def reference_state(config, plans: dict):
    """The state after ``config.steps`` steps of the run ``config`` describes, under ``plans[k]`` from
    step k on (host arrays)."""
    from integrations.flax import compile_step, shard

    run = RecipeRun.from_json(config.metadata)
    layers, axes = _layers_and_axes(run)
    state = jax.device_get(run.init_state())
    for step in range(config.steps):
        if step in plans:
            state = shard(plans[step], jax.device_get(state), param_axes=axes, layers=layers)
            step_fn = compile_step(plans[step], run.train_step, state, param_axes=axes, layers=layers)
        state, _ = step_fn(state, run.batch(step))
    return jax.device_get(state)


def max_diff(a, b) -> float:
    """The largest absolute difference between two pytrees of arrays."""
    return max(
        float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


def clean_env() -> dict:
    """A subprocess environment with 8 virtual CPU devices and nothing else inherited from tests."""
    env = {k: os.environ[k] for k in ("PATH", "HOME") if k in os.environ}
    env.update(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    return env


def finished_checkpoints(ckpt: Path) -> list[int]:
    """Complete checkpoints (orbax writes ``<step>.orbax-checkpoint-tmp-*`` and renames it when done)."""
    return sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) if ckpt.is_dir() else []


def read_checkpoint(run_dir: Path, step: int):
    """Checkpoint ``step`` of a run, as host arrays."""
    from integrations.callbacks import Checkpointer
    from integrations.flax import RunConfig

    run = RecipeRun.from_json(RunConfig.load(run_dir).metadata)
    checkpoints = Checkpointer(run_dir / "ckpt")
    try:
        return checkpoints.restore(jax.device_get(run.init_state()), step=step)
    finally:
        checkpoints.close()


def train_until_killed(run_dir: Path, plan_file: Path, *, steps: int, every: int, kill_after: int, timeout_s=300):
    """``orchestrator train`` of :data:`RUN` under ``plan_file`` in a subprocess, SIGKILLed once checkpoint
    ``kill_after`` is on disk.

    Returns:
      (its return code, the complete checkpoints on disk when it died).

    Raises:
      RuntimeError: training ended before it was killed, or no such checkpoint came within ``timeout_s``.
    """
    args = ["--run-dir", str(run_dir), "--steps", str(steps), "--batch", str(BATCH), "--seq", str(SEQ)]
    args += ["--checkpoint-every", str(every), "--plan", str(plan_file)]
    process = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "train", *args],
        cwd=ROOT,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + timeout_s
    while not any(step >= kill_after for step in finished_checkpoints(run_dir / "ckpt")):
        if process.poll() is not None:
            raise RuntimeError(f"training ended before it was killed: {process.communicate()[1][-300:]!r}")
        if time.monotonic() > deadline:
            process.kill()
            process.communicate()
            raise RuntimeError(f"no checkpoint {kill_after} within {timeout_s} s")
        time.sleep(0.02)
    os.kill(process.pid, signal.SIGKILL)
    process.communicate()
    return process.returncode, finished_checkpoints(run_dir / "ckpt")


def sigkill_case(steps: int = 16, every: int = 2, kill_after: int = 5) -> dict:
    """``orchestrator train`` in a subprocess, SIGKILLed once checkpoint ``kill_after`` is on disk,
    then ``orchestrator resume``; ok when the final parameters equal the reference within 1e-6."""
    from integrations.flax import RunConfig
    from orchestrator.bench.executor import check_plan

    plan = check_plan("DP4xTP2", global_batch=BATCH)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir, plan_file = Path(tmp) / "run", Path(tmp) / "plan.json"
        plan.save(plan_file)
        try:
            _, on_disk = train_until_killed(run_dir, plan_file, steps=steps, every=every, kill_after=kill_after)
        except RuntimeError as error:
            return {"name": "SIGKILL mid-run, then resume", "ok": False, "error": str(error)}
        started = time.perf_counter()
        resumed = subprocess.run(
            [sys.executable, "-m", "orchestrator", "resume", str(run_dir)],
            cwd=ROOT,
            env=clean_env(),
            capture_output=True,
            text=True,
        )
        resume_s = time.perf_counter() - started
        if resumed.returncode != 0:
            return {"name": "SIGKILL mid-run, then resume", "ok": False, "error": resumed.stderr[-500:]}
        final = read_checkpoint(run_dir, steps - 1)
        reference = reference_state(RunConfig.load(run_dir), {0: plan})
    diff = max(max_diff(final.params, reference.params), max_diff(final.opt_state, reference.opt_state))
    return {
        "name": "SIGKILL mid-run, then resume",
        "ok": diff <= 1e-6 and int(final.step) == steps and max(on_disk) < steps - 1,
        "killed_with_checkpoints": on_disk,
        "resume_s": resume_s,
        "max_abs_diff": diff,
        "tolerance": 1e-6,
    }


def train_losing_devices(run_dir: Path, plan, *, steps: int, every: int, at_step: int):
    """Train :data:`RUN` for ``steps`` steps under ``plan`` in a new ``run_dir``, checkpointing every ``every``
    steps; devices 4–7 are lost at the end of step ``at_step`` (:class:`~integrations.flax.LoseDevices`).

    Returns:
      The :class:`~integrations.flax.RunResult`.
    """
    from integrations.flax import LoseDevices, RunConfig, train

    config = RunConfig(steps=steps, checkpoint_every=every, time_limit_s=2, plan=plan, metadata=RUN.to_json())
    config.save(run_dir)
    model, losses = (RUN.train_step, RUN.init_state, RUN.batch), [LoseDevices(LOST, at_step=at_step)]
    return train(*model, run_dir=run_dir, param_axes=RUN.param_axes(), callbacks=losses)


def device_loss_case(steps: int = 12, every: int = 3, at_step: int = 7) -> dict:
    """Devices 4–7 lost during step ``at_step`` of a DP4×TP2 run: re-plan, restore, continue; ok when
    the final parameters equal a run that switched to the new plan at the restored step within 1e-5."""
    from integrations.flax import RunConfig
    from orchestrator.bench.executor import check_plan

    plan = check_plan("DP4xTP2", global_batch=BATCH)
    with tempfile.TemporaryDirectory() as tmp:
        result = train_losing_devices(Path(tmp), plan, steps=steps, every=every, at_step=at_step)
        config = RunConfig.load(tmp)
    [recovery] = result.recoveries
    used = {ref for stage in result.plan.stages for ref in stage.devices}
    reference = reference_state(config, {0: plan, recovery.restored_step + 1: result.plan})
    state = jax.device_get(result.state)
    diff = max(max_diff(state.params, reference.params), max_diff(state.opt_state, reference.opt_state))
    return {
        "name": "lose 4 of 8 devices mid-run",
        "ok": diff <= 1e-5 and used.isdisjoint(LOST) and int(result.state.step) == steps,
        "failed_step": recovery.failed_step,
        "restored_step": recovery.restored_step,
        "replan_s": recovery.replan_s,
        "restore_s": recovery.restore_s,
        "max_abs_diff": diff,
        "tolerance": 1e-5,
    }
