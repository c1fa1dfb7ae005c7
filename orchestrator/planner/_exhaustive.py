"""Ground truth for tiny planning instances: every partition, group choice and microbatch count."""

from __future__ import annotations

import itertools

from orchestrator.costs import CostModel
from orchestrator.planner._evaluate import Evaluation, evaluate
from orchestrator.planner._search import DEFAULT_MICROBATCHES, search_space


def _partitions(n: int, parts: int):
    """Contiguous splits of range(n) into ``parts`` non-empty runs."""
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = (0, *cuts, n)
        yield [list(range(bounds[i], bounds[i + 1])) for i in range(parts)]


def exhaustive_plan(
    model: CostModel,
    *,
    global_batch: int,
    schedule: str = "1f1b",
    microbatch_candidates: tuple[int, ...] = DEFAULT_MICROBATCHES,
    max_stages: int | None = None,
    recompute: bool = True,
    zero: bool = False,
    mixed_stages: bool = True,
) -> Evaluation | None:
    """The best feasible evaluation over the planner's whole search space (None if none fits)."""
    space = search_space(model, global_batch, recompute=recompute, zero=zero, mixed=mixed_stages)
    infos, groups, table, links, L = space.infos, space.groups, space.table, space.links, space.layers
    best = None
    for S in range(1, min(max_stages or 16, L, len(model.cluster.devices())) + 1):
        for M in (m for m in microbatch_candidates if global_batch % m == 0):
            valid = [g for g in groups if table.microbatch(g, M) is not None]
            for stages in _partitions(L, S):
                for chosen in itertools.product(valid, repeat=S):
                    ev = evaluate(
                        list(stages), list(chosen), M, table=table, infos=infos, schedule=schedule, links=links
                    )
                    if ev.feasible and (best is None or ev.iteration_s < best.iteration_s):
                        best = ev
    return best
