"""Baseline planners, scored by the same cost model as the ILP.

Each fixes what the named system fixes and optimises the rest with our cost model, so the
comparison isolates the decision the system gets wrong:

- ``uniform``: S stages of equal layer counts on equal device blocks taken in listed order;
  each stage then gets its fastest fitting (tp, recompute).
- ``alpa``: Alpa's inter-operator pass — a dynamic program splits layers to minimise the
  bottleneck assuming every device is of the first listed type (Alpa profiles one mesh and
  treats devices as identical), on equal submeshes placed in listed order (by size only);
  the intra-operator choice (tp, recompute) is then made per stage on the real devices.
- ``pipedream``: PipeDream's partitioner — balanced split assuming identical devices,
  each stage replicated data-parallel over its block (no tensor parallelism).
- ``greedy``: a list scheduler in the spirit of HEFT: blocks ordered fastest first, layers
  added to the current stage in order while it stays within its speed-proportional share
  of the total work (earliest finish), then the next block opens.
- ``exhaustive``: every split × group × M (tiny instances only) — the ground truth.

All searches range over stage counts 1..max_stages and the planner's microbatch candidates
(largest M first); with a ``deadline`` they stop there and return their best so far.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from orchestrator.baselines._split import (
    StageCosts,
    configs_for,
    configure,
    equal_split,
    fastest_times,
    min_bottleneck_split,
)
from orchestrator.costs import CostModel
from orchestrator.planner._evaluate import Evaluation, evaluate
from orchestrator.planner._exhaustive import exhaustive_plan
from orchestrator.planner._groups import GroupConfig
from orchestrator.planner._ilp import in_flight
from orchestrator.planner._search import DEFAULT_MICROBATCHES, search_space


@dataclass(frozen=True, slots=True)
class BaselinePlan:
    """A baseline's best plan: stages (layer lists), their groups, M, and its evaluation."""

    name: str
    stages: list[list[int]]
    groups: list[GroupConfig]
    microbatches: int
    evaluation: Evaluation

    @property
    def iteration_s(self) -> float:
        return self.evaluation.iteration_s


def listed_blocks(model: CostModel, space, stages: int) -> list[tuple[str, int]] | None:
    """``stages`` equal blocks of devices in the cluster's listed order; None unless each block is one
    type and a group size the planner knows."""
    devices = model.cluster.devices()
    if len(devices) % stages:
        return None
    size = len(devices) // stages
    sizes = {(g.device_type, g.size) for g in space.groups}
    blocks = []
    for s in range(stages):
        types = {d.device_type for d in devices[s * size : (s + 1) * size]}
        if len(types) > 1 or (next(iter(types)), size) not in sizes:
            return None
        blocks.append((next(iter(types)), size))
    return blocks


def _speed(model: CostModel, space, device_type: str, microbatches: int) -> float:
    """Layers per second of one device of a type (single device, no recompute)."""
    group = GroupConfig(device_type=device_type, size=1, tp=1, recompute=False)
    total = sum(space.table.entry(layer, group, microbatches).time_s for layer in range(space.layers))
    return space.layers / total if total > 0 else float("inf")


class _Search:
    def __init__(
        self,
        model,
        global_batch,
        schedule,
        microbatch_candidates,
        max_stages,
        recompute,
        space=None,
        deadline=None,
        zero=False,
    ):
        self.model, self.schedule, self.deadline = model, schedule, deadline
        self.space = space or search_space(model, global_batch, recompute=recompute, zero=zero)
        self.candidates = sorted((m for m in microbatch_candidates if global_batch % m == 0), reverse=True)
        self.max_stages = min(max_stages or 16, self.space.layers, len(model.cluster.devices()))
        self._costs: dict[tuple[GroupConfig, int], StageCosts] = {}

    def costs(self, group: GroupConfig, M: int) -> StageCosts:
        """``StageCosts(space, group, M)``, built once per search (they do not depend on S or the order)."""
        if (group, M) not in self._costs:
            self._costs[group, M] = StageCosts(self.space, group, M)
        return self._costs[group, M]

    def expired(self) -> bool:
        """Past the deadline (``time.perf_counter()``) the search returns its best so far."""
        return self.deadline is not None and time.perf_counter() > self.deadline

    def stage_counts(self, given):
        return [S for S in given if S <= self.max_stages] if given else range(1, self.max_stages + 1)

    def sweep(self, name, stage_counts, propose):
        """The best plan ``propose(S, M, blocks) -> (split, groups)`` gives over stage counts and
        microbatch counts, on ``S`` equal device blocks in listed order."""
        best = None
        for S in self.stage_counts(stage_counts):
            blocks = listed_blocks(self.model, self.space, S)
            for M in self.candidates if blocks else ():
                if self.expired():
                    break
                split, groups = propose(S, M, blocks)
                best = self.score(name, split, groups, M, best)
        return best

    def score(self, name, split, groups, M, best):
        if split is None or groups is None:
            return best
        ev = evaluate(
            split,
            groups,
            M,
            table=self.space.table,
            infos=self.space.infos,
            schedule=self.schedule,
            links=self.space.links,
        )
        if ev.feasible and (best is None or ev.iteration_s < best.iteration_s):
            return BaselinePlan(name, split, groups, M, ev)
        return best

    def reference_split(self, blocks, M, *, tp: bool):
        """Balanced split with every block costed as the first listed type (identical devices)."""
        reference = self.model.cluster.devices()[0].device_type
        options = [
            [self.costs(g, M) for g in configs_for(self.space, reference, size, M, tensor_parallel=tp)]
            for _, size in blocks
        ]

        def stage_times(s):
            return fastest_times(options[s], self.space.layers, in_flight(self.schedule, M, len(blocks), s))

        return min_bottleneck_split(self.space.layers, len(blocks), stage_times)


def uniform(
    model,
    *,
    global_batch,
    schedule="1f1b",
    microbatch_candidates=DEFAULT_MICROBATCHES,
    max_stages=None,
    recompute=True,
    zero=False,
    space=None,
    stage_counts=None,
    deadline=None,
):
    search = _Search(model, global_batch, schedule, microbatch_candidates, max_stages, recompute, space, deadline, zero)

    def propose(S, M, blocks):
        split = equal_split(search.space.layers, S)
        return split, configure(search.space, blocks, split, M, schedule, costs=search.costs)

    return search.sweep("uniform", stage_counts, propose)


def alpa(
    model,
    *,
    global_batch,
    schedule="1f1b",
    microbatch_candidates=DEFAULT_MICROBATCHES,
    max_stages=None,
    recompute=True,
    zero=False,
    space=None,
    stage_counts=None,
    deadline=None,
):
    search = _Search(model, global_batch, schedule, microbatch_candidates, max_stages, recompute, space, deadline, zero)

    def propose(S, M, blocks):
        split = search.reference_split(blocks, M, tp=True)
        return split, configure(search.space, blocks, split, M, schedule, costs=search.costs) if split else None

    return search.sweep("alpa", stage_counts, propose)


def pipedream(
    model,
    *,
    global_batch,
    schedule="1f1b",
    microbatch_candidates=DEFAULT_MICROBATCHES,
    max_stages=None,
    recompute=True,
    zero=False,
    space=None,
    stage_counts=None,
    deadline=None,
):
    search = _Search(model, global_batch, schedule, microbatch_candidates, max_stages, recompute, space, deadline, zero)

    def propose(S, M, blocks):
        split = search.reference_split(blocks, M, tp=False)
        return split, configure(
            search.space, blocks, split, M, schedule, tp=False, costs=search.costs
        ) if split else None

    return search.sweep("pipedream", stage_counts, propose)


def greedy(
    model,
    *,
    global_batch,
    schedule="1f1b",
    microbatch_candidates=DEFAULT_MICROBATCHES,
    max_stages=None,
    recompute=True,
    zero=False,
    space=None,
    stage_counts=None,
    deadline=None,
):
    search, best = (
        _Search(model, global_batch, schedule, microbatch_candidates, max_stages, recompute, space, deadline, zero),
        None,
    )
    space, L = search.space, search.space.layers
    for S in search.stage_counts(stage_counts):
        blocks = listed_blocks(model, space, S)
        for M in search.candidates if blocks else ():
            if search.expired():
                break
            speed = {t: _speed(model, space, t, M) for t in {b[0] for b in blocks}}
            order = sorted(blocks, key=lambda b: -speed[b[0]] * b[1])
            power = [speed[t] * n for t, n in order]
            split, start = [], 0
            for s, share in enumerate(power):
                left = S - s - 1
                quota = L * share / sum(power)
                end = start + 1
                while end < L - left and (end - start) + 1 <= quota + 0.5:
                    end += 1
                if s == S - 1:
                    end = L
                if end <= start:
                    split = None
                    break
                split.append(list(range(start, end)))
                start = end
            groups = configure(space, order, split, M, schedule, costs=search.costs) if split else None
            best = search.score("greedy", split, groups, M, best)
    return best


def exhaustive(
    model,
    *,
    global_batch,
    schedule="1f1b",
    microbatch_candidates=DEFAULT_MICROBATCHES,
    max_stages=None,
    recompute=True,
    zero=False,
):
    """The exact optimum by enumeration (only for tiny instances)."""
    ev = exhaustive_plan(
        model,
        global_batch=global_batch,
        schedule=schedule,
        microbatch_candidates=microbatch_candidates,
        max_stages=max_stages,
        recompute=recompute,
        zero=zero,
    )
    return None if ev is None else BaselinePlan("exhaustive", [], [], 0, ev)


def balanced(
    model,
    *,
    global_batch,
    schedule="1f1b",
    microbatch_candidates=DEFAULT_MICROBATCHES,
    max_stages=None,
    recompute=True,
    zero=False,
    stage_counts=None,
    space=None,
    deadline=None,
):
    """Not a baseline: our own fast heuristic (true costs, speed-ordered blocks, bottleneck DP),
    used as the ILP's starting incumbent.

    Blocks go fastest first and, separately, fastest last: under 1F1B the last stages hold the
    fewest microbatches in flight, so a fast type whose memory binds holds more layers there
    (GPT-175B × mixed-4type-512 with ZeRO-1, session 9: 674 → 548 s a step)."""
    search, best = (
        _Search(model, global_batch, schedule, microbatch_candidates, max_stages, recompute, space, deadline, zero),
        None,
    )
    space = search.space
    for S in search.stage_counts(stage_counts):
        blocks = listed_blocks(model, space, S)
        for M in search.candidates if blocks else ():
            if search.expired():
                break
            speed = {t: _speed(model, space, t, M) for t in {b[0] for b in blocks}}
            fastest_first = sorted(blocks, key=lambda b: -speed[b[0]] * b[1])
            for order in (fastest_first, fastest_first[::-1]):
                options = [[search.costs(g, M) for g in configs_for(space, t, n, M)] for t, n in order]

                def stage_times(s, options=options, M=M, S=S):
                    return fastest_times(options[s], space.layers, in_flight(schedule, M, S, s))

                split = min_bottleneck_split(space.layers, S, stage_times)
                groups = configure(space, order, split, M, schedule, costs=search.costs) if split else None
                best = search.score("balanced", split, groups, M, best)
                if fastest_first == fastest_first[::-1]:
                    break
    return best


BASELINES = {"uniform": uniform, "alpa": alpa, "pipedream": pipedream, "greedy": greedy}
