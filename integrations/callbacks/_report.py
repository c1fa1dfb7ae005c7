"""``PlanReporter``: log the plan and write it, with a predicted schedule trace, when training starts.

The trace is :func:`orchestrator.simulate.simulate` of the plan without a cost model: every
forward and backward (each virtual-stage chunk under interleaved 1F1B), each send of ``send_s``
seconds and each optimizer step at its predicted time, one row per device, in Chrome trace format
(open it at ui.perfetto.dev or chrome://tracing), with each stage's microbatches in flight as a
counter.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from integrations.callbacks._base import Callback
from orchestrator.simulate import simulate, trace_json

log = logging.getLogger("orchestrator.executor")


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
            "trace.json": json.dumps(trace_json(simulate(plan))),
        }
        for name, content in files.items():
            path = self.directory / name
            path.write_text(content)
            self.written.append(path)
