"""The Perfetto/Chrome trace: a strict check of the trace-event format, and coverage of every step.

Perfetto's own trace processor (``pip install perfetto``) downloads its
binary at first use, which this machine cannot; ``validate`` below checks the
JSON Object Format of the Trace Event Format as Perfetto's JSON importer
reads it: the top level, every field's type per phase, µs timestamps, and
that every process and thread an event uses is named by metadata.
"""

import collections
import itertools
import json
import math

import pytest

from orchestrator.simulate import simulate, trace_json, write_trace
from tests.orchestrator.simulate._plans import hand_plan, tiny_model
from tests.orchestrator.simulate.test_engine import _plan, _stage

REQUIRED = {
    "X": {"name": str, "ph": str, "pid": int, "tid": int, "ts": (int, float), "dur": (int, float)},
    "M": {"name": str, "ph": str, "pid": int, "tid": int, "args": dict},
    "C": {"name": str, "ph": str, "pid": int, "ts": (int, float), "args": dict},
}
METADATA = {"process_name", "thread_name", "process_sort_index", "thread_sort_index"}


def validate(trace: dict) -> list[dict]:
    """Raise AssertionError on anything Perfetto's JSON importer would reject or misplace; return the events."""
    assert set(trace) <= {"traceEvents", "displayTimeUnit", "otherData"}
    assert trace.get("displayTimeUnit", "ms") in ("ms", "ns")
    events = trace["traceEvents"]
    assert isinstance(events, list) and events
    named_processes, named_threads, used = set(), set(), set()
    for e in events:
        assert isinstance(e, dict)
        ph = e.get("ph")
        assert ph in REQUIRED, f"unexpected phase {ph!r}"
        for key, kind in REQUIRED[ph].items():
            assert key in e, f"{ph} event without {key!r}: {e}"
            assert isinstance(e[key], kind) and not isinstance(e[key], bool), f"{key} of {e} is not {kind}"
        for key in ("ts", "dur"):
            if key in e:
                assert math.isfinite(e[key]) and e[key] >= 0, f"{key} of {e}"
        if "args" in e:
            assert isinstance(e["args"], dict)
        if ph == "M":
            assert e["name"] in METADATA
            if e["name"] == "process_name":
                assert isinstance(e["args"]["name"], str)
                named_processes.add(e["pid"])
            if e["name"] == "thread_name":
                assert isinstance(e["args"]["name"], str)
                named_threads.add((e["pid"], e["tid"]))
        elif ph == "X":
            used.add((e["pid"], e["tid"]))
        elif ph == "C":
            assert all(isinstance(v, (int, float)) for v in e["args"].values())
            named_threads.add((e["pid"], 0))
            used.add((e["pid"], 0))
    assert {pid for pid, _ in used} <= named_processes
    assert {u for u in used if u[1]} <= named_threads
    json.loads(json.dumps(trace, allow_nan=False))  # strict JSON: no NaN or Infinity
    return events


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_trace_is_valid_and_covers_every_step_once_per_device(tmp_path, schedule):
    model = tiny_model()
    plan = hand_plan(model, schedule, microbatches=4)
    timeline = simulate(plan, model)
    write_trace(timeline, tmp_path / "trace.json")
    events = validate(json.loads((tmp_path / "trace.json").read_text()))
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    S, M = len(plan.stages), plan.microbatches
    per_thread = collections.defaultdict(list)
    for e in events:
        if e["ph"] == "X" and e["cat"] in ("forward", "backward"):
            per_thread[names[(e["pid"], e["tid"])].split()[0]].append(
                (e["args"]["stage"], e["args"]["microbatch"], e["cat"])
            )
    devices = {ref: s for s, stage in enumerate(plan.stages) for ref in stage.devices}
    assert set(per_thread) == set(devices)
    for ref, steps in per_thread.items():  # each device: each of its stage's (microbatch, phase) exactly once
        assert sorted(steps) == sorted(itertools.product([devices[ref]], range(M), ["forward", "backward"]))
    transfers = collections.Counter(
        (e["args"]["stage"], e["args"]["microbatch"], e["cat"])
        for e in events
        if e["ph"] == "X" and e["cat"].startswith("send")
    )
    # DP 2 → DP 2: two messages per (stage boundary, microbatch, direction)
    assert transfers == {k: 2 for k in itertools.product(range(S - 1), range(M), ["send_activation", "send_gradient"])}
    hosts = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert hosts == {"a-0", "a-1", "b-0", "b-1", "network"}
    counters = {e["name"] for e in events if e["ph"] == "C"}
    assert counters == {f"memory/device stage {s}" for s in range(S)}
    # in µs: the last event ends at the simulated step time
    end = max(e["ts"] + e["dur"] for e in events if e["ph"] == "X")
    assert end == pytest.approx(timeline.iteration_s * 1e6, abs=2e-6)  # rounded to the picosecond


def test_trace_without_the_cost_model():
    timeline = simulate(_plan([_stage("h/0", f=1.0, b=2.0, send=0.5), _stage("h/1", f=1.0, b=2.0)], 3, "1f1b"))
    events = validate(trace_json(timeline))
    assert sum(1 for e in events if e["ph"] == "X" and e["cat"] == "forward") == 6
    assert {next(iter(e["args"])) for e in events if e["ph"] == "C"} == {"microbatches"}
