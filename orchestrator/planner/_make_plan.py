"""The :class:`Plan` of a priced solution: concrete devices for each stage, and its certificate.

Virtual stages (interleaved 1F1B) are chosen here, after the search: the ILP prices plain
schedules, and its bound covers plans with v = 1 only. A solution whose stages each hold a
multiple of v repeated layers (the blocks of a run of identical layers; the embedding and the head
ride in the first and last chunks, as Megatron-LM places them) is priced at such v > 1 with M a
multiple of its stage count (in increasing order, until one is slower than the best so far), and the
fastest that fits is kept, so the plan is no slower than the plain one. Where interleaving is asked
under 1F1B, the space the plan's gap covers is every v ≤ v_max (``_interleaved_bound``): its bound is
the least of the search's bound over plain plans and the capacity LP's over interleaved ones, and
``Coverage.virtual_stages`` names 1..v_max (docs/planner.md, "Virtual stages").
"""

from __future__ import annotations

import time

from orchestrator.cluster import Cluster
from orchestrator.costs import CostModel
from orchestrator.planner._diagnose import binding_notes
from orchestrator.planner._evaluate import Evaluation, evaluate
from orchestrator.planner._groups import GroupConfig
from orchestrator.planner._ilp import Run
from orchestrator.planner._interleaved_bound import interleaved_bound_s, interleaved_coverage, max_virtual_stages
from orchestrator.planner._plan import Coverage, Plan, PlanInfeasible, Stage
from orchestrator.planner._space import SearchSpace
from orchestrator.solver import highs_available


def make_plan(
    model: CostModel,
    space: SearchSpace,
    ev: Evaluation,
    stages: list[list[int]],
    chosen: list[GroupConfig],
    M: int,
    *,
    schedule: str,
    global_batch: int,
    bound: float,
    gap: float,
    started: float,
    prefer_devices: list[tuple[str, ...] | None] | None = None,
    objective: float | None = None,
    covered: Coverage | None = None,
    interleave: bool = True,
) -> Plan:
    """The :class:`Plan` of an evaluated solution: devices allocated (``prefer_devices`` by
    position from the end), certified ``bound`` (s) on the step time; ``objective`` defaults to
    the step time; ``covered``: the search space ``bound`` holds over; ``interleave``: also try
    virtual stages (:func:`virtual_stage_counts`) and keep the fastest, and under 1F1B with ``covered``
    given, widen the space to every v ≤ v_max with the bound over it (``_interleaved_bound``)."""
    S = len(chosen)
    v = 1
    if interleave:
        v, interleaved = best_virtual_stages(space, stages, chosen, M, schedule, ev)
        if v > 1:
            if objective is not None:
                objective += interleaved.iteration_s - ev.iteration_s
            note = (
                f"interleaved 1F1B with {v} virtual stages: {interleaved.iteration_s * 1e3:.1f} ms against "
                f"{ev.iteration_s * 1e3:.1f} ms plain (chosen after the search)"
            )
            ev = interleaved
    prefer = [
        prefer_devices[S - 1 - s] if prefer_devices and S - 1 - s < len(prefer_devices) else None for s in range(S)
    ]
    devices = allocate(model.cluster, chosen, prefer=prefer)
    plan_stages = tuple(
        Stage(
            layers=tuple(layers),
            device_type=g.device_type,
            devices=devices[s],
            tp=g.tp,
            dp=g.dp,
            cp=g.cp,
            cp_form=next(filter(None, (space.table.entry(i, g, M).cp_form for i in layers)), None)
            if g.cp > 1
            else None,
            recompute=g.recompute,
            zero=space.table.zero and g.dp > 1,
            fsdp=space.table.fsdp and g.dp > 1,
            sequence_parallel=space.table.sequence_parallel and g.tp > 1,
            selective_recompute=space.table.selective_recompute and not g.recompute,
            microbatch_size=space.table.microbatch(g, M),
            parts=g.parts,
            shares=space.table.shares(g, M) if g.mixed else (),
            time_s=ev.stage_time_s[s],
            memory_bytes=ev.stage_memory_bytes[s],
            forward_s=ev.stage_forward_s[s],
            send_s=ev.stage_send_s[s],
            dp_sync_s=ev.stage_sync_s[s],
            optimizer_s=ev.stage_optimizer_s[s],
        )
        for s, (layers, g) in enumerate(zip(stages, chosen))
    )
    bound = min(bound, ev.iteration_s)
    plain_gap = (ev.iteration_s - bound) / ev.iteration_s if ev.iteration_s > 0 else 0.0
    notes = binding_notes(stages, chosen, M, ev, space)
    v_max = max_virtual_stages(space.runs)
    if interleave and schedule == "1f1b" and covered is not None and v_max > 1:
        # the space holds v ≤ v_max: its bound is the least of the plain one and the interleaved one, with
        # the plain one as the LP's cutoff (a plan no faster than it is bounded by it); a search stopped
        # without a bound (0) keeps 0
        interleaved_s = (
            interleaved_bound_s(space, covered.microbatches, covered.max_stages, v_max, below_s=bound)
            if bound > 0
            else 0.0
        )
        notes += (
            f"the gap covers v <= {v_max}: the search's bound over plain schedules is {bound * 1e3:.1f} ms, "
            f"the capacity LP's over every v <= {v_max} {interleaved_s * 1e3:.1f} ms",
        )
        bound, covered = min(bound, interleaved_s), interleaved_coverage(covered, v_max)
    final_gap = (ev.iteration_s - bound) / ev.iteration_s if ev.iteration_s > 0 else 0.0
    status = "Optimal" if final_gap <= gap else "Optimal over plain schedules" if plain_gap <= gap else None
    return Plan(
        stages=plan_stages,
        schedule=schedule,  # type: ignore[arg-type]
        microbatches=M,
        global_batch=global_batch,
        iteration_s=ev.iteration_s,
        virtual_stages=v,
        breakdown=ev.breakdown,
        solver="HiGHS" if highs_available() else "CBC",
        status=status or "Time limit reached",
        objective=ev.iteration_s if objective is None else objective,
        bound=bound,
        gap=final_gap,
        solve_s=time.perf_counter() - started,
        notes=notes + ((note,) if v > 1 else ()),
        space=covered,
    )


def virtual_stage_counts(runs: list[Run], stages: list[list[int]], microbatches: int) -> list[int]:
    """The virtual-stage counts v > 1 a plan of ``stages`` can take: every stage holds a multiple of v
    (and at least v) layers of runs of several identical layers, and M is a multiple of the stage
    count (Megatron-LM's interleaved order)."""
    S = len(stages)
    if S < 2 or microbatches % S:
        return []
    repeated = {layer for run in runs if run.count > 1 for layer in run.layers}
    counts = [sum(layer in repeated for layer in layers) for layers in stages]
    return [v for v in range(2, min(counts) + 1) if all(n % v == 0 for n in counts)]


def best_virtual_stages(
    space: SearchSpace, stages: list[list[int]], chosen: list[GroupConfig], M: int, schedule: str, ev: Evaluation
) -> tuple[int, Evaluation]:
    """(v, its evaluation): the fastest fitting plan of these stages over v = 1 (``ev``) and
    :func:`virtual_stage_counts` under 1F1B, tried in increasing order until one that fits is slower
    than the best so far (each chunk more shrinks the bubble less and adds as many transfers)."""
    best_v, best = 1, ev
    if schedule != "1f1b" or not ev.feasible:
        return best_v, best
    for v in virtual_stage_counts(space.runs, stages, M):
        priced = evaluate(
            stages, chosen, M, table=space.table, infos=space.infos, schedule=schedule, links=space.links,
            virtual_stages=v,
        )  # fmt: skip
        if priced.feasible and priced.iteration_s >= best.iteration_s:
            break
        if priced.feasible:
            best_v, best = v, priced
    return best_v, best


def allocate(
    cluster: Cluster, groups: list[GroupConfig], prefer: list[tuple[str, ...] | None] | None = None
) -> list[tuple[str, ...]]:
    """Concrete devices for each stage: preferred devices where they still match its group,
    then whole hosts first, then host slices, first fit. Devices come replica-major: each run
    of ``tp`` devices is one tensor-parallel group inside one host."""
    kinds = {d.ref: d.device_type for d in cluster.devices()}
    out: list[tuple[str, ...] | None] = [None] * len(groups)
    taken: set[str] = set()
    for index, wanted in enumerate(prefer or []):
        group = groups[index] if index < len(groups) else None
        if (
            group is not None
            and not group.mixed
            and wanted
            and len(wanted) == group.size
            and all(kinds.get(d) == group.device_type for d in wanted)
            and not taken & set(wanted)
        ):
            out[index] = tuple(wanted)
            taken |= set(wanted)
    free: dict[str, list[list[str]]] = {}
    on_host: dict[str, list[str]] = {host.name: [] for host in cluster.hosts}
    for device in cluster.devices():
        if device.ref not in taken:
            on_host[device.host].append(device.ref)
    for host in cluster.hosts:
        free.setdefault(host.device_type, []).append(on_host[host.name])
    for index in sorted(range(len(groups)), key=lambda i: -groups[i].size):
        if out[index] is not None:
            continue
        group = groups[index]
        # a mixed group: its first type's replicas, then its second's
        out[index] = tuple(
            ref for kind, size in group.by_type.items() for ref in _take(free[kind], kind, size, group.tp)
        )
    return out  # type: ignore[return-value]


def _take(hosts: list[list[str]], kind: str, size: int, tp: int) -> list[str]:
    """``size`` free devices from ``hosts`` (lists of free refs, taken from), each run of ``tp`` in one host."""
    picked: list[str] = []
    for refs in sorted(hosts, key=len, reverse=size > min(len(h) for h in hosts)):
        take = min(len(refs), size - len(picked))
        take -= take % tp  # a tensor-parallel group never spans two hosts
        if take and (size <= len(refs) or take == len(refs) - len(refs) % tp):
            picked += refs[:take]
            del refs[:take]
        if len(picked) == size:
            return picked
    raise PlanInfeasible(
        f"cannot place {size} {kind} devices with tensor parallelism {tp} inside "
        "hosts: too many devices are out of service on partly available hosts (mark whole hosts unavailable)"
    )
