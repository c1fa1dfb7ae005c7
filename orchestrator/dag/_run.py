"""Run a schedule's real functions on Dask distributed, each task pinned to its device's worker.

Devices map to workers in order (the i-th device of the schedule to the i-th
worker address given, by default the client's workers sorted by address).
Every task is submitted with ``workers=[its worker]`` and
``allow_other_workers=False``; Dask moves a task's inputs from the workers
that computed them, which is the transfer the schedule priced. Dask priorities
follow the scheduled start times, so a worker takes its tasks in the
schedule's order when several are ready.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from orchestrator.dag._jobs import Instance, JobGraph, call
from orchestrator.dag._schedule import Schedule


class JobFailed(RuntimeError):
    """A job raised. ``execution`` keeps what completed; ``execution.rerun()`` retries."""

    def __init__(self, task: str, error: BaseException, execution: Execution):
        super().__init__(f"job {task!r} failed: {type(error).__name__}: {error}")
        self.task, self.error, self.execution = task, error, execution


@dataclass(frozen=True, slots=True)
class TaskRecord:
    """Where and when a task ran (clock of the worker's host; one machine in tests)."""

    worker: str
    start_s: float
    finish_s: float


def _task(fn, index: int, grouping: tuple[int, ...], *inputs):
    """Runs on the worker: unwrap inputs, call the job, record where and when."""
    from distributed import get_worker

    values = [value for value, _ in inputs]
    args, k = [], 0
    for count in grouping:
        args.append(values[k] if count == 1 else values[k : k + count])
        k += count
    start = time.time()
    result = call(fn, args, index)
    return result, TaskRecord(worker=get_worker().address, start_s=start, finish_s=time.time())


class Execution:
    """Futures of one run of a schedule; finished ones are kept for reruns."""

    def __init__(self, schedule: Schedule, jobs: JobGraph, client, workers: Sequence[str] | None = None):
        self.schedule, self.jobs, self.client = schedule, jobs, client
        addresses = list(workers) if workers is not None else sorted(client.scheduler_info()["workers"])
        devices = schedule.problem.devices
        if len(addresses) < len(devices):
            raise ValueError(f"the schedule uses {len(devices)} devices but only {len(addresses)} workers were given")
        self.worker_of_device = dict(zip(devices, addresses))
        self.instances: dict[str, Instance] = {i.task: i for i in jobs.instances()}
        self.futures: dict = {}
        self.submitted_s = 0.0

    def worker_of(self, task: str) -> str:
        return self.worker_of_device[self.schedule.device_of(task)]

    def submit(self, tasks: Sequence[str]) -> None:
        order = sorted(tasks, key=lambda t: self.schedule.placements[t].start_s)
        for task in self.schedule.problem.tasks:
            if task not in order:
                continue
            inst = self.instances[task]
            inputs = [self.futures[p] for producers in inst.inputs for p in producers]
            self.futures[task] = self.client.submit(
                _task,
                self.jobs.jobs[inst.job].fn,
                inst.index,
                tuple(len(producers) for producers in inst.inputs),
                *inputs,
                key=f"{task}-{id(self)}-{time.monotonic_ns()}",
                workers=[self.worker_of(task)],
                allow_other_workers=False,
                priority=-int(self.schedule.placements[task].start_s * 1e6),
                pure=False,
            )

    def gather(self) -> tuple[dict[str, object], dict[str, TaskRecord]]:
        from distributed import wait

        wait(list(self.futures.values()))
        for task in self.schedule.problem.tasks:
            future = self.futures[task]
            if future.status == "error":
                inst = self.instances[task]
                upstream_ok = all(self.futures[p].status == "finished" for ps in inst.inputs for p in ps)
                if upstream_ok:
                    raise JobFailed(task, future.exception(), self)
        pairs = self.client.gather([self.futures[t] for t in self.schedule.problem.tasks])
        results = {t: value for t, (value, _) in zip(self.schedule.problem.tasks, pairs)}
        records = {t: record for t, (_, record) in zip(self.schedule.problem.tasks, pairs)}
        return results, records

    def completed(self) -> list[str]:
        return [t for t, f in self.futures.items() if f.status == "finished"]

    def rerun(self, replace: Mapping[str, object] | None = None):
        """Run again only the tasks that did not finish (the failed job and what depends on it).

        ``replace`` maps job names to new functions (a fixed version of the job).
        """
        for name, fn in (replace or {}).items():
            self.jobs.jobs[name] = dataclasses.replace(self.jobs.jobs[name], fn=fn)
        pending = [t for t in self.schedule.problem.tasks if self.futures[t].status != "finished"]
        self.submit(pending)
        return self.gather()


def run(schedule: Schedule, jobs: JobGraph, client, *, workers: Sequence[str] | None = None):
    """Execute on Dask; returns ``(results, records, execution)``; raises :class:`JobFailed` naming the job."""
    execution = Execution(schedule, jobs, client, workers)
    execution.submit(schedule.problem.tasks)
    results, records = execution.gather()
    return results, records, execution
