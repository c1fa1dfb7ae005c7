"""Shared pieces of the baselines: the best configuration for a stage on fixed devices, and chain splits."""

from __future__ import annotations

import itertools
from collections.abc import Callable

from orchestrator.planner._groups import GroupConfig
from orchestrator.planner._ilp import in_flight


class StageCosts:
    """Prefix sums of per-layer entries for one group at one M: interval time and memory in O(1)
    (memory per part: a group on two device types must fit on each)."""

    def __init__(self, space, group: GroupConfig, microbatches: int):
        entries = [space.table.entry(layer, group, microbatches) for layer in range(space.layers)]
        self.group = group
        self.time = [0.0, *itertools.accumulate(e.time_s for e in entries)]
        self.parts = []  # (capacity, static prefix sums, activation prefix sums, transients) per part
        layers = [space.table.memory_parts(layer, group, microbatches) for layer in range(space.layers)]
        for q in range(len(layers[0]) if layers else 0):
            held = [cell[q][1] for cell in layers]
            self.parts.append(
                (
                    layers[0][q][0],
                    [0.0, *itertools.accumulate(e.static_bytes for e in held)],
                    [0.0, *itertools.accumulate(e.activation_bytes for e in held)],
                    [e.transient_bytes for e in held],
                )
            )

    def time_s(self, i: int, k: int) -> float:
        return self.time[k] - self.time[i]

    def fits(self, i: int, k: int, in_flight_microbatches: int) -> bool:
        return all(
            static[k] - static[i] + (activation[k] - activation[i]) * in_flight_microbatches + max(transient[i:k])
            <= capacity
            for capacity, static, activation, transient in self.parts
        )


def configs_for(space, device_type: str, size: int, microbatches: int, *, tensor_parallel: bool = True):
    """Every (tp, recompute) the planner would consider for ``size`` devices of one type."""
    return [
        g
        for g in space.groups
        if g.device_type == device_type
        and g.size == size
        and (tensor_parallel or g.tp == 1)
        and space.table.microbatch(g, microbatches) is not None
    ]


def best_config(options: list[StageCosts], i: int, k: int, in_flight_microbatches: int) -> StageCosts | None:
    """The fastest configuration whose memory fits layers [i, k)."""
    fitting = [c for c in options if c.fits(i, k, in_flight_microbatches)]
    return min(fitting, key=lambda c: c.time_s(i, k)) if fitting else None


def min_bottleneck_split(layers: int, stages: int, time_s: Callable[[int, int, int], float]) -> list[list[int]] | None:
    """Contiguous split of ``layers`` into ``stages`` non-empty ranges minimising the largest
    ``time_s(stage, first, end)`` (inf where a stage does not fit), ties broken by the sum.
    Dynamic programming over (stage, end): O(stages · layers²)."""
    if stages > layers:
        return None
    inf = (float("inf"), float("inf"))
    best = [[inf] * (layers + 1) for _ in range(stages + 1)]
    cut = [[0] * (layers + 1) for _ in range(stages + 1)]
    best[0][0] = (0.0, 0.0)
    for s in range(1, stages + 1):
        for k in range(s, layers - (stages - s) + 1):
            for i in range(s - 1, k):
                if best[s - 1][i] == inf:
                    continue
                t = time_s(s - 1, i, k)
                value = (max(best[s - 1][i][0], t), best[s - 1][i][1] + t)
                if value < best[s][k]:
                    best[s][k], cut[s][k] = value, i
    if best[stages][layers][0] == float("inf"):
        return None
    bounds, k = [layers], layers
    for s in range(stages, 0, -1):
        k = cut[s][k]
        bounds.append(k)
    bounds.reverse()
    return [list(range(bounds[s], bounds[s + 1])) for s in range(stages)]


def equal_split(layers: int, stages: int) -> list[list[int]] | None:
    if stages > layers:
        return None
    base, extra = divmod(layers, stages)
    out, start = [], 0
    for s in range(stages):
        n = base + (1 if s < extra else 0)
        out.append(list(range(start, start + n)))
        start += n
    return out


def configure(
    space, blocks: list[tuple[str, int]], split: list[list[int]], microbatches: int, schedule: str, *, tp: bool = True
) -> list[GroupConfig] | None:
    """The fastest fitting configuration for each stage of a fixed split on fixed device blocks."""
    chosen = []
    for s, ((device_type, size), layers) in enumerate(zip(blocks, split)):
        options = [
            StageCosts(space, g, microbatches)
            for g in configs_for(space, device_type, size, microbatches, tensor_parallel=tp)
        ]
        k = in_flight(schedule, microbatches, len(blocks), s)
        best = best_config(options, layers[0], layers[-1] + 1, k)
        if best is None:
            return None
        chosen.append(best.group)
    return chosen
