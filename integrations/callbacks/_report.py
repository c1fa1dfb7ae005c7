"""``PlanReporter``: log the plan and write it, with a predicted schedule trace, when training starts.

The trace is the plan's schedule replayed with its predicted times: stage s
runs its (F | B, microbatch) list in the order :func:`orchestrator.simulate.stage_order`
gives (GPipe: all forwards then all backwards; 1F1B: ``min(S − s − 1, M)`` warm-up
forwards, then alternating), where

    start F(s, m) = max(end of s's previous op, end F(s−1, m) + send_{s−1})
    start B(s, m) = max(end of s's previous op, end B(s+1, m) + send_s)
    F lasts forward_s;  B lasts time_s − forward_s − 2·send_s

and the optimizer update (``dp_sync_s + optimizer_s``) follows each stage's
last backward. It is written in Chrome trace format (open in Perfetto or
chrome://tracing): one row per stage, times in microseconds.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from integrations.callbacks._base import Callback
from orchestrator.simulate import stage_order

log = logging.getLogger("orchestrator.executor")


def _orders(plan) -> list[list[tuple[str, int]]]:
    """Per stage, its ("F" | "B", microbatch) steps in the order :func:`orchestrator.simulate.stage_order` gives."""
    n = len(plan.stages)
    return [
        [("F" if phase == "forward" else "B", mb) for phase, mb in stage_order(plan.schedule, n, plan.microbatches, s)]
        for s in range(n)
    ]


def schedule_trace(plan) -> dict:
    """The plan's predicted schedule as a Chrome trace (``{"traceEvents": [...]}``); see module docstring."""
    n = len(plan.stages)
    orders = _orders(plan)
    end: dict[tuple[str, int, int], float] = {}
    clock = [0.0] * n
    position = [0] * n
    events = []
    while any(position[s] < len(orders[s]) for s in range(n)):
        progressed = False
        for s, stage in enumerate(plan.stages):
            if position[s] >= len(orders[s]):
                continue
            op, mb = orders[s][position[s]]
            if op == "F":
                dep = ("F", s - 1, mb) if s > 0 else None
                ready = end[dep] + plan.stages[s - 1].send_s if dep else 0.0
                duration = stage.forward_s
            else:
                dep = ("B", s + 1, mb) if s + 1 < n else ("F", s, mb)
                ready = end[dep] + (stage.send_s if s + 1 < n else 0.0) if dep in end else None
                duration = max(0.0, stage.time_s - stage.forward_s - 2 * stage.send_s)
            if dep is not None and dep not in end:
                continue
            start = max(clock[s], ready or 0.0)
            end[(op, s, mb)] = clock[s] = start + duration
            events.append(
                {"name": f"{op}{mb}", "ph": "X", "pid": 0, "tid": s, "ts": start * 1e6, "dur": duration * 1e6}
            )
            position[s] += 1
            progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {plan.schedule!r} deadlocked")
    for s, stage in enumerate(plan.stages):
        duration = stage.dp_sync_s + stage.optimizer_s
        events.append({"name": "update", "ph": "X", "pid": 0, "tid": s, "ts": clock[s] * 1e6, "dur": duration * 1e6})
    names = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": s, "args": {"name": f"stage {s}"}} for s in range(n)]
    return {"traceEvents": names + events, "displayTimeUnit": "ms"}


class PlanReporter(Callback):
    """At ``on_train_begin``: logs ``plan.explain()`` and writes ``plan.json``, ``plan.txt`` and ``trace.json``.

    Args:
      directory: where to write; created if missing. None: only log.
      plan: the plan, if the loop does not pass one to ``on_train_begin``.
    """

    def __init__(self, directory: str | Path | None = None, *, plan=None):
        self.directory = Path(directory) if directory is not None else None
        self.plan = plan
        self.written: list[Path] = []

    def on_train_begin(self, *, state=None, plan=None) -> None:
        plan = plan or self.plan
        if plan is None:
            raise ValueError("PlanReporter needs a plan: pass plan= to it or to on_train_begin")
        text = plan.explain()
        log.info("executing plan:\n%s", text)
        if self.directory is None:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        files = {
            "plan.json": json.dumps(plan.to_json(), indent=2),
            "plan.txt": text,
            "trace.json": json.dumps(schedule_trace(plan)),
        }
        for name, content in files.items():
            path = self.directory / name
            path.write_text(content)
            self.written.append(path)
