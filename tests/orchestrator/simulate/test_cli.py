"""``orchestrator simulate`` and ``orchestrator report``: outputs, the cost-model path, and one-line user errors."""

import json

import pytest
from typer.testing import CliRunner

from orchestrator.cli import app
from orchestrator.simulate import simulate
from tests.orchestrator.simulate.test_engine import _plan, _stage

runner = CliRunner()


@pytest.fixture
def plan_file(tmp_path):
    plan = _plan([_stage("h/0", f=1.0, b=2.0, send=0.5, sync=0.25), _stage("g/0", f=1.0, b=2.0)], 4, "1f1b")
    path = tmp_path / "plan.json"
    plan.save(path)
    return plan, path


def test_simulate_writes_trace_charts_and_json(plan_file, tmp_path):
    plan, path = plan_file
    out = {name: tmp_path / name for name in ("trace.json", "gantt.png", "memory.png")}
    result = runner.invoke(
        app,
        [
            *("simulate", str(path), "--trace", str(out["trace.json"]), "--png", str(out["gantt.png"])),
            *("--memory-png", str(out["memory.png"]), "--json"),
        ],
    )
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    expected = simulate(plan)
    assert payload["iteration_s"] == expected.iteration_s and payload["bubble_fraction"] == expected.bubble_fraction
    assert len(payload["events"]) == len(expected.events)
    assert json.loads(out["trace.json"].read_text())["traceEvents"]
    assert out["gantt.png"].read_bytes()[:4] == b"\x89PNG" and out["memory.png"].read_bytes()[:4] == b"\x89PNG"
    table = runner.invoke(app, ["simulate", str(path), "--blocking-p2p", "--no-sync-overlap"])
    assert table.exit_code == 0 and "closed form" in table.stdout
    assert f"{simulate(plan, overlap_p2p=False, overlap_dp_sync=False).iteration_s * 1e3:.3f} ms" in table.stdout


def test_report_writes_html(plan_file, tmp_path):
    _, path = plan_file
    result = runner.invoke(app, ["report", str(path), "--html", str(tmp_path / "r.html")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "r.html").read_text().startswith("<!DOCTYPE html>")


@pytest.mark.parametrize(
    ("content", "args", "message"),
    [
        (None, [], "no plan file"),
        ("{not json", [], "is not JSON"),
        ('{"stages": []}', [], "is not a plan file"),
        ("plan", ["--recipe", "gpt-tiny"], "--recipe and --cluster go together"),
        ("plan", ["--recipe", "gpt-5", "--cluster", "a100x8"], "unknown recipe 'gpt-5'"),
        ("plan", ["--recipe", "gpt-tiny", "--cluster", "a100x8"], "the plan was made for another model"),
    ],
)
def test_user_mistakes_are_one_line_and_exit_2(plan_file, tmp_path, content, args, message):
    _, path = plan_file
    if content is None:
        path = tmp_path / "missing.json"
    elif content != "plan":
        path.write_text(content)
    for command in (["simulate", str(path)], ["report", str(path), "--html", str(tmp_path / "r.html")]):
        result = runner.invoke(app, command + args)
        assert result.exit_code == 2, result.output
        assert message in result.stderr and "Traceback" not in result.output
        assert len(result.stderr.strip().splitlines()) == 1


def test_plan_then_simulate_with_its_cost_model(tmp_path):
    plan_path = tmp_path / "plan.json"
    made = runner.invoke(
        app,
        [
            *("plan", "--recipe", "gpt-tiny", "--cluster", "mixed-a100-v100", "--batch", "16"),
            *("--max-stages", "2", "--time-limit-s", "60", "--out", str(plan_path)),
        ],
    )
    assert made.exit_code == 0, made.output
    result = runner.invoke(app, ["simulate", str(plan_path), "--recipe", "gpt-tiny", "--cluster", "mixed-a100-v100"])
    assert result.exit_code == 0, result.output
    assert "peak memory" in result.stdout  # memory in bytes: the cost model was used
