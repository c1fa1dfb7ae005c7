"""The step time and memory of one concrete plan — what the ILP's objective and rows compute, evaluated directly.

The step time is the closed form of :mod:`orchestrator.planner._closed_form`. Under virtual
stages (interleaved 1F1B, v > 1) the last stage also sends to the first (the wrap between chunks:
its first chunk's last layer's output), and stage s holds ``interleaved_in_flight`` microbatches'
activations at its peak.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from orchestrator.planner._closed_form import interleaved_in_flight, step_time
from orchestrator.planner._groups import GroupConfig, TypeInfo
from orchestrator.planner._ilp import in_flight
from orchestrator.planner._table import CostTable
from orchestrator.solver import work


@dataclass(frozen=True, slots=True)
class Evaluation:
    feasible: bool
    iteration_s: float
    stage_time_s: tuple[float, ...]
    stage_memory_bytes: tuple[float, ...]
    breakdown: dict
    stage_forward_s: tuple[float, ...] = ()
    stage_send_s: tuple[float, ...] = ()
    stage_sync_s: tuple[float, ...] = ()
    stage_optimizer_s: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class StageSummary:
    """One stage's part of an :class:`Evaluation` (per microbatch, except memory)."""

    time_s: float  # compute plus both directions of its outgoing transfer
    forward_s: float
    send_s: float
    memory_bytes: float  # the fullest part's bytes per device
    fits: bool
    sync_s: float
    optimizer_s: float
    layer_backward_s: tuple[float, ...]
    layer_sync_s: tuple[float, ...]


def summarize_stage(
    layers,
    group: GroupConfig,
    next_group: GroupConfig | None,
    microbatches: int,
    in_flight_microbatches: float,
    *,
    table,
    links,
    send_layer: int | None = None,
) -> StageSummary | None:
    """A stage's times and memory; None when the group's data parallelism does not divide the
    microbatch. ``next_group``: the group it sends to (None for the last stage without virtual
    stages); ``send_layer``: the layer whose output it sends (default: its last)."""
    if table.microbatch(group, microbatches) is None:
        return None
    entries = [table.entry(l, group, microbatches) for l in layers]
    send = (
        0.0
        if next_group is None
        else table.send_s(
            layers[-1] if send_layer is None else send_layer,
            microbatches,
            links[group.device_type, next_group.device_type],
            min(group.size, next_group.size),
        )
    )
    parts = [table.memory_parts(l, group, microbatches) for l in layers]
    peak, fits = 0.0, True
    for p, (capacity, _) in enumerate(parts[0]):
        held = [part[p][1] for part in parts]
        memory = sum(e.static_bytes + e.activation_bytes * in_flight_microbatches for e in held) + max(
            e.transient_bytes for e in held
        )
        fits &= memory <= capacity
        peak = max(peak, memory)
    return StageSummary(
        time_s=sum(e.time_s for e in entries) + 2 * send,
        forward_s=sum(e.forward_s for e in entries),
        send_s=send,
        memory_bytes=peak,
        fits=fits,
        sync_s=sum(e.dp_sync_s for e in entries),
        optimizer_s=sum(e.optimizer_s for e in entries),
        layer_backward_s=tuple(e.time_s - e.forward_s for e in entries),
        layer_sync_s=tuple(e.dp_sync_s for e in entries),
    )


def summary_cache() -> Callable[..., StageSummary | None]:
    """:func:`summarize_stage`, each stage priced once: for the searches and enumerations that price
    many plans over one cost table and its links (a neighbour or the next plan changes few stages).
    Pass it to :func:`evaluate` as ``summarize``; ``layers`` may be a list or a tuple."""
    summaries: dict[tuple, StageSummary | None] = {}

    def summary(layers, group, next_group, microbatches, in_flight_microbatches, *, table, links):
        key = (tuple(layers), group, next_group, microbatches, in_flight_microbatches)
        if key not in summaries:
            summaries[key] = summarize_stage(
                layers, group, next_group, microbatches, in_flight_microbatches, table=table, links=links
            )
        return summaries[key]

    return summary


def combine(
    summaries: list[StageSummary | None],
    groups: list[GroupConfig],
    microbatches: int,
    *,
    infos,
    schedule: str,
    report_infeasible: bool = True,
    virtual_stages: int = 1,
) -> Evaluation:
    """The plan's evaluation from its stages' summaries: fits if every stage fits and no type's
    devices are over-used; the step time is the closed form (computed for a plan that does not fit
    too, unless ``report_infeasible`` is False)."""
    if any(s is None for s in summaries):
        return Evaluation(False, float("inf"), (), (), {})
    used: dict[str, int] = {}
    for group in groups:
        for name, n in group.by_type.items():
            used[name] = used.get(name, 0) + n
    feasible = all(s.fits for s in summaries) and all(n <= infos[t].devices for t, n in used.items())
    if not feasible and not report_infeasible:
        return Evaluation(False, float("inf"), (), (), {})
    closed = step_time(
        [s.forward_s for s in summaries],
        [list(s.layer_backward_s) for s in summaries],
        [s.send_s for s in summaries],
        [list(s.layer_sync_s) for s in summaries],
        [s.optimizer_s for s in summaries],
        microbatches,
        schedule,
        virtual_stages,
    )
    return Evaluation(
        feasible,
        closed.step_s,
        tuple(s.time_s for s in summaries),
        tuple(s.memory_bytes for s in summaries),
        closed.breakdown,
        tuple(s.forward_s for s in summaries),
        tuple(s.send_s for s in summaries),
        tuple(s.sync_s for s in summaries),
        tuple(s.optimizer_s for s in summaries),
    )


def evaluate(
    stages: list[list[int]],
    groups: list[GroupConfig],
    microbatches: int,
    *,
    table: CostTable,
    infos: dict[str, TypeInfo],
    schedule: str,
    links,
    summarize=summarize_stage,
    report_infeasible: bool = True,
    virtual_stages: int = 1,
) -> Evaluation:
    """``links[(t, t2)]``: the link a stage on type t uses to send to a next stage on type t2.
    ``summarize``: :func:`summarize_stage` or a cache of it (the local search's; not used under
    ``virtual_stages`` v > 1, interleaved 1F1B); ``report_infeasible``: as in :func:`combine`."""
    S = len(stages)
    work.charge(work.PLAN_S)  # (the search's budget counts plans priced)
    v = virtual_stages
    if v > 1:
        last = stages[-1]
        summaries = [
            summarize_stage(
                layers,
                group,
                groups[(s + 1) % S],
                microbatches,
                interleaved_in_flight(microbatches, S, s, v),
                table=table,
                links=links,
                send_layer=last[len(last) // v - 1] if s == S - 1 else None,
            )
            for s, (layers, group) in enumerate(zip(stages, groups))
        ]
        return combine(
            summaries,
            groups,
            microbatches,
            infos=infos,
            schedule=schedule,
            report_infeasible=report_infeasible,
            virtual_stages=v,
        )
    summaries = [
        summarize(
            layers,
            group,
            groups[s + 1] if s < S - 1 else None,
            microbatches,
            in_flight(schedule, microbatches, S, s),
            table=table,
            links=links,
        )
        for s, (layers, group) in enumerate(zip(stages, groups))
    ]
    return combine(summaries, groups, microbatches, infos=infos, schedule=schedule, report_infeasible=report_infeasible)
