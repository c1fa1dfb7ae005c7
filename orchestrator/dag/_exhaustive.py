"""Ground truth for small instances: depth-first search over every list schedule.

Any schedule can be shifted left until each task starts at the later of its
inputs' arrival and its slot's previous task's finish (a semi-active
schedule) without getting longer, and every semi-active schedule is produced
by placing the tasks one at a time, in some topological order, each at the end
of some slot. So the search branches over (next ready task, device, slot) and
keeps the best makespan; it prunes a branch once its partial makespan, or a
ready task's earliest finish plus its fastest remaining path, reaches the best
found. Slots of one device are interchangeable: only the first empty one is tried.
Tasks are placed in order of start time (ties by task order): every
semi-active schedule arises that way once, which removes the orderings of
independent tasks that would produce it again.
"""

from __future__ import annotations

import math
import time

from orchestrator.dag._list_scheduling import heft
from orchestrator.dag._problem import ScheduleProblem
from orchestrator.dag._schedule import Placement, Schedule, earliest_start


def exhaustive(problem: ScheduleProblem, *, max_tasks: int = 10, time_limit_s: float = 120.0) -> Schedule:
    """The optimal schedule by exhaustive search (tiny instances only)."""
    if len(problem.tasks) > max_tasks:
        raise ValueError(f"exhaustive search is for at most {max_tasks} tasks, got {len(problem.tasks)}")
    started = time.perf_counter()
    best_schedule = heft(problem)
    best = [best_schedule.makespan, dict(best_schedule.placements)]
    fastest = {t: min(x for x in problem.exec_s[t] if math.isfinite(x)) for t in problem.tasks}
    tail: dict[str, float] = {}
    for t in reversed(problem.tasks):
        tail[t] = max((fastest[s] + tail[s] for s in problem.succs(t)), default=0.0)
    waiting0 = {t: len(problem.preds(t)) for t in problem.tasks}
    free = {(d, k): 0.0 for d, n in enumerate(problem.slots) for k in range(n)}
    placed: dict[str, Placement] = {}

    position = {t: i for i, t in enumerate(problem.tasks)}

    def search(ready: list[str], waiting: dict[str, int], span: float, last: tuple[float, int]) -> None:
        if time.perf_counter() - started > time_limit_s:
            raise TimeoutError(f"exhaustive search exceeded {time_limit_s} s")
        if not ready:
            if span < best[0] - 1e-12:
                best[0], best[1] = span, dict(placed)
            return
        for task in ready:
            for d in problem.allowed(task):
                arrival = earliest_start(problem, placed, task, d)
                tried_empty = False
                for k in range(problem.slots[d]):
                    if free[(d, k)] == 0.0 and not any(p.device == d and p.slot == k for p in placed.values()):
                        if tried_empty:
                            continue
                        tried_empty = True
                    start = max(arrival, free[(d, k)])
                    if (start, position[task]) < (last[0] - 1e-12, last[1]) or (
                        abs(start - last[0]) <= 1e-12 and position[task] < last[1]
                    ):
                        continue
                    finish = start + problem.exec_s[task][d]
                    if max(span, finish + tail[task]) >= best[0] - 1e-12:
                        continue
                    previous = free[(d, k)]
                    placed[task] = Placement(device=d, slot=k, start_s=start, finish_s=finish)
                    free[(d, k)] = finish
                    nxt = [t for t in ready if t != task]
                    for s in problem.succs(task):
                        waiting[s] -= 1
                        if waiting[s] == 0:
                            nxt.append(s)
                    search(nxt, waiting, max(span, finish), (start, position[task]))
                    for s in problem.succs(task):
                        waiting[s] += 1
                    free[(d, k)] = previous
                    del placed[task]

    search([t for t in problem.tasks if waiting0[t] == 0], dict(waiting0), 0.0, (0.0, -1))
    return Schedule(
        problem=problem,
        placements=best[1],
        method="exhaustive",
        bound=best[0],
        gap=0.0,
        solve_s=time.perf_counter() - started,
        status="Optimal",
    )
