"""Exact schedules: a continuous-time disjunctive MILP, started from the best list schedule found.

Sets: tasks T, devices D, machines M = {(d, k) : k < slots(d)}; E the edges;
P = pairs of tasks neither of which reaches the other (only they can overlap).
U is the start's makespan; D_t ⊆ D, H[t,d] and Q[t,d] are the devices, heads
and tails left by propagating U (:func:`orchestrator.dag._bounds.propagate`):
they hold in every schedule of makespan ≤ U, so the model keeps every such
schedule, and an optimal one is among them.

Variables
    x[t,m] ∈ {0,1}   task t runs on machine m            (only for m on a device of D_t)
    o[i,j] ∈ {0,1}   for (i,j) ∈ P: i before j if they share a machine
    S_t ∈ [min_d H[t,d], max_d U − Q[t,d] − w[t,d]]   start of t;      C ≥ 0  makespan

With y[t,d] = Σ_{m ∈ d} x[t,m] and p_t = Σ_m x[t,m] · w[t,d(m)]:

    assign       Σ_m x[t,m] = 1                                                             ∀t
    precedence   S_b ≥ S_a + p_a + Σ_{d'≠d} y[b,d'] c(a→b, d, d') − max_{d'≠d} c(a→b, d, d') · (1 − y[a,d])   ∀(a,b) ∈ E, d
    order        S_j ≥ S_i + w[i,d] − F_ij · (1 − o_ij) − G_ij · (2 − x[i,m] − x[j,m])        ∀(i,j) ∈ P, m = (d, k)
                 S_i ≥ S_j + w[j,d] − F_ji · o_ij − G_ji · (2 − x[i,m] − x[j,m])
    head         S_t ≥ Σ_d y[t,d] · H[t,d]                                                  ∀t
    tail         C ≥ S_t + p_t + Σ_d y[t,d] · Q[t,d]                                        ∀t
    load         C ≥ Σ_t x[t,m] · w[t,d(m)]                                                 ∀m
    bound        C ≥ LB   (:func:`orchestrator.dag._bounds.lower_bound`)
    horizon      C ≤ U

    minimise C

Big-M values, each the least that keeps every schedule of makespan ≤ U:
* precedence: in the row of a's own device, S_b ≥ S_a + p_a + (a transfer ≥ 0);
  so in the row of any other device d the transfer term may be switched off by
  its own largest value, max_{d'} c(a→b, d, d').
* order: with both on d and j first, S_i + w[i,d] − S_j ≤ (U − Q[i,d]) − H[j,d] =: F_ij;
  elsewhere S_i + w[i,d] − S_j ≤ (latest S_i) + w[i,d] − (earliest S_j) =: G_ij.
  When the windows on d cannot overlap (U − Q[i,d] ≤ H[j,d] or the reverse) the
  head and tail rows already order the two tasks, and both rows are left out.

Most of what a time-limited solve certifies comes from the bound
(:mod:`orchestrator.dag._bounds`, refuting horizons) and the start
(:mod:`orchestrator.dag._local_search`), which both tighten the model: U fixes
the big-M constants and prunes devices, LB raises C from below. On large
instances the MILP itself mostly confirms them within the limit.
``orchestrator bench dag`` reports each instance's makespan, bound, gap and
solve time against HEFT and CPOP.

Why continuous-time and not the seed's time-indexed form: its size does not
grow with the horizon or a time step. Counted for three random 50-task DAGs
on 4 devices (CCR 1): 805–935 binaries here (200 assignments plus one order
variable per pair of unrelated tasks), against 50 × 4 × 200 = 40,000 for a
time-indexed model at a step of makespan/200.
"""

from __future__ import annotations

import itertools
import math
import time

import networkx as nx
import pulp

from orchestrator.dag._bounds import Windows, lower_bound, propagate
from orchestrator.dag._list_scheduling import heft
from orchestrator.dag._local_search import search
from orchestrator.dag._problem import ScheduleProblem
from orchestrator.dag._schedule import Placement, Schedule
from orchestrator.solver import solve


class _OutOfTime(Exception):
    """The model could not be built in the time left."""


class _Model:
    """The MILP above, one method per constraint family, every constraint named."""

    def __init__(self, problem: ScheduleProblem, windows: Windows, *, build_deadline: float = math.inf):
        self.build_deadline = build_deadline
        self.problem, self.upper = problem, windows.horizon
        self.head, self.tail, self.devices = windows.head, windows.tail, windows.allowed
        self.lp = pulp.LpProblem("dag_schedule", pulp.LpMinimize)
        self.machines = [(d, k) for d, n in enumerate(problem.slots) for k in range(n)]
        self.index = {t: i for i, t in enumerate(problem.tasks)}
        upper, head = self.upper, self.head
        self.x = {
            (t, m): self.lp.add_variable(f"x_{self.index[t]}_{m[0]}_{m[1]}", cat="Binary")
            for t in problem.tasks
            for m in self.machines
            if m[0] in self.devices[t]
        }
        self.earliest = {t: min(head[t][d] for d in self.devices[t]) for t in problem.tasks}
        self.latest = {t: max(self.latest_start(t, d) for d in self.devices[t]) for t in problem.tasks}
        self.start = {
            t: self.lp.add_variable(f"S_{self.index[t]}", lowBound=self.earliest[t], upBound=self.latest[t])
            for t in problem.tasks
        }
        self.makespan = self.lp.add_variable("C", lowBound=0, upBound=upper)
        closure = nx.transitive_closure_dag(problem.graph)
        self.pairs = [
            (i, j)
            for i, j in itertools.combinations(problem.tasks, 2)
            if not closure.has_edge(i, j) and not closure.has_edge(j, i) and set(self.devices[i]) & set(self.devices[j])
        ]
        self.order = {
            (i, j): self.lp.add_variable(f"o_{self.index[i]}_{self.index[j]}", cat="Binary") for i, j in self.pairs
        }
        self.lp += self.makespan, "makespan"
        self.x_of: dict[str, list] = {t: [] for t in problem.tasks}
        for (t, m), var in self.x.items():
            self.x_of[t].append((m, var))
        self._on_device: dict = {}
        self._duration: dict = {}

    def latest_start(self, t: str, d: int) -> float:
        """The latest t can start on d in a schedule of makespan ≤ U."""
        return self.upper - self.tail[t][d] - self.problem.exec_s[t][d]

    def on_device(self, t: str, d: int):
        """y[t,d]: 1 if t runs on device d (any of its slots)."""
        if (t, d) not in self._on_device:
            self._on_device[t, d] = pulp.lpSum(var for m, var in self.x_of[t] if m[0] == d)
        return self._on_device[t, d]

    def duration(self, t: str):
        """p_t: t's execution time on the machine it is given."""
        if t not in self._duration:
            self._duration[t] = pulp.lpSum(var * self.problem.exec_s[t][m[0]] for m, var in self.x_of[t])
        return self._duration[t]

    def add_assignment(self) -> None:
        for t in self.problem.tasks:
            self.lp += pulp.lpSum(var for _, var in self.x_of[t]) == 1, f"assign_{self.index[t]}"

    def add_precedence(self) -> None:
        prob = self.problem
        for a, b in prob.edges:
            for d in self.devices[a]:
                transfers = {d2: prob.transfer_s((a, b), d, d2) for d2 in self.devices[b] if d2 != d}
                arrival = pulp.lpSum(self.on_device(b, d2) * c for d2, c in transfers.items())
                # off d, the row for a's own device already gives S_b ≥ S_a + p_a + (a transfer ≥ 0)
                big_m = max(transfers.values(), default=0.0)
                self.lp += (
                    self.start[b] >= self.start[a] + self.duration(a) + arrival - big_m * (1 - self.on_device(a, d)),
                    f"precedence_{self.index[a]}_{self.index[b]}_{d}",
                )

    def add_order(self) -> None:
        prob, u = self.problem, self.upper
        for (i, j), before in self.order.items():
            if time.perf_counter() > self.build_deadline:
                raise _OutOfTime
            for m in self.machines:
                if (i, m) not in self.x or (j, m) not in self.x:
                    continue
                d = m[0]
                if u - self.tail[i][d] <= self.head[j][d] or u - self.tail[j][d] <= self.head[i][d]:
                    continue  # windows on d do not overlap: the head and tail rows already order them
                wi, wj = prob.exec_s[i][d], prob.exec_s[j][d]
                # S_i + w_i − S_j is at most (U − Q_i) − H_j with both on d, and at most
                # latest S_i + w_i − earliest S_j wherever they run
                flip_ij = max(0.0, u - self.tail[i][d] - self.head[j][d])
                flip_ji = max(0.0, u - self.tail[j][d] - self.head[i][d])
                off_ij = max(0.0, self.latest[i] + wi - self.earliest[j])
                off_ji = max(0.0, self.latest[j] + wj - self.earliest[i])
                tag = f"{self.index[i]}_{self.index[j]}_{d}_{m[1]}"
                xi, xj, si, sj = self.x[i, m], self.x[j, m], self.start[i], self.start[j]
                # the two rows above, expanded (built directly: PuLP's operators dominate the build time)
                a = pulp.LpAffineExpression([(sj, 1), (si, -1), (before, -flip_ij), (xi, -off_ij), (xj, -off_ij)])
                b = pulp.LpAffineExpression([(si, 1), (sj, -1), (before, flip_ji), (xi, -off_ji), (xj, -off_ji)])
                self.lp.addConstraint(
                    pulp.LpConstraint(a, pulp.LpConstraintGE, rhs=wi - flip_ij - 2 * off_ij), f"order_a_{tag}"
                )
                self.lp.addConstraint(pulp.LpConstraint(b, pulp.LpConstraintGE, rhs=wj - 2 * off_ji), f"order_b_{tag}")

    def add_makespan(self, bound: float) -> None:
        prob = self.problem
        for t in prob.tasks:
            k = self.index[t]
            head = pulp.lpSum(self.on_device(t, d) * self.head[t][d] for d in self.devices[t])
            tail = pulp.lpSum(self.on_device(t, d) * self.tail[t][d] for d in self.devices[t])
            self.lp += self.start[t] >= head, f"head_{k}"
            self.lp += self.makespan >= self.start[t] + self.duration(t) + tail, f"tail_{k}"
        self.lp += self.makespan >= bound, "lower_bound"

    def add_load(self) -> None:
        on_machine: dict = {m: [] for m in self.machines}
        for (t, m), var in self.x.items():
            on_machine[m].append(var * self.problem.exec_s[t][m[0]])
        for m, work in on_machine.items():
            self.lp += self.makespan >= pulp.lpSum(work), f"load_{m[0]}_{m[1]}"

    def start_from(self, schedule: Schedule) -> None:
        """Set every variable's value to ``schedule`` (HiGHS's starting solution)."""
        for (t, m), var in self.x.items():
            p = schedule.placements[t]
            var.varValue = 1.0 if (p.device, p.slot) == m else 0.0
        for t, var in self.start.items():
            var.varValue = schedule.placements[t].start_s
        for (i, j), var in self.order.items():
            var.varValue = 1.0 if schedule.placements[i].start_s <= schedule.placements[j].start_s else 0.0
        self.makespan.varValue = schedule.makespan

    def read(self) -> dict[str, Placement]:
        placements = {}
        for t in self.problem.tasks:
            (d, k) = max((m for m in self.machines if (t, m) in self.x), key=lambda m: self.x[t, m].varValue or 0.0)
            start = max(0.0, self.start[t].varValue or 0.0)
            placements[t] = Placement(device=d, slot=k, start_s=start, finish_s=start + self.problem.exec_s[t][d])
        return placements


def _tighten(problem: ScheduleProblem, placements: dict[str, Placement]) -> dict[str, Placement]:
    """Recompute the earliest starts for the solver's assignment and per-slot order.

    Removes the solver's floating-point slack so the schedule validates exactly.
    """
    from orchestrator.dag._schedule import earliest_start

    order = sorted(problem.tasks, key=lambda t: (placements[t].start_s, problem.tasks.index(t)))
    rank = {t: i for i, t in enumerate(order)}
    for a, b in problem.edges:  # keep precedence even if starts tie
        if rank[a] > rank[b]:
            order = list(nx.lexicographical_topological_sort(problem.graph, key=lambda t: rank[t]))
            break
    free: dict[tuple[int, int], float] = {}
    out: dict[str, Placement] = {}
    for t in order:
        p = placements[t]
        start = max(earliest_start(problem, out, t, p.device), free.get((p.device, p.slot), 0.0))
        out[t] = Placement(device=p.device, slot=p.slot, start_s=start, finish_s=start + problem.exec_s[t][p.device])
        free[(p.device, p.slot)] = out[t].finish_s
    return out


def _fits(schedule: Schedule, windows: Windows) -> bool:
    """``schedule`` is a solution of the model built on ``windows`` (it always is, up to rounding)."""
    if windows.refuted:
        return False
    for t, p in schedule.placements.items():
        if p.device not in windows.allowed[t] or p.start_s < windows.head[t][p.device] - 1e-9 * windows.horizon:
            return False
    return True


def milp(
    problem: ScheduleProblem,
    *,
    time_limit_s: float = 10.0,
    gap: float = 1e-4,
    search_share: float = 0.35,
    bound_share: float = 0.15,
    msg: bool = False,
) -> Schedule:
    """The optimal schedule (or the best found within ``time_limit_s``), with its certified gap.

    1. Start: the best list schedule found from HEFT's priorities by
       :func:`~orchestrator.dag._local_search.search` in ``search_share`` of the time
       (HEFT's own schedule is its first candidate, so the result is never worse than HEFT).
    2. Bound: path and load bounds with communication, raised by refuting
       horizons (:func:`~orchestrator.dag._bounds.lower_bound`) in ``bound_share`` of the time.
    3. The MILP over the devices and windows left at the start's makespan U,
       from the start, for the rest of the time; skipped when the bound already
       meets the start within ``gap``.

    The certified bound is the larger of the solver's dual bound and step 2's
    (each proven on its own); gap = (makespan − bound) / makespan.
    """
    start = time.perf_counter()
    deadline = start + 0.96 * time_limit_s  # 4% in reserve
    first = heft(problem)
    incumbent = first
    if search_share > 0:
        found = search(problem, time_limit_s=search_share * time_limit_s)
        incumbent = found if found.makespan < first.makespan else first
    bound_s = min(bound_share * time_limit_s, deadline - time.perf_counter())
    bound = lower_bound(problem, upper=incumbent.makespan, time_limit_s=bound_s)
    placements, status = incumbent.placements, "Optimal (bound met)"
    if bound < incumbent.makespan * (1 - gap):
        horizon = incumbent.makespan * (1 + 1e-9) + 1e-12
        windows = propagate(problem, horizon)
        if not _fits(incumbent, windows):  # rounding in the bounds: fall back to windows without pruning
            windows = propagate(problem, math.inf)
            windows = Windows(
                horizon=horizon, allowed=windows.allowed, head=windows.head, tail=windows.tail, refuted=False
            )
        # handing a large model to HiGHS and reading its solution back take time HiGHS's own limit
        # does not count, and HiGHS can overrun that limit: the build leaves 10% of the time, and
        # HiGHS stops 3% + 20 µs per row before the deadline
        model = _Model(problem, windows, build_deadline=deadline - 0.1 * time_limit_s)
        try:
            model.add_assignment()
            model.add_precedence()
            model.add_order()
            model.add_makespan(bound)
            model.add_load()
        except _OutOfTime:
            model = None
            status = "Time limit reached (before the solver)"
        if model is not None:
            model.start_from(incumbent)
            solver_deadline = deadline - 0.03 * time_limit_s - 2e-5 * model.lp.numConstraints()
            result = solve(
                model.lp,
                time_limit_s=max(0.05, solver_deadline - time.perf_counter()),
                gap=gap,
                use_start=True,
                msg=msg,
                deadline_s=solver_deadline,
                bulk_load=True,
            )
            status = result.status
            if result.has_solution:
                candidate = _tighten(problem, model.read())
                if max(p.finish_s for p in candidate.values()) < incumbent.makespan:
                    placements = candidate
            if math.isfinite(result.bound):
                bound = max(bound, result.bound)
    makespan = max(p.finish_s for p in placements.values())
    bound = min(bound, makespan)
    return Schedule(
        problem=problem,
        placements=placements,
        method="milp",
        bound=bound,
        gap=0.0 if makespan <= 0 else (makespan - bound) / makespan,
        solve_s=time.perf_counter() - start,
        status=status,
    )
