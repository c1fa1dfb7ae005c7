"""A certified lower bound over interleaved 1F1B plans: the capacity LP at v_max, least over M.

The ILP's rows price plain schedules (v = 1), so its bound holds over plain plans only. A plan with
v virtual stages (chunks) a stage does, on every stage s, all its M·c_s of work after the first
microbatch reaches it and before its last backward, and that last backward (of chunk 0: any
chunk's backward of a microbatch precedes chunk 0's on the same stage) drains through the stages
before it, so

    step ≥ Σ_{s'<s} c_s'/v + M·c_s                      for every stage s

(the transfers only add). Weighting these rows by λ_s ∝ (1 − 1/(vM))^{S−1−s} gives step ≥
α_v(S)·Σ_s c_s with α_v(S) = 1 / (v·(1 − (1 − 1/(vM))^S)), which falls as S and as v grow: at
v_max it holds for every plan of at most S stages and v ≤ v_max. The capacity LP's other rows hold
under interleaving as they are: step ≥ M·c_s; a stage holds at least one microbatch's activations
(``interleaved_in_flight`` ≥ 1); and under a cutoff C its tail, (M − 1)·c_s + f_s + y_s + o_s ≤ step,
since the gradient sync follows the last backward, a chunk's b_s/v ≤ b_s, which also gives the
per-type tail rows. The plain first stage's in-flight cycle row does not hold (interleaving runs
other warm-up counts), and ``capacity_bound_s`` writes it at v = 1 only (docs/planner.md, "Virtual
stages", gives each row's argument). So :func:`capacity_bound_s` with ``virtual_stages``
= v_max bounds every plan, plain or interleaved, of at most v_max chunks a stage; its least over the
microbatch counts searched bounds the space ``Coverage.virtual_stages`` = (1, ..., v_max) names.

v_max is the most chunks any plan of the model can take (:func:`max_virtual_stages`): the space is
then every v a plan of these layers can have, and the bound gives up little for it, as α_v's fall
from v = 2 to v_max is small beside the capacity relaxation's own slack (docs/planner.md, "Virtual
stages", measures both).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

from orchestrator.planner._capacity import capacity_bound_s
from orchestrator.planner._ilp import Run
from orchestrator.planner._plan import Coverage
from orchestrator.planner._space import SearchSpace


def max_virtual_stages(runs: list[Run]) -> int:
    """v_max: the most virtual stages a plan of ``runs`` can take. Interleaving needs at least two
    stages, each holding at least v layers of runs of several identical layers
    (``_make_plan.virtual_stage_counts``), so 2·v is at most their number; 1 where there are none."""
    repeated = sum(run.count for run in runs if run.count > 1)
    return max(1, repeated // 2)


def interleaved_coverage(covered: Coverage, v_max: int) -> Coverage:
    """``covered`` with every virtual-stage count 1..``v_max``."""
    return dataclasses.replace(covered, virtual_stages=tuple(range(1, v_max + 1)))


def interleaved_bound_s(
    space: SearchSpace,
    microbatches: Iterable[int],
    max_stages: int,
    v_max: int,
    *,
    below_s: float = math.inf,
) -> float:
    """The least over ``microbatches`` of the capacity LP under 1F1B at ``virtual_stages`` = ``v_max``
    and at most ``max_stages`` stages (seconds): no plan of ``space`` at those counts with v ≤ ``v_max``
    is faster. With ``below_s`` (a cutoff, e.g. a plan's own step) it is at most ``below_s``, and still
    a bound: a plan faster than the cutoff is bounded by the capped LP, any other by the cutoff."""
    return min(
        (
            capacity_bound_s(
                space.runs,
                space.groups,
                space.table,
                space.infos,
                M,
                "1f1b",
                max_stages=max_stages,
                below_s=below_s,
                virtual_stages=v_max,
            )
            for M in microbatches
        ),
        default=below_s,
    )
