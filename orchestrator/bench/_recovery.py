"""Runtime evidence for ``orchestrator bench replan --runtime``: a SIGKILLed run resumes, a run that
loses 4 of 8 devices re-plans and continues.

Both compare against a reference trained without checkpoints, the run loop or the CLI: ``shard`` +
``compile_step`` over the same batches (``batch_for_step``), switching plans by copying the state to
the host and placing it under the next plan. gpt-tiny, global batch 16 × 16 tokens, the ``local``
cluster (jax's devices; 8 virtual CPU devices under ``make``).
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

ROOT = Path(__file__).resolve().parents[2]
BATCH, SEQ = 16, 16
LOST = tuple(f"localhost/{i}" for i in range(4, 8))


@functools.cache
def _layers_and_axes():
    from integrations.flax import capture
    from orchestrator.coarsen import coarsen
    from recipes import get_recipe

    recipe = get_recipe("gpt-tiny")
    graph = capture(recipe.train_step, recipe.abstract_state(), recipe.batch_spec(BATCH, SEQ))
    return coarsen(graph), recipe.param_axes()


def reference_state(config, plans: dict):
    """The state after ``config.steps`` steps, under ``plans[k]`` from step k on (host arrays)."""
    from integrations.flax import compile_step, shard
    from integrations.flax._run import batch_for_step, initial_state
    from recipes import get_recipe

    layers, axes = _layers_and_axes()
    state = jax.device_get(initial_state(config))
    for step in range(config.steps):
        if step in plans:
            state = shard(plans[step], jax.device_get(state), param_axes=axes, layers=layers)
            step_fn = compile_step(plans[step], get_recipe(config.recipe).train_step, state, param_axes=axes,
                                   layers=layers)  # fmt: skip
        state, _ = step_fn(state, batch_for_step(config, step))
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
    from integrations.flax._run import RunConfig, initial_state

    checkpoints = Checkpointer(run_dir / "ckpt")
    try:
        return checkpoints.restore(jax.device_get(initial_state(RunConfig.load(run_dir))), step=step)
    finally:
        checkpoints.close()


def sigkill_case(steps: int = 16, every: int = 2, kill_after: int = 5) -> dict:
    """``orchestrator train`` in a subprocess, SIGKILLed once checkpoint ``kill_after`` is on disk,
    then ``orchestrator resume``; ok when the final parameters equal the reference within 1e-6."""
    from integrations.flax._run import RunConfig
    from orchestrator.bench.executor import check_plan

    plan = check_plan("DP4xTP2", global_batch=BATCH)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir, plan_file = Path(tmp) / "run", Path(tmp) / "plan.json"
        plan.save(plan_file)
        args = ["--run-dir", str(run_dir), "--steps", str(steps), "--batch", str(BATCH), "--seq", str(SEQ)]
        args += ["--checkpoint-every", str(every), "--plan", str(plan_file)]
        process = subprocess.Popen(
            [sys.executable, "-m", "orchestrator", "train", *args],
            cwd=ROOT,
            env=clean_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + 300
        while not any(step >= kill_after for step in finished_checkpoints(run_dir / "ckpt")):
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                return {"name": "SIGKILL mid-run, then resume", "ok": False, "error": "no checkpoint before the end"}
            time.sleep(0.02)
        os.kill(process.pid, signal.SIGKILL)
        process.communicate()
        on_disk = finished_checkpoints(run_dir / "ckpt")
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


def device_loss_case(steps: int = 12, every: int = 3, at_step: int = 7) -> dict:
    """Devices 4–7 lost during step ``at_step`` of a DP4×TP2 run: re-plan, restore, continue; ok when
    the final parameters equal a run that switched to the new plan at the restored step within 1e-5."""
    from integrations.flax._run import LoseDevices, RunConfig, train
    from orchestrator.bench.executor import check_plan

    plan = check_plan("DP4xTP2", global_batch=BATCH)
    config = RunConfig(recipe="gpt-tiny", global_batch=BATCH, seq_len=SEQ, time_limit_s=2, steps=steps,
                       checkpoint_every=every, plan=plan)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        config.save(Path(tmp))
        result = train(Path(tmp), callbacks=[LoseDevices(LOST, at_step=at_step)])
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
