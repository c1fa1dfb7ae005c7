"""The step time and memory of one concrete plan — what the ILP's objective and rows compute, evaluated directly.

The step time is the closed form of :mod:`orchestrator.planner._closed_form`.
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.planner._closed_form import step_time
from orchestrator.planner._groups import GroupConfig, TypeInfo
from orchestrator.planner._ilp import in_flight
from orchestrator.planner._table import CostTable


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


def evaluate(
    stages: list[list[int]],
    groups: list[GroupConfig],
    microbatches: int,
    *,
    table: CostTable,
    infos: dict[str, TypeInfo],
    schedule: str,
    links,
) -> Evaluation:
    """``links[(t, t2)]``: the link a stage on type t uses to send to a next stage on type t2."""
    S = len(stages)
    times, memories, syncs, optims, forwards, sends = [], [], [], [], [], []
    layer_backwards, layer_syncs = [], []
    feasible = True
    used: dict[str, int] = {}
    for s, (layers, group) in enumerate(zip(stages, groups)):
        if table.microbatch(group, microbatches) is None:
            return Evaluation(False, float("inf"), (), (), {})
        entries = [table.entry(l, group, microbatches) for l in layers]
        t = sum(e.time_s for e in entries)
        send = (
            table.send_s(layers[-1], microbatches, links[group.device_type, groups[s + 1].device_type])
            if s < S - 1
            else 0.0
        )
        t += 2 * send
        forwards.append(sum(e.forward_s for e in entries))
        sends.append(send)
        k = in_flight(schedule, microbatches, S, s)
        parts = [table.memory_parts(l, group, microbatches) for l in layers]
        peak = 0.0  # the fullest part's bytes per device
        for p, (capacity, _) in enumerate(parts[0]):
            held = [part[p][1] for part in parts]
            memory = sum(e.static_bytes + e.activation_bytes * k for e in held) + max(e.transient_bytes for e in held)
            feasible &= memory <= capacity
            peak = max(peak, memory)
        for name, n in group.by_type.items():
            used[name] = used.get(name, 0) + n
        times.append(t)
        memories.append(peak)
        syncs.append(sum(e.dp_sync_s for e in entries))
        layer_backwards.append([e.time_s - e.forward_s for e in entries])
        layer_syncs.append([e.dp_sync_s for e in entries])
        optims.append(sum(e.optimizer_s for e in entries))
    feasible &= all(n <= infos[t].devices for t, n in used.items())
    closed = step_time(forwards, layer_backwards, sends, layer_syncs, optims, microbatches, schedule)
    return Evaluation(
        feasible,
        closed.step_s,
        tuple(times),
        tuple(memories),
        closed.breakdown,
        tuple(forwards),
        tuple(sends),
        tuple(syncs),
        tuple(optims),
    )
