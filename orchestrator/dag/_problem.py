"""A scheduling problem: tasks with per-device times, data on edges, devices with slots and links.

This is the form every scheduler here reads (HEFT, CPOP, the MILP, exhaustive
search). Build it from a :class:`~orchestrator.dag.JobGraph` and a cluster with
:meth:`JobGraph.problem`, or directly (the published HEFT example is given
this way, with its communication costs as bytes over unit-bandwidth links).

Transfer of an edge's ``nbytes`` from device a to device b:

    0                                                   if a == b
    nbytes / serialisation rate + latency(a, b) + nbytes / bandwidth(a, b)   otherwise
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import networkx as nx
import numpy as np


@dataclass(frozen=True, kw_only=True)
class ScheduleProblem:
    """Tasks, their costs, and the devices that run them.

    Attributes:
      tasks: task names, in a topological order.
      edges: (producer, consumer) → bytes sent.
      exec_s: task → seconds on each device (``inf`` where it may not run).
      devices: device names (``host/index``).
      slots: jobs each device runs at once.
      latency_s, bandwidth: (device × device) link matrices (bytes/s).
      serialisation_bytes_per_s: cost of turning an output into bytes and back.
    """

    tasks: tuple[str, ...]
    edges: dict[tuple[str, str], float]
    exec_s: dict[str, tuple[float, ...]]
    devices: tuple[str, ...]
    slots: tuple[int, ...]
    latency_s: np.ndarray = field(repr=False)
    bandwidth: np.ndarray = field(repr=False)
    serialisation_bytes_per_s: float = math.inf

    def __post_init__(self) -> None:
        n = len(self.devices)
        if len(self.slots) != n or self.latency_s.shape != (n, n) or self.bandwidth.shape != (n, n):
            raise ValueError("devices, slots, latency and bandwidth must agree in size")
        for task in self.tasks:
            times = self.exec_s.get(task)
            if times is None or len(times) != n:
                raise ValueError(f"task {task!r} needs one execution time per device")
            if not any(math.isfinite(t) for t in times):
                raise ValueError(f"task {task!r} cannot run on any device (check allowed devices and memory)")
        if not nx.is_directed_acyclic_graph(self.graph):
            raise ValueError("the task graph has a cycle")

    @cached_property
    def graph(self) -> nx.DiGraph:
        g = nx.DiGraph()
        g.add_nodes_from(self.tasks)
        g.add_edges_from(self.edges)
        return g

    @cached_property
    def transfers(self) -> dict[tuple[str, str], tuple[tuple[float, ...], ...]]:
        """Edge → its transfer time from each device (row) to each device (column), computed once."""
        n = range(len(self.devices))
        return {e: tuple(tuple(self.transfer_s(e, a, b) for b in n) for a in n) for e in self.edges}

    def preds(self, task: str) -> list[str]:
        return list(self.graph.predecessors(task))

    def succs(self, task: str) -> list[str]:
        return list(self.graph.successors(task))

    def transfer_s(self, edge: tuple[str, str], a: int, b: int) -> float:
        if a == b:
            return 0.0
        nbytes = self.edges[edge]
        if nbytes <= 0:
            return float(self.latency_s[a, b])
        return (
            nbytes / self.serialisation_bytes_per_s + float(self.latency_s[a, b]) + nbytes / float(self.bandwidth[a, b])
        )

    def allowed(self, task: str) -> list[int]:
        return [d for d, t in enumerate(self.exec_s[task]) if math.isfinite(t)]

    # -- averages used by list schedulers --------------------------------------
    def mean_exec_s(self, task: str) -> float:
        times = [t for t in self.exec_s[task] if math.isfinite(t)]
        return sum(times) / len(times)

    def mean_transfer_s(self, edge: tuple[str, str]) -> float:
        """Average over ordered pairs of distinct devices (0 with one device)."""
        n = len(self.devices)
        if n < 2:
            return 0.0
        total = sum(self.transfer_s(edge, a, b) for a in range(n) for b in range(n) if a != b)
        return total / (n * (n - 1))


def uniform_links(n: int, *, latency_s: float = 0.0, bandwidth: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Latency and bandwidth matrices with one value for every pair of devices."""
    return np.full((n, n), latency_s), np.full((n, n), bandwidth)


def problem_from_costs(
    exec_s: dict[str, Sequence[float]],
    comm_s: dict[tuple[str, str], float],
    *,
    slots: Sequence[int] | None = None,
) -> ScheduleProblem:
    """The textbook form: execution times per device and a communication cost per edge.

    Communication costs apply between distinct devices and vanish on the same
    device, as in Topcuoglu et al. (2002).
    """
    n = len(next(iter(exec_s.values())))
    g = nx.DiGraph(list(comm_s))
    g.add_nodes_from(exec_s)
    if not nx.is_directed_acyclic_graph(g):
        raise ValueError(f"the task graph has a cycle: {nx.find_cycle(g)}")
    latency, bandwidth = uniform_links(n)
    return ScheduleProblem(
        tasks=tuple(nx.lexicographical_topological_sort(g, key=str)),
        edges={e: float(c) for e, c in comm_s.items()},
        exec_s={t: tuple(float(x) for x in v) for t, v in exec_s.items()},
        devices=tuple(f"p{i + 1}" for i in range(n)),
        slots=tuple(slots or [1] * n),
        latency_s=latency,
        bandwidth=bandwidth,
    )
