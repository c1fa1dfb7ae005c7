import json

import pytest
from typer.testing import CliRunner

from integrations.flax import hlo_collective_bytes
from orchestrator.cli import app

HLO = """
ENTRY %main {
  %p0 = f32[2,1024,768]{2,1,0} parameter(0)
  %p1 = f32[768]{0} parameter(1)
  %bitcast.1 = f32[2,1024,768]{2,1,0} bitcast(%p0)
  %all-reduce = f32[2,1024,768]{2,1,0} all-reduce(%bitcast.1), channel_id=1, replica_groups=[4,2]<=[8]
  %all-reduce.2 = (f32[768]{0}, f32[], /*index=2*/f32[768]{0}) all-reduce(%p1, %s, /*index=2*/%p1), channel_id=2
  %s = f32[] constant(0)
  %ag = f32[8,768]{1,0} all-gather(%p1), dimensions={0}
  %ars = (f32[768]{0}, u32[]) all-reduce-start(%p1)
  %ard = f32[768]{0} all-reduce-done(%ars)
}
"""


def test_hlo_collective_bytes_counts_operands_once():
    out = hlo_collective_bytes(HLO)
    assert out["all-reduce"] == 2 * 1024 * 768 * 4 + (768 * 4 + 4 + 768 * 4) + 768 * 4
    assert out["all-gather"] == 768 * 4  # the operand, not the gathered result
    assert out["reduce-scatter"] == out["collective-permute"] == 0


def test_bench_fidelity_json_reports_every_case():
    result = CliRunner().invoke(app, ["bench", "fidelity", "--no-compute", "--json"])
    payload = json.loads(result.stdout)
    cases = payload["cases"]
    assert {c["name"] for c in cases} == {
        "gpt2-small block DP8",
        "gpt2-small block DP4xTP2",
        "gpt2-small block DP2xTP4",
    }
    for case in cases:
        assert set(case) == {"name", "metric", "predicted", "measured", "rel_err", "tolerance", "ok"}
    communication = [c for c in cases if c["metric"].endswith("bytes") and "memory" not in c["metric"]]
    assert all(c["ok"] for c in communication), communication
    memory = [c for c in cases if c["metric"] == "peak memory bytes"]
    assert all(abs(c["rel_err"]) < 0.15 for c in memory), memory
    # exit code 1 exactly when some case misses its tolerance
    assert result.exit_code == (0 if all(c["ok"] for c in cases) else 1)


def test_bench_dag_json_has_every_field_and_milp_is_never_worse():
    result = CliRunner().invoke(app, ["bench", "dag", "--quick", "--time-limit-s", "1", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["instances"]
    assert len(rows) >= 10
    for row in rows:
        assert {"name", "milp", "heft", "cpop", "exhaustive"} <= set(row)
        assert {"makespan", "bound", "gap", "solve_s"} <= set(row["milp"])
        assert row["milp"]["makespan"] <= row["heft"] + 1e-9
        if row["exhaustive"] is not None:
            assert row["milp"]["makespan"] == pytest.approx(row["exhaustive"], rel=1e-6)


def test_bench_replan_json_reports_warm_and_cold_for_every_re_plan():
    result = CliRunner().invoke(app, ["bench", "replan", "--quick", "--json"])
    assert result.exit_code == 0, result.output
    cases = json.loads(result.stdout)["cases"]
    names = [case["name"] for case in cases]
    assert any(name.startswith("cache") for name in names)
    assert any(name.startswith("exact") for name in names)
    assert any(name.startswith("migration") for name in names)
    for case in cases:
        assert case["ok"], case
        if not case["name"].startswith("cache"):
            assert {"warm_s", "cold_s", "objective_warm", "objective_cold"} <= case.keys()
    migration = next(case for case in cases if case["name"].startswith("migration"))
    assert migration["layers_moved_warm"] == 0 < migration["layers_moved_cold"]


def test_bench_planner_json_has_every_field_and_the_ilp_is_never_worse():
    result = CliRunner().invoke(app, ["bench", "planner", "--quick", "--time-limit-s", "5", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["instances"]
    assert [r["preset"] for r in rows] == [None] * 6 + ["a100x8", "mixed-a100-v100"]
    for row in rows:
        assert {"name", "preset", "ilp", "baselines", "exhaustive"} <= set(row)
        if row["ilp"] is None:  # an infeasible random chain: enumeration finds nothing either
            assert row["exhaustive"] is None
            continue
        assert {"objective", "bound", "gap", "solve_s"} <= set(row["ilp"])
        assert row["ilp"]["bound"] <= row["ilp"]["objective"] * (1 + 1e-9)
        for baseline in row["baselines"].values():
            assert baseline is None or row["ilp"]["objective"] <= baseline * (1 + 1e-9)
        if row["preset"] is None:
            assert row["ilp"]["objective"] == pytest.approx(row["exhaustive"], rel=1e-6)


def test_bench_executor_prints_its_tables_and_exits_1_on_a_miss(monkeypatch):
    """The command's printing, on a made-up result (the real run takes minutes: ``orchestrator.bench.executor.run``)."""
    import orchestrator.bench.executor as bench

    result = {
        "cases": [
            {"name": "gpt-tiny DP8", "metric": "parity", "ok": True, "loss_rel_err": 1e-7},
            {"name": "gpt-tiny DP8 stage 0", "metric": "forward+backward s (alone)", "ok": False, "repeat_err": 0.02},
        ],
        "ranking": [{"plan": "DP8", "measured_s": 0.015, "simulated_s": 0.016}],
        "controls": [
            {"name": "gpt-tiny DP8 stage 0", "stage_ms": 14.7, "warm_over_cold": 1.04, "layers_over_stage": 1.24},
            {"name": "gpt-tiny 4 stages TP 1/2/4/1 stage 0", "stage_ms": 0.21, "warm_over_cold": 0.69},
        ],
    }
    monkeypatch.setattr(bench, "run", lambda progress=None, quick=False: result)
    printed = CliRunner().invoke(app, ["bench", "executor"])
    assert printed.exit_code == 1  # one case missed
    for text in (
        "step time: measured vs simulated",
        "stage times measured two other ways",
        "1.24",
        "0.69",
        "1/2 cases",
    ):
        assert text in printed.output
    as_json = CliRunner().invoke(app, ["bench", "executor", "--json"])
    assert json.loads(as_json.stdout) == result
