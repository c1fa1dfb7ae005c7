"""The planning ILP for a fixed number of stages S and microbatches M.

Sets: layers l = 0..L−1 (a chain), stages s = 0..S−1, group configurations
g ∈ G (device type, size, tp, recompute) whose data-parallel degree divides
the microbatch. Costs per layer, group and M come from the cost model
(:class:`~orchestrator.planner._table.CostTable`): time τ, static memory σ,
activations per in-flight microbatch α, transient memory ρ, gradient sync δ,
optimizer ω.

Variables
    a[l,s] ∈ {0,1}    layer l is in stage s
    u[s,g] ∈ {0,1}    stage s runs on a group g
    w[l,s,g] ∈ [0,1]  layer l is in stage s and s runs on g  (w = a·u)
    e[l,s] ∈ [0,1]    layer l is the last of stage s         (e ≥ a[l,s] − a[l+1,s])
    T, D, O ≥ 0       bottleneck stage time, gradient sync, optimizer;  X_s ≥ 0 transient peak

Constraints (one function each, every row named)
    layer_once      Σ_s a[l,s] = 1
    contiguous      0 ≤ Σ_s s·a[l+1,s] − Σ_s s·a[l,s] ≤ 1,   a[0,0] = a[L−1,S−1] = 1
    one_group       Σ_g u[s,g] = 1,   Σ_g w[l,s,g] = a[l,s],   w[l,s,g] ≤ u[s,g]   (exact w = a·u,
                    and a tighter LP relaxation than w ≥ a + u − 1)
    devices         Σ_{s, g of type t} size_g · u[s,g] ≤ devices(t)
    bottleneck      T ≥ t_s = Σ_{l,g} τ·w[l,s,g] + Σ_l p2p_l · e[l,s]     (s < S−1 send to s+1)
    sync, optimizer D ≥ Σ δ·w,   O ≥ Σ ω·w
    memory          Σ (σ + α·k_s)·w + X_s ≤ Σ_g mem(g)·u[s,g],   X_s ≥ ρ·w[l,s,g]
                    k_s = min(M, S − s) in-flight microbatches under 1F1B, M under GPipe

Objective: the step time  Σ_s t_s + (M − 1)·T + D + O
(pipeline fill and drain — one microbatch through every stage — then M − 1
microbatches at the bottleneck's pace; gradient sync after the last backward,
not overlapped; then the optimizer step).
"""

from __future__ import annotations

import pulp

from orchestrator.planner._groups import GroupConfig, TypeInfo
from orchestrator.planner._table import CostTable


def in_flight(schedule: str, microbatches: int, stages: int, stage: int) -> int:
    """Microbatches whose activations a stage holds at its peak."""
    return microbatches if schedule == "gpipe" else min(microbatches, stages - stage)


class StageModel:
    """The ILP above for one (S, M)."""

    def __init__(
        self,
        *,
        layers: int,
        stages: int,
        microbatches: int,
        groups: list[GroupConfig],
        table: CostTable,
        infos: dict[str, TypeInfo],
        schedule: str,
        p2p_link,
    ):
        self.L, self.S, self.M = layers, stages, microbatches
        self.groups = [g for g in groups if table.microbatch(g, microbatches) is not None]
        self.table, self.infos, self.schedule, self.p2p_link = table, infos, schedule, p2p_link
        lp = self.lp = pulp.LpProblem(f"plan_S{stages}_M{microbatches}", pulp.LpMinimize)
        L, S, G = range(layers), range(stages), range(len(self.groups))
        self.a = {(l, s): lp.add_variable(f"a_{l}_{s}", cat="Binary") for l in L for s in S}
        self.u = {(s, g): lp.add_variable(f"u_{s}_{g}", cat="Binary") for s in S for g in G}
        self.w = {(l, s, g): lp.add_variable(f"w_{l}_{s}_{g}", 0, 1) for l in L for s in S for g in G}
        self.e = {(l, s): lp.add_variable(f"e_{l}_{s}", 0, 1) for l in L for s in S}
        self.T = lp.add_variable("T", 0)
        self.D = lp.add_variable("D", 0)
        self.O = lp.add_variable("O", 0)
        self.X = {s: lp.add_variable(f"X_{s}", 0) for s in S}
        self.stage_time = {s: self._stage_time(s) for s in S}
        lp += pulp.lpSum(self.stage_time.values()) + (microbatches - 1) * self.T + self.D + self.O, "step_time"

    def entry(self, layer: int, g: int):
        return self.table.entry(layer, self.groups[g], self.M)

    def _stage_time(self, s: int):
        compute = pulp.lpSum(
            self.entry(l, g).time_s * self.w[l, s, g] for l in range(self.L) for g in range(len(self.groups))
        )
        if s == self.S - 1:
            return compute
        send = pulp.lpSum(self.table.p2p_s(l, self.M, self.p2p_link) * self.e[l, s] for l in range(self.L))
        return compute + send

    # -- constraint families -------------------------------------------------
    def add_layer_once(self) -> None:
        for l in range(self.L):
            self.lp += pulp.lpSum(self.a[l, s] for s in range(self.S)) == 1, f"layer_once_{l}"

    def add_contiguous(self) -> None:
        index = {l: pulp.lpSum(s * self.a[l, s] for s in range(self.S)) for l in range(self.L)}
        for l in range(self.L - 1):
            self.lp += index[l + 1] - index[l] >= 0, f"contiguous_order_{l}"
            self.lp += index[l + 1] - index[l] <= 1, f"contiguous_step_{l}"
        self.lp += self.a[0, 0] == 1, "contiguous_first"
        self.lp += self.a[self.L - 1, self.S - 1] == 1, "contiguous_last"
        for l in range(self.L):
            for s in range(self.S):
                nxt = self.a[l + 1, s] if l + 1 < self.L else 0
                self.lp += self.e[l, s] >= self.a[l, s] - nxt, f"last_layer_{l}_{s}"

    def add_one_group(self) -> None:
        for s in range(self.S):
            self.lp += pulp.lpSum(self.u[s, g] for g in range(len(self.groups))) == 1, f"one_group_{s}"
            for l in range(self.L):
                # w = a·u, written so the LP relaxation stays tight: w splits a over the groups, within u
                self.lp += (
                    pulp.lpSum(self.w[l, s, g] for g in range(len(self.groups))) == self.a[l, s],
                    f"split_{l}_{s}",
                )
                for g in range(len(self.groups)):
                    self.lp += self.w[l, s, g] <= self.u[s, g], f"within_{l}_{s}_{g}"

    def add_devices(self) -> None:
        for name, info in self.infos.items():
            used = pulp.lpSum(
                grp.size * self.u[s, g]
                for s in range(self.S)
                for g, grp in enumerate(self.groups)
                if grp.device_type == name
            )
            self.lp += used <= info.devices, f"devices_{name}"

    def add_bottleneck(self) -> None:
        for s in range(self.S):
            self.lp += self.T >= self.stage_time[s], f"bottleneck_{s}"
            terms = [(l, g) for l in range(self.L) for g in range(len(self.groups))]
            self.lp += self.D >= pulp.lpSum(self.entry(l, g).dp_sync_s * self.w[l, s, g] for l, g in terms), f"sync_{s}"
            self.lp += (
                self.O >= pulp.lpSum(self.entry(l, g).optimizer_s * self.w[l, s, g] for l, g in terms),
                f"optimizer_{s}",
            )

    def add_memory(self) -> None:
        for s in range(self.S):
            k = in_flight(self.schedule, self.M, self.S, s)
            used = pulp.lpSum(
                (self.entry(l, g).static_bytes + self.entry(l, g).activation_bytes * k) * self.w[l, s, g]
                for l in range(self.L)
                for g in range(len(self.groups))
            )
            capacity = pulp.lpSum(
                self.infos[grp.device_type].memory_bytes * self.u[s, g] for g, grp in enumerate(self.groups)
            )
            # scaled to GB so the row is well conditioned
            self.lp += (used + self.X[s]) * 1e-9 <= capacity * 1e-9, f"memory_{s}"
            for l in range(self.L):
                for g in range(len(self.groups)):
                    self.lp += self.X[s] >= self.entry(l, g).transient_bytes * self.w[l, s, g], f"transient_{l}_{s}_{g}"

    def build(self) -> StageModel:
        self.add_layer_once()
        self.add_contiguous()
        self.add_one_group()
        self.add_devices()
        self.add_bottleneck()
        self.add_memory()
        return self

    def read(self) -> tuple[list[list[int]], list[GroupConfig]]:
        """(layers per stage, group per stage) of the solution."""
        stages: list[list[int]] = [[] for _ in range(self.S)]
        for l in range(self.L):
            s = max(range(self.S), key=lambda s: self.a[l, s].varValue or 0.0)
            stages[s].append(l)
        chosen = [
            self.groups[max(range(len(self.groups)), key=lambda g: self.u[s, g].varValue or 0.0)] for s in range(self.S)
        ]
        return stages, chosen
