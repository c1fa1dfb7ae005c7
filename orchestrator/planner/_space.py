"""The search space every planner search shares: device groups, their cost table, links and layer runs."""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.cluster import Link
from orchestrator.costs import CostModel
from orchestrator.planner._groups import (
    MEMORY_HEADROOM,
    GroupConfig,
    TypeInfo,
    context_parallel_configs,
    group_configs,
    mixed_group_configs,
    pair_links,
    type_infos,
    with_mixed_links,
)
from orchestrator.planner._ilp import Run, StageModel, layer_runs
from orchestrator.planner._plan import PRICING_OPTIONS, Coverage
from orchestrator.planner._table import CostTable


def microbatch_counts(global_batch: int, candidates: tuple[int, ...] | None = None) -> list[int]:
    """The microbatch counts M a search tries, largest first: those of ``candidates`` that divide
    the batch, or (None) every divisor of it, as published runs use (M = 48 of a batch of 2304)."""
    if candidates is None:
        return [m for m in range(global_batch, 0, -1) if global_batch % m == 0]
    return sorted((m for m in candidates if global_batch % m == 0), reverse=True)


@dataclass(frozen=True, slots=True)
class SearchSpace:
    """What every microbatch count's ILP, the baselines and the exhaustive search share."""

    infos: dict[str, TypeInfo]
    groups: list[GroupConfig]
    table: CostTable
    links: dict[tuple[str, str], Link]
    runs: list[Run]
    layers: int

    def coverage(self, microbatches, max_stages: int) -> Coverage:
        """This space searched at ``microbatches`` (counts M) up to ``max_stages`` stages, with the
        pricing options of its cost table; a context-parallel group is named with its degree,
        (type, devices, tp, recompute, cp)."""
        groups = tuple((g.device_type, g.size, g.tp, g.recompute) + ((g.cp,) if g.cp > 1 else ()) for g in self.groups)
        options = tuple(name for name in PRICING_OPTIONS if getattr(self.table, name))
        return Coverage(microbatches=tuple(microbatches), max_stages=max_stages, groups=groups, options=options)

    def stage_model(
        self,
        microbatches: int,
        max_stages: int,
        schedule: str,
        *,
        groups: list[GroupConfig] | None = None,
        repair: bool = False,
    ) -> StageModel:
        """The stage ILP of one microbatch count over this space (``_ilp``; over ``groups`` when given,
        else every group), not yet built."""
        return StageModel(
            runs=self.runs,
            max_stages=max_stages,
            microbatches=microbatches,
            groups=self.groups if groups is None else groups,
            table=self.table,
            infos=self.infos,
            schedule=schedule,
            links=self.links,
            repair=repair,
        )


def search_space(
    model: CostModel,
    global_batch: int,
    *,
    recompute: bool,
    zero: bool = False,
    mixed: bool = True,
    memory_headroom: float = MEMORY_HEADROOM,
    sequence_parallel: bool = False,
    selective_recompute: bool = False,
    overlap_param_gather: bool = False,
    fsdp: bool = False,
) -> SearchSpace:
    """``mixed``: also offer groups that join hosts of two device types (``_groups``);
    ``sequence_parallel``: price every TP group with sequence parallelism; likewise
    ``selective_recompute``, ``fsdp`` (every data-parallel group) and ``overlap_param_gather``.
    The plans record the first three per stage (``Stage``); ``integrations.flax.compile_step``
    runs them, on one stage and in pipelines, and ``integrations.torch_xla.apply`` refuses them,
    so ``plan()`` asks for them only when told (its keywords, off by default;
    ``overlap_param_gather`` is a pricing option for published configurations)."""
    infos = type_infos(model.cluster, memory_headroom=memory_headroom)
    keys = [(layer.signature, layer.activation_bytes) for layer in model.layers]
    settings = {"recompute": recompute, "tensor_parallel": model.tensor_parallel}
    groups = group_configs(infos, global_batch=global_batch, **settings) + (
        mixed_group_configs(infos, **settings) if mixed else []
    )
    links = pair_links(model.cluster, infos)
    table = CostTable(
        model,
        infos,
        global_batch,
        zero=zero,
        links=links,
        sequence_parallel=sequence_parallel,
        selective_recompute=selective_recompute,
        overlap_param_gather=overlap_param_gather,
        fsdp=fsdp,
    )
    # context parallelism only where it is needed, and never on a stand-in cost model without a sequence to split
    context_length = getattr(model, "context_length", lambda: None)
    if (length := context_length()) is not None:
        needed = table.needs_context_parallel(groups)
        groups += context_parallel_configs(
            infos,
            seq_len=length,
            device_types=needed,
            global_batch=global_batch,
            recompute=recompute,
            tensor_parallel=model.tensor_parallel,
        )
    return SearchSpace(
        infos=infos,
        groups=groups,
        table=table,
        links=with_mixed_links(links, groups),
        runs=layer_runs(keys),
        layers=len(model.layers),
    )
