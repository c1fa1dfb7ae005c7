"""``orchestrator train`` and ``resume`` are transactional: a run directory appears only for a run that passes
validation, a plan for another model, cluster or device set is refused, devices are never made up."""

import json

import pytest
import yaml
from typer.testing import CliRunner

from integrations.flax import RunConfig
from orchestrator.cli import app
from orchestrator.planner import Plan

runner = CliRunner()
TRAIN = ["train", "--recipe", "gpt-tiny", "--batch", "16", "--seq", "16", "--steps", "2", "--time-limit-s", "60"]


def refused(args, expected: str) -> str:
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    *progress, line = result.stderr.strip().splitlines()  # progress lines, when piped, come first
    assert not any(p.startswith("error: ") for p in progress), progress
    assert expected in line, line
    return line


@pytest.fixture(scope="module")
def tiny_plan(tmp_path_factory):
    """gpt-tiny planned on a100x8 at batch 16 × 16 tokens, as ``orchestrator plan --out`` writes it."""
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    args = ["plan", "--recipe", "gpt-tiny", "--batch", "16", "--seq", "16", "--time-limit-s", "60", "--out", str(path)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    return path


def test_a_run_that_fails_validation_leaves_no_run_directory(tmp_path):
    run_dir = tmp_path / "run"
    refused([*TRAIN, "--run-dir", str(run_dir), "--seq", "100000"], "max_seq_len 64")
    refused([*TRAIN, "--run-dir", str(run_dir), "--cluster", "mixed-a100-v100"], "has 32 devices and there are 8")
    refused([*TRAIN, "--run-dir", str(run_dir), "--devices", "16"], "--devices 16: there are 8 jax devices here")
    refused([*TRAIN, "--run-dir", str(run_dir), "--recipe", "gpt-5"], "unknown recipe 'gpt-5'")
    refused([*TRAIN, "--run-dir", str(run_dir), "--plan", str(tmp_path)], "is a directory")
    (tmp_path / "plan.json").write_bytes(b"\xff\xfe")
    refused([*TRAIN, "--run-dir", str(run_dir), "--plan", str(tmp_path / "plan.json")], "is not UTF-8 text")
    assert not run_dir.exists()


def test_a_run_that_fails_before_its_first_checkpoint_is_taken_away(tmp_path):
    # 8 devices (as many as jax has) too small for any plan: planning fails inside the run, after run.json
    cluster = {
        "name": "tiny-memory",
        "device_types": {"a": {"peak_tflops": {"float32": 1}, "memory_bytes": 1000, "memory_bandwidth_gbps": 10}},
        "hosts": [{"name": "h", "device_type": "a", "count": 8, "intra_link": {"bandwidth_gbps": 10, "latency_us": 1}}],
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cluster))
    run_dir = tmp_path / "run"
    args = [*TRAIN, "--run-dir", str(run_dir), "--cluster", str(path)]
    first = refused(args, "")
    assert not run_dir.exists()
    assert refused(args, "") == first  # the retry meets the same error, not "already holds a run"


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--recipe", "gpt2-small", "--seq", "16"], "made for recipe 'gpt-tiny', and this run trains 'gpt2-small'"),
        (["--batch", "32"], "plans a global batch of 16, and this run's is 32"),
        (["--seq", "32"], "made for sequence length 16, and this run's is 32"),
        (["--cluster", "local"], "made for cluster 'a100x8' (8 devices), and this run is on 'local'"),
        (["--cluster", "a100x8", "--devices", "4"], "which is not in service on 'a100x8'"),
    ],
    ids=["another model", "another batch", "another sequence length", "another cluster", "fewer devices"],
)
def test_train_refuses_a_plan_for_another_run(tmp_path, tiny_plan, args, expected):
    run_dir = tmp_path / "run"
    refused([*TRAIN, "--run-dir", str(run_dir), "--cluster", "a100x8", "--plan", str(tiny_plan), *args], expected)
    assert not run_dir.exists()


def test_train_refuses_a_plan_for_a_users_own_model(tmp_path, tiny_plan):
    data = json.loads(tiny_plan.read_text())
    data["source"] = {"model": "mypkg.model:build", **{k: v for k, v in data["source"].items() if k != "recipe"}}
    (tmp_path / "plan.json").write_text(json.dumps(data))
    args = [*TRAIN, "--run-dir", str(tmp_path / "run"), "--cluster", "a100x8", "--plan", str(tmp_path / "plan.json")]
    refused(args, "it was made for the model 'mypkg.model:build', and this run trains the recipe 'gpt-tiny'")


def test_resume_refuses_a_cluster_larger_than_the_devices_here(tmp_path):
    RunConfig(steps=2, cluster="mixed-a100-v100", metadata={"recipe": "gpt-tiny"}).save(tmp_path)
    before = (tmp_path / "run.json").read_text()
    refused(["resume", str(tmp_path)], "cluster 'mixed-a100-v100' has 32 devices and there are 8 jax devices here")
    refused(["resume", str(tmp_path), "--devices", "9"], "--devices 9: there are 8 jax devices here")
    assert (tmp_path / "run.json").read_text() == before


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("steps", "many", "RunConfig.steps must be a whole number >= 1, got 'many'"),
        ("time_limit_s", float("nan"), "RunConfig.time_limit_s must be a finite number > 0, got nan"),
        ("keep", 2.5, "RunConfig.keep must be a whole number >= 1, got 2.5"),
        ("metadata", [], "RunConfig.metadata must be a JSON object"),
    ],
)
def test_a_corrupt_run_json_is_one_line(tmp_path, field, value, expected):
    RunConfig(steps=2, metadata={"recipe": "gpt-tiny"}).save(tmp_path)
    data = json.loads((tmp_path / "run.json").read_text())
    data[field] = value
    (tmp_path / "run.json").write_text(json.dumps(data))
    line = refused(["resume", str(tmp_path)], "is not a run configuration")
    assert expected in line


def test_train_plan_runs_what_was_planned_from_any_directory(tmp_path, tiny_plan, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["train", "--run-dir", "run", "--plan", str(tiny_plan), "--steps", "1"])
    assert result.exit_code == 0, result.output
    config = RunConfig.load(tmp_path / "run")
    assert config.cluster == str(tmp_path / "run" / "cluster.yaml")  # the plan's cluster travels with the run
    assert {k: config.metadata[k] for k in ("recipe", "global_batch", "seq_len")} == {
        "recipe": "gpt-tiny",
        "global_batch": 16,
        "seq_len": 16,
    }
    assert config.plan.stages == Plan.load(tiny_plan).stages
