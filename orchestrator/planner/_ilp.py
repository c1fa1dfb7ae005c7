"""The planning ILP for one microbatch count M: stage split, stage count, groups, recompute, memory.

Sets
    runs r = 0..R−1   maximal runs of consecutive identical layers (same signature, so the
                      same costs): n_r layers each. GPT-175B is 3 runs (embedding, 96 blocks,
                      head), so the model grows with distinct layers, not with layers.
    positions j = 0..J−1   pipeline stages counted from the END (j = 0 is the last stage), so a
                      stage's in-flight microbatches k_j = min(M, j + 1) under 1F1B (M under
                      GPipe) are constants and the stage count S ≤ J is a decision.
    groups g ∈ G      (device type, size, tp, recompute) with dp = size / tp dividing the
                      microbatch; hosts of one type are counts, not enumerated (``_groups``);
                      a mixed group joins hosts of two types, its replicas taking batch shares
                      fixed per (group, M) by the cost table
    parts q of g      its device types: one, or two for a mixed group (mem_q, size_q, and
                      σ_q, α_q, ρ_q each part's own memory per device)
    types t           device types; a stage's devices are of one type or of one mixed group.

Parameters (per layer of run r on group g, per microbatch and device, from the cost model)
    τ time (forward + backward + recompute + TP all-reduces), σ static memory (parameters,
    gradients, optimizer state), α activations kept per in-flight microbatch, ρ transient
    memory, δ gradient sync, ω optimizer step; π_r(t, t′) one point-to-point transfer of run r's
    output from a stage on type t to the next stage on type t′ (the slowest link between them).

Variables
    u[j,g] ∈ {0,1}      stage j runs on group g; used_j = Σ_g u[j,g]
    a[r,j] ∈ {0,1}      run r has layers in stage j
    z[r,j] ∈ ℤ, 0..n_r  how many (= a[r,j] when n_r = 1)
    v[r,j,g] ∈ [0,1]    = a[r,j]·u[j,g]      (Σ_g v = a, v ≤ u: exact)
    y[r,j,g] ≥ 0        = z[r,j]·u[j,g]      (Σ_g y = z, y ≤ n_r·v: exact; = v when n_r = 1)
    e[r,j] ∈ [0,1]      run r is the last run of stage j
    c[j,t,t′] ∈ [0,1]   stage j is on type t and the next stage (j − 1) on type t′
    P_j ≥ 0             stage j's point-to-point transfer time per direction
    X_j ≥ 0             transient peak of stage j
    compute_j, forward_j, backward_j, sync_j, optimizer_j ≥ 0   position j's times
    T ≥ 0               the bottleneck (slowest stage or link per microbatch), for the cuts
    B_j, E_j, W, step ≥ 0   first backward start and last backward end of position j, the
                        pipeline drain and the step; Ff, Fb_j ≥ 0 GPipe's paces
                        (rows in ms and GB, see MS and GB below)

Constraints (one function each; every row named)
    stage_order     used_j ≤ 1, used_{j+1} ≤ used_j, used_0 = 1 (stages are positions 0..S−1)
    layer_counts    Σ_j z[r,j] = n_r,  a ≤ z ≤ n_r·a,  a[r,j] ≤ used_j ≤ Σ_r a[r,j],  a[R−1,0] = 1
    contiguous      a[r,j] + a[r+1,j′] ≤ 1 for j < j′ (adjacent runs never cross; with non-empty
                    stages this makes every stage a contiguous slice of the chain)
    group_split     Σ_g v[r,j,g] = a[r,j],  v ≤ u,  Σ_g y[r,j,g] = z[r,j],  y ≤ f[r,j,g]·v, where
                    f = min(n_r, ⌊(mem − ρ) / (σ + α·k_j)⌋) layers of r fit alone (v = 0 if none)
    devices         Σ_{j, g with a part q of type t} size_q·u[j,g] ≤ devices(t)
    transfers       e[r,j] ≥ a[r,j] − a[r+1,j];  c[j,t,t′] ≥ ut[j,t] + ut[j−1,t′] − 1;
                    P_j ≥ π_r(t,t′)·(e[r,j] + c[j,t,t′] − 1);  and for j ≥ 1, over the runs r a
                    stage before the last can end with: Σ_r e[r,j] ≥ used_j, P_j ≥ Σ_r min_{t,t′} π_r(t,t′)·e[r,j]
    stage_times     compute_j = Σ_{r,g} τ·y[r,j,g], forward_j = Σ φ·y (φ: forward part of τ),
                    backward_j = compute_j − forward_j, sync_j = Σ δ·y, optimizer_j = Σ ω·y;
                    T ≥ compute_j, T ≥ 2·P_j
    schedule        the rows of ``_closed_form`` with stage s = S − 1 − j: B_j (1F1B: round trip
                    and warm-up), E_j (in-flight cycle, own work, outgoing link; GPipe: the two
                    flow shops with paces Ff and Fb_j), W ≥ E_j + upstream drain, W ≥ M·T,
                    step ≥ W, step ≥ E_j + optimizer_j, and the gradient-sync flow shop
                    step ≥ E_j + (one row per run r and end of r, ``sync_tails``) + optimizer_j;
                    for the first stage (used_{j+1} = 0; big-M on used_{j+1}) the same with E_j = W
    memory          per part slot q (a group of one type fills every slot with its one part):
                    Σ_{r,g} (σ_q + α_q·k_j)·y[r,j,g] + X_jq ≤ Σ_g mem_q(g)·u[j,g],  X_jq ≥ Σ_g ρ_q·v[r,j,g]
    group limits    Σ_r (σ_q + α_q·k_j)·y[r,j,g] ≤ mem_q(g)·u[j,g] per part;  with an incumbent I,
                    Σ_r τ·y[r,j,g] ≤ (I / M)·u[j,g]  (a better plan has T ≤ I / M)
    capacity        (valid cuts) N_t·T ≥ Σ_{r,j,(g,q) of type t} size_q·τ·y[r,j,g],  Σ_j t_j ≥ T,
                    Σ_{r,j,(g,q) of type t} size_q·(σ_q + α_q·k_j)·y[r,j,g] ≤ N_t·mem_t

Objective: the step time ``step`` — the closed form of ``_closed_form``: the critical paths of
the schedule with transfers beside compute and each layer's gradient sync following that
layer's last backward on one ring (a flow shop), then the optimizer step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import pulp

from orchestrator.cluster import Link
from orchestrator.planner._closed_form import in_flight_cycle
from orchestrator.planner._groups import GroupConfig, TypeInfo
from orchestrator.planner._table import CostTable

# Rows are written in milliseconds and gigabytes: HiGHS drops matrix entries below 1e-9
# (``small_matrix_value``), which seconds and bytes of small layers would fall under.
MS = 1e3
GB = 1e-9


def linear(terms: Iterable[tuple[pulp.LpVariable, float]]) -> pulp.LpAffineExpression:
    """Σ coefficient · variable over (variable, coefficient) pairs, as one PuLP expression built in
    one pass. ``pulp.lpSum(c * x for ...)`` makes a temporary expression of every product and
    merges it in, one per product, which dominates the build time of the large models. As with lpSum, a variable met twice gets the sum of its coefficients and
    a product with 0 adds nothing."""
    coefficients: dict = {}
    for variable, coefficient in terms:
        if coefficient:
            coefficients[variable] = coefficients.get(variable, 0) + coefficient
    return pulp.LpAffineExpression(coefficients)


def in_flight(schedule: str, microbatches: int, stages: int, stage: int) -> int:
    """Microbatches whose activations stage ``stage`` (0-based from the front) holds at its peak."""
    return microbatches if schedule == "gpipe" else min(microbatches, stages - stage)


@dataclass(frozen=True, slots=True)
class Run:
    """``count`` consecutive identical layers starting at layer ``first``."""

    first: int
    count: int

    @property
    def layers(self) -> range:
        return range(self.first, self.first + self.count)


def layer_runs(keys: list) -> list[Run]:
    """Maximal runs of equal consecutive keys (layer signatures)."""
    runs: list[Run] = []
    for index, key in enumerate(keys):
        if runs and keys[runs[-1].first] == key:
            runs[-1] = Run(runs[-1].first, runs[-1].count + 1)
        else:
            runs.append(Run(index, 1))
    return runs


def undominated(groups: list[GroupConfig], runs: list[Run], table: CostTable, microbatches: int) -> list[GroupConfig]:
    """Drop every group another group of the same type matches or beats on all counts: no more
    devices and, for every run, no more time, memory (static, per in-flight microbatch,
    transient), gradient sync or optimizer time. Swapping it in never hurts, so the optimum
    is unchanged."""

    def profile(g: GroupConfig) -> tuple[float, ...]:
        values: list[float] = [g.size]
        for run in runs:
            e = table.entry(run.first, g, microbatches)
            values += [e.time_s, e.dp_sync_s, e.optimizer_s]
            for _, part in table.memory_parts(run.first, g, microbatches):
                values += [part.static_bytes, part.activation_bytes, part.transient_bytes]
        return tuple(values)

    profiles = {g: profile(g) for g in groups}
    kept = []
    for g in groups:
        dominated = any(
            h.device_type == g.device_type
            and profiles[h] != profiles[g]
            and all(a <= b for a, b in zip(profiles[h], profiles[g]))
            for h in groups
        )
        # of groups with identical profiles keep the first
        duplicate = any(profiles[h] == profiles[g] and h.device_type == g.device_type for h in kept)
        if not dominated and not duplicate:
            kept.append(g)
    return kept


def simple_bound_s(runs: list[Run], groups: list[GroupConfig], table: CostTable, infos, microbatches: int) -> float:
    """A lower bound on the step time at M microbatches that needs no solve (seconds): the
    capacity cut alone, M·T ≥ M · Σ_r n_r · min_g size_g·τ(r,g) / N (every layer's cheapest
    device-seconds spread perfectly over all N devices)."""
    valid = [g for g in groups if table.microbatch(g, microbatches) is not None]
    if not valid:
        return math.inf
    devices = sum(info.devices for info in infos.values())
    work = sum(run.count * min(g.size * table.entry(run.first, g, microbatches).time_s for g in valid) for run in runs)
    return microbatches * work / devices


def boundary_runs(runs: list[Run]) -> list[int]:
    """The runs a stage other than the last can end with: every run but the last, and the last
    too if it has several layers (a stage may end inside it)."""
    return [r for r, run in enumerate(runs) if r < len(runs) - 1 or run.count > 1]


def cheapest_transfer_s(
    runs: list[Run], groups: list[GroupConfig], table: CostTable, links, microbatches: int
) -> float:
    """π: the cheapest one-way transfer any stage boundary can have — the least output of a run a
    stage other than the last can end with, over the cheapest link between the groups' types (0
    when there is none)."""
    types = {g.device_type for g in groups}
    pairs = [links[t, t2] for t in types for t2 in types if (t, t2) in links]
    ends = [runs[r].first + runs[r].count - 1 for r in boundary_runs(runs)]  # as the ILP's ``send_s``
    if not pairs or not ends:
        return 0.0
    widest = max(g.size for g in groups)  # the most links a transfer can spread over
    return min(table.send_s(layer, microbatches, link, widest) for layer in ends for link in pairs)


def transfer_floors_s(
    runs: list[Run], groups: list[GroupConfig], table: CostTable, links, microbatches: int
) -> tuple[np.ndarray, np.ndarray]:
    """(send[r, g], receive[r, g]): the least one-way transfer of run r's output (its last layer's)
    out of a stage on group g, and into one, over any link from or to the groups' types (0 where
    there is none). A boundary between stages of n and n′ devices sends over min(n, n′) links
    (``CostTable.send_s``), never more than either side's own count, so each bounds every transfer
    of that run across a boundary with g on that side: the narrower the group, the dearer."""
    types = sorted({g.device_type for g in groups})
    send, receive = np.zeros((len(runs), len(groups))), np.zeros((len(runs), len(groups)))
    for r, run in enumerate(runs):
        layer = run.first + run.count - 1
        for g, group in enumerate(groups):
            t = group.device_type
            out = [table.send_s(layer, microbatches, links[t, t2], group.size) for t2 in types if (t, t2) in links]
            into = [table.send_s(layer, microbatches, links[t2, t], group.size) for t2 in types if (t2, t) in links]
            send[r, g], receive[r, g] = min(out, default=0.0), min(into, default=0.0)
    return send, receive


def link_bound_s(
    runs: list[Run], groups: list[GroupConfig], table: CostTable, links, microbatches: int, stages: int, schedule: str
) -> float:
    """A lower bound on the step time of every plan with exactly ``stages`` stages at M
    microbatches that needs no solve (seconds): the pipeline's transfers on its critical paths.

    With π the cheapest transfer any stage boundary can have (the least output of a run a
    stage other than the last can end with, over the slowest link of any pair of types) and
    c_min = Σ_r n_r·min_g τ(r,g) the least compute of one microbatch through all layers, the
    closed form (``_closed_form``) gives, for S ≥ 2 stages,

        1F1B:  step ≥ W ≥ E_{S−1} + U^b_{S−1} ≥ c_min + 2(S−1)·π           (first microbatch's round trip)
               step ≥ W ≥ E_{S−2} + U^b_{S−2} ≥ τ_min(layer 0) + 2(S−2+M)·π  (the last link's 2M transfers)
        GPipe: step ≥ E_0 ≥ c_min + 2(S+M−2)·π                               (both flow shops' fill and pace)

    The ILP's LP relaxation loses them: a stage spread over fractions of groups of several
    types prices its neighbour links at 0 (``c[j,t,t′] ≥ ut + ut′ − 1``). Where racks are joined by
    slow links (``mixed-4type-512``: 100 GbE), π of a small model is a large part of its step, and
    this bound closes the deep pipelines whose LP bounds are a fraction of the incumbent."""
    if stages < 2:
        return 0.0
    valid = [g for g in groups if table.microbatch(g, microbatches) is not None]
    if not valid:
        return math.inf
    pi = cheapest_transfer_s(runs, valid, table, links, microbatches)
    if pi == 0.0:
        return 0.0
    least = [min(table.entry(run.first, g, microbatches).time_s for g in valid) for run in runs]
    work = sum(run.count * t for run, t in zip(runs, least))
    if schedule == "gpipe":
        return work + 2 * (stages + microbatches - 2) * pi
    return max(work + 2 * (stages - 1) * pi, least[0] + 2 * (stages - 2 + microbatches) * pi)


class StageModel:
    """The ILP above for one microbatch count M and at most J stages."""

    def __init__(
        self,
        *,
        runs: list[Run],
        max_stages: int,
        microbatches: int,
        groups: list[GroupConfig],
        table: CostTable,
        infos: dict[str, TypeInfo],
        schedule: str,
        links: dict[tuple[str, str], Link],
        repair: bool = False,
    ):
        """``repair=True`` builds the diagnosis variant: memory rows get a slack Q (GB per
        device, the same for every stage) and the objective becomes min Q — the least extra
        memory per device that would make a plan exist."""
        self.runs, self.J, self.M, self.repair = runs, max_stages, microbatches, repair
        self.table, self.infos, self.schedule, self.links = table, infos, schedule, links
        self.groups = undominated(
            [g for g in groups if table.microbatch(g, microbatches) is not None], runs, table, microbatches
        )
        self.types = sorted({g.device_type for g in self.groups})
        R, J, G = range(len(runs)), range(max_stages), range(len(self.groups))
        lp = self.lp = pulp.LpProblem(f"plan_M{microbatches}", pulp.LpMinimize)
        var = lp.add_variable
        self.u = {(j, g): var(f"u_{j}_{g}", cat="Binary") for j in J for g in G}
        self.a = {(r, j): var(f"a_{r}_{j}", cat="Binary") for r in R for j in J}
        self.v = {(r, j, g): var(f"v_{r}_{j}_{g}", 0, 1) for r in R for j in J for g in G}
        self.z, self.y = {}, {}
        for r in R:
            n = runs[r].count
            for j in J:
                self.z[r, j] = var(f"z_{r}_{j}", 0, n, cat="Integer") if n > 1 else self.a[r, j]
                for g in G:
                    self.y[r, j, g] = var(f"y_{r}_{j}_{g}", 0, n) if n > 1 else self.v[r, j, g]
        self.e = {(r, j): var(f"e_{r}_{j}", 0, 1) for r in R for j in J}
        self.P = {j: var(f"P_{j}", 0) for j in J}
        self.c: dict = {}  # (j, t, t2), made by add_transfers
        self.q: dict = {}  # j: 1 / the smaller device count of positions j and j − 1, made by add_transfers
        self.T = var("T", 0)
        # a mixed group has two parts, each with its own memory rows (slots); groups of one type fill both
        self.slots = range(max(len(g.parts) or 1 for g in self.groups) if self.groups else 1)
        self.X = {(j, q): var(f"X_{j}_{q}", 0) for j in J for q in self.slots}
        # per-position times (ms) and the closed form's critical-path variables
        self.compute = {j: var(f"compute_{j}", 0) for j in J}
        self.forward = {j: var(f"forward_{j}", 0) for j in J}
        self.backward = {j: var(f"backward_{j}", 0) for j in J}
        self.sync = {j: var(f"sync_{j}", 0) for j in J}
        self.optimizer = {j: var(f"optimizer_{j}", 0) for j in J}
        self.B = {j: var(f"B_{j}", 0) for j in J}
        self.E = {j: var(f"E_{j}", 0) for j in J}
        self.W, self.step = var("W", 0), var("step", 0)
        self.Ff = var("Ff", 0)
        self.Fb = {j: var(f"Fb_{j}", 0) for j in J}
        # lower-bound rows of each derived variable, in dependency order (``set_start`` replays them)
        self.bounds: dict = {}
        self.definitions: list = []
        # the migration term of re-planning (``_migration``): stay variables and their part of the objective
        self.stays: list = []
        self._link_bounds: dict[int, float] = {}
        self._capacity: float | None = None
        self._entries: dict = {}
        self._parts: dict = {}
        self.migration = 0
        self.Q = var("Q", 0) if repair else 0
        self.used = {j: pulp.lpSum(self.u[j, g] for g in G) for j in J}
        self.on_type = {
            (j, t): pulp.lpSum(self.u[j, g] for g in G if self.groups[g].device_type == t)
            for j in J
            for t in self.types
        }
        self.stage_time = {j: self.compute[j] + (2 * self.P[j] if j > 0 else 0) for j in J}
        lp += self.step, "step_time"

    def entry(self, r: int, g: int):
        # remembered by index: the table's own key hashes the group, and a build asks 250,000 times
        found = self._entries.get((r, g))
        if found is None:
            found = self._entries[r, g] = self.table.entry(self.runs[r].first, self.groups[g], self.M)
        return found

    def part(self, r: int, g: int, q: int) -> tuple[float, float, str, object]:
        """(device memory, devices, type, entry) of slot q of group g for run r (a group of one
        type has one part, in every slot)."""
        found = self._parts.get((r, g, q))
        if found is None:
            group = self.groups[g]
            parts = self.table.memory_parts(self.runs[r].first, group, self.M)
            index = min(q, len(parts) - 1)
            kind, size = list(group.by_type.items())[index]
            capacity, entry = parts[index]
            found = self._parts[r, g, q] = (capacity, size, kind, entry)
        return found

    def held(self, r: int, g: int, q: int, k: int) -> float:
        """Bytes per device one layer of run r keeps on slot q of group g with k microbatches in flight."""
        entry = self.part(r, g, q)[3]
        return entry.static_bytes + entry.activation_bytes * k

    def _terms(self, j: int):
        return [(r, g, self.y[r, j, g]) for r in range(len(self.runs)) for g in range(len(self.groups))]

    def in_flight(self, j: int) -> int:
        return self.M if self.schedule == "gpipe" else min(self.M, j + 1)

    # -- constraint families -------------------------------------------------
    def add_stage_order(self) -> None:
        for j in range(self.J):
            self.lp += self.used[j] <= 1, f"stage_order_one_group_{j}"
            if j + 1 < self.J:
                self.lp += self.used[j + 1] <= self.used[j], f"stage_order_{j}"
        self.lp += self.used[0] == 1, "stage_order_last_used"

    def add_layer_counts(self) -> None:
        R = len(self.runs)
        for r, run in enumerate(self.runs):
            self.lp += pulp.lpSum(self.z[r, j] for j in range(self.J)) == run.count, f"layer_counts_{r}"
            for j in range(self.J):
                self.lp += self.a[r, j] <= self.used[j], f"layer_in_used_stage_{r}_{j}"
                if run.count > 1:
                    self.lp += self.z[r, j] >= self.a[r, j], f"layer_counts_min_{r}_{j}"
                    self.lp += self.z[r, j] <= run.count * self.a[r, j], f"layer_counts_max_{r}_{j}"
        for j in range(self.J):
            self.lp += pulp.lpSum(self.a[r, j] for r in range(R)) >= self.used[j], f"stage_not_empty_{j}"
        self.lp += self.a[R - 1, 0] == 1, "last_run_in_last_stage"

    def add_contiguous(self) -> None:
        for r in range(len(self.runs) - 1):
            for j in range(self.J):
                for later in range(j + 1, self.J):
                    self.lp += self.a[r, j] + self.a[r + 1, later] <= 1, f"contiguous_{r}_{j}_{later}"

    def fit(self, r: int, j: int, g: int) -> int:
        """The most layers of run r that fit alone on group g at position j (memory row with
        only that run): the tight coefficient that makes the LP relaxation respect memory."""
        if self.repair:  # memory may grow by Q: no layer count is ruled out
            return self.runs[r].count
        fits = self.runs[r].count
        for q in self.slots:
            capacity, _, _, entry = self.part(r, g, q)
            free = capacity - entry.transient_bytes
            per_layer = self.held(r, g, q, self.in_flight(j))
            if free < per_layer:
                return 0
            if per_layer > 0:
                fits = min(fits, int(free // per_layer))
        return fits

    def add_group_split(self) -> None:
        G = range(len(self.groups))
        for r, run in enumerate(self.runs):
            for j in range(self.J):
                self.lp += pulp.lpSum(self.v[r, j, g] for g in G) == self.a[r, j], f"split_{r}_{j}"
                for g in G:
                    fit = self.fit(r, j, g)
                    if fit == 0:
                        self.v[r, j, g].upBound = 0
                        self.y[r, j, g].upBound = 0
                        continue
                    self.lp += self.v[r, j, g] <= self.u[j, g], f"within_{r}_{j}_{g}"
                    if run.count > 1:
                        self.lp += self.y[r, j, g] <= fit * self.v[r, j, g], f"within_count_{r}_{j}_{g}"
                if run.count > 1:
                    self.lp += pulp.lpSum(self.y[r, j, g] for g in G) == self.z[r, j], f"split_count_{r}_{j}"

    def add_devices(self) -> None:
        for name, info in self.infos.items():
            used = linear(
                (self.u[j, g], grp.by_type[name])
                for j in range(self.J)
                for g, grp in enumerate(self.groups)
                if name in grp.by_type
            )
            self.lp += used <= info.devices, f"devices_{name}"

    def add_transfers(self) -> None:
        """P_j ≥ the transfer from position j to j − 1: the latency plus the bytes over the link,
        divided by the smaller stage's device count (``CostTable.send_s``). That count enters as
        q_j ≥ Σ_g u_jg / n_g on both sides (1 / n of the chosen group, exactly, at an integer
        point), so the rows stay one per (run, type pair)."""
        R = len(self.runs)
        for j in range(self.J):
            for r in range(R):
                nxt = self.a[r + 1, j] if r + 1 < R else 0
                self.lp += self.e[r, j] >= self.a[r, j] - nxt, f"last_run_{r}_{j}"
        G = range(len(self.groups))
        for j in range(1, self.J):
            q = self.q[j] = self.lp.add_variable(f"q_{j}", 0, 1)
            for side in (j, j - 1):
                self.lp += q >= linear((self.u[side, g], 1 / self.groups[g].size) for g in G), f"fewer_{j}_{side}"
        for j in range(1, self.J):
            # named by index: type names may hold characters (a mixed group's "+") that names cannot
            for i, t in enumerate(self.types):
                for i2, t2 in enumerate(self.types):
                    c = self.c[j, t, t2] = self.lp.add_variable(f"c_{j}_{i}_{i2}", 0, 1)
                    self.lp += c >= self.on_type[j, t] + self.on_type[j - 1, t2] - 1, f"neighbours_{j}_{i}_{i2}"
                    for r in range(R):
                        whole = self.send_s(r, t, t2) * MS  # every byte over one link
                        latency = self.links[t, t2].latency_s * MS
                        volume = whole - latency
                        if whole > 0:
                            self.lp += (
                                self.P[j]
                                >= latency * (self.e[r, j] + c - 1)
                                + volume * self.q[j]
                                - volume * (2 - self.e[r, j] - c),
                                f"transfer_{j}_{r}_{i}_{i2}",
                            )
        # valid without the types (whose c rows the LP relaxation sets to 0): a stage before the
        # last ends at exactly one run, and sends at least that run's cheapest transfer
        ends = boundary_runs(self.runs) if self.types else []
        widest = max((g.size for g in self.groups), default=1)
        floor = {
            r: min(self.send_s(r, t, t2, devices=widest) for t in self.types for t2 in self.types) * MS for r in ends
        }
        for j in range(1, self.J):
            self.lp += pulp.lpSum(self.e[r, j] for r in ends) >= self.used[j], f"one_last_run_{j}"
            self.lp += self.P[j] >= linear((self.e[r, j], floor[r]) for r in ends), f"transfer_floor_{j}"
        if not ends:
            return
        # valid without the types or the counts too: a stage on g sends, and one on g receives, at
        # least g's own floor (a boundary spreads over at most either side's devices); the LP
        # relaxation keeps these where it spreads q over the widest groups
        send, receive = (
            MS * a[ends].min(axis=0) for a in transfer_floors_s(self.runs, self.groups, self.table, self.links, self.M)
        )
        most = float(receive.max(initial=0.0))
        for j in range(1, self.J):
            self.lp += self.P[j] >= linear((self.u[j, g], send[g]) for g in G if send[g] > 0), f"sends_at_least_{j}"
            self.lp += (
                self.P[j]
                >= linear((self.u[j - 1, g], receive[g]) for g in G if receive[g] > 0) - most * (1 - self.used[j]),
                f"receives_at_least_{j}",
            )

    def send_s(self, r: int, source: str, target: str, devices: float = 1) -> float:
        """One transfer of run r's output from a stage on ``source`` to one on ``target``, sent over
        ``devices`` links at once."""
        layer = self.runs[r].count + self.runs[r].first - 1
        return self.table.send_s(layer, self.M, self.links[source, target], devices)

    def _bound(self, variable, expression, name: str) -> None:
        """Row ``variable ≥ expression``, remembered for :meth:`set_start`."""
        self.lp += variable >= expression, name
        self.bounds.setdefault(variable.name, (variable, []))[1].append(expression)

    def send(self, j: int):
        """One transfer from position j to j − 1 (none from the last stage)."""
        return self.P[j] if j > 0 else 0

    def add_stage_times(self) -> None:
        """compute_j, forward_j, backward_j, sync_j, optimizer_j of position j (ms per microbatch
        or per step): the cost table summed over its layers; and the bottleneck T ≥ compute_j,
        T ≥ 2·P_j that the capacity cuts use."""
        for j in range(self.J):
            terms = self._terms(j)
            compute = linear((y, self.entry(r, g).time_s * MS) for r, g, y in terms)
            forward = linear((y, self.entry(r, g).forward_s * MS) for r, g, y in terms)
            sync = linear((y, self.entry(r, g).dp_sync_s * MS) for r, g, y in terms)
            optimizer = linear((y, self.entry(r, g).optimizer_s * MS) for r, g, y in terms)
            for name, variable, expression in (
                ("compute", self.compute[j], compute),
                ("forward", self.forward[j], forward),
                ("backward", self.backward[j], compute - forward),
                ("sync", self.sync[j], sync),
                ("optimizer", self.optimizer[j], optimizer),
            ):
                self.lp += variable == expression, f"{name}_{j}"
                self.definitions.append((variable, expression))
            self._bound(self.T, self.compute[j], f"bottleneck_{j}")
            if j > 0:
                self._bound(self.T, 2 * self.P[j], f"bottleneck_link_{j}")

    def add_schedule(self) -> None:
        """The closed form of ``_closed_form`` in positions (stage s = S − 1 − j, so s′ < s is
        j′ > j and K_s = j + 1): rows for B_j, E_j, W and the step. Positions past the
        first stage hold no work and give rows no stronger than the first stage's."""
        J, M = range(self.J), self.M
        up_f = {j: pulp.lpSum(self.forward[k] + self.send(k) for k in J if k > j) for j in J}
        up_b = {j: pulp.lpSum(self.backward[k] + self.send(k) for k in J if k > j) for j in J}
        if self.schedule == "gpipe":
            for j in J:
                self._bound(self.Ff, self.forward[j], f"gpipe_forward_pace_{j}")
                if j > 0:
                    self._bound(self.Ff, self.P[j], f"gpipe_forward_link_{j}")
            forwards_end = pulp.lpSum(self.forward[j] + self.send(j) for j in J) + (M - 1) * self.Ff
            for j in J:
                for k in range(j + 1):
                    self._bound(self.Fb[j], self.backward[k], f"gpipe_backward_pace_{j}_{k}")
                    if k > 0:
                        self._bound(self.Fb[j], self.P[k], f"gpipe_backward_link_{j}_{k}")
                drain = pulp.lpSum(self.backward[k] + self.send(k) for k in range(j + 1))
                self._bound(self.E[j], forwards_end + drain + (M - 1) * self.Fb[j], f"gpipe_end_{j}")
        else:
            for j in J:
                q, r = in_flight_cycle(M, j + 1)
                warm = min(M, j + 1)
                loop = pulp.lpSum(self.compute[k] + 2 * self.send(k) for k in range(j + 1))
                self._bound(self.B[j], up_f[j] + loop - self.backward[j], f"start_round_trip_{j}")
                self._bound(self.B[j], up_f[j] + warm * self.forward[j], f"start_warm_up_{j}")
                step = self.compute[j] if q >= 1 else self.backward[j]
                self._bound(self.E[j], self.B[j] + q * loop + r * step + self.backward[j], f"end_in_flight_{j}")
                self._bound(
                    self.E[j], self.B[j] + M * self.backward[j] + (M - warm) * self.forward[j], f"end_own_work_{j}"
                )
                if j > 0:
                    self._bound(self.E[j], up_f[j] + self.compute[j] + 2 * M * self.P[j], f"end_link_{j}")
        for j in J:
            self._bound(self.W, self.E[j] + up_b[j], f"drain_{j}")
        self._bound(self.W, M * self.T, "drain_covers_bottleneck")
        # the first stage (j used, j + 1 not) ends at W: its tail rows hold when used_{j+1} = 0
        big = self.tail_limit_ms()
        self._bound(self.step, self.W, "step_covers_pipeline")
        for j in J:
            relax = big * self.used[j + 1] if j + 1 < self.J else 0
            self._bound(self.step, self.E[j] + self.optimizer[j], f"step_optimizer_{j}")
            self._bound(self.step, self.W + self.optimizer[j] - relax, f"step_first_optimizer_{j}")
            for r, tail in enumerate(self.sync_tails(j)):
                self._bound(self.step, self.E[j] + tail, f"step_sync_{j}_{r}")
                self._bound(self.step, self.W + tail - relax, f"step_first_sync_{j}_{r}")

    def sync_tails(self, j: int) -> list:
        """Y_j − E_j + o_j for each candidate k of the flow shop in ``_closed_form``: the backward
        pass visits runs last first, and within a run of equal layers the max over k is at one
        of its ends, so k is the first or the last layer the pass visits of some run r:

            k = r's last layer:   − Σ_{r′≤r} (b − y)·y[r′] + b_r·v[r] + o_j
            k = r's first layer:  − Σ_{r′<r} (b − y)·y[r′] + y_r·v[r] + o_j

        (b, y one layer's backward and sync on the stage's group). A run outside the stage gives
        E_j or E_j − backward_j + sync_j + o_j, both still lower bounds."""
        G = range(len(self.groups))

        def backward(r, g):
            return (self.entry(r, g).time_s - self.entry(r, g).forward_s) * MS

        def sync(r, g):
            return self.entry(r, g).dp_sync_s * MS

        def exposed(runs):
            return linear((self.y[r, j, g], backward(r, g) - sync(r, g)) for r in runs for g in G)

        tails = []
        for r in range(len(self.runs)):
            first_visited = linear((self.v[r, j, g], backward(r, g)) for g in G)
            last_visited = linear((self.v[r, j, g], sync(r, g)) for g in G)
            tails.append(self.optimizer[j] - exposed(range(r + 1)) + first_visited)
            tails.append(self.optimizer[j] - exposed(range(r)) + last_visited)
        return tails

    def tail_limit_ms(self) -> float:
        """An upper bound on any stage's sync + optimizer time plus one layer's backward (ms): the
        big-M of the first-stage rows."""
        total = 0.0
        for r, run in enumerate(self.runs):
            total += run.count * max(
                (self.entry(r, g).dp_sync_s + self.entry(r, g).optimizer_s for g in range(len(self.groups))),
                default=0.0,
            )
        one_layer = max(
            (self.entry(r, g).time_s for r in range(len(self.runs)) for g in range(len(self.groups))), default=0.0
        )
        return (total + one_layer) * MS

    def add_capacity(self) -> None:
        """Valid cuts the LP relaxation needs (without them fractional u splits one big group
        over every stage): per device type t, the bottleneck times its devices covers the
        device-seconds of its stages, N_t·T ≥ Σ_{j on t} size_j·t_j ≥ Σ_{r,j,g of t} size_g·τ·y;
        and the fill and drain take at least T."""
        for t in self.infos:
            work = linear(
                (y, self.groups[g].by_type[t] * self.entry(r, g).time_s * MS)
                for j in range(self.J)
                for r, g, y in self._terms(j)
                if t in self.groups[g].by_type
            )
            self.lp += self.infos[t].devices * self.T >= work, f"capacity_{t}"
            held = linear(
                (y, size * self.held(r, g, q, self.in_flight(j)) * GB)
                for j in range(self.J)
                for r, g, y in self._terms(j)
                for q in range(len(self.groups[g].by_type))
                for _, size, kind, _ in [self.part(r, g, q)]
                if kind == t
            )
            if not self.repair:
                self.lp += held <= self.infos[t].devices * self.infos[t].memory_bytes * GB, f"capacity_memory_{t}"
        self.lp += pulp.lpSum(self.stage_time.values()) >= self.T, "fill_covers_bottleneck"

    def add_group_limits(self, bottleneck_limit_s: float | None = None) -> None:
        """Per (stage, group) rows, valid in integral solutions because a stage has one group,
        and much tighter in the LP than the per-stage rows: a fraction u of a group holds at most
        u of its memory, and — given an incumbent of step time I, so any better plan has
        T ≤ I / M (the objective is at least M·T) — at most u·I/M of compute time."""
        for j in range(self.J):
            k = self.in_flight(j)
            for g, group in enumerate(self.groups):
                terms = [(r, self.y[r, j, g]) for r in range(len(self.runs))]
                for q in range(len(group.by_type)):
                    held = linear((y, self.held(r, g, q, k) * GB) for r, y in terms)
                    capacity = self.part(0, g, q)[0] * GB
                    if not self.repair:
                        self.lp += held <= capacity * self.u[j, g], f"group_memory_{j}_{g}_{q}"
                if bottleneck_limit_s is not None:
                    work = linear((y, self.entry(r, g).time_s * MS) for r, y in terms)
                    self.lp += work <= bottleneck_limit_s * MS * self.u[j, g], f"group_time_{j}_{g}"

    def add_memory(self) -> None:
        G = range(len(self.groups))
        for j in range(self.J):
            k = self.in_flight(j)
            for q in self.slots:
                used = linear((y, self.held(r, g, q, k) * GB) for r, g, y in self._terms(j))
                capacity = linear((self.u[j, g], self.part(0, g, q)[0] * GB) for g in G)
                self.lp += used + self.X[j, q] <= capacity + self.Q, f"memory_{j}_{q}"
                for r in range(len(self.runs)):
                    peak = linear((self.v[r, j, g], self.part(r, g, q)[3].transient_bytes * GB) for g in G)
                    self.lp += self.X[j, q] >= peak, f"transient_{r}_{j}_{q}"

    def build(self, incumbent_s: float | None = None) -> StageModel:
        """All constraint families; ``incumbent_s`` (a known plan's step time) enables the
        bottleneck limit of :meth:`add_group_limits`."""
        self.add_stage_order()
        self.add_layer_counts()
        self.add_contiguous()
        self.add_group_split()
        self.add_devices()
        self.add_transfers()
        self.add_stage_times()
        self.add_schedule()
        self.add_capacity()
        self.add_memory()
        self.add_group_limits(None if incumbent_s is None else incumbent_s / self.M)
        if self.repair:
            self.lp.setObjective(self.Q)
        return self

    def simple_bound_s(self) -> float:
        """The solve-free floor of this M's plans: each device type's capacity (``_capacity``; its
        memory rows left out in the diagnosis variant, whose memory may grow), remembered."""
        if self._capacity is None:
            from orchestrator.planner._capacity import capacity_bound_s  # (it reads this module's runs)

            self._capacity = capacity_bound_s(
                self.runs,
                self.groups,
                self.table,
                self.infos,
                self.M,
                self.schedule,
                memory=not self.repair,
                max_stages=self.J,
            )
        return self._capacity

    def link_bound_s(self, stages: int) -> float:
        """:func:`link_bound_s` of this model's plans with exactly ``stages`` stages (remembered)."""
        if stages not in self._link_bounds:
            self._link_bounds[stages] = link_bound_s(
                self.runs, self.groups, self.table, self.links, self.M, stages, self.schedule
            )
        return self._link_bounds[stages]

    def set_start(self, stages: list[list[int]], groups: list[GroupConfig]) -> bool:
        """Give every variable the value of a known plan (a starting incumbent for the solver).

        Returns False (and sets nothing) if the plan is outside this model (another M, more
        stages than positions, a group the model does not have)."""
        S = len(stages)
        if S > self.J or any(g not in self.groups for g in groups):
            return False
        for variable in self.lp.variables():
            variable.varValue = 0.0
        run_of = {layer: r for r, run in enumerate(self.runs) for layer in run.layers}
        for s, (layers, group) in enumerate(zip(stages, groups)):
            j, g = S - 1 - s, self.groups.index(group)
            self.u[j, g].varValue = 1.0
            for layer in layers:
                r = run_of[layer]
                self.a[r, j].varValue = 1.0
                self.v[r, j, g].varValue = 1.0
                if self.runs[r].count > 1:
                    self.z[r, j].varValue = (self.z[r, j].varValue or 0.0) + 1.0
                    self.y[r, j, g].varValue = (self.y[r, j, g].varValue or 0.0) + 1.0
        types = {S - 1 - s: g.device_type for s, g in enumerate(groups)}
        for j in range(S):
            last = max(run_of[layer] for layer in stages[S - 1 - j])
            self.e[last, j].varValue = 1.0
            if j > 0:
                self.c[j, types[j], types[j - 1]].varValue = 1.0
                fewer = min(groups[S - 1 - j].size, groups[S - j].size)
                self.q[j].varValue = 1 / fewer
                self.P[j].varValue = self.send_s(last, types[j], types[j - 1], fewer) * MS
        for j in range(S):
            g = self.groups.index(groups[S - 1 - j])
            terms = [r for r in range(len(self.runs)) if (self.a[r, j].varValue or 0) > 0.5]
            for q in self.slots:
                self.X[j, q].varValue = max(self.part(r, g, q)[3].transient_bytes * GB for r in terms)
        for variable, expression in self.definitions:
            variable.varValue = pulp.value(expression) or 0.0
        for variable, expressions in self.bounds.values():
            variable.varValue = max(0.0, *(pulp.value(e) or 0.0 for e in expressions))
        for stay, y, count in self.stays:
            stay.varValue = min(count, y.varValue or 0.0)
        return True

    def read(self) -> tuple[list[list[int]], list[GroupConfig]]:
        """(layers per stage, group per stage) of the solution, in pipeline order."""
        G = range(len(self.groups))
        used = [j for j in range(self.J) if (self.used[j].value() or 0.0) > 0.5]
        counts = {(r, j): round(pulp.value(self.z[r, j]) or 0.0) for r in range(len(self.runs)) for j in used}
        stages, chosen = [], []
        taken = [0] * len(self.runs)
        for j in sorted(used, reverse=True):
            layers = []
            for r, run in enumerate(self.runs):
                n = counts[r, j]
                layers += list(run.layers[taken[r] : taken[r] + n])
                taken[r] += n
            stages.append(layers)
            chosen.append(self.groups[max(G, key=lambda g: self.u[j, g].varValue or 0.0)])
        return stages, chosen
