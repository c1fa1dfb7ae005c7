"""``plan --memory-headroom PERCENT``: what the planner leaves free of each device, recorded in the plan."""

import json

from typer.testing import CliRunner

from orchestrator.cli import app
from orchestrator.planner import MEMORY_HEADROOM

runner = CliRunner()
PLAN = ["plan", "--recipe", "gpt-tiny", "--batch", "8", "--time-limit-s", "30", "--json"]


def test_the_headroom_is_the_planners_unless_given_and_travels_in_the_plan():
    default = runner.invoke(app, PLAN)
    assert default.exit_code == 0, default.output
    assert json.loads(default.stdout)["source"]["memory_headroom"] == MEMORY_HEADROOM
    none = runner.invoke(app, [*PLAN, "--memory-headroom", "0"])
    assert none.exit_code == 0, none.output
    assert json.loads(none.stdout)["source"]["memory_headroom"] == 0.0


def test_a_headroom_past_90_percent_is_one_line():
    result = runner.invoke(app, [*PLAN, "--memory-headroom", "95"])
    assert result.exit_code == 2
    [line] = result.stderr.strip().splitlines()
    assert "--memory-headroom" in line and "90" in line
