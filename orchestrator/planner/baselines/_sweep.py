"""What every baseline shares: the request (batch, schedule, microbatch counts, depth) over the
planner's search space, the sweep over stage and microbatch counts, and its best plan."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from orchestrator.costs import CostModel
from orchestrator.planner._evaluate import Evaluation, evaluate, summarize_stage
from orchestrator.planner._groups import GroupConfig
from orchestrator.planner._ilp import in_flight
from orchestrator.planner._space import SearchSpace, microbatch_counts, search_space
from orchestrator.planner._split import configs_for, configure, fastest_times, min_bottleneck_split, stage_costs
from orchestrator.solver import work

Blocks = list[tuple[str, int]]  # (device type, devices) per stage
Proposal = tuple[list[list[int]] | None, list[GroupConfig] | None]  # (split, groups), None where none fits


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


def listed_blocks(model: CostModel, space: SearchSpace, stages: int) -> Blocks | None:
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


class Sweep:
    """One baseline's search over stage counts and microbatch counts, with the costs it shares.

    Args:
      model: the cost model (its layers and cluster).
      global_batch: samples per step; only the microbatch counts that divide it are tried.
      schedule: "1f1b" or "gpipe".
      microbatch_candidates: the microbatch counts to try (None: every divisor of the batch).
      max_stages: the deepest pipeline (default: layers, at most 16, at most the devices).
      recompute: also offer groups that recompute their forward.
      zero: price data-parallel stages with ZeRO-1.
      sequence_parallel: price tensor-parallel stages with sequence parallelism.
      selective_recompute: price every stage with selective (core attention) recompute.
      mixed_stages: also offer groups on two device types (only where ``space`` is not given).
      space: the planner's search space, when the caller has built it.
      stage_counts: the stage counts to try (default: 1..``max_stages``).
      deadline: a ``work.now()`` time after which the sweep returns its best so far.
    """

    def __init__(
        self,
        model: CostModel,
        *,
        global_batch: int,
        schedule: str = "1f1b",
        microbatch_candidates: tuple[int, ...] | None = None,
        max_stages: int | None = None,
        recompute: bool = True,
        zero: bool = False,
        sequence_parallel: bool = False,
        selective_recompute: bool = False,
        mixed_stages: bool = True,
        space: SearchSpace | None = None,
        stage_counts=None,
        deadline: float | None = None,
    ):
        self.model, self.schedule, self.deadline = model, schedule, deadline
        self.space = space or search_space(
            model,
            global_batch,
            recompute=recompute,
            zero=zero,
            mixed=mixed_stages,
            sequence_parallel=sequence_parallel,
            selective_recompute=selective_recompute,
        )
        self.candidates = microbatch_counts(global_batch, microbatch_candidates)
        devices = model.cluster.devices()
        self.max_stages = min(max_stages or 16, self.space.layers, len(devices))
        # the type every block is costed as by the reference split (identical devices; none in service: none)
        self.reference_type = devices[0].device_type if devices else None
        self.stage_counts = (
            [S for S in stage_counts if S <= self.max_stages] if stage_counts else range(1, self.max_stages + 1)
        )

    def expired(self) -> bool:
        """Past the deadline (``work.now()``) the search returns its best so far."""
        return self.deadline is not None and work.now() > self.deadline

    def best(self, name: str, propose: Callable[[int, int, Blocks], Iterator[Proposal]]) -> BaselinePlan | None:
        """The best plan ``propose(S, M, blocks)`` yields over the stage counts and microbatch counts,
        on ``S`` equal device blocks in listed order."""
        best = None
        for S in self.stage_counts:
            blocks = listed_blocks(self.model, self.space, S)
            for M in self.candidates if blocks else ():
                if self.expired():
                    break
                for split, groups in propose(S, M, blocks):
                    best = self._better(name, split, groups, M, best)
        return best

    def evaluate(
        self, split: list[list[int]], groups: list[GroupConfig], M: int, *, summarize=summarize_stage
    ) -> Evaluation:
        """A plan priced by the closed form (``summarize``: as for :func:`evaluate`)."""
        space = self.space
        return evaluate(
            split,
            groups,
            M,
            table=space.table,
            infos=space.infos,
            schedule=self.schedule,
            links=space.links,
            summarize=summarize,
        )

    def _better(self, name: str, split, groups, M: int, best: BaselinePlan | None) -> BaselinePlan | None:
        if split is None or groups is None:
            return best
        ev = self.evaluate(split, groups, M)
        if ev.feasible and (best is None or ev.iteration_s < best.iteration_s):
            return BaselinePlan(name, split, groups, M, ev)
        return best

    def configure(self, blocks: Blocks, split, M: int, *, tp: bool = True) -> list[GroupConfig] | None:
        """Each stage's fastest fitting configuration on its block (``_split.configure``), None without a split."""
        return configure(self.space, blocks, split, M, self.schedule, tp=tp) if split else None

    def speed(self, blocks: Blocks, M: int) -> dict[str, float]:
        """Layers per second of one device of each type in ``blocks`` (single device, no recompute)."""
        speeds = {}
        for device_type in {b[0] for b in blocks}:
            group = GroupConfig(device_type=device_type, size=1, tp=1, recompute=False)
            total = sum(self.space.table.entry(layer, group, M).time_s for layer in range(self.space.layers))
            speeds[device_type] = self.space.layers / total if total > 0 else float("inf")
        return speeds

    def reference_split(self, blocks: Blocks, M: int, *, tp: bool):
        """Balanced split with every block costed as the first listed type (identical devices)."""
        options = [
            [
                stage_costs(self.space, g, M)
                for g in configs_for(self.space, self.reference_type, size, M, tensor_parallel=tp)
            ]
            for _, size in blocks
        ]

        def stage_times(s):
            return fastest_times(options[s], self.space.layers, in_flight(self.schedule, M, len(blocks), s))

        return min_bottleneck_split(self.space.layers, len(blocks), stage_times)
