"""Chrome trace-event JSON of a timeline, for ui.perfetto.dev (or chrome://tracing).

Format (the "JSON Array/Object Format" of the Trace Event Format):
``{"traceEvents": [...], "displayTimeUnit": "ms"}`` with

* ``"ph": "M"`` metadata naming each process (a host, plus one ``network``
  process) and thread (a device; on ``network`` a link resource or a stage's
  gradient-sync stream), with sort indices so stages read top to bottom;
* ``"ph": "X"`` complete events, ``ts``/``dur`` in microseconds: every
  forward, backward and optimizer step on every device of its stage (args:
  stage, microbatch, phase), every transfer message on its link thread, every
  gradient-sync bucket on its stage's sync thread;
* ``"ph": "C"`` counters: per-device memory of each stage (bytes, or
  microbatches in flight without the cost model) in its first device's host.
"""

from __future__ import annotations

import json
from pathlib import Path

from orchestrator.simulate._timeline import Timeline

_NAMES = {"forward": "F", "backward": "B", "send_activation": "act", "send_gradient": "grad"}


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 6)


def trace_json(timeline: Timeline) -> dict:
    """The trace as a JSON-ready dict (see the module docstring)."""
    hosts: dict[str, int] = {}
    threads: dict[str, tuple[int, int]] = {}
    for stats in timeline.stage_stats:
        for ref in stats.devices:
            host = ref.split("/")[0]
            pid = hosts.setdefault(host, len(hosts) + 1)
            threads.setdefault(ref, (pid, len(threads) + 1))
    network = len(hosts) + 1
    links = sorted({r for e in timeline.events if e.kind != "dp_sync" for r in e.resources})
    link_tid = {r: k + 1 for k, r in enumerate(links)}
    sync_tid = {s.stage: len(links) + 1 + s.stage for s in timeline.stage_stats}

    out: list[dict] = []

    def meta(name: str, pid: int, tid: int, args: dict) -> None:
        out.append({"ph": "M", "name": name, "pid": pid, "tid": tid, "args": args})

    for host, pid in hosts.items():
        meta("process_name", pid, 0, {"name": host})
        meta("process_sort_index", pid, 0, {"sort_index": pid})
    stage_of = {ref: s.stage for s in timeline.stage_stats for ref in s.devices}
    for ref, (pid, tid) in threads.items():
        meta("thread_name", pid, tid, {"name": f"{ref} (stage {stage_of[ref]})"})
        meta("thread_sort_index", pid, tid, {"sort_index": tid})
    meta("process_name", network, 0, {"name": "network"})
    meta("process_sort_index", network, 0, {"sort_index": network})
    for r, tid in link_tid.items():
        meta("thread_name", network, tid, {"name": f"link {r}"})
    for s, tid in sync_tid.items():
        meta("thread_name", network, tid, {"name": f"dp-sync stage {s}"})

    devices = {s.stage: s.devices for s in timeline.stage_stats}
    for e in timeline.events:
        args = {"stage": e.stage, "microbatch": e.microbatch, "phase": e.kind}
        if e.kind in ("forward", "backward", "optimizer"):
            name = f"{_NAMES[e.kind]}{e.microbatch}" if e.microbatch is not None else "optimizer"
            for ref in devices[e.stage]:
                pid, tid = threads[ref]
                out.append(_complete(name, e.kind, pid, tid, e.start_s, e.end_s, args))
        elif e.kind == "dp_sync":
            name = f"sync layer {e.layer}" if e.layer is not None else f"sync stage {e.stage}"
            args |= {"layer": e.layer, "links": list(e.resources)}
            out.append(_complete(name, e.kind, network, sync_tid[e.stage], e.start_s, e.end_s, args))
        else:
            nxt = (e.stage + 1) % timeline.stages  # the last stage's transfers cross the wrap to the first
            src, dst = (e.stage, nxt) if e.kind == "send_activation" else (nxt, e.stage)
            args |= {"from_stage": src, "to_stage": dst, "bytes": e.nbytes, "blocking": e.blocking}
            name = f"{_NAMES[e.kind]}{e.microbatch} s{src}→s{dst}"
            out.append(_complete(name, e.kind, network, link_tid[e.resources[0]], e.start_s, e.end_s, args))
    for series in timeline.memory:
        pid = threads[series.devices[0]][0]
        values = series.bytes if series.bytes is not None else series.in_flight
        unit = "bytes" if series.bytes is not None else "microbatches"
        for t, v in zip(series.times_s, values):
            out.append(
                {"ph": "C", "name": f"memory/device stage {series.stage}", "pid": pid, "ts": _us(t), "args": {unit: v}}
            )
    return {
        "traceEvents": out,
        "displayTimeUnit": "ms",
        "otherData": {
            "schedule": timeline.schedule,
            "iteration_s": timeline.iteration_s,
            "closed_form_s": timeline.closed_form_s,
            "bubble_fraction": timeline.bubble_fraction,
        },
    }


def _complete(name: str, cat: str, pid: int, tid: int, start_s: float, end_s: float, args: dict) -> dict:
    return {
        "ph": "X",
        "name": name,
        "cat": cat,
        "pid": pid,
        "tid": tid,
        "ts": _us(start_s),
        "dur": _us(end_s - start_s),
        "args": args,
    }


def write_trace(timeline: Timeline, path: str | Path) -> None:
    """Write :func:`trace_json` to ``path`` (open it at ui.perfetto.dev)."""
    Path(path).write_text(json.dumps(trace_json(timeline)))
