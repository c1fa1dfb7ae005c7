"""Chain splits and the best configuration for a stage on fixed devices, shared by the baselines and re-planning."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np

from orchestrator.planner._groups import GroupConfig
from orchestrator.planner._ilp import in_flight


class StageCosts:
    """Prefix sums of per-layer entries for one group at one M: interval time and memory in O(1)
    (memory per part: a group on two device types must fit on each), and the same for every
    interval at once as (layers + 1) × (layers + 1) matrices indexed [first, end) (:meth:`times`)."""

    def __init__(self, space, group: GroupConfig, microbatches: int):
        entries = [space.table.entry(layer, group, microbatches) for layer in range(space.layers)]
        self.group = group
        self._matrices = None  # (``_memory``)
        self._times: dict[int, np.ndarray] = {}  # (``times``, per in-flight count)
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

    def times(self, in_flight_microbatches: int) -> np.ndarray:
        """[i, k]: the time of layers [i, k) where they fit with ``in_flight_microbatches``, inf elsewhere
        (and wherever k ≤ i). Built once per count (the sweeps ask for each many times), read-only."""
        if in_flight_microbatches not in self._times:
            out = _spans(self.time)
            fits = np.triu(np.ones_like(out, dtype=bool), 1)
            for capacity, static, activations, peak in self._memory():
                fits &= static + activations * in_flight_microbatches + peak <= capacity
            out[~fits] = np.inf
            out.flags.writeable = False
            self._times[in_flight_microbatches] = out
        return self._times[in_flight_microbatches]

    def _memory(self) -> list[tuple[float, np.ndarray, np.ndarray, np.ndarray]]:
        """Per part: (capacity, and over layers [i, k): static bytes, activation bytes, the largest
        transient), built once."""
        if self._matrices is None:
            self._matrices = []
            for capacity, static, activation, transient in self.parts:
                n = len(static)
                peak = np.full((n, n), -np.inf)
                for i in range(n - 1):  # peak[i, k] = max(transient[i:k])
                    peak[i, i + 1 :] = np.maximum.accumulate(transient[i:])
                self._matrices.append((capacity, _spans(static), _spans(activation), peak))
        return self._matrices

    def fits(self, i: int, k: int, in_flight_microbatches: int) -> bool:
        return all(
            static[k] - static[i] + (activation[k] - activation[i]) * in_flight_microbatches + max(transient[i:k])
            <= capacity
            for capacity, static, activation, transient in self.parts
        )


def stage_costs(space, group: GroupConfig, microbatches: int) -> StageCosts:
    """``StageCosts(space, group, microbatches)``, built once per cost table (kept in its ``derived``):
    they read the table alone, and the baselines, the configurations of fixed splits and re-planning
    ask for the same ones many times."""
    key = (StageCosts, group, microbatches)
    found = space.table.derived.get(key)
    if found is None:
        found = space.table.derived[key] = StageCosts(space, group, microbatches)
    return found


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


def _spans(prefix: list[float]) -> np.ndarray:
    """[i, k] = prefix[k] − prefix[i]."""
    prefix = np.asarray(prefix)
    return prefix[None, :] - prefix[:, None]


def best_config(options: list[StageCosts], i: int, k: int, in_flight_microbatches: int) -> StageCosts | None:
    """The fastest configuration whose memory fits layers [i, k)."""
    fitting = [c for c in options if c.fits(i, k, in_flight_microbatches)]
    return min(fitting, key=lambda c: c.time_s(i, k)) if fitting else None


def fastest_times(options: list[StageCosts], layers: int, in_flight_microbatches: int) -> np.ndarray:
    """[i, k]: the time of layers [i, k) under the fastest of ``options`` that fits (``best_config``
    for every interval at once), inf where none does."""
    out = np.full((layers + 1, layers + 1), np.inf)
    for option in options:
        np.minimum(out, option.times(in_flight_microbatches), out=out)
    return out


def min_bottleneck_split(layers: int, stages: int, stage_times: Callable[[int], np.ndarray]) -> list[list[int]] | None:
    """Contiguous split of ``layers`` into ``stages`` non-empty ranges minimising the largest stage
    time, ties broken by the sum; ``stage_times(s)[i, k]`` is stage s's time on layers [i, k) (inf
    where they do not fit, and where k ≤ i). Dynamic programming over (stage, end), one stage at a
    time over every (first, end) at once: O(stages · layers²)."""
    if stages > layers:
        return None
    worst = np.full(layers + 1, np.inf)  # over the split of layers [0, k) into the stages so far
    total = np.full(layers + 1, np.inf)
    worst[0] = total[0] = 0.0
    cuts = []
    for s in range(stages):
        times = stage_times(s)
        candidate = np.maximum(worst[:, None], times)  # [i, k]: stages so far on [0, i), stage s on [i, k)
        worst = candidate.min(axis=0)
        tied = np.where(candidate == worst[None, :], total[:, None] + times, np.inf)
        cut = tied.argmin(axis=0)  # the first i of the least sum among the least bottlenecks
        total = tied[cut, np.arange(layers + 1)]
        cuts.append(cut)
    if worst[layers] == np.inf:
        return None
    bounds = [layers]
    for cut in reversed(cuts):
        bounds.append(int(cut[bounds[-1]]))
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
    space,
    blocks: list[tuple[str, int]],
    split: list[list[int]],
    microbatches: int,
    schedule: str,
    *,
    tp: bool = True,
) -> list[GroupConfig] | None:
    """The fastest fitting configuration for each stage of a fixed split on fixed device blocks."""
    chosen = []
    for s, ((device_type, size), layers) in enumerate(zip(blocks, split)):
        options = [
            stage_costs(space, g, microbatches)
            for g in configs_for(space, device_type, size, microbatches, tensor_parallel=tp)
        ]
        k = in_flight(schedule, microbatches, len(blocks), s)
        best = best_config(options, layers[0], layers[-1] + 1, k)
        if best is None:
            return None
        chosen.append(best.group)
    return chosen
