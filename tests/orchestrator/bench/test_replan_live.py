"""``orchestrator bench replanner``: its rows and its command, on made-up step times (the real run
takes minutes: ``orchestrator.bench._replan_live.run``)."""

import json
import types

from typer.testing import CliRunner

import orchestrator.bench
from orchestrator.bench._replan_live import AFTER, ONSET, speedup_rows
from orchestrator.cli import app


def _record(switch, before_s, after_s):
    """Step times: 1 s up to the onset, ``before_s`` while slowed, 9 s for the step that compiles
    the new plan, ``after_s`` after it."""
    times = {s: 1.0 for s in range(ONSET)}
    times |= {s: before_s for s in range(ONSET, switch + 1)}
    times[switch + 1] = 9.0
    times |= {s: after_s for s in range(switch + 2, switch + 2 + AFTER)}
    return types.SimpleNamespace(switch=switch, step_cpu_s=times, step_wall_s={s: 2 * t for s, t in times.items()})


def test_rows_compare_the_fastest_slowed_step_with_the_fastest_after_the_compile():
    record = _record(ONSET + 4, before_s=5.0, after_s=2.0)
    record.step_cpu_s[ONSET + 1] = 4.0  # the window's minimum counts, not its first step
    rows = speedup_rows(record)
    assert [r["clock"] for r in rows] == ["cpu", "wall"]
    assert [(r["before_s"], r["after_s"]) for r in rows] == [(4.0, 2.0), (10.0, 4.0)]
    assert all(r["ok"] and r["switch_step"] == ONSET + 4 for r in rows)
    assert not any(r["ok"] for r in speedup_rows(_record(ONSET + 4, before_s=5.0, after_s=4.0)))
    [never] = speedup_rows(types.SimpleNamespace(switch=None))
    assert not never["ok"] and "kept" in never["error"]


def test_command_prints_the_rows_and_exits_1_on_a_miss(monkeypatch):
    result = {"cases": speedup_rows(_record(ONSET + 3, before_s=5.0, after_s=4.5))}
    monkeypatch.setattr(orchestrator.bench, "run_replanner_suite", lambda progress=None: result)
    printed = CliRunner().invoke(app, ["bench", "replanner"])
    assert printed.exit_code == 1, printed.output
    assert "slowed step, cpu clock" in printed.output and "0.9" in printed.output
    as_json = CliRunner().invoke(app, ["bench", "replanner", "--json"])
    assert as_json.exit_code == 1
    assert json.loads(as_json.stdout) == result
