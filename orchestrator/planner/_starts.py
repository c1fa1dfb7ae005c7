"""The search's first incumbent: the balanced heuristic and the baselines, the best one-stage plan,
a plan the caller hands in, and the local search (``_polish``) around the best of them.

The ILP starts from this incumbent, so the plan returned is never worse than the baselines',
even when the time limit stops the search; and every solve asks only for plans better than it,
so the better it is, the more of the search space closes at once.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from orchestrator.cluster import Cluster
from orchestrator.costs import CostModel
from orchestrator.planner import baselines
from orchestrator.planner._evaluate import evaluate
from orchestrator.planner._groups import GroupConfig
from orchestrator.planner._ilp import MS
from orchestrator.planner._incumbent import Best, Incumbent
from orchestrator.planner._polish import polish
from orchestrator.planner._scope import Scope
from orchestrator.planner._space import SearchSpace
from orchestrator.solver import work

log = logging.getLogger(__name__)


def heuristic_stage_counts(cluster: Cluster, max_stages: int) -> list[int]:
    """2^k and 3·2^k stages, and the counts that give every stage whole hosts of one type (the
    hosts in service and their divisors: 7 hosts left of 8 give 7 one-host blocks, which no
    power of two does)."""
    hosts = len({d.host for d in cluster.devices()})
    counts = {1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64} | {d for d in range(1, hosts + 1) if hosts % d == 0}
    return sorted(s for s in counts if s <= max_stages)


def heuristic(model, space, global_batch, schedule, candidates, max_stages, recompute, deadline=None):
    """The best of our balanced heuristic and every baseline (over the stage counts of
    :func:`heuristic_stage_counts`, to bound the time), or None.

    The balanced heuristic runs first and may use the whole ``deadline``: it is the one that
    finds a plan wherever one fits, and on the largest clusters an equal share of the window
    stops it before any plan. The baselines share what it leaves."""
    settings = {
        "global_batch": global_batch,
        "schedule": schedule,
        "microbatch_candidates": tuple(candidates),
        "max_stages": max_stages,
        "recompute": recompute,
        "space": space,
        "stage_counts": heuristic_stage_counts(model.cluster, max_stages),
    }
    found = [baselines.balanced(model, **settings, deadline=deadline)]
    others = list(baselines.BASELINES.values())
    for index, run in enumerate(others):  # each gets an equal share of what balanced left
        if deadline is not None:
            left = deadline - work.now()
            if left <= 0:
                break
            settings["deadline"] = work.now() + left / (len(others) - index)
        found.append(run(model, **settings))
    found = [f for f in found if f is not None]
    return min(found, key=lambda f: f.iteration_s) if found else None


@dataclass(frozen=True, slots=True)
class OneStage:
    """The one-stage plans, all priced: the best (scored by its step time) or None when none fits,
    and per M the least step time of any (inf where none fits); ``complete`` is False when the
    deadline stopped the pricing, and ``least_s`` then covers only what was priced."""

    best: Incumbent | None
    least_s: dict[int, float]
    complete: bool


def single_stage(space: SearchSpace, candidates, schedule: str, *, deadline: float) -> OneStage:
    """The best plan of one stage: every layer on one group (any type, size, tp, recompute, or a
    mixed group with its batch shares), at every M.

    The balanced heuristic and the baselines build pipelines and place one type per stage, so
    they miss plans that give one stage every device of two types (data parallelism over two
    types is the best plan of a small model on a mixed cluster), and the local search from a
    pipeline seldom reaches them. A group whose parameters and optimizer state alone overflow its
    devices is skipped at once.

    Pricing every group is enumeration: when it completes, each M's least one-stage time is that
    M's one-stage optimum, so the ILP's one-stage piece of that M needs no solve."""
    layers = list(range(space.layers))
    found = None
    least = dict.fromkeys(candidates, math.inf)
    for group in space.groups:
        for M in candidates:
            if work.now() >= deadline:
                return OneStage(found, least, complete=False)
            if space.table.microbatch(group, M) is None:
                continue
            if state_overflows(space.table, layers, group, M):
                break  # (the state does not depend on M)
            ev = evaluate(
                [layers],
                [group],
                M,
                table=space.table,
                infos=space.infos,
                schedule=schedule,
                links=space.links,
                report_infeasible=False,
            )
            if not ev.feasible:
                continue
            least[M] = min(least[M], ev.iteration_s)
            if found is None or ev.iteration_s < found.score:
                found = Incumbent(ev.iteration_s, ev, [list(layers)], [group], M)
    return OneStage(found, least, complete=True)


def state_overflows(table, layers: list[int], group: GroupConfig, M: int) -> bool:
    """Whether ``layers``' parameters, gradients and optimizer state alone exceed some part of ``group``."""
    parts = [table.memory_parts(l, group, M) for l in layers]
    return any(sum(part[p][1].static_bytes for part in parts) > capacity for p, (capacity, _) in enumerate(parts[0]))


def first_incumbent(
    model: CostModel,
    scope: Scope,
    best: Best,
    *,
    global_batch: int,
    recompute: bool,
    given: tuple[list[list[int]], list[GroupConfig], int] | None,
    started: float,
    time_limit_s: float,
) -> dict[int, float]:
    """Fill ``best`` with the first incumbent: the heuristic's, the best one-stage plan and
    ``given`` (each within ``options.start_share`` of the time limit), then polished. Returns each
    M's one-stage optimum where every group was priced (with a migration term the score is not the
    step time, so none: the one-stage pieces are then solved as the others are)."""
    space, schedule = best.space, best.schedule
    candidates, max_stages, options = scope.candidates, scope.max_stages, scope.options
    window = started + options.start_share * time_limit_s
    # the first plans priced fill the space's cost table, one (run, group) cell at a time: that work
    # counts against the budget before any of them (a budget below it finds no plan)
    work.charge(work.CELL_S * len(space.runs) * len(space.groups))
    start = heuristic(model, space, global_batch, schedule, candidates, max_stages, recompute, deadline=window)
    if start is not None:
        ev = best.evaluate(start.stages, start.groups, start.microbatches)
        best.keep(
            Incumbent(best.score(ev, start.stages, start.groups), ev, start.stages, start.groups, start.microbatches)
        )
        log.debug(
            "heuristic start: %.6g ms at M=%d, %d stages", ev.iteration_s * MS, start.microbatches, len(start.stages)
        )
    single = single_stage(space, candidates, schedule, deadline=window)
    if single.best is not None:
        one = single.best
        if best.keep(one._replace(score=best.score(one.evaluation, one.stages, one.groups))):
            log.debug("single stage start: %.6g ms at M=%d on %s", one.score * MS, one.microbatches, one.groups[0])
    cold = best.current
    if given is not None and given[2] in candidates:
        best.offer(*given)
    # the local search around the incumbent and, when a given plan displaced the cold start, around
    # that start too (each in its share of the window): a given plan (a re-plan's repair) can sit in
    # a region whose local optimum is worse than the cold start's
    starts = [best.current] + ([cold] if cold is not None and best.current is not cold else [])
    deadline = min(started + options.polish_by * time_limit_s, work.now() + options.polish_share * time_limit_s)
    for k, found in enumerate(starts if best.current is not None else []):
        share = work.now() + (deadline - work.now()) / (len(starts) - k)
        polished = polish(
            found.stages,
            found.groups,
            found.microbatches,
            space=space,
            schedule=schedule,
            candidates=candidates,
            max_stages=max_stages,
            score=best.score,
            deadline=share,
        )
        if polished is not None and polished.score < best.current.score:
            best.keep(polished)
            log.debug(
                "polished start: %.6g ms at M=%d, %d stages",
                polished.evaluation.iteration_s * MS,
                polished.microbatches,
                len(polished.stages),
            )
    return single.least_s if single.complete and best.migration is None else {}
