"""Ground truth for tiny planning instances: every partition, group choice and microbatch count."""

from __future__ import annotations

import itertools

from orchestrator.costs import CostModel
from orchestrator.planner._evaluate import Evaluation, summary_cache
from orchestrator.planner.baselines._sweep import Sweep


def _partitions(n: int, parts: int):
    """Contiguous splits of range(n) into ``parts`` non-empty runs."""
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = (0, *cuts, n)
        yield [list(range(bounds[i], bounds[i + 1])) for i in range(parts)]


def exhaustive_plan(model: CostModel, **settings) -> Evaluation | None:
    """The best feasible evaluation over the planner's whole search space (None if none fits);
    ``settings`` as for every baseline (:class:`~orchestrator.planner.baselines._sweep.Sweep`)."""
    sweep = Sweep(model, **settings)
    space = sweep.space
    summary = summary_cache()  # (a stage is in many plans: each is summarised once)
    best = None
    for S in sweep.stage_counts:
        for M in sweep.candidates:
            valid = [g for g in space.groups if space.table.microbatch(g, M) is not None]
            for stages in _partitions(space.layers, S):
                for chosen in itertools.product(valid, repeat=S):
                    ev = sweep.evaluate(stages, list(chosen), M, summarize=summary)
                    if ev.feasible and (best is None or ev.iteration_s < best.iteration_s):
                        best = ev
    return best
