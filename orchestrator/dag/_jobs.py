"""A job graph of plain Python functions, and how it becomes a scheduling problem.

A job names a function and the jobs whose outputs it takes, in order. A
dependency may carry a count — ``deps=[("sample", 4)]``: every run of this job
takes four runs of ``sample`` (the seed's "run a n times per b") — so a job
runs ``multiplicity`` times: 1 for jobs nothing depends on, and for the others
the largest count × multiplicity over their consumers. Run k of a consumer
takes runs k·n … k·n+n−1 of a producer (modulo its multiplicity) as a list.
A function that has a parameter named ``instance`` receives its run index.

Execution-time estimates are given per device type (``{"cpu": 0.2}``,
``"*"`` for any type) or measured by :meth:`JobGraph.measure`, which runs every
job once on this machine and records its time (for every device type) and the
pickled size of its output. Output bytes cross links at the cluster's link
model plus serialisation at ``serialisation_gbps``.

Constraints: ``devices`` limits a job to device types or device refs
(``"host/0"``); ``memory_bytes`` must fit in a device's memory divided among
its threads (so jobs running side by side on one device always fit).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import pickle
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import networkx as nx
import numpy as np

from orchestrator.cluster import Cluster
from orchestrator.dag._problem import ScheduleProblem


@dataclass(frozen=True, slots=True, kw_only=True)
class Job:
    name: str
    fn: Callable
    deps: tuple[tuple[str, int], ...] = ()
    exec_s: dict[str, float] | None = None
    output_bytes: float = 0.0
    memory_bytes: int = 0
    devices: tuple[str, ...] | None = None

    def time_on(self, device_type: str) -> float | None:
        if self.exec_s is None:
            return None
        return self.exec_s.get(device_type, self.exec_s.get("*"))


@dataclass(frozen=True, slots=True)
class Instance:
    """One run of a job: its task name, run index, and the task names feeding each argument."""

    task: str
    job: str
    index: int
    inputs: tuple[tuple[str, ...], ...]  # per dependency: the producer tasks (a list when count > 1)


class JobGraph:
    """Jobs and their dependencies.

    Example:
      >>> jobs = JobGraph()
      >>> jobs.add("load", lambda: list(range(10)), exec_s={"*": 0.1}, output_bytes=80)
      >>> jobs.add("total", sum, deps=["load"], exec_s={"*": 0.01})
      >>> [i.task for i in jobs.instances()]
      ['load', 'total']
    """

    def __init__(self) -> None:
        self.jobs: dict[str, Job] = {}

    def add(
        self,
        name: str,
        fn: Callable,
        *,
        deps: Iterable[str | tuple[str, int]] = (),
        exec_s: float | dict[str, float] | None = None,
        output_bytes: float = 0.0,
        memory_bytes: int = 0,
        devices: Sequence[str] | None = None,
    ) -> None:
        if name in self.jobs:
            raise ValueError(f"job {name!r} is already in the graph")
        if "[" in name:
            raise ValueError(f"job name {name!r} may not contain '['")
        parsed = []
        for dep in deps:
            dep_name, count = (dep, 1) if isinstance(dep, str) else dep
            if dep_name not in self.jobs:
                raise ValueError(f"job {name!r} depends on {dep_name!r}, which is not in the graph yet: add it first")
            if count < 1:
                raise ValueError(f"job {name!r}: count for {dep_name!r} must be >= 1, got {count}")
            parsed.append((dep_name, int(count)))
        times = {"*": float(exec_s)} if isinstance(exec_s, int | float) else (dict(exec_s) if exec_s else None)
        self.jobs[name] = Job(
            name=name,
            fn=fn,
            deps=tuple(parsed),
            exec_s=times,
            output_bytes=float(output_bytes),
            memory_bytes=int(memory_bytes),
            devices=tuple(devices) if devices else None,
        )

    def multiplicity(self) -> dict[str, int]:
        mult: dict[str, int] = {}
        for name in reversed(list(self.jobs)):
            consumers = [(c, n) for c, job in self.jobs.items() for d, n in job.deps if d == name]
            mult[name] = max((n * mult[c] for c, n in consumers), default=1)
        return mult

    def instances(self) -> list[Instance]:
        mult = self.multiplicity()

        def task(job: str, k: int) -> str:
            return job if mult[job] == 1 else f"{job}[{k}]"

        out = []
        for name, job in self.jobs.items():
            for k in range(mult[name]):
                inputs = tuple(tuple(task(dep, (k * n + i) % mult[dep]) for i in range(n)) for dep, n in job.deps)
                out.append(Instance(task=task(name, k), job=name, index=k, inputs=inputs))
        return out

    def measure(self, *, overwrite: bool = False) -> None:
        """Run every job once, serially, here; record its time and output size where not given."""
        results: dict[str, object] = {}
        for inst in self.instances():
            job = self.jobs[inst.job]
            args = [
                [results[t] for t in producers] if len(producers) > 1 else results[producers[0]]
                for producers in inst.inputs
            ]
            start = time.perf_counter()
            results[inst.task] = call(job.fn, args, inst.index)
            elapsed = time.perf_counter() - start
            if inst.index == 0:
                self.jobs[inst.job] = dataclasses.replace(
                    job,
                    exec_s={"*": elapsed} if overwrite or job.exec_s is None else job.exec_s,
                    output_bytes=(
                        float(len(pickle.dumps(results[inst.task])))
                        if overwrite or not job.output_bytes
                        else job.output_bytes
                    ),
                )

    def problem(self, cluster: Cluster, *, serialisation_gbps: float = 1.0) -> ScheduleProblem:
        """The scheduling problem of running these jobs on ``cluster``'s devices in service."""
        devices = cluster.devices()
        instances = self.instances()
        exec_s: dict[str, tuple[float, ...]] = {}
        for inst in instances:
            job = self.jobs[inst.job]
            row = []
            for device in devices:
                dtype = cluster.device_types[device.device_type]
                threads = cluster.host(device.host).threads_per_device
                t = job.time_on(device.device_type)
                if t is None:
                    raise ValueError(
                        f"job {job.name!r} has no time for device type {device.device_type!r}: "
                        "give exec_s (or '*') or call JobGraph.measure()"
                    )
                allowed = job.devices is None or device.device_type in job.devices or device.ref in job.devices
                fits = job.memory_bytes <= dtype.memory_bytes / threads
                row.append(t if allowed and fits else math.inf)
            exec_s[inst.task] = tuple(row)
        edges: dict[tuple[str, str], float] = {}
        for inst in instances:
            for producers in inst.inputs:
                for producer in producers:
                    job = self.jobs[producer.split("[")[0]]
                    edges[(producer, inst.task)] = job.output_bytes
        n = len(devices)
        latency, bandwidth = np.zeros((n, n)), np.full((n, n), np.inf)
        for a, da in enumerate(devices):
            for b, db in enumerate(devices):
                if a != b:
                    link = cluster.link(da, db)
                    latency[a, b], bandwidth[a, b] = link.latency_s, link.bandwidth_bytes_per_s
        graph = nx.DiGraph(list(edges))
        graph.add_nodes_from(exec_s)
        return ScheduleProblem(
            tasks=tuple(nx.lexicographical_topological_sort(graph, key=lambda t: [i.task for i in instances].index(t))),
            edges=edges,
            exec_s=exec_s,
            devices=tuple(d.ref for d in devices),
            slots=tuple(cluster.host(d.host).threads_per_device for d in devices),
            latency_s=latency,
            bandwidth=bandwidth,
            serialisation_bytes_per_s=serialisation_gbps * 1e9,
        )


def call(fn: Callable, args: list, index: int):
    """Call a job function, passing ``instance=index`` if it takes one."""
    try:
        takes_instance = "instance" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins without a signature
        takes_instance = False
    return fn(*args, instance=index) if takes_instance else fn(*args)
