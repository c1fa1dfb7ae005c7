"""``orchestrator plan|graph --model package.module:factory`` on the own model in ``tests/orchestrator/user_model.py``."""

import json

import pytest
from typer.testing import CliRunner

from orchestrator.cli import app
from orchestrator.planner import Plan

runner = CliRunner()
MODEL = "tests.orchestrator.user_model:mlp"


def test_plan_takes_a_user_model():
    result = runner.invoke(app, ["plan", "--model", MODEL, "--cluster", "a100x8", "--time-limit-s", "10", "--json"])
    assert result.exit_code == 0, result.output
    plan = Plan.from_json(json.loads(result.stdout))
    assert sorted(i for stage in plan.stages for i in stage.layers) == list(range(5))  # stem, 3 blocks, head
    assert plan.global_batch == 32  # the factory's batch, when --batch is not given
    assert plan.source["model"] == MODEL and "recipe" not in plan.source


def test_plan_batch_overrides_the_factory_batch():
    args = ["plan", "--model", MODEL, "--batch", "64", "--time-limit-s", "10", "--json"]
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
