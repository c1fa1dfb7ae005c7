"""Better starting schedules: list scheduling under perturbed priorities (iterated local search).

A priority vector turns into a schedule the way HEFT does it: the ready task
of highest priority goes next, to the device (and slot) where it finishes
earliest, in the earliest idle gap long enough for it (insertion). With
HEFT's upward ranks as priorities this is HEFT's schedule.

The search keeps the best priority vector found and perturbs it: each
priority is multiplied by a factor uniform on [1 − noise, 1 + noise] with
probability ``share``; the perturbed vector is kept if its schedule is no
longer (so the search also drifts across plateaus). It stops at the time
limit, after ``patience`` evaluations without improvement, or when the
makespan reaches a known lower bound. The schedules are valid by
construction; the MILP takes the best as its start and its horizon U, which
also tightens its big-M constants and prunes the devices a task can use.
"""

from __future__ import annotations

import bisect
import heapq
import math
import random
import time

from orchestrator.dag._list_scheduling import upward_ranks
from orchestrator.dag._problem import ScheduleProblem
from orchestrator.dag._schedule import Placement, Schedule


class Evaluator:
    """The problem as flat lists, and insertion-based list scheduling over them."""

    def __init__(self, problem: ScheduleProblem):
        self.problem = problem
        self.tasks = list(problem.tasks)
        index = {t: i for i, t in enumerate(self.tasks)}
        n = len(self.tasks)
        self.exec_s = [list(problem.exec_s[t]) for t in self.tasks]
        self.allowed = [problem.allowed(t) for t in self.tasks]
        # preds[b] = [(a, transfer[e][d] from a on e to b on d)]
        self.preds: list[list[tuple[int, tuple[tuple[float, ...], ...]]]] = [[] for _ in range(n)]
        self.succs: list[list[int]] = [[] for _ in range(n)]
        for (a, b), transfer in problem.transfers.items():
            self.preds[index[b]].append((index[a], transfer))
            self.succs[index[a]].append(index[b])

    def run(self, priority: list[float]) -> tuple[float, list[Placement]]:
        """Makespan and placements (by task index) of list scheduling under ``priority``."""
        n, slots = len(self.tasks), self.problem.slots
        busy: dict[tuple[int, int], list[tuple[float, float]]] = {}
        placed: list[Placement] = [None] * n  # type: ignore[list-item]
        waiting = [len(p) for p in self.preds]
        ready = [(-priority[i], i) for i in range(n) if waiting[i] == 0]
        heapq.heapify(ready)
        while ready:
            _, t = heapq.heappop(ready)
            best = None
            for d in self.allowed[t]:
                arrival = 0.0
                for a, transfer in self.preds[t]:
                    arrival = max(arrival, placed[a].finish_s + transfer[placed[a].device][d])
                duration = self.exec_s[t][d]
                for k in range(slots[d]):
                    start = _gap(busy.setdefault((d, k), []), arrival, duration)
                    if best is None or start + duration < best.finish_s - 1e-12:
                        best = Placement(device=d, slot=k, start_s=start, finish_s=start + duration)
            placed[t] = best
            bisect.insort(busy[best.device, best.slot], (best.start_s, best.finish_s))
            for s in self.succs[t]:
                waiting[s] -= 1
                if waiting[s] == 0:
                    heapq.heappush(ready, (-priority[s], s))
        return max(p.finish_s for p in placed), placed

    def schedule(self, placed: list[Placement]) -> Schedule:
        return Schedule(problem=self.problem, placements=dict(zip(self.tasks, placed, strict=True)), method="search")


def _gap(busy: list[tuple[float, float]], ready: float, duration: float) -> float:
    """Earliest start ≥ ``ready`` of an idle gap of ``duration`` among sorted, disjoint ``busy`` intervals."""
    i = bisect.bisect_right(busy, (ready, math.inf)) - 1
    start = ready
    if i >= 0 and busy[i][1] > start:
        start = busy[i][1]
    for begin, end in busy[i + 1 :]:
        if start + duration <= begin + 1e-9:
            break
        start = max(start, end)
    return start


def search(
    problem: ScheduleProblem,
    *,
    time_limit_s: float,
    lower_bound: float = 0.0,
    noise: float = 0.5,
    share: float = 0.3,
    patience: int | None = None,
    seed: int = 0,
) -> Schedule:
    """The best list schedule found from HEFT's priorities within ``time_limit_s`` (see the module docstring).

    Example:
        >>> from orchestrator.dag import heft, random_problem
        >>> p = random_problem(tasks=30, devices=4, seed=1)
        >>> search(p, time_limit_s=0.5).makespan <= heft(p).makespan
        True
    """
    deadline = time.perf_counter() + time_limit_s
    evaluator = Evaluator(problem)
    rank = upward_ranks(problem)
    best_priority = [rank[t] for t in evaluator.tasks]
    best, placed = evaluator.run(best_priority)
    rng = random.Random(seed)
    patience = patience if patience is not None else max(200, 20 * len(evaluator.tasks))
    stale = 0
    while time.perf_counter() < deadline and stale < patience and best > lower_bound * (1 + 1e-9):
        priority = [p * rng.uniform(1 - noise, 1 + noise) if rng.random() < share else p for p in best_priority]
        makespan, candidate = evaluator.run(priority)
        stale = 0 if makespan < best - 1e-9 else stale + 1
        if makespan <= best:
            best, placed, best_priority = makespan, candidate, priority
    return evaluator.schedule(placed)
