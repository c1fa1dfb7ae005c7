"""HEFT and CPOP (Topcuoglu, Hariri & Wu, IEEE TPDS 2002), insertion-based.

Both rank tasks with mean execution and transfer times over the devices:

    rank_u(i) = w̄_i + max_{j ∈ succ(i)} (c̄_ij + rank_u(j))          (upward; exit tasks: w̄_i)
    rank_d(i) = max_{j ∈ pred(i)} (rank_d(j) + w̄_j + c̄_ji)          (downward; entry tasks: 0)

HEFT schedules tasks by decreasing rank_u, each on the device giving the
earliest finish time, looking for idle gaps between already scheduled tasks.
CPOP puts the critical path — the tasks with rank_u + rank_d equal to the entry
task's — on the one device that runs the whole path fastest, and every other
task, in priority order from a ready queue, on its earliest-finish device.
"""

from __future__ import annotations

import heapq
import math
import time

from orchestrator.dag._problem import ScheduleProblem
from orchestrator.dag._schedule import Placement, Schedule, earliest_start, insertion_slot


def upward_ranks(problem: ScheduleProblem) -> dict[str, float]:
    rank: dict[str, float] = {}
    for task in reversed(problem.tasks):
        tail = max((problem.mean_transfer_s((task, s)) + rank[s] for s in problem.succs(task)), default=0.0)
        rank[task] = problem.mean_exec_s(task) + tail
    return rank


def downward_ranks(problem: ScheduleProblem) -> dict[str, float]:
    rank: dict[str, float] = {}
    for task in problem.tasks:
        rank[task] = max(
            (rank[p] + problem.mean_exec_s(p) + problem.mean_transfer_s((p, task)) for p in problem.preds(task)),
            default=0.0,
        )
    return rank


class _Timeline:
    """Busy intervals per (device, slot), for insertion-based placement."""

    def __init__(self, problem: ScheduleProblem):
        self.problem = problem
        self.busy = {(d, s): [] for d, n in enumerate(problem.slots) for s in range(n)}
        self.placements: dict[str, Placement] = {}

    def best_on(self, task: str, device: int) -> Placement:
        duration = self.problem.exec_s[task][device]
        ready = earliest_start(self.problem, self.placements, task, device)
        best = None
        for slot in range(self.problem.slots[device]):
            start = insertion_slot(self.busy[(device, slot)], ready, duration)
            if best is None or start < best.start_s:
                best = Placement(device=device, slot=slot, start_s=start, finish_s=start + duration)
        return best

    def best(self, task: str) -> Placement:
        options = [self.best_on(task, d) for d in self.problem.allowed(task)]
        return min(options, key=lambda p: (p.finish_s, p.device))

    def place(self, task: str, placement: Placement) -> None:
        self.placements[task] = placement
        intervals = self.busy[(placement.device, placement.slot)]
        intervals.append((placement.start_s, placement.finish_s))
        intervals.sort()


def heft(problem: ScheduleProblem) -> Schedule:
    """Heterogeneous Earliest Finish Time."""
    start = time.perf_counter()
    rank = upward_ranks(problem)
    order = sorted(problem.tasks, key=lambda t: (-rank[t], problem.tasks.index(t)))
    timeline = _Timeline(problem)
    for task in order:
        timeline.place(task, timeline.best(task))
    return Schedule(problem=problem, placements=timeline.placements, method="heft", solve_s=time.perf_counter() - start)


def cpop(problem: ScheduleProblem) -> Schedule:
    """Critical Path On a Processor."""
    start = time.perf_counter()
    up, down = upward_ranks(problem), downward_ranks(problem)
    priority = {t: up[t] + down[t] for t in problem.tasks}
    entries = [t for t in problem.tasks if not problem.preds(t)]
    critical_length = max(priority[t] for t in entries)
    tolerance = 1e-9 * max(1.0, critical_length)
    task = max(entries, key=lambda t: priority[t])
    path = [task]
    while problem.succs(task):
        nxt = [s for s in problem.succs(task) if abs(priority[s] - critical_length) <= tolerance]
        if not nxt:
            break
        task = nxt[0]
        path.append(task)
    on_path = set(path)
    candidates = [d for d in range(len(problem.devices)) if all(math.isfinite(problem.exec_s[t][d]) for t in path)]
    cp_device = min(candidates, key=lambda d: sum(problem.exec_s[t][d] for t in path)) if candidates else None

    timeline = _Timeline(problem)
    waiting = {t: len(problem.preds(t)) for t in problem.tasks}
    ready = [(-priority[t], problem.tasks.index(t), t) for t in entries]
    heapq.heapify(ready)
    while ready:
        _, _, task = heapq.heappop(ready)
        if task in on_path and cp_device is not None:
            timeline.place(task, timeline.best_on(task, cp_device))
        else:
            timeline.place(task, timeline.best(task))
        for succ in problem.succs(task):
            waiting[succ] -= 1
            if waiting[succ] == 0:
                heapq.heappush(ready, (-priority[succ], problem.tasks.index(succ), succ))
    return Schedule(problem=problem, placements=timeline.placements, method="cpop", solve_s=time.perf_counter() - start)
