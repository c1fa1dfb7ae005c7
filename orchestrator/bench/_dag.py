"""``orchestrator bench dag``: the MILP against HEFT, CPOP and exhaustive search.

Instances:
* small random DAGs (6–10 tasks, 3 devices) where exhaustive search gives the optimum;
* random DAGs of 50 tasks on 4 devices at CCR 0.5, 1 and 5 (HEFT paper generator, β = 0.5);
* 100 tasks on 8 devices;
* WfCommons workflow shapes (Montage 58, Epigenomics 45, Cycles 75 tasks) on 4 devices.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

from orchestrator.dag import ScheduleProblem, cpop, exhaustive, heft, milp, random_problem, wfcommons_problem


def instances(*, quick: bool = False) -> Iterator[tuple[str, Callable[[], ScheduleProblem], bool]]:
    """(name, builder, enumerable) for every instance of the suite."""
    small = 6 if quick else 30
    for seed in range(small):
        tasks = 6 + seed % 5
        ccr = (0.5, 1.0, 5.0)[seed % 3]
        yield (
            f"random v={tasks} p=3 ccr={ccr} seed={seed}",
            lambda t=tasks, c=ccr, s=seed: random_problem(tasks=t, devices=3, ccr=c, seed=s),
            True,
        )
    for ccr in (0.5, 1.0, 5.0):
        for seed in range(2 if quick else 5):
            yield (
                f"random v=50 p=4 ccr={ccr} seed={seed}",
                lambda c=ccr, s=seed: random_problem(tasks=50, devices=4, ccr=c, seed=s),
                False,
            )
    yield "random v=100 p=8 ccr=1 seed=0", lambda: random_problem(tasks=100, devices=8, ccr=1.0, seed=0), False
    # each WfCommons recipe has a smallest size it can generate
    for recipe, size in (("montage", 60), ("epigenomics", 50), ("cycles", 80)):
        yield (
            f"wfcommons {recipe} p=4",
            lambda r=recipe, n=size: wfcommons_problem(r, tasks=n, devices=4, seed=0),
            False,
        )


def run_suite(*, time_limit_s: float = 10.0, quick: bool = False, progress=None) -> list[dict]:
    rows = []
    for name, build, enumerable in instances(quick=quick):
        if progress:
            progress(name)
        problem = build()
        found = milp(problem, time_limit_s=time_limit_s)
        found.validate()
        best = exhaustive(problem) if enumerable else None
        h, c = heft(problem), cpop(problem)
        rows.append(
            {
                "name": name,
                "tasks": len(problem.tasks),
                "devices": len(problem.devices),
                "milp": {
                    "makespan": found.makespan,
                    "bound": found.bound,
                    "gap": found.gap if math.isfinite(found.gap) else None,
                    "solve_s": found.solve_s,
                    "status": found.status,
                },
                "heft": h.makespan,
                "cpop": c.makespan,
                "exhaustive": best.makespan if best else None,
            }
        )
    return rows
