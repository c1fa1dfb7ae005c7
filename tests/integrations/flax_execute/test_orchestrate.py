"""orchestrate() end to end with the callbacks, and the executor's error paths."""

import collections
import dataclasses
import json

import jax
import numpy as np
import pytest

from integrations.callbacks import Checkpointer, PlanReporter, StepTimeDrift, StepTimer
from integrations.flax import compile_step, orchestrate, shard
from orchestrator.bench.executor import check_plan
from orchestrator.simulate import stage_order
from recipes import get_recipe, synthetic_batch


@pytest.fixture(scope="module")
def gpt():
    recipe = get_recipe("gpt-tiny")
    state = jax.jit(recipe.create_state)(jax.random.key(0))
    batches = [synthetic_batch(jax.random.key(i), 16, 16, recipe.config.vocab_size) for i in range(4)]
    return recipe, state, batches


def test_orchestrate_plans_trains_reports_and_checkpoints(gpt, tmp_path):
    recipe, state, batches = gpt
    timer = StepTimer(tolerance=float("inf"))
    checkpoints = Checkpointer(tmp_path / "ckpt", every=1, keep=2)
    run = orchestrate(
        state,
        recipe.train_step,
        "local",
        batch=batches[0],
        param_axes=recipe.param_axes(),
        callbacks=[timer, PlanReporter(tmp_path / "report"), checkpoints],
        time_limit_s=60,
    )
    used = {ref for stage in run.plan.stages for ref in stage.devices}
    assert len(used) == sum(s.tp * s.dp for s in run.plan.stages) <= 8
    losses = [float(run.step(batch)["loss"]) for batch in batches]
    run.close()
    assert losses[-1] < losses[0]
    assert len(timer.times_s) == len(batches) - 1  # the compiling step is not timed
    assert timer.ratio == pytest.approx(timer.median_s / run.plan.iteration_s)
    saved = json.loads((tmp_path / "report" / "plan.json").read_text())
    assert saved["global_batch"] == 16
    trace = json.loads((tmp_path / "report" / "trace.json").read_text())
    assert {e["args"]["stage"] for e in trace["traceEvents"] if e["ph"] == "X"} == set(range(len(run.plan.stages)))
    assert checkpoints.steps() == [2, 3]  # the last two of steps 0..3
    restored = checkpoints.restore(run.state, step=3)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(run.state)):
        assert a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    checkpoints.close()


def test_conductor_rewritten_step_runs_under_the_plan(gpt):
    recipe, state, batches = gpt
    plan = check_plan("DP8", global_batch=16)
    run = orchestrate(state, recipe.train_step, "local", batch=batches[0], plan=plan, profile=False, conductor=True)
    reference = jax.jit(recipe.train_step)
    ref_state = state
    for batch in batches[:2]:
        ref_state, metrics = reference(ref_state, batch)
        np.testing.assert_allclose(float(run.step(batch)["loss"]), float(metrics["loss"]), rtol=1e-5)


def test_step_timer_warns_when_the_prediction_is_off():
    timer = StepTimer(predicted_s=1e-9, warmup=0)
    timer.on_step_begin(0)
    with pytest.warns(StepTimeDrift, match="predicted"):
        timer.on_step_end(0, {"loss": jax.numpy.zeros(())})


def test_schedules_keep_dependencies_and_bound_in_flight_microbatches():
    stages, micro = 4, 6
    for schedule in ("gpipe", "1f1b"):
        orders = [stage_order(schedule, stages, micro, s) for s in range(stages)]
        for s, order in enumerate(orders):
            assert sorted(order) == sorted(
                [("forward", m) for m in range(micro)] + [("backward", m) for m in range(micro)]
            )
            in_flight = peak = 0
            for op, m in order:
                assert op == "forward" or ("forward", m) in order[: order.index((op, m))]
                in_flight += 1 if op == "forward" else -1
                peak = max(peak, in_flight)
            assert peak == (micro if schedule == "gpipe" else min(stages - s, micro))


def test_the_reported_trace_has_every_chunk_of_every_microbatch_on_every_device(tmp_path):
    """``PlanReporter``'s trace is the simulator's: each device of a stage runs a forward and a
    backward per microbatch, per virtual-stage chunk under interleaved 1F1B."""
    plan = check_plan("2 stages (3+1) x 4 mb", global_batch=16)
    for v in (1, 2):
        reporter = PlanReporter(tmp_path / f"v{v}", plan=dataclasses.replace(plan, virtual_stages=v))
        reporter.on_train_begin()
        trace = json.loads((tmp_path / f"v{v}" / "trace.json").read_text())
        for phase in ("forward", "backward"):
            events = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == phase]
            per_device = collections.Counter((e["pid"], e["tid"]) for e in events)
            assert len(per_device) == sum(len(stage.devices) for stage in plan.stages)
            assert set(per_device.values()) == {v * plan.microbatches}


def test_user_mistakes_get_one_line_errors(gpt):
    recipe, state, _ = gpt
    plan = check_plan("2 stages (3+1) x 4 mb", global_batch=16)
    with pytest.raises(ValueError, match="layers="):
        compile_step(plan, recipe.train_step, state)
    with pytest.raises(ValueError, match="owners="):
        shard(plan, state)
    with pytest.raises(ValueError, match="divisible by 16"):
        check_plan("DP8", global_batch=8)


def test_cli_user_mistakes_exit_2_with_one_line():
    from typer.testing import CliRunner

    from orchestrator.cli._app import app

    result = CliRunner().invoke(app, ["demo", "--recipe", "nope"])
    assert result.exit_code == 2
    assert "unknown recipe 'nope'" in result.output


def test_a_plain_train_state_with_a_python_int_step_trains_as_on_one_device():
    """``TrainState.create`` leaves ``step`` a Python int; orchestrate takes that state as it is."""
    import jax.numpy as jnp
    import optax
    from flax import linen as nn
    from flax.training.train_state import TrainState

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for i in range(3):
                x = nn.relu(nn.Dense(32, name=f"layers_{i}")(x))
            return nn.Dense(4, name="head")(x)

    def train_step(state, batch):
        def loss_fn(params):
            logits = state.apply_fn({"params": params}, batch["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}

    model = MLP()
    x = jax.random.normal(jax.random.key(1), (16, 8))
    batch = {"x": x, "y": jnp.arange(16) % 4}
    state = TrainState.create(
        apply_fn=model.apply, params=model.init(jax.random.key(0), x)["params"], tx=optax.adamw(1e-2)
    )
    assert isinstance(state.step, int)

    run = orchestrate(state, train_step, "local", batch=batch, time_limit_s=60)
    reference, step = state, jax.jit(train_step)
    for _ in range(2):
        loss = float(run.step(batch)["loss"])
        reference, metrics = step(reference, batch)
        np.testing.assert_allclose(loss, float(metrics["loss"]), rtol=1e-5)
    assert int(run.state.step) == 2


def test_a_cluster_jax_cannot_run_says_how_to_get_its_devices(gpt):
    """16 devices planned, 8 here: one line before any capture or plan, saying how to get 16 on CPU."""
    recipe, state, batches = gpt
    with pytest.raises(ValueError, match="XLA_FLAGS=--xla_force_host_platform_device_count=16"):
        orchestrate(state, recipe.train_step, "h100x16", batch=batches[0], param_axes=recipe.param_axes())


def test_one_local_cpu_device_warns_how_to_get_more():
    """Without XLA_FLAGS jax has one CPU device: planning for it says so, and how to get N (a fresh
    process, since this one has 8; the warning is made an error so nothing after it runs)."""
    import os
    import subprocess
    import sys

    code = (
        "import warnings; warnings.simplefilter('error')\n"
        "import jax, jax.numpy as jnp\n"
        "from integrations.flax import orchestrate\n"
        "try:\n"
        "    orchestrate({'w': jnp.ones(2)}, lambda s, b: (s, {}), 'local', batch={'x': jnp.ones((2, 2))})\n"
        "except UserWarning as w:\n"
        "    print(w)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert "planning for 1 local CPU device" in out.stdout, out.stderr[-2000:]
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=N" in out.stdout


def test_the_state_comes_before_the_step(gpt):
    recipe, state, batches = gpt
    with pytest.raises(TypeError, match="takes the state first, then the step"):
        orchestrate(recipe.train_step, state, batch=batches[0])
