"""``plan()``: solve the stage ILP for every stage count and microbatch count, keep the best.

The ILP (``_ilp``) fixes S and M so that in-flight activations (which depend
on a stage's distance from the end of the pipeline) stay linear; the loop over
(S, M) is exact over the candidate sets. The certified lower bound is the
smallest of the per-(S, M) bounds, so the gap covers the whole search space.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass

from orchestrator.cluster import Cluster, Link
from orchestrator.costs import CostModel
from orchestrator.planner._evaluate import evaluate
from orchestrator.planner._groups import GroupConfig, TypeInfo, group_configs, type_infos
from orchestrator.planner._ilp import StageModel
from orchestrator.planner._plan import Plan, PlanInfeasible, Stage
from orchestrator.planner._table import CostTable
from orchestrator.solver import solve

DEFAULT_MICROBATCHES = (1, 2, 4, 8, 16, 32)


def _p2p_link(cluster: Cluster, infos: dict[str, TypeInfo]):
    links = [i.inter_link for i in infos.values()] + ([cluster.cluster_link] if cluster.cluster_link else [])
    return min(links, key=lambda link: link.bandwidth_bytes_per_s)


@dataclass(frozen=True, slots=True)
class SearchSpace:
    """What every (S, M) subproblem and the exhaustive search share."""

    infos: dict[str, TypeInfo]
    groups: list[GroupConfig]
    table: CostTable
    p2p_link: Link
    layers: int


def search_space(model: CostModel, global_batch: int, *, recompute: bool) -> SearchSpace:
    infos = type_infos(model.cluster)
    return SearchSpace(
        infos=infos,
        groups=group_configs(infos, recompute=recompute, tensor_parallel=model.tensor_parallel),
        table=CostTable(model, infos, global_batch),
        p2p_link=_p2p_link(model.cluster, infos),
        layers=len(model.layers),
    )


def _allocate(cluster: Cluster, groups: list[GroupConfig]) -> list[tuple[str, ...]]:
    """Concrete devices for each stage: whole hosts first, then host slices, first fit."""
    free: dict[str, list[list[str]]] = {}
    for host in cluster.hosts:
        refs = [d.ref for d in cluster.devices() if d.host == host.name]
        free.setdefault(host.device_type, []).append(refs)
    out: list[tuple[str, ...] | None] = [None] * len(groups)
    for index in sorted(range(len(groups)), key=lambda i: -groups[i].size):
        group = groups[index]
        hosts = free[group.device_type]
        picked: list[str] = []
        for refs in sorted(hosts, key=len, reverse=group.size > min(len(h) for h in hosts)):
            take = min(len(refs), group.size - len(picked))
            if group.size <= len(refs) or take == len(refs):
                picked += refs[:take]
                del refs[:take]
            if len(picked) == group.size:
                break
        out[index] = tuple(picked)
    return out  # type: ignore[return-value]


def plan(
    model: CostModel,
    *,
    global_batch: int,
    schedule: str = "1f1b",
    microbatch_candidates: tuple[int, ...] = DEFAULT_MICROBATCHES,
    max_stages: int | None = None,
    time_limit_s: float = 30.0,
    gap: float = 1e-3,
    recompute: bool = True,
) -> Plan:
    """The best plan for ``model``'s layers on its cluster (see the module docstring).

    Raises:
      PlanInfeasible: no stage count, microbatch count and groups fit in memory.
    """
    if schedule not in ("gpipe", "1f1b"):
        raise ValueError(f"schedule must be 'gpipe' or '1f1b', got {schedule!r}")
    started = time.perf_counter()
    cluster = model.cluster
    space = search_space(model, global_batch, recompute=recompute)
    infos, groups, table, link, L = space.infos, space.groups, space.table, space.p2p_link, space.layers
    max_stages = min(max_stages or L, L, len(cluster.devices()))
    candidates = [m for m in microbatch_candidates if global_batch % m == 0]
    best, lower = None, math.inf
    runs = list(itertools.product(range(1, max_stages + 1), candidates))
    for S, M in runs:
        remaining = time_limit_s - (time.perf_counter() - started)
        sub = StageModel(
            layers=L,
            stages=S,
            microbatches=M,
            groups=groups,
            table=table,
            infos=infos,
            schedule=schedule,
            p2p_link=link,
        )
        if not sub.groups:
            continue
        sub.build()
        result = solve(sub.lp, time_limit_s=max(0.5, remaining / max(1, len(runs))), gap=gap)
        if result.status == "Infeasible" or not result.has_solution:
            if result.status != "Infeasible":
                lower = min(lower, result.bound)
            continue
        lower = min(lower, result.bound)
        stages, chosen = sub.read()
        ev = evaluate(stages, chosen, M, table=table, infos=infos, schedule=schedule, p2p_link=link)
        if ev.feasible and (best is None or ev.iteration_s < best[0].iteration_s):
            best = (ev, stages, chosen, M, result)
    if best is None:
        raise PlanInfeasible(
            f"no plan fits: {L} layers, global batch {global_batch}, {len(cluster.devices())} devices of "
            f"{sorted(infos)}; every stage count and microbatch count in {candidates} exceeds device memory "
            "(try more devices, recompute, or a smaller batch)"
        )
    ev, stages, chosen, M, result = best
    devices = _allocate(cluster, chosen)
    plan_stages = tuple(
        Stage(
            layers=tuple(layers),
            device_type=g.device_type,
            devices=devices[s],
            tp=g.tp,
            dp=g.dp,
            recompute=g.recompute,
            microbatch_size=table.microbatch(g, M),
            time_s=ev.stage_time_s[s],
            memory_bytes=ev.stage_memory_bytes[s],
            forward_s=ev.stage_forward_s[s],
            send_s=ev.stage_send_s[s],
            dp_sync_s=ev.stage_sync_s[s],
            optimizer_s=ev.stage_optimizer_s[s],
        )
        for s, (layers, g) in enumerate(zip(stages, chosen))
    )
    bound = min(lower, ev.iteration_s)
    return Plan(
        stages=plan_stages,
        schedule=schedule,  # type: ignore[arg-type]
        microbatches=M,
        global_batch=global_batch,
        iteration_s=ev.iteration_s,
        breakdown=ev.breakdown,
        solver=result.solver,
        status=result.status,
        objective=ev.iteration_s,
        bound=bound,
        gap=(ev.iteration_s - bound) / ev.iteration_s if ev.iteration_s > 0 else 0.0,
        solve_s=time.perf_counter() - started,
    )
