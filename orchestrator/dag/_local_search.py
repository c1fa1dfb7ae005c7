"""Improve a schedule by moving single tasks between devices (hill climbing).

A candidate is an assignment of tasks to devices; it is turned into a schedule
by placing the tasks in HEFT's order (decreasing upward rank), each on its
assigned device at the earliest idle gap (insertion, as HEFT does). A move
re-assigns one task; the first move that shortens the makespan is kept, until
none does or the time is up. This gives the MILP a better starting schedule —
and a smaller horizon U, which tightens every big-M constraint.
"""

from __future__ import annotations

import random
import time

from orchestrator.dag._list_scheduling import _Timeline, upward_ranks
from orchestrator.dag._problem import ScheduleProblem
from orchestrator.dag._schedule import Schedule


def schedule_assignment(problem: ScheduleProblem, order: list[str], assignment: dict[str, int]) -> Schedule:
    timeline = _Timeline(problem)
    for task in order:
        timeline.place(task, timeline.best_on(task, assignment[task]))
    return Schedule(problem=problem, placements=timeline.placements, method="local-search")


def improve(problem: ScheduleProblem, start: Schedule, *, time_limit_s: float, seed: int = 0) -> Schedule:
    """The best schedule found by single-task moves from ``start`` within ``time_limit_s``."""
    deadline = time.perf_counter() + time_limit_s
    rank = upward_ranks(problem)
    order = sorted(problem.tasks, key=lambda t: (-rank[t], problem.tasks.index(t)))
    assignment = {t: p.device for t, p in start.placements.items()}
    best = schedule_assignment(problem, order, assignment)
    if best.makespan > start.makespan:
        best, assignment = start, {t: p.device for t, p in start.placements.items()}
    rng = random.Random(seed)
    moves = [(t, d) for t in problem.tasks for d in problem.allowed(t)]
    improved = True
    while improved and time.perf_counter() < deadline:
        improved = False
        rng.shuffle(moves)
        for task, device in moves:
            if time.perf_counter() >= deadline:
                break
            if assignment[task] == device:
                continue
            trial = dict(assignment)
            trial[task] = device
            candidate = schedule_assignment(problem, order, trial)
            if candidate.makespan < best.makespan - 1e-12:
                best, assignment, improved = candidate, trial, True
    return best
