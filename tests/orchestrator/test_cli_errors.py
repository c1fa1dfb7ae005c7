"""User mistakes on the command line: one line on stderr, exit 2, ``{"error": ...}`` on stdout under --json.

Each case is a row of issue 37's table of bad inputs, or a mistake of the same kind in another command.
"""

import json

import pytest
import yaml
from typer.testing import CliRunner

from orchestrator.cli import app

runner = CliRunner()

SMALL = {
    "name": "small",
    "device_types": {
        "a": {"peak_tflops": {"float32": 19.5}, "memory_bytes": 80 * 2**30, "memory_bandwidth_gbps": 2000}
    },
    "hosts": [{"name": "h", "device_type": "a", "count": 4, "intra_link": {"bandwidth_gbps": 300, "latency_us": 2}}],
}


def one_line_error(args, expected: str, *, also_json: bool = True) -> str:
    """Run ``args`` (and with --json unless not ``also_json``): exit 2, one error line naming ``expected``, the same
    error as JSON on stdout."""
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    *progress, line = result.stderr.strip().splitlines()  # progress lines, when piped, come first
    assert not any(p.startswith("error: ") for p in progress), progress
    assert line.startswith("error: ") and expected in line, line
    if not also_json:
        return line
    as_json = runner.invoke(app, [*args, "--json"])
    assert as_json.exit_code == 2, as_json.output
    assert json.loads(as_json.stdout) == {"error": line.removeprefix("error: ")}
    return line


@pytest.fixture(scope="module")
def plan_json():
    """A plan of gpt-tiny on a100x8, as ``orchestrator plan --json`` prints it."""
    planned = runner.invoke(app, ["plan", "--recipe", "gpt-tiny", "--batch", "8", "--time-limit-s", "60", "--json"])
    assert planned.exit_code == 0, planned.output
    return json.loads(planned.stdout)


def _cluster_file(tmp_path, edit=None, name="c.yaml"):
    data = json.loads(json.dumps(SMALL))
    if edit:
        edit(data)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def test_absurd_batch_is_refused_with_the_largest_accepted():
    one_line_error(["plan", "--recipe", "gpt-tiny", "--batch", "100000000", "--time-limit-s", "5"], "65536")


def test_sequence_past_the_model_is_one_line():
    one_line_error(["plan", "--recipe", "gpt2-small", "--seq", "2048"], "max_seq_len 1024; pass --seq 1024 or less")
    one_line_error(["profile", "--recipe", "gpt-tiny", "--seq-len", "100"], "max_seq_len 64; pass --seq-len 64")
    one_line_error(["graph", "--recipe", "gpt-tiny", "--seq-len", "100"], "max_seq_len 64; pass --seq-len 64")


def test_options_out_of_range_and_unknown_options_are_one_line():
    one_line_error(["plan", "--batch", "0"], "--batch")
    one_line_error(["plan", "--max-stages", "1000"], "--max-stages")
    one_line_error(["plan", "--time-limit-s", "inf"], "--time-limit-s")
    one_line_error(["plan", "--bogus"], "No such option: --bogus")
    one_line_error(["cluster", "show"], "Missing argument", also_json=False)


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda d: d["hosts"][0].update(count=10**30), "hosts[0].count: Input should be less than or equal to 128"),
        (lambda d: d["hosts"][0].update(count=10_000_000), "hosts[0].count: Input should be less than or equal to 128"),
        (
            lambda d: d["hosts"][0]["intra_link"].update(bandwidth_gbps=float("inf")),
            "hosts[0].intra_link.bandwidth_gbps: Input should be a finite number",
        ),
        (lambda d: d["device_types"]["a"].update(peak_tflops={"int8": 624}), "needs a floating-point peak"),
    ],
    ids=["count 1e30", "count 1e7", "infinite bandwidth", "only an int8 peak"],
)
def test_bad_cluster_files_are_refused_by_plan(tmp_path, edit, expected):
    path = _cluster_file(tmp_path, edit)
    one_line_error(["plan", "--recipe", "gpt-tiny", "--cluster", str(path)], expected)


def test_unreadable_cluster_and_plan_files_are_one_line(tmp_path):
    (tmp_path / "dir.yaml").mkdir()
    (tmp_path / "dir.json").mkdir()
    (tmp_path / "bytes.yaml").write_bytes(b"name: \xff\xfe\n")
    (tmp_path / "bytes.json").write_bytes(b'{"stages": "\xff"}')
    plan = ["plan", "--recipe", "gpt-tiny", "--cluster"]
    one_line_error([*plan, str(tmp_path / "dir.yaml")], "is a directory; expected a cluster YAML file")
    one_line_error([*plan, str(tmp_path / "bytes.yaml")], "is not UTF-8 text")
    one_line_error(["simulate", str(tmp_path / "dir.json")], "is a directory")
    one_line_error(["simulate", str(tmp_path / "bytes.json")], "is not UTF-8 text")
    report = ["report", str(tmp_path / "dir.json"), "--html", str(tmp_path / "r.html")]
    one_line_error(report, "is a directory", also_json=False)


def test_infeasible_plan_under_json_prints_the_error_on_stdout(tmp_path):
    path = _cluster_file(tmp_path, lambda d: d["device_types"]["a"].update(memory_bytes=1000))
    # a limit the diagnosis never reaches, so the text and the JSON runs say the same on a busy machine
    one_line_error(["plan", "--recipe", "gpt-tiny", "--cluster", str(path), "--time-limit-s", "120"], "")


def test_a_plan_simulates_and_reports_from_any_directory(tmp_path, monkeypatch):
    made, elsewhere = tmp_path / "made", tmp_path / "elsewhere"
    made.mkdir()
    elsewhere.mkdir()
    monkeypatch.chdir(made)
    _cluster_file(made, name="my.yaml")
    args = ["plan", "--recipe", "gpt-tiny", "--cluster", "my.yaml", "--batch", "8", "--time-limit-s", "60"]
    planned = runner.invoke(app, [*args, "--out", "plan.json"])
    assert planned.exit_code == 0, planned.output
    here = runner.invoke(app, ["simulate", "plan.json", "--json"])
    assert here.exit_code == 0, here.output
    monkeypatch.chdir(elsewhere)
    plan_file = str(made / "plan.json")
    there = runner.invoke(app, ["simulate", plan_file, "--json"])
    assert there.exit_code == 0, there.output
    assert json.loads(there.stdout)["iteration_s"] == json.loads(here.stdout)["iteration_s"]
    report = runner.invoke(app, ["report", plan_file, "--html", "r.html"])
    assert report.exit_code == 0, report.output
    assert (elsewhere / "r.html").is_file()


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda p: p.update(iteration_s=float("nan")), "iteration_s must be a finite number"),
        (lambda p: p["stages"][0].update(tp=2.5), "stages[0].tp must be a whole number"),
        (lambda p: p["stages"][0].update(memory_bytes=float("inf")), "stages[0].memory_bytes must be a finite"),
        (lambda p: p.update(schedule="zigzag"), "schedule must be gpipe or 1f1b"),
        (lambda p: p.update(stages=[]), "a plan has at least one stage"),
        (lambda p: p["source"]["cluster_spec"]["hosts"][0].update(count=-1), "source.cluster_spec: hosts[0].count"),
    ],
    ids=["nan step time", "fractional tp", "infinite memory", "unknown schedule", "no stages", "bad embedded cluster"],
)
def test_meaningless_plan_files_are_one_line(tmp_path, plan_json, edit, expected):
    data = json.loads(json.dumps(plan_json))
    edit(data)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    one_line_error(["simulate", str(path)], expected)


def test_a_dtype_no_recipe_computes_in_is_one_line():
    one_line_error(["plan", "--recipe", "gpt-tiny", "--dtype", "float64"], "--dtype 'float64' is not one of")


def test_a_plan_in_bfloat16_keeps_its_dtype_for_simulate(tmp_path):
    """The plan records the dtype it was priced in; simulate rebuilds the same cost model from it."""
    out = tmp_path / "plan.json"
    args = ["plan", "--recipe", "gpt-tiny", "--cluster", "a100x8", "--batch", "8", "--dtype", "bfloat16"]
    result = runner.invoke(app, [*args, "--out", str(out), "--time-limit-s", "20"])
    assert result.exit_code == 0, result.output
    plan = json.loads(out.read_text())
    assert plan["source"]["dtype"] == "bfloat16"
    simulated = runner.invoke(app, ["simulate", str(out), "--json"])
    assert simulated.exit_code == 0, simulated.output
