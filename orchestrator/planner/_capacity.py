"""A lower bound on the step time at M microbatches from each device type's capacity: a small LP.

The solve-free capacity bound (``_ilp.simple_bound_s``) spreads every layer's cheapest
device-seconds over all N devices, as if every device were as fast as the fastest type's. On a
mixed cluster that counts an L4 as an H100. Here each type t has its own N_t devices, and its
own memory.

For M microbatches, let y[r,g] ≥ 0 be the layers of run r held by stages on group g (a plan's
stage count and order play no part), and T the bottleneck per microbatch:

    Σ_g y[r,g] = n_r                                              every layer placed
    Σ_{r, g with a part of type t} size_t(g)·τ[r,g]·y[r,g] ≤ N_t·T        compute of type t
    Σ_{r, g, parts q of g on type t} size_q·(σ_q + α_q·k)·y[r,g] / mem_q(g) ≤ N_t   memory of type t

(τ time, σ static, α activation memory per in-flight microbatch of one layer per device, from
the :class:`CostTable` the ILP reads; k the fewest microbatches any stage holds in flight: 1
under 1F1B, M under GPipe; mem_q(g) what a device of part q may fill.)

**Why it is a bound.** Take any plan: stage s on group g_s computes c_s = Σ τ over its layers per
microbatch, and the closed form (``_closed_form``) gives step ≥ M·c_s for every stage (1F1B:
E_s ≥ B_s + M·b_s + (M − K_s)·f_s with B_s ≥ U^f_s + K_s·f_s; GPipe: both flow shops pass every
microbatch through s). So with T = step / M, every stage computes within T, and a stage's devices
of type t give size_t(g_s)·c_s ≤ size_t(g_s)·T device-seconds; the stages on t use at most N_t
devices, so the compute row holds with y the plan's layers per group. Every device holds its
layers' static memory and at least k microbatches of their activations, within mem_q, so each
device's share of the memory row is at most 1, and type t has at most N_t of them. The plan is
therefore a point of the LP with T = step / M, and M·T* (T* the LP's least T) bounds its step.

The LP has R·G columns and two rows per type, so it costs less than one probe of the packing
bound (``_packing``), and on ``mixed-4type-512`` it doubles the capacity bound of GPT-175B.
``tests/orchestrator/planner/test_capacity.py`` checks that it never exceeds the exhaustive
optimum.
"""

from __future__ import annotations

import math

import numpy as np

from orchestrator.planner._groups import GroupConfig
from orchestrator.planner._ilp import MS, Run, in_flight, simple_bound_s
from orchestrator.planner._table import CostTable
from orchestrator.solver import highs_available, highs_lp, work


def capacity_bound_s(
    runs: list[Run],
    groups: list[GroupConfig],
    table: CostTable,
    infos,
    microbatches: int,
    schedule: str,
    *,
    memory: bool = True,
) -> float:
    """M·T* of the LP above (seconds), never below ``simple_bound_s``: +inf where no group divides
    the microbatch, or where the layers' memory exceeds some type's (``memory``: with the memory rows;
    without them, as a diagnosis that lets memory grow needs). Without HiGHS, ``simple_bound_s``."""
    M = microbatches
    simple = simple_bound_s(runs, groups, table, infos, M)
    valid = [g for g in groups if table.microbatch(g, M) is not None]
    if not valid or not runs or not highs_available():
        return simple
    import highspy

    R, G = len(runs), len(valid)
    y = np.arange(R * G).reshape(R, G)  # column of y[r, g]; then T (ms)
    T = R * G
    k = in_flight(schedule, M, 1, 0)
    time = np.array([[table.entry(run.first, g, M).time_s * MS for g in valid] for run in runs])
    rows: list[tuple[np.ndarray, np.ndarray, float, float]] = []
    for r, run in enumerate(runs):
        rows.append((y[r], np.ones(G), float(run.count), float(run.count)))
    for t, info in infos.items():
        mine = [g for g in range(G) if t in valid[g].by_type]
        if not mine:
            continue
        size = np.array([float(valid[g].by_type[t]) for g in mine])
        cols = y[:, mine].ravel()
        rows.append((np.r_[cols, T], np.r_[(time[:, mine] * size).ravel(), -float(info.devices)], -math.inf, 0.0))
        if not memory:
            continue
        shares = np.zeros((R, len(mine)))  # one layer's share of the type's devices' memory
        for r, run in enumerate(runs):
            for i, g in enumerate(mine):
                for (capacity, part), (kind, count) in zip(
                    table.memory_parts(run.first, valid[g], M), _parts(valid[g])
                ):
                    if kind == t:
                        shares[r, i] += count * (part.static_bytes + k * part.activation_bytes) / capacity
        rows.append((cols, shares.ravel(), -math.inf, float(info.devices)))
    cost = np.zeros(R * G + 1)
    cost[T] = 1.0
    highs = highs_lp(cost, np.full(R * G + 1, math.inf), rows)
    work.run(highs)
    status = highs.getModelStatus()
    if status == highspy.HighsModelStatus.kInfeasible:
        return math.inf
    if status != highspy.HighsModelStatus.kOptimal:  # undecided: the solve-free bound still holds
        return simple
    return max(simple, M * highs.getInfo().objective_function_value / MS)


def _parts(group: GroupConfig) -> list[tuple[str, int]]:
    """(type, devices) of each part of ``group``, in the order ``CostTable.memory_parts`` gives them."""
    return list(group.parts) if group.mixed else [(group.device_type, group.size)]
