"""``orchestrator plan|graph|train --model package.module:factory`` on the own model in ``tests/orchestrator/user_model.py``,
and ``simulate``/``report`` of the plan it makes."""

import json

import pytest
from typer.testing import CliRunner

from integrations.flax import RunConfig
from orchestrator.cli import app
from orchestrator.planner import Plan

runner = CliRunner()
MODEL = "tests.orchestrator.user_model:mlp"


def test_plan_takes_a_user_model():
    result = runner.invoke(app, ["plan", "--model", MODEL, "--cluster", "a100x8", "--time-limit-s", "60", "--json"])
    assert result.exit_code == 0, result.output
    plan = Plan.from_json(json.loads(result.stdout))
    assert sorted(i for stage in plan.stages for i in stage.layers) == list(range(5))  # stem, 3 blocks, head
    assert plan.global_batch == 32  # the factory's batch, when --batch is not given
    assert plan.source["model"] == MODEL and "recipe" not in plan.source


def test_plan_batch_overrides_the_factory_batch():
    args = ["plan", "--model", MODEL, "--batch", "64", "--time-limit-s", "60", "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["global_batch"] == 64


def test_graph_takes_a_user_model():
    result = runner.invoke(app, ["graph", "--model", MODEL, "--json", "--no-xla"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["model"] == MODEL and payload["batch_size"] == 32
    assert [layer["name"] for layer in payload["layers"]] == ["MLP/stem"] + [f"MLP/layers_{i}" for i in range(3)] + [
        "MLP/head"
    ]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("tests.orchestrator.no_such_module:mlp", "no module named 'tests.orchestrator.no_such_module'"),
        ("tests.orchestrator.user_model:nope", "has no function 'nope'"),
        ("tests.orchestrator.user_model:NOT_A_FUNCTION", "'NOT_A_FUNCTION' is not a function (it is int)"),
        ("tests.orchestrator.user_model:two_things", "must return (train_step, state, batch), got 2 items"),
        ("tests.orchestrator.user_model:not_a_step", "its train_step is not a function (it is str)"),
        ("tests.orchestrator.user_model:no_batch", "the batch has no array with a leading batch dimension"),
        ("tests.orchestrator.user_model", "--model takes package.module:factory"),
    ],
)
@pytest.mark.parametrize("command", ["plan", "graph"])
def test_a_bad_model_spec_is_one_line(command, spec, message):
    result = runner.invoke(app, [command, "--model", spec, "--json"])
    assert result.exit_code == 2
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output
    assert message in json.loads(result.stdout)["error"]


def test_recipe_options_with_a_model_are_refused():
    result = runner.invoke(app, ["plan", "--model", MODEL, "--recipe", "gpt-tiny"])
    assert result.exit_code == 2 and "--recipe applies to recipes" in result.stderr
    result = runner.invoke(app, ["graph", "--model", MODEL, "--seq-len", "8"])
    assert result.exit_code == 2 and "--seq-len applies to recipes" in result.stderr


def test_simulate_report_and_train_take_a_model_plan(tmp_path):
    plan_file = tmp_path / "plan.json"
    args = ["plan", "--model", MODEL, "--cluster", "a100x8", "--time-limit-s", "30", "--out", str(plan_file)]
    assert runner.invoke(app, args).exit_code == 0
    result = runner.invoke(app, ["simulate", str(plan_file)])
    assert result.exit_code == 0, result.output
    assert "peak memory" in result.stdout  # from the cost model: the plan's own numbers have no memory timeline
    result = runner.invoke(app, ["report", str(plan_file), "--html", str(tmp_path / "report.html")])
    assert result.exit_code == 0 and (tmp_path / "report.html").stat().st_size > 0
    result = runner.invoke(app, ["train", "--plan", str(plan_file), "--run-dir", str(tmp_path / "run"), "--steps", "1"])
    assert result.exit_code == 0, result.output  # the plan names its model: train runs it on the plan's cluster
    assert RunConfig.load(tmp_path / "run").metadata["model"] == MODEL
    result = runner.invoke(
        app, ["train", "--plan", str(plan_file), "--run-dir", str(tmp_path / "r2"), "--recipe", "gpt-tiny"]
    )
    assert result.exit_code == 2 and f"it was made for the model {MODEL!r}" in result.stderr


def test_train_and_resume_a_user_model_like_jit(tmp_path):
    import jax
    import numpy as np

    from integrations.flax import latest_checkpoint
    from tests.orchestrator.user_model import mlp

    run_dir = tmp_path / "run"
    args = ["train", "--model", MODEL, "--run-dir", str(run_dir), "--steps", "2", "--time-limit-s", "30"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert RunConfig.load(run_dir).metadata == {"model": MODEL, "global_batch": 32}
    result = runner.invoke(app, ["resume", str(run_dir), "--steps", "3"])
    assert result.exit_code == 0, result.output
    assert latest_checkpoint(run_dir) == 2
    step, state, batch = mlp()
    for _ in range(3):  # the factory's batch every step, as train runs it
        state, metrics = jax.jit(step)(state, batch)
    loss = float(result.stdout.split("loss ")[1].split(":")[0])  # "at step 3, loss 2.3456: ..."
    np.testing.assert_allclose(loss, float(metrics["loss"]), atol=1e-4)  # printed with 4 decimals


@pytest.mark.parametrize(
    ("spec", "extra", "message"),
    [
        (
            "tests.orchestrator.user_model:no_loss",
            [],
            "to train, train_step(state, batch) must return (state, metrics)",
        ),
        ("tests.orchestrator.user_model:shapes_only", [], "training needs arrays"),
        (MODEL, ["--batch", "64"], "--batch applies to recipes"),
        ("tests.orchestrator.no_such_module:mlp", [], "no module named 'tests.orchestrator.no_such_module'"),
    ],
)
def test_train_refuses_a_model_it_cannot_train_in_one_line(tmp_path, spec, extra, message):
    run_dir = tmp_path / "run"
    result = runner.invoke(app, ["train", "--model", spec, "--run-dir", str(run_dir), *extra])
    assert result.exit_code == 2, result.output
    [line] = result.stderr.strip().splitlines()
    assert message in line and "Traceback" not in result.output
    assert not run_dir.exists()
