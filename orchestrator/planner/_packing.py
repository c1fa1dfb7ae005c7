"""A lower bound on the step time from packing layers into stages, without the ILP.

The ILP's own LP relaxation is weak where memory binds: there a stage's compute is
``Σ_g τ·y[g]`` over fractions of groups, and a fraction of a big, fast group holds a
fraction of its layers at full speed. The *perspective* rows below scale both the memory and
the compute a group may take by how much of it is used — exact for one group per stage, and
much tighter in the LP — but compute against a bottleneck T makes them bilinear (T·n), so T is
fixed and found by bisection.

For M microbatches, at most S stages and a bottleneck T (per microbatch), with positions
p = 0..S−1 counted from the end of the pipeline (k_p = min(M, p + 1) microbatches in flight
under 1F1B, M under GPipe), let n[g,p] ∈ [0,1] be the share of position p on group g and
x[r,g,p] ≥ 0 the layers of run r it holds. A plan whose slowest stage computes at most T per
microbatch exists only if this LP is feasible:

    Σ_{g,p} x[r,g,p] = n_r                                     every layer placed
    Σ_g n[g,p] ≤ 1                                             one group per position
    Σ_r τ[r,g]·x[r,g,p] ≤ T·n[g,p]                             compute within T
    Σ_r (σ[r,g] + α[r,g]·k_p)·x[r,g,p] ≤ (mem_g − ρ_g)·n[g,p]  memory (ρ_g: the least transient)
    x[r,g,p] ≤ min(f, ⌊T/τ[r,g]⌋)·n[g,p]                       whole layers of one run that fit
                f = ⌊(mem_g − ρ[r,g]) / (σ + α·k_p)⌋            beside its transient, and compute within T
    Σ_{p, g with a part of type t} size_t(g)·n[g,p] ≤ N_t       devices
    Σ_g n[g,0] = 1,  Σ_g x[R−1,g,0] ≥ 1                         a last stage, holding the last layer
    Σ_{r,g} x[r,g,p] ≥ Σ_g n[g,p]                              a stage holds at least one layer
    u_{p+1} / w_{p+1} ≤ u_p / w_p,  u_p = Σ_g n[g,p]            the stages used are the last S positions

(a mixed group has the memory row and f of each of its two parts, each on its own type).

(τ time, σ static, α activation and ρ transient memory of one layer per device, from the
same :class:`CostTable` the ILP reads.)

Every stage s of a plan gives step ≥ Σ_{s′<s} c_s′ + M·c_s (the closed form of
``_closed_form``: 1F1B's E_s ≥ U^f_s + M·c_s, and the pipeline drains U^b_s after it; GPipe's
two flow shops likewise). In positions, with c_p = Σ_{r,g} τ·x[r,g,p] the compute of a bucket
of w_p positions (its slowest stage computes at least c_p / w_p):

    Z ≥ Σ_{p′>p} c_p′ + M·c_p / w_p                             the fill ahead of each stage

The closed form gives more rows of the same kind. Its 1F1B rows B_s ≥ U^f_s + L_s −
b_s and E_s ≥ B_s + M·b_s + (M − K_s)·f_s (K_s ≤ M in flight) put the whole round trip before
the drain: step ≥ Σ_{s′≠s} c_s′ + M·c_s − (K_s − 1)·f_s (GPipe: without the last term). A
stage's sync starts after the backward of its last layer, and its first layer's sync (the last
bucket) after the stage's last backward: Y_s ≥ E_s − b_s + b_last + y_s and Y_s ≥ E_s + y_first, with y_s, o_s the
stage's gradient sync and optimizer (Σ over its layers). In positions, with d_p the most
microbatches in flight in bucket p less one (0 under GPipe), f_p, b_p, y_p, o_p the bucket's
forward, backward, sync and optimizer, and a bucket's own stages counted at least once each
(a forward) for one another:

    Z ≥ Σ_{p′} c_p′ + ((M−1)·c_p − d_p·f_p) / w_p                       the whole round trip
    Z ≥ Σ_{p′>p} f_p′ + (M·c_p − b_p + y_p + o_p) / w_p [+ b_last]     the tail after the drain
    Z ≥ Σ_{p′>p} f_p′ + Σ_{p′<p} c_p′ + ((w_p−1−d_p)·f_p + M·c_p − b_p + y_p + o_p) / w_p [+ b_last]
    Z ≥ Σ_{p′} c_p′ + (M−1)·b + y + o of layer 0                       the first stage's sync

(b_last: the last layer's backward on position 0's group, in position 0's rows; the last row
only where layer 0 is a run of its own). Under 1F1B, stage s's backward i + K_s waits for
backward i's microbatch to go round the loop L_s = Σ_{s′≥s} c_s′ + 2·Σ P (the transfers to the
end and back), so with M − 1 = q·K_s + r the closed form gives step ≥ U^f_s + U^b_s + (q+1)·L_s +
r·b_s. With π_g the least transfer a stage on group g sends (``_ilp.transfer_floors_s``: a
boundary spreads over the smaller side's devices, at most g's own), π·u_p standing for
Σ_g π_g·n[g,p] (what the stages at bucket p send at least), and q_p for the most in flight in the
bucket (K = its last position + 1; r·b_p only for one-position buckets):

    Z ≥ Σ_{p′>p} (c_p′ + 2π·u_p′) + (q_p+1)·(Σ_{p′<p} c_p′ + c_p/w_p + 2π·(Σ_{1≤p′<p} u_p′ + u_p/w_p)) + r_p·b_p

(u_p/w_p only where the bucket starts past position 0). It holds where bucket p is empty too: the
plan's first stage then has fewer in flight, so a q at least q_p, and a loop over every stage.
The other rows count the transfers on their paths the same way: the fill ahead of a stage
2π·Σ_{p′>p} u_p′ (there and back), the whole round trip 2π·Σ_{p′≥1} u_p′ (every stage but the
last sends), the tails π·Σ_{p′>p} u_p′ (the forwards only) and, downstream, 2π per boundary.
Each row averages over a bucket's stages the row that holds for every one of them, which is
valid as each stage's own terms are non-negative. The sync rows matter where a stage's sync
overlaps most of its backward (a one-stage plan of a small model); the in-flight cycle row,
wherever 1F1B's round trips bind (deep pipelines, and few microbatches).

Z(T), the least Z of the LP, bounds every plan whose stages each compute within T. A plan
whose slowest stage computes more than T takes more than M·T, so min(M·T, Z(T)) is a bound
for every T: Z falls and M·T rises with T, and a bisection finds their crossing. The LP has no
order, link or sync rows, so it relaxes every plan with at most S stages: its bound holds for
each of the ILP's pieces with S stages or fewer (more positions only loosen it).

The last three families stop the LP from spreading the pipeline over slivers of stages, each
holding a sliver of a layer, whose fill is a sliver too.

On the largest presets the bound is several times the capacity bound, and an M where nothing
fits is proven empty in a fraction of a second; ``tests/orchestrator/planner/test_packing.py``
checks that it never exceeds the exhaustive optimum of its M.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from orchestrator.planner._groups import GroupConfig
from orchestrator.planner._ilp import boundary_runs, in_flight, transfer_floors_s
from orchestrator.planner._space import SearchSpace
from orchestrator.planner._table import per_run
from orchestrator.solver import highs_lp, work

# the search stops when its bound is this close (relative) to the most the bound could be: a
# tenth of the 1% gap the planner aims for
TOLERANCE = 1e-3
# a probe starts from the last basis when its T is this close to the last one's (relative), else afresh
WARM_WITHIN = 0.05


class _BottleneckLP:
    """The LP above for one stage count, loaded into HiGHS once; :meth:`least_step_s` changes
    only the coefficients that depend on T (τ/T in the compute rows, which are divided by T, and
    the whole-layer caps) so each solve starts from the last basis."""

    def __init__(self, bound: PackingBound, stages: int):
        buckets = bound.buckets(stages)
        R, G, P = len(bound.runs), len(bound.groups), len(buckets)
        x = np.arange(R * G * P).reshape(R, G, P)  # column of x[r, g, p]
        n = R * G * P + np.arange(G * P).reshape(G, P)  # column of n[g, p]
        columns = R * G * P + G * P
        rows: list[tuple[np.ndarray, np.ndarray, float, float]] = []
        self.compute_cells: list[tuple[int, int, float]] = []  # (row, column, τ): coefficient τ/T
        # (row, column, f, τ): coefficient −min(f, ⌊T/τ⌋), the whole layers that fit and compute within T
        self.count_cells: list[tuple[int, int, int, float]] = []
        for g in range(G):
            for p, (_, k) in enumerate(buckets):
                self.compute_cells += [(len(rows), int(x[r, g, p]), float(bound.time[r, g])) for r in range(R)]
                rows.append((np.r_[x[:, g, p], n[g, p]], np.r_[np.ones(R), -1.0], -math.inf, 0.0))
                fits = [run.count for run in bound.runs]
                for q in range(bound.parts):
                    memory = bound.memory[q][g]
                    held = bound.static[q][:, g] + bound.activation[q][:, g] * k
                    least_transient = bound.transient[q][:, g].min()
                    # memory in units of the device's memory
                    rows.append(
                        (
                            np.r_[x[:, g, p], n[g, p]],
                            np.r_[held / memory, -(1 - least_transient / memory)],
                            -math.inf,
                            0.0,
                        )
                    )
                    for r in range(R):
                        free = memory - bound.transient[q][r, g]
                        if held[r] > 0:
                            fits[r] = min(fits[r], max(0, math.floor(free / held[r])))
                        elif free < 0:
                            fits[r] = 0
                for r in range(R):
                    self.count_cells.append((len(rows), int(n[g, p]), fits[r], float(bound.time[r, g])))
                    rows.append((np.array([x[r, g, p], n[g, p]]), np.array([1.0, -fits[r]]), -math.inf, 0.0))
        for p, (positions, _) in enumerate(buckets):
            rows.append((n[:, p], np.ones(G), -math.inf, float(positions)))
        # the step rows (module docstring), each Z ≥ Σ W[r,g,p]·x[r,g,p], the last stage's tails
        # also + its last layer's backward on position 0's group
        step = columns
        M, times, forward = bound.M, bound.time, bound.forward
        backward = times - forward
        after_sync = bound.sync + bound.optimizer

        def step_row(weights: np.ndarray, last_backward: bool = False, per_stage: np.ndarray | None = None) -> None:
            """Z ≥ Σ weights·x (+ Σ per_stage[g,p]·n[g,p])."""
            cols, vals = np.r_[step, x.ravel()], np.r_[1.0, -weights.ravel()]
            if per_stage is not None:
                cols, vals = np.r_[cols, n.ravel()], np.r_[vals, -per_stage.ravel()]
            if last_backward:
                cols, vals = np.r_[cols, n[:, 0]], np.r_[vals, -backward[R - 1]]
            keep = vals != 0
            rows.append((cols[keep], vals[keep], 0.0, math.inf))

        end = 0  # one past the bucket's last position
        pi = bound.transfer_s[:, None]  # [g, 1]: what a stage on g sends at least
        every_boundary = np.zeros((G, P))  # each stage but the last sends there and back
        every_boundary[:, 1:] = 2 * pi
        for p, (width, _) in enumerate(buckets):
            end += width
            # d: the most microbatches in flight in the bucket (1F1B), less one
            d = 0 if bound.schedule == "gpipe" else min(M, end) - 1
            # transfers: 2π for each stage upstream (there and back), π one way, 2π for each
            # boundary downstream (the bucket's own stages at 1/w each, where they send)
            both_ways_up, one_way_up, downstream = (np.zeros((G, P)) for _ in range(3))
            both_ways_up[:, p + 1 :], one_way_up[:, p + 1 :] = 2 * pi, pi
            downstream[:, 1:p] = 2 * pi
            if end - width >= 1:
                downstream[:, p] = 2 * pi[:, 0] / width
            weights = np.zeros((R, G, P))  # fill, upstream only
            weights[:, :, p + 1 :] = times[:, :, None]
            weights[:, :, p] = M * times / width
            step_row(weights, per_stage=both_ways_up)
            weights = np.repeat(times[:, :, None], P, axis=2)  # fill, the whole pipeline
            weights[:, :, p] += ((M - 1) * times - d * forward) / width
            step_row(weights, per_stage=every_boundary)
            weights = np.zeros((R, G, P))  # tail, upstream forwards only
            weights[:, :, p + 1 :] = forward[:, :, None]
            weights[:, :, p] = (M * times - backward + after_sync) / width
            step_row(weights, last_backward=p == 0, per_stage=one_way_up)
            weights[:, :, :p] = times[:, :, None]  # tail, the whole pipeline
            weights[:, :, p] = ((width - 1 - d) * forward + M * times - backward + after_sync) / width
            step_row(weights, last_backward=p == 0, per_stage=one_way_up + downstream)
            if bound.schedule != "gpipe":  # 1F1B's in-flight cycle, its loop with its transfers
                q = (M - 1) // end  # K = end, the most in flight in the bucket
                weights = np.zeros((R, G, P))
                weights[:, :, p + 1 :] = times[:, :, None]
                weights[:, :, :p] = (q + 1) * times[:, :, None]
                weights[:, :, p] = (q + 1) * times / width + (((M - 1) % end) * backward if width == 1 else 0.0)
                step_row(weights, per_stage=both_ways_up + (q + 1) * downstream)
        if bound.runs and bound.runs[0].count == 1:  # the first layer's stage, its sync after its drain
            weights = np.repeat(times[:, :, None], P, axis=2)
            weights[0] += ((M - 1) * backward[0] + after_sync[0])[:, None]
            step_row(weights, per_stage=every_boundary)
        columns += 1
        for t, info in bound.infos.items():
            mine = [g for g in range(G) if t in bound.groups[g].by_type]
            if mine:
                sizes = np.repeat([float(bound.groups[g].by_type[t]) for g in mine], P)
                rows.append((n[mine, :].ravel(), sizes, -math.inf, float(info.devices)))
        for r, run in enumerate(bound.runs):
            rows.append((x[r].ravel(), np.ones(G * P), float(run.count), float(run.count)))
        # every plan has a last stage (position 0, one group) holding the last layer, every stage
        # holds at least one layer, and the stages used are the last S positions
        rows.append((n[:, 0], np.ones(G), 1.0, 1.0))
        rows.append((x[R - 1, :, 0], np.ones(G), 1.0, math.inf))
        for p in range(P):
            rows.append((np.r_[x[:, :, p].ravel(), n[:, p]], np.r_[np.ones(R * G), -np.ones(G)], 0.0, math.inf))
        for p, ((width, _), (next_width, _)) in enumerate(itertools.pairwise(buckets)):
            rows.append(
                (np.r_[n[:, p + 1], n[:, p]], np.r_[np.full(G, 1 / next_width), np.full(G, -1 / width)], -math.inf, 0.0)
            )

        cost = np.zeros(columns)
        cost[step] = 1.0
        self.highs = highs_lp(cost, np.full(columns, math.inf), rows)
        self.last_s: float | None = None  # the T of the last solve, whose basis the next starts from

    def least_step_s(self, bottleneck_s: float, *, retry: bool = True) -> float:
        """The least Z with every stage computing within ``bottleneck_s``: +inf when infeasible,
        0 when HiGHS ends undecided (still a bound); without ``retry``, after one solve."""
        import highspy

        for row, column, time_s in self.compute_cells:
            self.highs.changeCoeff(row, column, time_s / bottleneck_s)
        for row, column, fits, time_s in self.count_cells:
            within = fits if time_s <= 0 else min(fits, math.floor(bottleneck_s / time_s * (1 + 1e-9)))
            self.highs.changeCoeff(row, column, -float(within))
        decided = (highspy.HighsModelStatus.kOptimal, highspy.HighsModelStatus.kInfeasible)
        fresh = self.last_s is None
        if not fresh and abs(bottleneck_s - self.last_s) > WARM_WITHIN * self.last_s:
            # far from the last T a warm start tends to end undecided, slowly, where a fresh start
            # decides at once
            self.highs.clearSolver()
            fresh = True
        self.last_s = bottleneck_s
        work.run(self.highs)
        status = self.highs.getModelStatus()
        # a warm start can end undecided (kUnknown after a large change of T), and so can a fresh
        # start with or without presolve, on different probes of the same model; an undecided
        # probe weakens the bound. Try each fresh start in turn, then the interior-point solver;
        # a fresh start with presolve is not tried twice (the same solve ends the same way)
        retries = (("presolve", "choose"), ("presolve", "off"), ("solver", "ipm"))
        for option, value in (retries[1:] if fresh else retries) if retry else ():
            if status in decided:
                break
            self.highs.clearSolver()
            self.highs.setOptionValue(option, value)
            work.run(self.highs)
            status = self.highs.getModelStatus()
        self.highs.setOptionValue("presolve", "choose")
        self.highs.setOptionValue("solver", "choose")
        if status == highspy.HighsModelStatus.kInfeasible:
            return math.inf
        return self.highs.getInfo().objective_function_value if status == highspy.HighsModelStatus.kOptimal else 0.0


class PackingBound:
    """The bound above for one microbatch count, any stage count up to ``max_stages``."""

    def __init__(
        self, space: SearchSpace, groups: list[GroupConfig], *, microbatches: int, max_stages: int, schedule: str
    ):
        """Over ``groups`` of ``space`` (its runs, cost table, and the links whose least transfer
        per group the rows price)."""
        runs, table, infos, links = space.runs, space.table, space.infos, space.links
        self.runs, self.groups, self.infos, self.M, self.J = runs, groups, infos, microbatches, max_stages
        self.schedule = schedule
        # [g]: the least transfer a stage on g sends (from any run it can end with, over any link)
        sends = transfer_floors_s(runs, groups, table, links, microbatches)[0] if links else None
        ends = boundary_runs(runs)
        self.transfer_s = sends[ends].min(axis=0) if sends is not None and ends else np.zeros(len(groups))
        self.time, self.forward, self.sync, self.optimizer = (
            per_run(table, runs, groups, microbatches, field)
            for field in ("time_s", "forward_s", "dp_sync_s", "optimizer_s")
        )
        # memory per part: [q][r, g], q over the most parts a group has (a group of one type repeats its one)
        parts = [[table.memory_parts(run.first, g, microbatches) for g in groups] for run in runs]
        self.parts = max((len(g.by_type) for g in groups), default=1)

        def per_part(q: int, field: str) -> np.ndarray:
            return np.array(
                [[getattr(row[min(q, len(row) - 1)][1], field) for row in cells] for cells in parts], dtype=float
            ).reshape(len(runs), len(groups))

        self.static = [per_part(q, "static_bytes") for q in range(self.parts)]
        self.activation = [per_part(q, "activation_bytes") for q in range(self.parts)]
        self.transient = [per_part(q, "transient_bytes") for q in range(self.parts)]
        self.memory = [
            np.array([row[min(q, len(row) - 1)][0] for row in parts[0]], dtype=float) if runs else np.zeros(0)
            for q in range(self.parts)
        ]
        self.in_flight = [in_flight(schedule, microbatches, max_stages, max_stages - 1 - p) for p in range(max_stages)]
        self._lps: dict[int, _BottleneckLP] = {}

    def buckets(self, stages: int) -> list[tuple[int, int]]:
        """(positions, least in-flight count) of each bucket of positions 0..stages−1: 0, 1, 2, 3, then
        two per doubling (4–5, 6–7, 8–11, 12–15, ...), each priced at its first position's
        in-flight count — a relaxation (memory only grows with in-flight microbatches) a third
        the size of one column set per position, whose bound on GPT-175B moved by under 1%."""
        edges, start = [], 0
        while start < stages:
            width = max(1, start // 2) if start >= 4 else 1
            end = min(stages, start + width)
            edges.append((end - start, self.in_flight[start]))
            start = end
        return edges

    def least_step_s(self, bottleneck_s: float, stages: int | None = None, *, retry: bool = True) -> float:
        """Z(T): a lower bound on the step time of every plan whose stages each compute within
        ``bottleneck_s`` per microbatch (+inf: there is none; 0: HiGHS ended undecided, after
        its retries unless ``retry`` is False)."""
        S = self.J if stages is None else stages
        if S not in self._lps:
            self._lps[S] = _BottleneckLP(self, S)
        return self._lps[S].least_step_s(bottleneck_s, retry=retry)

    def bound_s(
        self,
        stages: int | None = None,
        *,
        above_s: float = 0.0,
        below_s: float = math.inf,
        deadline: float | None = None,
        tolerance: float = TOLERANCE,
    ) -> float:
        """A lower bound on the step time of every plan with at most ``stages`` stages (s).

        A plan whose slowest stage computes c > T takes ≥ M·c > M·T; one with c ≤ T takes
        ≥ Z(T). So min(M·T, Z(T)) is a bound for every T, and Z falls as T grows while M·T
        rises: a search for their crossing (bisection alternating with regula falsi) stops
        when the best bound is within ``tolerance`` (relative) of the most it could be. It starts bracketed by
        ``above_s`` (a known bound) and ``below_s`` (an incumbent's step time): once the bound
        reaches the incumbent, no plan of this M beats it and the bound is +inf. At
        ``deadline`` (on ``work.now()``'s clock) the search stops with the best bound so far.
        With an infinite ``tolerance`` (a probe: one solve, at T = ``below_s`` / M) an undecided
        solve is not retried: the retries cost up to three solves more where the M's whole-stage
        LPs bound it anyway, and the probe then keeps ``above_s``."""
        if not self.groups:
            return math.inf
        M = self.M
        slowest = float(self.time.max() * sum(run.count for run in self.runs))
        if slowest <= 0:  # nothing takes time: no T to search
            return above_s
        hi = min(below_s / M, slowest)
        z_hi = self.least_step_s(hi, stages, retry=math.isfinite(tolerance))
        if z_hi == math.inf or (z_hi >= M * hi and hi < slowest):
            return math.inf  # nothing within T = hi, and anything slower loses to the incumbent
        if z_hi >= M * hi:  # hi = slowest bounds every stage: Z(hi) bounds every plan, and beats M·T below it
            return max(above_s, z_hi)
        # g(T) = Z(T) − M·T falls as T grows: g(lo) > 0 (Z(lo) = inf before the first probe),
        # g(hi) ≤ 0, and the best bound lies in [max(floor, Z(hi)), min(M·hi, Z(lo))], where
        # floor is M·lo once lo is probed (or the bound given)
        lo, z_lo, floor = max(above_s / M, hi * 1e-6), math.inf, above_s
        geometric = True
        while deadline is None or work.now() < deadline:
            if min(M * hi, z_lo) - max(floor, z_hi) <= tolerance * min(M * hi, z_lo):
                break
            if geometric or z_lo == math.inf:
                mid = math.sqrt(lo * hi) if hi > 4 * lo else (lo + hi) / 2
            else:  # regula falsi on g between the bracket's ends
                g_lo, g_hi = z_lo - M * lo, z_hi - M * hi
                mid = lo + g_lo * (hi - lo) / (g_lo - g_hi)
            geometric = not geometric  # alternate, so the bracket at least halves every other probe
            z = self.least_step_s(mid, stages)
            if z > M * mid:
                lo, z_lo, floor = mid, z, max(floor, M * mid)
            else:
                hi, z_hi = mid, z
        best = max(floor, z_hi)
        return math.inf if best >= below_s else best
