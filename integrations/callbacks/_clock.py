"""``StageClock``: a pipeline observer that times each stage's programs during a step.

It waits for every program call a pipeline step dispatches and adds the call's wall time, and the
process's CPU time during it, to its stage. Waiting serialises the stages; on virtual CPU devices
sharing a few cores they barely overlap anyway. It implements the Flax executor's observer hook
(:class:`~integrations.flax.PipelineObserver`) by its method names alone, so the callbacks need
not import a framework.
"""

from __future__ import annotations

import time

import jax


class StageClock:
    """Per stage, the seconds its programs ran during the last step a pipeline dispatched.

    Attributes:
      busy_s: wall seconds per stage; None until a pipeline step ran since :meth:`clear`.
      cpu_s: the CPU seconds this process spent while they ran: on virtual CPU devices the work
        itself, unaffected by other processes on the machine; None likewise.
    """

    def __init__(self):
        self.busy_s: list[float] | None = None
        self.cpu_s: list[float] | None = None
        self._start = self._start_cpu = 0.0

    def clear(self) -> None:
        self.busy_s = self.cpu_s = None

    def on_step_begin(self, stages: int) -> None:
        self.busy_s, self.cpu_s = [0.0] * stages, [0.0] * stages

    def on_dispatch(self, dispatch) -> None:
        if dispatch.kind != "transfer":
            self._start, self._start_cpu = time.perf_counter(), time.process_time()

    def on_dispatched(self, dispatch, outputs) -> None:
        if dispatch.kind == "transfer" or self.busy_s is None or self.cpu_s is None:
            return
        jax.block_until_ready(outputs)
        self.busy_s[dispatch.stage] += time.perf_counter() - self._start
        self.cpu_s[dispatch.stage] += time.process_time() - self._start_cpu

    def on_step_end(self) -> None:
        pass
