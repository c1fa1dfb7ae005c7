"""The search space every planner search shares: device groups, their cost table, links and layer runs."""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.cluster import Link
from orchestrator.costs import CostModel
from orchestrator.planner._groups import (
    GroupConfig,
    TypeInfo,
    group_configs,
    mixed_group_configs,
    pair_links,
    type_infos,
    with_mixed_links,
)
from orchestrator.planner._ilp import Run, StageModel, layer_runs
from orchestrator.planner._table import CostTable

DEFAULT_MICROBATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True, slots=True)
class SearchSpace:
    """What every microbatch count's ILP, the baselines and the exhaustive search share."""

    infos: dict[str, TypeInfo]
    groups: list[GroupConfig]
    table: CostTable
    links: dict[tuple[str, str], Link]
    runs: list[Run]
    layers: int

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
    model: CostModel, global_batch: int, *, recompute: bool, zero: bool = False, mixed: bool = True
) -> SearchSpace:
    """``mixed``: also offer groups that join hosts of two device types (``_groups``)."""
    infos = type_infos(model.cluster)
    keys = [(layer.signature, layer.activation_bytes) for layer in model.layers]
    settings = {"recompute": recompute, "tensor_parallel": model.tensor_parallel}
    groups = group_configs(infos, **settings) + (mixed_group_configs(infos, **settings) if mixed else [])
    links = pair_links(model.cluster, infos)
    return SearchSpace(
        infos=infos,
        groups=groups,
        table=CostTable(model, infos, global_batch, zero=zero, links=links),
        links=with_mixed_links(links, groups),
        runs=layer_runs(keys),
        layers=len(model.layers),
    )
