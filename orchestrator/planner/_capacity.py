"""A lower bound on the step time at M microbatches from each device type's capacity: a small LP.

The solve-free capacity bound (``_ilp.simple_bound_s``) spreads every layer's cheapest
device-seconds over all N devices, as if every device were as fast as the fastest type's. On a
mixed cluster that counts an L4 as an H100. Here each type t has its own N_t devices, and its
own memory, and a plan has at most S stages (``max_stages``): a type's devices are used only by
stages large enough to take them, which single devices running a layer each at full efficiency
are not.

For M microbatches, let y[r,g] ≥ 0 be the layers of run r held by stages on group g, w[g] ≥ 0 the
compute per microbatch of those stages together, m[g] ≥ 0 how many stages are on g (a plan's order
plays no part), T the bottleneck per microbatch and Z the step:

    Σ_g y[r,g] = n_r                                              every layer placed
    Σ_r τ[r,g]·y[r,g] ≤ w[g]                                      the compute of g's stages
    Σ_{g with a part of type t} size_t(g)·w[g] ≤ N_t·T                compute of type t
    Σ_g w[g] ≤ S·T                                                 at most S stages, each within T
    Σ_{r, g, parts q of g on type t} size_q·(σ_q + α_q·k)·y[r,g] / mem_q(g) ≤ N_t   memory of type t
    Σ_g m[g] ≤ S,  Σ_{g with a part of type t} size_t(g)·m[g] ≤ N_t       stages and their devices
    Σ_r (σ_q + α_q·k)·y[r,g] ≤ (mem_q(g) − ρ_q(g))·m[g]             the memory of g's stages, per part
    y[r,g] ≤ f[r,g]·m[g]                                           whole layers one stage holds
    Z ≥ M·T,   Z ≥ α(S)·Σ_g w[g],  α(S) = 1 / (1 − (1 − 1/M)^S)        the bottleneck and the fill
    Z ≥ (⌊(M − 1)/S⌋ + 1)·Σ_g w[g]                          1F1B: the first stage's in-flight cycle
    Σ_{g with a part of type t} size_t(g)·Σ_r ((M − 1)·τ + φ + δ + ω)[r,g]·y[r,g] ≤ N_t·Z   tails of type t

(τ time, σ static, α activation memory per in-flight microbatch and ρ transient of one layer per
device, from the :class:`CostTable` the ILP reads; ρ_q(g) the least over runs; k the fewest
microbatches any stage holds in flight: 1 under 1F1B, M under GPipe; mem_q(g) what a device of
part q may fill; f[r,g] the most layers of run r beside its transient in one stage's memory,
at most n_r; φ forward, δ gradient sync, ω optimizer of one layer; the cycle row only under plain
1F1B.) With a cutoff C (``below_s``), only plans faster than C are bounded: each stage then
computes within C/M and ends its own tail, (M − 1)·c_s + f_s + y_s + o_s (its forward, gradient sync
and optimizer after its M microbatches), within C, so also w[g] ≤ (C/M)·m[g], Σ_r ((M − 1)·τ + φ +
δ + ω)[r,g]·y[r,g] ≤ C·m[g], no layer slower than C/M
is placed, and f[r,g] ≤ ⌊(C/M) / τ[r,g]⌋ and ⌊C / ((M − 1)·τ + φ + δ + ω)[r,g]⌋; the bound is then
min(Z*, C), and C where the LP is infeasible.

**Why it is a bound.** Take any plan of S′ ≤ S stages: stage s on group g_s computes c_s = Σ τ over
its layers per microbatch, and the closed form (``_closed_form``) gives step ≥ Σ_{s′<s} c_s′ + M·c_s
for every stage s in pipeline order (1F1B: E_s ≥ B_s + M·b_s + (M − K_s)·f_s with B_s ≥ U^f_s +
K_s·f_s, and the drain U^b_s after it; GPipe: both flow shops pass every microbatch through s after
the forwards of the stages before it and before their backwards). So with T = step / M every stage
computes within T. Let w[g] be Σ c_s over the stages on g and m[g] their number. Then Σ_g w[g] =
Σ_s c_s ≤ S′·T ≤ S·T; a stage's devices of type t give size_t(g_s)·c_s ≤ size_t(g_s)·T device-seconds
and the stages on t use at most N_t devices; each stage's devices hold its layers' static memory
and at least k microbatches of their activations beside a transient of at least ρ, within mem_q,
which summed over g's stages is the per-group row and, per device, the per-type row; each stage
holds at most f[r,g] layers of run r. The fill: weighting the stages' rows by λ_s = (α/M)·(1 −
1/M)^{S′−1−s} (they sum to 1 at α = α(S′)) gives step ≥ α(S′)·Σ_s c_s, and α falls as S′ grows, so
α(S) holds for every plan of at most S stages. The cycle: under 1F1B the first stage holds
K_0 = S′ microbatches in flight, so with M − 1 = q·S′ + r its last backward ends at E_0 ≥ B_0 +
q·L_0 + r·c_0 + b_0 (q ≥ 1) with B_0 ≥ L_0 − b_0 (its first microbatch's round trip L_0 ≥ Σ_s c_s), and
step ≥ E_0 ≥ (q + 1)·Σ_s c_s; q = ⌊(M − 1)/S′⌋ falls as S′ grows, so q at S holds for every plan
of at most S stages. The tails: each stage's gradient sync and optimizer follow its last
backward, Y_s + o_s ≥ E_s − b_s + y_s + o_s (the bucket flow shop's makespan is at least b_1 + y_s)
with E_s ≥ U^f_s + M·c_s (both schedules: the rows above; interleaved, v chunks: its v·M chunk
steps of c_s/v end no earlier, and its sync follows a backward of b_s/v ≤ b_s), so (M − 1)·c_s + f_s + y_s + o_s ≤ step
for every stage; weighted by its devices of type t and summed over the stages on t (at most N_t
devices) that is at most N_t·step, the per-type tail row: where gradient sync outlasts compute it
charges each type the device-seconds of its stages' exposed sync, which the compute row, at T =
step / M, does not. With a cutoff, a plan faster than C has every c_s ≤ step/M < C/M, so w[g] ≤
(C/M)·m[g] and no stage holds a layer slower than C/M, and each stage's tail is below C, summed
over g's stages. The plan is therefore a point of the LP with Z = its step, and Z* bounds it.

The LP has 3 columns per (run, group) and a few rows per group and type, a fraction of one
probe of the packing bound (``_packing``). On ``mixed-4type-512`` GPT-175B's bound rises from
315 s to 330–422 s at the M of the best plans and past the cutoff of a 437 s incumbent at every
M ≤ 48, which no packing LP then needs. ``tests/orchestrator/planner/test_capacity.py`` checks
that it never exceeds the exhaustive optimum of at most S stages, with and without a cutoff.
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
    max_stages: int | None = None,
    below_s: float = math.inf,
    virtual_stages: int = 1,
) -> float:
    """The LP's least Z (seconds), never below ``simple_bound_s``: +inf where no group divides the
    microbatch, or where no plan of at most ``max_stages`` stages (default: one a layer) fits (``memory``:
    with the memory rows; without them, as a diagnosis that lets memory grow needs). With ``below_s``
    (a cutoff), only plans faster than it are bounded: the bound is then at most ``below_s``, which it
    is where none is. With ``virtual_stages`` v_max > 1, the fill row's α becomes α_v at v_max, which
    bounds every interleaved 1F1B plan of at most v_max chunks a stage too (docs/planner.md, "Virtual
    stages"). Without HiGHS, ``simple_bound_s``."""
    M = microbatches
    simple = simple_bound_s(runs, groups, table, infos, M)
    valid = [g for g in groups if table.microbatch(g, M) is not None]
    if not valid or not runs or not highs_available():
        return simple
    import highspy

    R, G = len(runs), len(valid)
    stages = float(max_stages if max_stages is not None else sum(run.count for run in runs))
    # columns: y[r, g], then w[g] and m[g], then T and Z (ms)
    y = np.arange(R * G).reshape(R, G)
    w, m = R * G + np.arange(G), R * G + G + np.arange(G)
    T, Z = R * G + 2 * G, R * G + 2 * G + 1
    k = in_flight(schedule, M, 1, 0)
    # times in units of the cutoff's bottleneck (cutoff / M) where one is given, else ms: the capped
    # rows then have unit coefficients, which keeps HiGHS's presolve decided
    unit_s = below_s / M if math.isfinite(below_s) else 1 / MS
    entries = [[table.entry(run.first, g, M) for g in valid] for run in runs]
    time = np.array([[e.time_s / unit_s for e in row] for row in entries])
    # tail[r, g]: a layer's share of its stage's own tail, (M−1)·c + f + sync + optimizer, which
    # ends within the step
    tail = (M - 1) * time + np.array(
        [[(e.forward_s + e.dp_sync_s + e.optimizer_s) / unit_s for e in row] for row in entries]
    )
    rows: list[tuple[np.ndarray, np.ndarray, float, float]] = []
    for r, run in enumerate(runs):
        rows.append((y[r], np.ones(G), float(run.count), float(run.count)))
    for g in range(G):  # w_g: the compute of the stages on g, per microbatch
        rows.append((np.r_[y[:, g], w[g]], np.r_[time[:, g], -1.0], -math.inf, 0.0))
    rows.append((np.r_[w, T], np.r_[np.ones(G), -stages], -math.inf, 0.0))  # Σ_s c_s ≤ S·T
    rows.append((m, np.ones(G), -math.inf, stages))  # at most S stages
    for t, info in infos.items():
        mine = [g for g in range(G) if t in valid[g].by_type]
        if not mine:
            continue
        size = np.array([float(valid[g].by_type[t]) for g in mine])
        rows.append((np.r_[w[mine], T], np.r_[size, -float(info.devices)], -math.inf, 0.0))
        rows.append((m[mine], size, -math.inf, float(info.devices)))
        # each stage's tail within the step, weighted by its devices of type t: N_t·Z device-seconds
        rows.append(
            (np.r_[y[:, mine].ravel(), Z], np.r_[(tail[:, mine] * size).ravel(), -float(info.devices)], -math.inf, 0.0)
        )
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
        rows.append((y[:, mine].ravel(), shares.ravel(), -math.inf, float(info.devices)))
    capped = math.isfinite(below_s)
    # fits[r, g]: the most layers of run r one stage on g holds (its memory beside the layer's transient,
    # and compute within cutoff / M: one unit)
    fits = np.array([[float(run.count)] * G for run in runs])
    if capped:  # a plan faster than the cutoff (M units) ends each stage's tail within it
        with np.errstate(divide="ignore"):
            fits = np.minimum(fits, np.floor(np.where(time > 0, 1.0 / time, np.inf) * (1 + 1e-9)))
            fits = np.minimum(fits, np.floor(np.where(tail > 0, M / tail, np.inf) * (1 + 1e-9)))
        for g in range(G):
            if np.any(tail[:, g] > M * time[:, g]):  # (else the compute row implies it)
                rows.append((np.r_[y[:, g], m[g]], np.r_[tail[:, g], -float(M)], -math.inf, 0.0))
    if memory:  # the stages on g hold their layers within m_g stages' memory, per part
        for g in range(G):
            parts = [table.memory_parts(run.first, valid[g], M) for run in runs]
            for q, (capacity, _) in enumerate(parts[0]):
                held = np.array([cells[q][1].static_bytes + k * cells[q][1].activation_bytes for cells in parts])
                transients = np.array([cells[q][1].transient_bytes for cells in parts])
                rows.append(
                    (np.r_[y[:, g], m[g]], np.r_[held / capacity, transients.min() / capacity - 1.0], -math.inf, 0.0)
                )
                free = capacity - transients
                with np.errstate(divide="ignore", invalid="ignore"):
                    whole = np.where(held > 0, np.floor(free / np.where(held > 0, held, 1.0)), np.inf)
                fits[:, g] = np.minimum(fits[:, g], np.where(free >= 0, whole, 0.0))
    for r in range(R):  # y[r, g] ≤ fits[r, g]·m_g: each stage on g holds at most that many
        for g in range(G):
            rows.append((np.array([y[r, g], m[g]]), np.array([1.0, -fits[r, g]]), -math.inf, 0.0))
    if capped:  # a plan below the cutoff has every stage within cutoff / M (one unit): w_g ≤ m_g
        for g in range(G):
            rows.append((np.array([w[g], m[g]]), np.array([1.0, -1.0]), -math.inf, 0.0))
    rows.append((np.array([Z, T]), np.array([1.0, -float(M)]), 0.0, math.inf))  # step ≥ M·T
    # step ≥ α_v(S)·Σ_s c_s, α_v(S) = 1 / (v·(1 − (1 − 1/(vM))^S)) falling in S and in v (v = 1: α(S))
    v = virtual_stages
    fill = 1.0 / (v * (1.0 - (1.0 - 1.0 / (v * M)) ** stages))
    rows.append((np.r_[Z, w], np.r_[1.0, np.full(G, -fill)], 0.0, math.inf))
    cycles = (M - 1) // int(stages) + 1
    if schedule == "1f1b" and v == 1 and cycles > 1:  # the first stage's in-flight cycle: step ≥ (q+1)·Σ_s c_s
        rows.append((np.r_[Z, w], np.r_[1.0, np.full(G, -float(cycles))], 0.0, math.inf))
    cost = np.zeros(Z + 1)
    cost[Z] = 1.0
    upper = np.full(Z + 1, math.inf)
    if capped:  # a layer slower than cutoff / M fits no stage of such a plan
        upper[y[(time > 1 + 1e-9) | (fits < 1)]] = 0.0
    highs = highs_lp(cost, upper, rows)
    work.run(highs)
    status = highs.getModelStatus()
    # HiGHS's presolve can end undecided (kUnknown) on the capped rows: then a fresh start without
    # it, then the interior-point solver (the packing LPs' retries)
    for option, value in (("presolve", "off"), ("solver", "ipm")):
        if status in (highspy.HighsModelStatus.kOptimal, highspy.HighsModelStatus.kInfeasible):
            break
        highs.clearSolver()
        highs.setOptionValue(option, value)
        work.run(highs)
        status = highs.getModelStatus()
    if status == highspy.HighsModelStatus.kInfeasible:
        return below_s
    if status != highspy.HighsModelStatus.kOptimal:  # undecided: the solve-free bound still holds
        return min(simple, below_s)
    return min(max(simple, highs.getInfo().objective_function_value * unit_s), below_s)


def _parts(group: GroupConfig) -> list[tuple[str, int]]:
    """(type, devices) of each part of ``group``, in the order ``CostTable.memory_parts`` gives them."""
    return list(group.parts) if group.mixed else [(group.device_type, group.size)]
