"""``plan --time-limit-s`` bounds the whole command: past it, the best plan found, or "no plan found within N s" (exit 3)."""

import json

from typer.testing import CliRunner

from orchestrator.cli import app

runner = CliRunner()


class JumpingClock:
    """A clock that moves ``step`` seconds each time it is read: the second reading is past any limit below ``step``."""

    def __init__(self, step: float):
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def test_a_time_limit_that_runs_out_before_any_plan_is_one_line_and_exit_3(monkeypatch):
    import orchestrator.cli._plan as plan_module

    args = ["plan", "--recipe", "gpt-tiny", "--batch", "8", "--time-limit-s", "5"]
    monkeypatch.setattr(plan_module, "clock", JumpingClock(step=100.0))
    result = runner.invoke(app, args)
    assert result.exit_code == 3, result.output
    *progress, line = result.stderr.strip().splitlines()  # progress lines come first
    assert line.startswith("error: no plan found within 5 s") and line.endswith("raise --time-limit-s"), line
    assert not any(p.startswith("error: ") for p in progress)
    monkeypatch.setattr(plan_module, "clock", JumpingClock(step=100.0))
    as_json = runner.invoke(app, [*args, "--json"])
    assert as_json.exit_code == 3
    assert json.loads(as_json.stdout) == {"error": line.removeprefix("error: ")}


def test_absurd_sizes_are_refused_before_any_planning_with_the_largest_accepted():
    result = runner.invoke(app, ["plan", "--recipe", "gpt-tiny", "--batch", "100000000", "--time-limit-s", "5"])
    assert result.exit_code == 2
    assert "65536" in result.stderr
    result = runner.invoke(app, ["plan", "--recipe", "gpt-tiny", "--time-limit-s", "1e9"])
    assert result.exit_code == 2
    assert "86400" in result.stderr
