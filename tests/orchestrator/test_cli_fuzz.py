"""Fuzzing the command line with mutated cluster YAMLs and plan JSONs (issue 37).

Each example takes a valid file, replaces, deletes or adds a few fields anywhere in it (or garbles its
bytes), and runs a command on it in process. Whatever the file holds, the command ends in exit 0 or a
one-line error with exit 2, never a traceback or a hang, and what it accepts holds no non-finite or
meaningless number. Examples are bounded and derandomized, so the test is the same on every run.
"""

import contextlib
import copy
import json
import math
import signal

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from orchestrator.cli import app
from orchestrator.cluster import ClusterError, load_cluster
from orchestrator.planner import Plan

runner = CliRunner()

CLUSTER = {
    "name": "fuzz",
    "device_types": {
        "a": {
            "peak_tflops": {"float32": 19.5, "bfloat16": 312},
            "memory_bytes": 80 * 2**30,
            "memory_bandwidth_gbps": 2000,
        },
        "b": {"peak_tflops": {"float32": 14}, "memory_bytes": 32 * 2**30, "memory_bandwidth_gbps": 900},
    },
    "hosts": [
        {
            "name": "h0",
            "device_type": "a",
            "count": 2,
            "rack": "r0",
            "intra_link": {"bandwidth_gbps": 300, "latency_us": 2},
        },
        {
            "name": "h1",
            "device_type": "b",
            "count": 2,
            "rack": "r1",
            "intra_link": {"bandwidth_gbps": 150, "latency_us": 2},
        },
    ],
    "network": {"rack": {"bandwidth_gbps": 25, "latency_us": 5}, "cluster": {"bandwidth_gbps": 12.5, "latency_us": 10}},
}

# values a hand edit, a typo or a bad tool could leave in a field
ODD = st.sampled_from(
    [
        math.inf,
        -math.inf,
        math.nan,
        0,
        -1,
        0.5,
        10**30,
        2**63,
        1e308,
        1e-300,
        "",
        "x",
        "1 GB",
        None,
        True,
        [],
        {},
        [1, 2],
    ]
)
# plausible values too, so that some mutated files are accepted and what is accepted gets checked
PLAUSIBLE = st.integers(0, 64) | st.floats(0, 1e3) | st.sampled_from(["h0", "h1", "a", "b", "r0", "float16", "gpipe"])
VALUES = ODD | PLAUSIBLE | PLAUSIBLE | st.integers() | st.floats() | st.text(max_size=6)


def _nodes(tree, path=()):
    """Every path into ``tree`` (dict keys and list indices), the root excepted."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    for key, child in items:
        yield (*path, key)
        yield from _nodes(child, (*path, key))


@st.composite
def mutated(draw, base: dict) -> dict:
    """``base`` with one or two fields replaced by an odd value, deleted, or joined by an unknown one."""
    data = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 2))):
        paths = list(_nodes(data))
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = data
        for key in path[:-1]:
            parent = parent[key]
        action = draw(st.sampled_from(["replace", "replace", "delete", "add"]))
        if action == "replace":
            parent[path[-1]] = draw(VALUES)
        elif action == "delete":
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[draw(st.text(min_size=1, max_size=8))] = draw(VALUES)
    return data


@st.composite
def garbled(draw, text: str) -> bytes:
    """``text`` as bytes with a short run replaced by arbitrary bytes (not UTF-8, cut short, ...)."""
    raw = text.encode()
    start = draw(st.integers(0, len(raw)))
    end = draw(st.integers(start, min(len(raw), start + 16)))
    return raw[:start] + draw(st.binary(max_size=8)) + raw[end:]


@contextlib.contextmanager
def _no_hang(seconds: int = 120):
    """Fail instead of waiting forever: a command that hangs is the bug this test looks for."""

    def hung(signum, frame):
        raise AssertionError(f"the command ran past {seconds} s")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def run(args) -> object:
    """The command's result, checked: exit 0, or exit 2 with one line on stderr; never a traceback."""
    with _no_hang():
        result = runner.invoke(app, args)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code in (0, 2), result.output
    assert "Traceback" not in result.output
    event(f"{args[0]}: exit {result.exit_code}")
    if result.exit_code == 2:
        *progress, line = result.stderr.strip().splitlines()  # progress lines, when piped, come first
        assert not any(p.startswith("error: ") for p in progress), progress
        assert line.startswith("error: ")
    return result


def _finite(tree) -> bool:
    """Every number in ``tree`` (a JSON-like value) is finite."""
    if isinstance(tree, dict):
        return all(_finite(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return all(_finite(v) for v in tree)
    return not isinstance(tree, float) or math.isfinite(tree)


def _check_accepted_cluster(path) -> None:
    """A cluster the CLI accepted: every rate, size and time finite and meaningful."""
    try:
        cluster = load_cluster(path)
    except ClusterError:
        pytest.fail("the command accepted a cluster file that load_cluster refuses")
    for dtype in cluster.device_types.values():
        assert dtype.peak_flops and all(0 < v < math.inf for v in dtype.peak_flops.values())
        assert 0 < dtype.memory_bytes < 2**60 and 0 < dtype.memory_bandwidth_bytes_per_s < math.inf
    links = [h.intra_link for h in cluster.hosts] + [cluster.rack_link, cluster.cluster_link]
    for link in [*links, *cluster.overrides.values()]:
        if link is not None:
            assert 0 < link.bandwidth_bytes_per_s < math.inf and 0 <= link.latency_s < math.inf
    assert all(0 < h.count <= 128 for h in cluster.hosts)


FUZZ = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@FUZZ
@given(data=mutated(CLUSTER))
def test_mutated_cluster_files_are_accepted_sound_or_refused_in_one_line(tmp_path, data):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    if run(["cluster", "show", str(path)]).exit_code == 0:
        _check_accepted_cluster(path)


@FUZZ
@given(raw=garbled(yaml.safe_dump(CLUSTER)))
def test_garbled_cluster_bytes_are_accepted_sound_or_refused_in_one_line(tmp_path, raw):
    path = tmp_path / "c.yaml"
    path.write_bytes(raw)
    if run(["cluster", "show", str(path)]).exit_code == 0:
        _check_accepted_cluster(path)


@settings(FUZZ, max_examples=6)
@given(data=mutated(CLUSTER))
def test_plan_on_a_mutated_cluster_plans_or_refuses_in_one_line(tmp_path, data):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    args = ["plan", "--recipe", "gpt-tiny", "--cluster", str(path), "--batch", "8", "--time-limit-s", "2", "--json"]
    result = run(args)
    payload = json.loads(result.stdout)
    assert ("error" in payload) == (result.exit_code == 2)
    if result.exit_code == 0:
        assert _finite(payload)


@pytest.fixture(scope="module")
def plan_json():
    """gpt-tiny planned on the fuzz cluster (the cluster embedded in the plan's source)."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "c.yaml"
        path.write_text(yaml.safe_dump(CLUSTER))
        args = [
            "plan",
            "--recipe",
            "gpt-tiny",
            "--cluster",
            str(path),
            "--batch",
            "8",
            "--time-limit-s",
            "60",
            "--json",
        ]
        result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _simulate_checked(path) -> None:
    result = run(["simulate", str(path), "--json"])
    if result.exit_code == 0:
        assert _finite(Plan.load(path).to_json())
        assert _finite(json.loads(result.stdout))


@FUZZ
@given(data=st.data())
def test_mutated_plans_without_their_model_simulate_or_refuse_in_one_line(tmp_path, plan_json, data):
    # without a source the simulator replays the plan's own numbers: no capture, so many examples are cheap
    plan = data.draw(mutated({k: v for k, v in plan_json.items() if k != "source"}))
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    _simulate_checked(path)


@settings(FUZZ, max_examples=8)
@given(data=st.data())
def test_mutated_plans_with_their_model_simulate_report_or_refuse_in_one_line(tmp_path, plan_json, data):
    plan = data.draw(mutated(plan_json))
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    _simulate_checked(path)
    run(["report", str(path), "--html", str(tmp_path / "r.html")])


@settings(FUZZ, max_examples=20)
@given(data=st.data())
def test_garbled_plan_bytes_are_refused_in_one_line_or_read_soundly(tmp_path, plan_json, data):
    raw = data.draw(garbled(json.dumps({k: v for k, v in plan_json.items() if k != "source"})))
    path = tmp_path / "plan.json"
    path.write_bytes(raw)
    _simulate_checked(path)


# train and resume are fuzzed on a 32-device cluster, which the 8 devices here cannot run: a file that
# passes validation ends at that refusal, so no example trains
ELSEWHERE = ["--cluster", "mixed-a100-v100"]


@settings(FUZZ, max_examples=15)
@given(data=st.data())
def test_train_with_a_mutated_plan_refuses_in_one_line(tmp_path, plan_json, data):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data.draw(mutated(plan_json))))
    run_dir = tmp_path / "run"
    result = run(["train", "--run-dir", str(run_dir), "--plan", str(path), *ELSEWHERE])
    assert result.exit_code == 2 and not (run_dir / "run.json").exists()


@settings(FUZZ, max_examples=15)
@given(data=st.data())
def test_resume_of_a_mutated_run_json_refuses_in_one_line(tmp_path, plan_json, data):
    from integrations.flax import RunConfig
    from recipes import RecipeRun

    recipe = RecipeRun(recipe="gpt-tiny", global_batch=8, seq_len=16)
    config = RunConfig(steps=4, plan=Plan.from_json(plan_json), metadata=recipe.to_json())
    (tmp_path / "run.json").write_text(json.dumps(data.draw(mutated(config.to_json()))))
    assert run(["resume", str(tmp_path), *ELSEWHERE]).exit_code == 2
