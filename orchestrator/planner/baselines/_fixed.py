"""A configuration someone already chose (a published run's, a hand-tuned one), priced as it stands."""

from __future__ import annotations

from orchestrator.costs import CostModel
from orchestrator.planner._evaluate import evaluate
from orchestrator.planner._groups import GroupConfig
from orchestrator.planner._space import search_space
from orchestrator.planner.baselines._sweep import BaselinePlan, Sweep


def fixed(
    model: CostModel,
    *,
    stages: list[list[int]],
    device_type: str,
    tp: int,
    dp: int,
    recompute: bool,
    microbatches: int,
    global_batch: int,
    zero: bool = False,
    sequence_parallel: bool = False,
    selective_recompute: bool = False,
    overlap_param_gather: bool = False,
    schedule: str = "1f1b",
    virtual_stages: int = 1,
    cp: int = 1,
) -> BaselinePlan:
    """``stages`` (layer indices per pipeline stage), each on ``tp · dp`` devices of ``device_type``,
    at ``microbatches`` microbatches, priced by the planner's closed form. ``zero``,
    ``sequence_parallel``, ``selective_recompute`` and ``overlap_param_gather`` are the pricing
    options of :class:`~orchestrator.costs.ParallelConfig`, applied to every stage;
    ``virtual_stages``: interleaved 1F1B chunks per stage (1: plain ``schedule``); ``cp``: each
    sequence split over that many devices per replica (context parallelism; ``tp · cp · dp`` devices
    per stage).

    The evaluation says whether it fits (``evaluation.feasible``); its time is priced either way.
    """
    if global_batch % microbatches or (global_batch // microbatches) % dp:
        raise ValueError(
            f"global batch {global_batch} does not split into {microbatches} microbatches of a multiple of dp={dp}"
        )
    group = GroupConfig(device_type=device_type, size=tp * cp * dp, tp=tp, recompute=recompute, cp=cp)
    space = search_space(
        model,
        global_batch,
        recompute=recompute,
        zero=zero,
        mixed=False,
        sequence_parallel=sequence_parallel,
        selective_recompute=selective_recompute,
        overlap_param_gather=overlap_param_gather,
    )
    sweep = Sweep(model, global_batch=global_batch, schedule=schedule, space=space)
    groups = [group] * len(stages)
    if virtual_stages == 1:
        return BaselinePlan("fixed", stages, groups, microbatches, sweep.evaluate(stages, groups, microbatches))
    ev = evaluate(
        stages, groups, microbatches, table=space.table, infos=space.infos, schedule=schedule, links=space.links,
        virtual_stages=virtual_stages,
    )  # fmt: skip
    return BaselinePlan("fixed", stages, groups, microbatches, ev)
