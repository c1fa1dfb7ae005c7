"""Why a plan looks the way it does, and why no plan exists: binding constraints in words."""

from __future__ import annotations

import logging
import math
import time

from orchestrator.planner._deadline import Deadline, DeadlineExceeded
from orchestrator.planner._evaluate import Evaluation
from orchestrator.planner._groups import GroupConfig
from orchestrator.solver import solve

log = logging.getLogger(__name__)

NEAR = 0.95  # a resource used to this fraction of its capacity counts as binding


def binding_notes(
    stages: list[list[int]], groups: list[GroupConfig], microbatches: int, ev: Evaluation, space
) -> tuple[str, ...]:
    """Which constraints bind in a plan, and why each stage sits on its device type."""
    notes = []
    S = len(stages)
    bottleneck = max(range(S), key=lambda s: ev.stage_time_s[s])
    if S > 1 and microbatches > 1:
        notes.append(
            f"bottleneck: stage {bottleneck} ({ev.stage_time_s[bottleneck] * 1e3:.3g} ms per microbatch) sets the pace "
            f"of the {microbatches - 1} steady-state microbatch{'es' if microbatches > 2 else ''}"
        )
    elif S > 1:
        notes.append(
            f"one microbatch: the {S} stages run one after another, none overlapping; stage {bottleneck} is the "
            f"slowest ({ev.stage_time_s[bottleneck] * 1e3:.3g} ms)"
        )
    for s, (layers, group) in enumerate(zip(stages, groups)):
        if group.mixed:
            shares = space.table.shares(group, microbatches)
            split = " and ".join(f"{b} per replica on {kind}" for kind, b in zip(group.by_type, shares))
            notes.append(f"stage {s} spans {group.device_type}: each microbatch is split {split}")
            continue
        if group.cp > 1:
            forms = {space.table.entry(i, group, microbatches).cp_form for i in layers} - {None}
            notes.append(
                f"stage {s} splits each sequence over {group.cp} devices ({' and '.join(sorted(forms)).replace('_', '-') or 'no'} "
                f"attention): some layer fits no {group.device_type} device with its whole sequence"
            )
        info = space.infos[group.device_type]
        share = ev.stage_memory_bytes[s] / info.memory_bytes
        if share >= NEAR:
            why = "; it recomputes its forward pass to fit" if group.recompute else ""
            usable = f"{info.memory_bytes / 1e9:.1f} GB"
            if info.memory_bytes < info.capacity_bytes:
                usable += f" usable (of {info.capacity_bytes / 1e9:.1f} GB, the rest kept free as headroom)"
            notes.append(f"memory binds on stage {s}: {share:.0%} of {usable} per device{why}")
        alternatives = []
        for name, info in space.infos.items():
            if name == group.device_type or info.devices < group.size:
                continue
            other = GroupConfig(
                device_type=name, size=group.size, tp=min(group.tp, info.per_host), recompute=group.recompute
            )
            if other.size % other.tp or space.table.microbatch(other, microbatches) is None:
                continue
            alternatives.append((sum(space.table.entry(l, other, microbatches).time_s for l in layers), name))
        own = sum(space.table.entry(l, group, microbatches).time_s for l in layers)
        if alternatives:
            time, name = min(alternatives)
            notes.append(
                f"stage {s} on {group.size} × {group.device_type}: its layers take {own * 1e3:.3g} ms there vs "
                f"{time * 1e3:.3g} ms on {group.size} × {name}"
            )
    used: dict[str, int] = {}
    for group in groups:
        for name, n in group.by_type.items():
            used[name] = used.get(name, 0) + n
    for name, info in space.infos.items():
        n = used.get(name, 0)
        if n == info.devices:
            notes.append(f"devices bind: all {n} {name} devices are in use")
        elif n == 0:
            notes.append(f"{name}: none of its {info.devices} devices is used")
    return tuple(notes)


def _round_up(value: float, digits: int = 3) -> float:
    if value <= 0:
        return 0.0
    scale = 10 ** (math.floor(math.log10(value)) - digits + 1)
    return math.ceil(value / scale) * scale


def infeasibility_message(
    model,
    space,
    candidates,
    max_stages: int,
    schedule: str,
    global_batch: int,
    *,
    deadline: Deadline | None = None,
) -> str:
    """Name the binding constraint and the least extra memory per device that would make a plan exist
    (one MIP per microbatch count, largest first, each in its share of what is left of ``deadline``;
    what the deadline leaves unproven is said so)."""
    devices = sum(info.devices for info in space.infos.values())
    head = f"no plan fits {space.layers} layers with global batch {global_batch} on {devices} devices"
    advice = "Add devices or memory, allow more stages, or use a smaller batch."
    out_of_time = f"{head}: the time limit ran out before the least extra memory that makes one exist was found"
    try:
        valid = [M for M in candidates if any(space.table.microbatch(g, M) is not None for g in space.groups)]
    except DeadlineExceeded:
        return f"{out_of_time}. {advice}"
    if not valid:
        return f"{head}: no microbatch count in {candidates} divides the global batch (choose a batch divisible by one)"
    least, proven = None, True

    def share(index: int) -> float:  # each M's share of the time left (at most 10 s)
        return 10.0 if deadline is None else min(10.0, deadline.left() / (len(valid) - index))

    build_s = 0.0  # how long the last model took to build and hand over: no M is started that could not finish
    for index, M in enumerate(valid):
        started = time.perf_counter()
        try:
            if share(index) <= build_s:
                raise DeadlineExceeded(deadline.limit_s)
            sub = space.stage_model(M, max_stages, schedule, repair=True).build()
        except DeadlineExceeded:
            proven = False
            break
        result = solve(sub.lp, time_limit_s=max(0.05, share(index) - build_s), gap=1e-4)
        build_s = time.perf_counter() - started - result.solve_s
        log.debug(
            "least extra memory at M=%d: %s, %.2f s to build, %.2f s to solve",
            M,
            result.status,
            build_s,
            result.solve_s,
        )
        proven = proven and result.status in ("Optimal", "Infeasible")
        if result.has_solution and (least is None or result.objective < least[0]):
            least = (result.objective, M)
    if least is None and not proven:
        return f"{out_of_time}. {advice}"
    if least is None:
        return f"{head}: the device and stage limits leave no assignment (more devices or --max-stages needed)"
    extra_gb, M = least
    # the model's extra is usable memory; a device gives only its usable share of what is added
    info = next(iter(space.infos.values()))
    extra_gb *= info.capacity_bytes / info.memory_bytes
    extra_gb = _round_up(extra_gb * (1 + 1e-6))  # shown rounded up, so adding what it says is enough
    if proven:
        extra = f"the least extra memory that makes a plan exist is {extra_gb:.4g} GB per device (at {M} microbatches)"
    else:
        extra = (
            f"{extra_gb:.4g} GB more per device makes a plan exist (at {M} microbatches; the least was not proven "
            "within the time limit)"
        )
    return (
        f"{head}: the memory constraint binds — every split into ≤ {max_stages} stages with microbatches in {valid} "
        f"exceeds device memory; {extra}. {advice}"
    )
