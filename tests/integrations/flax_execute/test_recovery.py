"""Recovery: a SIGKILLed run resumes, lost devices are re-planned around, a run moves 8 → 4 devices.

Every comparison is against a reference trained here without checkpoints, the run loop or the CLI:
``shard`` + ``compile_step`` over the same batches (the run's ``RecipeRun.batch``), switching plans
by copying the state to the host and placing it under the next plan.
"""

import dataclasses
import json
import shutil
import signal
import time

import jax
import numpy as np
import pytest
from typer.testing import CliRunner

from integrations.flax import RunConfig
from orchestrator.bench._recovery import (
    LOST,
    RUN,
    max_diff,
    read_checkpoint,
    reference_state,
    train_losing_devices,
    train_until_killed,
)
from orchestrator.bench.executor import check_plan
from orchestrator.cli import app

BATCH = RUN.global_batch
KILL_STEPS, KILL_EVERY, KILL_AFTER = 16, 2, 5  # kill once checkpoint ≥ 5 of steps 0..15 is on disk


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory):
    """A run killed with SIGKILL mid-run, then resumed by ``orchestrator resume`` (in this process)."""
    root = tmp_path_factory.mktemp("killed")
    run_dir, plan_file = root / "run", root / "plan.json"
    check_plan("DP4xTP2", global_batch=BATCH).save(plan_file)
    returncode, on_disk = train_until_killed(
        run_dir, plan_file, steps=KILL_STEPS, every=KILL_EVERY, kill_after=KILL_AFTER, timeout_s=180
    )
    partial = sorted(p.name for p in (run_dir / "ckpt").iterdir() if not p.name.isdigit())
    started = time.perf_counter()
    resumed = CliRunner().invoke(app, ["resume", str(run_dir)])
    return {
        "run_dir": run_dir,
        "returncode": returncode,
        "on_disk": on_disk,
        "partial": partial,
        "resumed": resumed,
        "resume_s": time.perf_counter() - started,
    }


def test_batches_are_a_pure_function_of_seed_and_step():
    a, b = RUN.batch(3), RUN.batch(3)
    np.testing.assert_array_equal(np.asarray(a["inputs"]), np.asarray(b["inputs"]))
    assert not np.array_equal(np.asarray(a["inputs"]), np.asarray(RUN.batch(2)["inputs"]))
    other = dataclasses.replace(RUN, seed=1)
    assert not np.array_equal(np.asarray(a["inputs"]), np.asarray(other.batch(3)["inputs"]))


def test_sigkilled_run_resumes_to_the_uninterrupted_parameters(killed_run):
    resumed, on_disk = killed_run["resumed"], killed_run["on_disk"]
    assert killed_run["returncode"] == -signal.SIGKILL
    assert max(on_disk) < KILL_STEPS - 1, f"killed after the last step: {on_disk}"
    assert resumed.exit_code == 0, resumed.output
    restored_from = int(resumed.stdout.split("resumed from checkpoint ")[1].split()[0])
    assert KILL_AFTER <= restored_from == max(on_disk)
    config = RunConfig.load(killed_run["run_dir"])
    final = read_checkpoint(killed_run["run_dir"], KILL_STEPS - 1)
    assert int(final.step) == KILL_STEPS
    reference = reference_state(config, {0: check_plan("DP4xTP2", global_batch=BATCH)})
    diff = max_diff(final.params, reference.params)
    print(f"killed with checkpoints {on_disk}, partial {killed_run['partial']}")
    print(f"resumed in {killed_run['resume_s']:.1f} s; max |Δparam| {diff:.2e}")
    assert diff <= 1e-6
    assert max_diff(final.opt_state, reference.opt_state) <= 1e-6


def test_resume_moves_a_run_from_8_to_4_devices(killed_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(killed_run["run_dir"], run_dir)
    before = (run_dir / "run.json").read_text()
    result = CliRunner().invoke(app, ["resume", str(run_dir), "--steps", "3"])
    assert result.exit_code == 2 and f"already at step {KILL_STEPS}" in result.stderr
    assert (run_dir / "run.json").read_text() == before
    args = ["resume", str(run_dir), "--devices", "4", "--steps", str(KILL_STEPS + 4), "--time-limit-s", "2"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert f"resumed from checkpoint {KILL_STEPS - 1} at step {KILL_STEPS}" in result.output
    config = RunConfig.load(run_dir)
    assert set(config.unavailable) == set(LOST)
    used = {ref for stage in config.plan.stages for ref in stage.devices}
    assert used <= {f"localhost/{i}" for i in range(4)}
    final = read_checkpoint(run_dir, KILL_STEPS + 3)
    assert int(final.step) == KILL_STEPS + 4
    reference = reference_state(config, {0: check_plan("DP4xTP2", global_batch=BATCH), KILL_STEPS: config.plan})
    diff = max_diff(final.params, reference.params)
    print(f"8 → 4 devices onto {config.plan.stages}: max |Δparam| {diff:.2e}")
    assert diff <= 1e-5


def test_losing_4_of_8_devices_replans_restores_and_continues(tmp_path):
    plan = check_plan("DP4xTP2", global_batch=BATCH)  # compiled already for the tests above
    # checkpoints after steps 2, 5, 8, 11; the devices go during step 7, so checkpoint 5 is restored
    result = train_losing_devices(tmp_path, plan, steps=12, every=3, at_step=7)
    [recovery] = result.recoveries
    assert (recovery.failed_step, recovery.restored_step, recovery.lost) == (7, 5, LOST)
    used = {ref for stage in result.plan.stages for ref in stage.devices}
    assert used and used.isdisjoint(LOST)
    survivors = set(jax.devices()[:4])
    assert all(leaf.sharding.device_set <= survivors for leaf in jax.tree.leaves(result.state))
    assert int(result.state.step) == 12
    assert RunConfig.load(tmp_path).unavailable == LOST
    # steps 6 and 7 ran on 8 devices, were lost, and ran again on 4: the reference switches at step 6
    reference = reference_state(RunConfig.load(tmp_path), {0: plan, 6: result.plan})
    diff = max_diff(jax.device_get(result.state.params), reference.params)
    print(f"replan {recovery.replan_s:.2f} s, restore {recovery.restore_s:.2f} s onto {result.plan.stages}")
    print(f"lost 4 of 8 devices: max |Δparam| {diff:.2e}")
    assert diff <= 1e-5
    assert max_diff(jax.device_get(result.state.opt_state), reference.opt_state) <= 1e-5


def test_resume_and_train_errors_are_one_line(tmp_path):
    runner = CliRunner()

    def one_line_error(args, expected):
        result = runner.invoke(app, args)
        assert result.exit_code == 2, result.output
        assert expected in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
        assert "Traceback" not in result.output

    one_line_error(["resume", str(tmp_path / "nothing")], "holds no run")
    one_line_error(["resume", str(tmp_path)], "holds no run")
    (tmp_path / "run.json").write_text("{not json")
    one_line_error(["resume", str(tmp_path)], "not a run configuration")
    one_line_error(["train", "--run-dir", str(tmp_path)], "already holds a run")


def test_a_corrupted_latest_checkpoint_falls_back_to_the_previous_one(killed_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(killed_run["run_dir"], run_dir)
    latest, previous = KILL_STEPS - 1, KILL_STEPS - 1 - KILL_EVERY
    uninterrupted = read_checkpoint(run_dir, latest)
    for path in (run_dir / "ckpt" / str(latest)).rglob("*"):
        if path.is_file():
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    result = CliRunner().invoke(app, ["resume", str(run_dir)])
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    [report] = [line for line in result.output.splitlines() if "does not read back" in line]
    assert report.startswith(f"checkpoint {latest} does not read back") and f"using checkpoint {previous}" in report
    assert f"resumed from checkpoint {previous} at step {previous + 1}" in result.stdout
    assert (run_dir / "ckpt" / f"{latest}.unreadable").is_dir()
    final = read_checkpoint(run_dir, latest)
    assert int(final.step) == KILL_STEPS
    assert max_diff(final.params, uninterrupted.params) <= 1e-6
    assert max_diff(final.opt_state, uninterrupted.opt_state) <= 1e-6


def test_resume_replans_with_a_message_when_the_stored_plan_names_devices_not_here(killed_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(killed_run["run_dir"], run_dir)
    stored = json.loads((run_dir / "run.json").read_text())
    for stage in stored["plan"]["stages"]:
        stage["devices"] = [f"elsewhere/{i}" for i in range(len(stage["devices"]))]
    (run_dir / "run.json").write_text(json.dumps(stored))
    result = CliRunner().invoke(app, ["resume", str(run_dir), "--steps", str(KILL_STEPS + 1), "--time-limit-s", "2"])
    assert result.exit_code == 0, result.output
    assert "the stored plan does not fit the 8 devices here" in result.stderr and "re-planning" in result.stderr
    assert "re-planned for local" in result.stdout
    used = {ref for stage in RunConfig.load(run_dir).plan.stages for ref in stage.devices}
    assert used <= {f"localhost/{i}" for i in range(8)}
    assert int(read_checkpoint(run_dir, KILL_STEPS).step) == KILL_STEPS + 1
