"""A lower bound on the step time of the plans with exactly S stages, from whole stages as columns.

The ILP (``_ilp``) and the packing bound (``_packing``) price a stage by summing its layers'
costs over fractions of groups, and their LP relaxations let one stage take a fraction of a big,
fast group. Here every column is a whole stage: a group g and the layers it holds, priced
exactly — its time, memory (whole layers, the in-flight activations of its position) and
devices. The LP then only mixes whole stages, which is far tighter than the packing bound: it
closes in hundredths of a second most of the pieces the ILP takes seconds each to close, and the
MIP (:meth:`StageColumns.integer_bound_s`) most of the others.

A stage's layers are a contiguous slice of the chain of runs (``_ilp.Run``: identical layers in
a row), so it is known by what it takes of each run — a *shape*: k layers inside one run, or
the last k₁ layers of run r₁, every run between, and the first k₂ of run r₂. Positions
p = 0..S−1 count from the end of the pipeline (k_p = min(M, p + 1) microbatches in flight under
1F1B, M under GPipe). For shape v on group g, per microbatch: c[v,g] time (forward, backward,
recompute, TP all-reduces), f[v,g] its forward part, b = c − f, e[v,g] gradient sync and optimizer
step. Column x[p,v,g] ∈ [0,1] exists where v fits g's memory at position p (every part q of a
mixed group: Σ σ + k_p·Σ α + max ρ ≤ mem_q, over the layers of v) and its own bound o[p,v,g] is
below the cutoff: the least step of any plan with that stage at p, read off the rows below for that
stage alone (at least M·c[v,g]; its sync and optimizer after its M microbatches, its links' 2M
transfers, the least compute of the layers before and after it on their fastest groups;
:meth:`StageColumns.own_ms`), so a stage whose own bound reaches the cutoff makes the step slower
than the incumbent. The first stage's shapes start at layer 0, the last stage's end at the last layer:

    Σ_{v,g} x[p,v,g] = 1                             one stage at each position
    Σ_{p,v,g} n_r(v)·x[p,v,g] = n_r                  every layer of run r placed once
    Σ_{p,v,g} size_t(g)·x[p,v,g] ≤ N_t               devices of each type
    C_p = Σ c·x[p,·],  F_p = Σ f·x[p,·],  E_p = Σ e·x[p,·]   (B_p = C_p − F_p)

and Z ≥ each row below, the rows of the packing bound (``_packing``) with one position per
bucket, so each a lower bound of the closed form (``_closed_form``) of every plan of S stages.
Q_p ≥ 0 is the transfer from position p to p − 1 (p ≥ 1): at least what p's column sends and what
p − 1's receives, Q_p ≥ Σ π^out·x[p,·] and Q_p ≥ Σ π^in·x[p−1,·], with π^out[v,g] the least
transfer of v's last layer's output out of a stage on g and π^in[v,g] that of the layer before v's
first into one (``_ilp.transfer_floors_s``: a boundary spreads over the smaller side's devices, at
most either side's own count, so a narrow group pays its own price whatever its neighbour);
d_p = k_p − 1 under 1F1B (0 under GPipe), Q↑ = Σ_{p′>p} Q_p′ and Q↓ = Σ_{1≤p′≤p} Q_p′:

    W ≥ Σ_{p′>p} C_p′ + M·C_p + 2·Q↑                                         fill ahead of p
    W ≥ Σ_{p′} C_p′ + (M−1)·C_p − d_p·F_p + 2·ΣQ                             the whole round trip
    W ≥ Σ_{p′>p} C_p′ + cycle_p + 2·Q↑                                        1F1B's in-flight cycle
    W ≥ Σ_{p′>p} C_p′ + C_p + 2·Q↑ + 2M·Q_p                                  p's link (1F1B, p ≥ 1)
    W ≥ Σ_{p′} C_p′ + 2·ΣQ + 2(M−1)·Q_p                                      p's link (GPipe, p ≥ 1)
    Z ≥ W,   Z ≥ W − B_{S−1} + E_{S−1} [+ b_last if S = 1]                   the drain, then the
                                                                               first stage's sync
    Z ≥ Σ_{p′>p} F_p′ + M·C_p − B_p + E_p + Q↑ [+ b_last]                      tail after the drain
    Z ≥ Σ_{p′>p} F_p′ + Σ_{p′<p} C_p′ + M·C_p − B_p + E_p − d_p·F_p + Q↑ + 2·Q↓ [+ b_last]
    Z ≥ Σ_{p′>p} F_p′ + cycle_p − B_p + E_p + Q↑ [+ b_last]                    p's sync after its cycle
    Z ≥ Σ_{p′} C_p′ + (M−1)·b₀ + e₀ + 2·ΣQ                                    the first layer's sync
                                                                               (its own run only)

with 1F1B's in-flight cycle of p, M − 1 = q·(p+1) + r: cycle_p = (q+1)·(Σ_{p′≤p} C_p′ + 2·Q↓) + r·C_p
for q ≥ 1 and r·B_p for q = 0 (``_closed_form``: E_s ≥ B_s + q·L_s + r·(c_s or b_s) + b_s, with
B_s ≥ U^f_s + L_s − b_s). W bounds the drain, max_s (E_s + U^b_s); the first stage's last backward
ends at W, and a stage's sync flow shop ends at least Σ y after its last backward less b_s, so
Y_s + o_s ≥ E_s − b_s + e_s: for the first stage at W, for any stage at its cycle. (b_last: the last
layer's backward on position 0's group; b₀, e₀: the first layer's backward, sync and optimizer on
position S−1's group.) Every plan of S stages whose stages are each at
most the cutoff / M gives a point of this LP with Z its step time, so the least Z bounds it; a
plan with a slower stage is above the cutoff. The bound is therefore min(LP, cutoff) — and the
cutoff itself, closing the piece, when the LP is infeasible or reaches it. Three things make it
tighter or faster, each its own method: a bisection on the bottleneck T (columns whose own bound
exceeds M·T closed, those slower than T among them: a plan holding one takes more than M·T, so
min(M·T, Z(T)) bounds every plan, :meth:`StageColumns.bound_s`), the same model with whole
columns as a MIP (:meth:`StageColumns.integer_bound_s`, whose solution, laid end to end, is a plan
to price), and dropping the columns another column of the same shape beats on every row while
taking no more devices (:meth:`StageColumns._dominance`).

The MIP first solves its LP and drops every column whose reduced cost lifts the LP above the cutoff
(:meth:`_PositionsLP.drop_by_reduced_cost`), then runs without HiGHS's sub-MIP heuristics, and
with presolve only above ``PRESOLVE_ABOVE_STAGES`` stages (``MIP_OPTIONS``). Given a pricing
function, it stops at each plan it finds (HiGHS's ``mip_max_improving_sols`` 1), prices it, which
may lower the cutoff, and excludes it with every order of its inner stages that it holds
(:meth:`StageColumns._reorders`, each priced too:
the rows see a stage's neighbours only through its transfer floors, so those orders are what it
would find next), until none is left below the cutoff: its rows only bound the closed form, so a
plan it finds below the cutoff may be priced above it. Its bound is HiGHS's dual bound, never the
objective of a plan it stopped at. A plan excluded stands for the plans of the
columns it dominates, so that MIP drops only the columns dominated in price, not merely in its
rows (:meth:`StageColumns._price_dominance`). Reduced-cost fixing and the options below make each
MIP of the largest presets' open pieces a fraction of a second.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

import numpy as np

from orchestrator.planner._groups import GroupConfig
from orchestrator.planner._ilp import MS, Run, in_flight, transfer_floors_s
from orchestrator.planner._space import SearchSpace
from orchestrator.planner._table import CostTable, per_run
from orchestrator.solver import highs_lp, work

# the bisection on the bottleneck stops when its bracket is this close (relative), or after PROBES solves
TOLERANCE = 1e-3
PROBES = 12
# the most reorders of a MIP's plan priced and excluded with it (``StageColumns._reorders``): the 6! orders
# of the inner stages of 8
REORDERS = 720
# HiGHS options of the MIPs. No presolve up to PRESOLVE_ABOVE_STAGES stages: with it the MIPs stop at
# other plans first, and GPT-175B × mixed-4type-512 (S ≤ 16) ends at 9.8% in 10 s (1.0% without).
# Presolve above: the MIPs of deep pipelines only prove at their root node that no plan is below the
# cutoff, and presolve drops about 70% of their columns before HiGHS's root cut separation walks
# them (GPT-1T × 3072 A100, S = 39: 1.2 s against 14 s). No RENS, RINS, root reduced-cost, ZI-round
# or shifting heuristics: after reduced-cost fixing the MIPs only prove that no plan is below the
# cutoff, and the sub-MIPs of RENS and the root reduced-cost heuristic would take most of their time.
PRESOLVE_ABOVE_STAGES = 16
MIP_OPTIONS = {
    "presolve": "off",
    "mip_heuristic_run_rens": False,
    "mip_heuristic_run_rins": False,
    "mip_heuristic_run_root_reduced_cost": False,
    "mip_heuristic_run_zi_round": False,
    "mip_heuristic_run_shifting": False,
}


def stage_shapes(runs: Sequence[Run]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every contiguous slice of the chain of ``runs`` by what it takes of each run:
    (counts[v, r], starts[v], ends[v]) — whether slice v can start at the first layer, and end at
    the last."""
    R = len(runs)
    counts, starts, ends = [], [], []
    for r1 in range(R):
        for k1 in range(1, runs[r1].count + 1):  # k1 layers inside run r1
            row = np.zeros(R, dtype=np.int64)
            row[r1] = k1
            counts.append(row)
            starts.append(r1 == 0)
            ends.append(r1 == R - 1)
        for r2 in range(r1 + 1, R):  # the last k1 of r1, every run between, the first k2 of r2
            for k1 in range(1, runs[r1].count + 1):
                for k2 in range(1, runs[r2].count + 1):
                    row = np.array([run.count for run in runs], dtype=np.int64)
                    row[:r1] = 0
                    row[r2 + 1 :] = 0
                    row[r1], row[r2] = k1, k2
                    counts.append(row)
                    starts.append(r1 == 0 and k1 == runs[0].count)
                    ends.append(r2 == R - 1 and k2 == runs[-1].count)
    return np.array(counts, dtype=np.int64).reshape(-1, R), np.array(starts), np.array(ends)


class StageColumns:
    """The LP above for one microbatch count, any stage count: shapes × groups priced once."""

    def __init__(self, space: SearchSpace, groups: list[GroupConfig], *, microbatches: int, schedule: str):
        """Over ``groups`` of ``space`` (its runs, cost table, and the links whose transfers the
        rows price)."""
        runs, table, infos, links = space.runs, space.table, space.infos, space.links
        self.runs, self.groups, self.infos, self.M, self.schedule = runs, groups, infos, microbatches, schedule
        self.counts, self.starts, self.ends = stage_shapes(runs)
        work.charge(work.CELL_S * len(runs) * len(groups))  # (its cost table, read below)
        self.send, self.receive = self._transfer_floors(table, links)  # [v, g], ms

        def of_runs(field: str) -> np.ndarray:  # [r, g], in ms
            return MS * per_run(table, runs, groups, microbatches, field)

        time, forward = of_runs("time_s"), of_runs("forward_s")
        sync, optimizer = of_runs("dp_sync_s"), of_runs("optimizer_s")
        after = sync + optimizer
        self._layer_inputs = [forward, time - forward, sync, optimizer]  # [r, g]: what the closed form reads
        n = self.counts.astype(float)
        self.time, self.forward, self.after = n @ time, n @ forward, n @ after  # [v, g]
        self.last_backward = time[-1] - forward[-1] if runs else np.zeros(len(groups))  # [g]
        # [v]: the least compute (and forward) of one microbatch through the layers before shape v and
        # after it, each layer on its fastest group: what the stages upstream and downstream take at least
        before, after_it = self._outside()
        least, least_forward = time.min(axis=1, initial=np.inf), forward.min(axis=1, initial=np.inf)
        if not groups:
            least, least_forward = np.zeros(len(runs)), np.zeros(len(runs))
        self.before, self.before_forward, self.after_it = before @ least, before @ least_forward, after_it @ least
        # the first layer's sync after its stage's drain (a row only when it is a run of its own)
        self.first_tail = (
            (microbatches - 1) * (time[0] - forward[0]) + after[0] if runs and runs[0].count == 1 else None
        )
        self.most_in_flight = self._most_in_flight(table)  # [v, g]
        self.sizes = {
            t: np.array([float(g.by_type.get(t, 0)) for g in groups])
            for t in infos
            if any(t in g.by_type for g in groups)
        }
        self.beaten_by = self._dominance()
        self._priced_beaten_by = None  # (``_price_dominance``, built when first needed)
        # answers by (mask, kind): one per in-flight count, as the cutoff is fixed for a search (read from threads)
        self._undominated: dict[tuple[bytes, bool], np.ndarray] = {}

    def own_ms(self, position: int, stages: int) -> np.ndarray:
        """[v, g] (ms): the least step of any plan of ``stages`` stages with shape v on group g at
        ``position`` (from the end), from the rows of the module docstring read off that stage alone:
        the other stages enter only through the layers before and after it (``before``, ``after_it``:
        each at its fastest group's time), every other term being non-negative. With K its in-flight
        count and d = K − 1 (0 under GPipe), U the upstream and D the downstream least compute:

            U + M·c                          fill ahead of it (E_s ≥ U^f_s + M·c_s, then U^b_s)
            U^f + (M−1)·c + f + e [+ b_last]   its sync and optimizer after its last backward
            U + D + M·c − d·f                the whole round trip
            U^f + c + 2M·π^out               its outgoing link (position ≥ 1; GPipe: 2M·π^out)
            2M·π^in                          its incoming link (all but the first stage)
            c + D + (M−1)·b₀ + e₀            the first layer's sync (the first stage, layer 0 a run of its own)

        A plan with that column there takes at least this long, so a column whose own bound reaches
        the cutoff is never made, and one above M·T is closed with the columns slower than T."""
        M = self.M
        K = in_flight(self.schedule, M, stages, stages - 1 - position)
        d = 0 if self.schedule == "gpipe" else K - 1
        U, Uf, D = self.before[:, None], self.before_forward[:, None], self.after_it[:, None]
        tail = Uf + (M - 1) * self.time + self.forward + self.after
        if position == 0:
            tail = tail + self.last_backward[None, :]
        own = np.maximum.reduce([U + M * self.time, tail, U + D + M * self.time - d * self.forward])
        if position >= 1:  # it sends to the stage after it
            own = np.maximum(own, (Uf + self.time if self.schedule != "gpipe" else 0.0) + 2 * M * self.send)
        if position < stages - 1:  # it receives from the stage before it
            own = np.maximum(own, 2 * M * self.receive)
        if position == stages - 1 and self.first_tail is not None:
            own = np.maximum(own, self.time + D + self.first_tail[None, :])
        return own

    def _outside(self) -> tuple[np.ndarray, np.ndarray]:
        """([v, r], [v, r]): how many layers of each run lie before shape v, and after it, at least (a
        shape inside one run may start anywhere in it: only the runs before and after count)."""
        held = self.counts > 0
        R = len(self.runs)
        n = np.array([run.count for run in self.runs], dtype=float)
        before, after = np.zeros(self.counts.shape), np.zeros(self.counts.shape)
        if not R:
            return before, after
        first = np.argmax(held, axis=1)
        last = R - 1 - np.argmax(held[:, ::-1], axis=1)
        spans = held.sum(axis=1) > 1
        for v in range(len(self.counts)):
            before[v, : first[v]] = n[: first[v]]
            after[v, last[v] + 1 :] = n[last[v] + 1 :]
            if spans[v]:  # the tail of its first run and the head of its last
                before[v, first[v]] = n[first[v]] - self.counts[v, first[v]]
                after[v, last[v]] = n[last[v]] - self.counts[v, last[v]]
        return before, after

    def _transfer_floors(self, table: CostTable, links) -> tuple[np.ndarray, np.ndarray]:
        """[v, g] (ms): the least transfer shape v on group g sends to the next stage (its last
        layer's output) and receives from the one before (the output of the layer before its first:
        in its first run where it starts inside that run, else the run before; a shape inside one run
        may do either), from ``_ilp.transfer_floors_s``. 0 where there is nothing to send or receive."""
        V, G = len(self.counts), len(self.groups)
        if not links or not self.runs:
            return np.zeros((V, G)), np.zeros((V, G))
        send, receive = (MS * a for a in transfer_floors_s(self.runs, self.groups, table, links, self.M))
        held = self.counts > 0
        R = len(self.runs)
        last = R - 1 - np.argmax(held[:, ::-1], axis=1)
        first = np.argmax(held, axis=1)
        into = np.zeros((V, G))
        for v in range(V):
            r1 = int(first[v])
            whole = self.counts[v, r1] == self.runs[r1].count  # it starts where run r1 starts
            inside = held[v].sum() == 1
            before = ([r1 - 1] if r1 > 0 else []) if whole else [r1] + ([r1 - 1] if inside and r1 > 0 else [])
            if before:
                into[v] = receive[before].min(axis=0)
        return send[last], into

    def _dominance(self):
        """(g, g′, beaten[v, pair]) over the pairs of groups where g′ takes no more devices of any type
        than g: on shape v, g′ is as good as g in every row (forward, backward, sync and optimizer,
        the last layer's backward, the first layer's tail) and better in one, or equal with g′ < g.
        Every step row grows with each of these (the −d·F and −r·F terms come with at least as much
        C = F + B), so a plan with g at some position is no better than the same plan with g′ there,
        wherever g′ fits: g's column can go."""
        G = len(self.groups)
        extra = [self.last_backward] + ([self.first_tail] if self.first_tail is not None else [])
        fewer = np.ones((G, G), dtype=bool)  # [g, g′]
        for a in [*self.sizes.values(), *extra]:
            fewer &= a[None, :] <= a[:, None] + 1e-12 * np.abs(a[:, None])
        np.fill_diagonal(fewer, False)
        g, g2 = np.nonzero(fewer)
        backward = self.time - self.forward
        no_worse = np.ones((len(self.counts), len(g)), dtype=bool)
        better = np.zeros_like(no_worse)
        for a in [self.forward, backward, self.after, self.send, self.receive]:
            no_worse &= a[:, g2] <= a[:, g] + 1e-12 * np.abs(a[:, g])
            better |= a[:, g2] < a[:, g] - 1e-12 * np.abs(a[:, g])
        for a in [*self.sizes.values(), *extra]:
            better |= (a[g2] < a[g] - 1e-12 * np.abs(a[g]))[None, :]
        beaten = no_worse & (better | (g2 < g)[None, :])
        return g2, beaten, _onto(g, G)

    def _price_dominance(self):
        """As :meth:`_dominance`, for a stronger claim: every plan with g at some position is priced
        by the closed form (``_closed_form``) no lower than the same plan with g′ there, wherever g′
        fits. So g′ is of g's device type and takes as many devices of each type (the same links to
        and from its neighbours, over as many devices, so the same transfers), and on every run
        of shape v each layer's forward, backward, gradient sync and optimizer step is no slower:
        the closed form is a max of sums that each grow with every one of these (E_s − b_s too, as
        every row of E_s holds b_s at least once)."""
        G = len(self.groups)
        fewer = np.array([[a.device_type == b.device_type and a.by_type.keys() == b.by_type.keys() for b in self.groups]
                          for a in self.groups])  # fmt: skip
        for a in self.sizes.values():
            fewer &= a[None, :] == a[:, None]
        np.fill_diagonal(fewer, False)
        g, g2 = np.nonzero(fewer)
        slower = np.zeros((len(self.runs), len(g)), dtype=bool)  # [r, pair]: some input of run r slower on g′
        better = np.zeros_like(slower)
        for a in self._layer_inputs:
            slower |= a[:, g2] > a[:, g] + 1e-12 * np.abs(a[:, g])
            better |= a[:, g2] < a[:, g] - 1e-12 * np.abs(a[:, g])
        held = (self.counts > 0).astype(np.float64)  # [v, r]
        no_worse = held @ slower.astype(np.float64) == 0
        beaten = no_worse & ((held @ better.astype(np.float64) > 0) | (g2 < g)[None, :])
        return g2, beaten, _onto(g, G)

    def undominated(self, allowed: np.ndarray, *, priced: bool = False) -> np.ndarray:
        """``allowed`` [v, g] less the columns another allowed column of the same shape beats (on
        the LP's rows, or with ``priced`` in the closed form's price, :meth:`_price_dominance`)."""
        key = (allowed.tobytes(), priced)
        kept = self._undominated.get(key)
        if kept is None:  # (threads may compute the same mask twice; each stores the same answer)
            if priced and self._priced_beaten_by is None:
                self._priced_beaten_by = self._price_dominance()
            g2, beaten, onto = self._priced_beaten_by if priced else self.beaten_by
            hit = (beaten & allowed[:, g2]).astype(np.float64)
            kept = self._undominated[key] = allowed & ~np.asarray((onto.T @ hit.T).T > 0)
        return kept.copy()

    def _most_in_flight(self, table: CostTable) -> np.ndarray:
        """[v, g]: the most microbatches in flight with which shape v fits group g (−1: none)."""
        V, G = len(self.counts), len(self.groups)
        most = np.full((V, G), np.inf)
        holds = self.counts > 0  # [v, r]
        for g, group in enumerate(self.groups):
            per_run = [table.memory_parts(run.first, group, self.M) for run in self.runs]
            for q, (memory, _) in enumerate(per_run[0]):
                static = np.array([parts[q][1].static_bytes for parts in per_run])
                activation = np.array([parts[q][1].activation_bytes for parts in per_run])
                transient = np.array([parts[q][1].transient_bytes for parts in per_run])
                free = memory - self.counts @ static - np.where(holds, transient, -np.inf).max(axis=1)
                kept = self.counts @ activation
                with np.errstate(divide="ignore", invalid="ignore"):
                    k = np.where(
                        kept > 0, np.floor(free / np.where(kept > 0, kept, 1.0)), np.where(free >= 0, np.inf, -1)
                    )
                most[:, g] = np.minimum(most[:, g], np.where(free >= 0, k, -1))
        return most

    def bound_s(self, stages: int, *, cutoff_s: float = math.inf, probes: int = PROBES) -> float:
        """A lower bound (s) on the step of every plan of exactly ``stages`` stages, at most the
        cutoff (+inf when no plan of that many stages fits, which only shows without a cutoff).

        A plan holding a column whose own bound (:meth:`own_ms`, at least M times its time) exceeds
        M·T takes more than M·T, and any other plan takes at least Z(T), the LP with those columns
        closed. So min(M·T, Z(T)) bounds every plan, for every T; Z falls as T grows, and a
        bisection of at most ``probes`` solves looks for the crossing."""
        bound, refine = self.first_bound_s(stages, cutoff_s=cutoff_s)
        return bound if refine is None else refine(probes)

    def first_bound_s(self, stages: int, *, cutoff_s: float = math.inf) -> tuple[float, Callable[[int], float] | None]:
        """:meth:`bound_s` in two steps: the bound of its first solve, Z(T) at the largest T below the
        cutoff (M·T = the cutoff), which is all a piece that cannot beat the incumbent needs; and,
        where that leaves the piece open, ``refine(probes)``, the bisection that tightens it (the LP
        kept loaded), else None. A search that gives every piece its first solve before any
        bisection bounds every piece before it tightens any."""
        M, cutoff_ms = self.M, cutoff_s * MS
        lp = _PositionsLP(self, stages, cutoff_ms=cutoff_ms)
        top = cutoff_ms / M if math.isfinite(cutoff_ms) else float(lp.stage_ms.max(initial=0.0))
        z_top = lp.least_step_ms(top, stop_ms=cutoff_ms)
        if z_top >= cutoff_ms:
            return (cutoff_s if math.isfinite(cutoff_ms) else math.inf), None

        def refine(probes: int = PROBES) -> float:
            best, hi = z_top, top  # (every plan has its stages within hi, or is above the cutoff)
            lo = best / M  # below it, M·T ≤ best: nothing to gain
            for _ in range(probes):
                if hi - lo <= TOLERANCE * hi:
                    break
                mid = (lo + hi) / 2
                z = lp.least_step_ms(mid)
                if z >= M * mid:  # the crossing lies above mid: min(M·T, Z(T)) ≥ M·mid there
                    best, lo = max(best, M * mid), mid
                else:
                    best, hi = max(best, z), mid
            return min(best, cutoff_ms) / MS

        return min(z_top, cutoff_ms) / MS, refine

    def integer_bound_s(
        self,
        stages: int,
        *,
        cutoff_s: float,
        time_limit_s: float,
        price: Callable[[list[list[int]], list[GroupConfig]], tuple[float, float]] | None = None,
    ) -> tuple[float, list | None, bool]:
        """The same bound with whole columns only (each position one shape on one group): a MIP, far
        tighter where the LP mixes stages (it proves pieces the LP leaves a few percent below the
        cutoff closed). Returns (the bound, at most the cutoff; the best solution's
        stages in pipeline order as (layers, group), or None when it has none or its shapes do not
        chain — see :meth:`chain`; whether the MIP was decided, not stopped), within ``time_limit_s``.

        With ``price(stages, groups)`` → (that plan's step s, the cutoff s now), every solution the
        MIP finds below the cutoff is priced, then excluded (Σ x ≤ S − 1 over its columns), and the
        MIP solved again under the cutoff ``price`` returns, until none is left below it: the rows
        only bound the closed form, so a MIP optimum below the cutoff may be a plan whose price is
        not. Solutions whose shapes do not chain are no plans and are excluded unpriced. The
        bound is then the least of the cutoff, the MIP's and the priced plans; the solutions went
        to ``price``, and None is returned for them."""
        import highspy

        started = work.now()
        cutoff_ms = cutoff_s * MS
        # (with ``price``, a plan excluded once priced stands for the plans of the columns it dominates:
        # only where its price is no higher than theirs, ``_price_dominance``)
        lp = _PositionsLP(self, stages, cutoff_ms=cutoff_ms, priced=price is not None)
        if lp.empty:
            return (cutoff_s if math.isfinite(cutoff_ms) else math.inf), None, True
        kept = lp.drop_by_reduced_cost(cutoff_ms)
        if kept is None:  # the relaxation alone reaches the cutoff
            return cutoff_s, None, True
        X = len(kept)
        kind = np.full(X, highspy.HighsVarType.kInteger)
        lp.highs.changeColsIntegrality(X, np.arange(X, dtype=np.int32), kind)
        lp.highs.setOptionValue("mip_rel_gap", TOLERANCE)
        for option, value in MIP_OPTIONS.items():
            lp.highs.setOptionValue(option, value)
        if stages > PRESOLVE_ABOVE_STAGES:
            lp.highs.setOptionValue("presolve", "on")
        floor, priced = 0.0, math.inf  # (ms) the MIP's bound so far; the least price of the plans priced
        column_of = {(int(lp.position[i]), int(lp.shape[i]), int(lp.group[i])): j for j, i in enumerate(kept)}
        for excluded in itertools.count():
            left = time_limit_s - (work.now() - started)
            if excluded and left <= 0:  # out of time between two solves
                return min(floor, cutoff_ms, priced) / MS, None, False
            # (counting work, its node limit ends it and the wall clock only caps it)
            lp.highs.setOptionValue("time_limit", lp.highs.getRunTime() + work.wall_limit_s(max(0.01, left)))
            for option, value in work.limits(max(0.01, left)).items():
                lp.highs.setOptionValue(option, value)
            if math.isfinite(cutoff_ms):
                lp.highs.setOptionValue("objective_bound", cutoff_ms)
            if price is not None:  # (each plan it finds is priced at once, and may lower the cutoff)
                lp.highs.setOptionValue("mip_max_improving_sols", 1)
            work.run(lp.highs)
            status = lp.highs.getModelStatus()
            info = lp.highs.getInfo()
            if status == highspy.HighsModelStatus.kInfeasible:
                return min(cutoff_ms, priced) / MS, None, True
            optimal = status == highspy.HighsModelStatus.kOptimal
            found = status == highspy.HighsModelStatus.kSolutionLimit  # stopped at a plan, to price it
            if math.isfinite(info.mip_dual_bound):  # its dual bound (optimal: within ``mip_rel_gap`` of its plan)
                floor = max(floor, info.mip_dual_bound)
            chosen, picked, at = None, None, {}
            if info.primal_solution_status == 2:  # a solution: the column at each position, first stage first
                picked = np.nonzero(np.asarray(lp.highs.getSolution().col_value[:X]) > 0.5)[0]
                at = {int(lp.position[i]): (int(lp.shape[i]), int(lp.group[i])) for i in kept[picked]}
                if len(at) == stages:
                    chosen = self.chain([at[p] for p in reversed(range(stages))])
            if price is None:
                return min(max(floor, 0.0), cutoff_ms) / MS, chosen, optimal
            cuts = [picked] if picked is not None else []
            if chosen is not None:
                step_s, now_s = price([layers for layers, _ in chosen], [group for _, group in chosen])
                priced, cutoff_ms = min(priced, step_s * MS), min(cutoff_ms, now_s * MS)
                if (optimal or found) and floor < cutoff_ms:  # the MIP goes on: its plan's reorders go with it
                    for columns, plan in self._reorders(at, stages, column_of):
                        step_s, now_s = price([layers for layers, _ in plan], [group for _, group in plan])
                        priced, cutoff_ms = min(priced, step_s * MS), min(cutoff_ms, now_s * MS)
                        cuts.append(columns)
            bound_ms = min(max(floor, 0.0), cutoff_ms, priced)
            if not (optimal or found) or picked is None or floor >= cutoff_ms:
                return bound_ms / MS, None, optimal or floor >= cutoff_ms
            for cut in cuts:
                lp.highs.addRow(-math.inf, float(stages - 1), len(cut), cut.astype(np.int32), np.ones(len(cut)))

    def _reorders(self, at: dict[int, tuple[int, int]], stages: int, column_of: dict):
        """(the MIP's column indices, the plan in pipeline order) of every other order of the stages
        of the solution ``at`` ({position: (shape, group)}) between the first and the last whose
        columns the MIP holds and whose shapes chain; none when the inner stages have more than
        ``REORDERS`` orders. The step rows price a stage's neighbours only through the floors of its
        own transfers, so the MIP's next solutions are often these same stages reordered, each
        costing a solve to exclude; priced and excluded together, they cost one."""
        middle = [at[p] for p in range(1, stages - 1)]
        if math.factorial(len(middle)) > REORDERS:
            return
        seen = {tuple(middle)}
        for order in itertools.permutations(middle):
            if order in seen:
                continue
            seen.add(order)
            full = [at[0], *order, at[stages - 1]]
            columns = [column_of.get((p, *full[p])) for p in range(stages)]
            if None in columns:  # (a column the MIP does not hold: it cannot choose this order)
                continue
            plan = self.chain(list(reversed(full)))
            if plan is not None:
                yield np.array(columns, dtype=np.int64), plan

    def chain(self, columns: list[tuple[int, int]]) -> list[tuple[list[int], GroupConfig]] | None:
        """(layers, group) of each (shape, group) in pipeline order, the shapes laid end to end from
        layer 0; None when they do not make the chain (the LP counts each run's layers, not where
        they sit, so its stages may not fit together)."""
        out, at = [], 0
        for shape, group in columns:
            layers = []
            for r, run in enumerate(self.runs):
                k = int(self.counts[shape, r])
                if not k:
                    continue
                if not run.first <= at < run.first + run.count or at + k > run.first + run.count:
                    return None
                if layers and at != run.first:  # a slice continues into run r only from its start
                    return None
                layers += range(at, at + k)
                at += k
            out.append((layers, self.groups[group]))
        return out if at == sum(run.count for run in self.runs) else None


def _onto(g: np.ndarray, groups: int):
    """The (pair, group) matrix that sends each pair of groups to its first group ``g[pair]``."""
    from scipy.sparse import csr_matrix

    return csr_matrix((np.ones(len(g)), (np.arange(len(g)), g)), shape=(len(g), groups))


class _PositionsLP:
    """The LP of :class:`StageColumns` for one stage count, in HiGHS."""

    def __init__(self, columns: StageColumns, stages: int, *, cutoff_ms: float, priced: bool = False):
        self.c, self.S = columns, stages
        M, S = columns.M, stages
        cells = []  # (position, shape, group) of every column
        own = []  # [v, g] per position: the least step of any plan with that column there
        for p in range(S):
            k = in_flight(columns.schedule, M, S, S - 1 - p)
            own.append(columns.own_ms(p, S))
            allowed = (own[p] < cutoff_ms) & (columns.most_in_flight >= k)
            allowed = columns.undominated(allowed, priced=priced)
            if p == S - 1:
                allowed &= columns.starts[:, None]
            if p == 0:
                allowed &= columns.ends[:, None]
            v, g = np.nonzero(allowed)
            cells.append((np.full(len(v), p), v, g))
        self.position = np.concatenate([c[0] for c in cells])
        self.shape = np.concatenate([c[1] for c in cells])
        self.group = np.concatenate([c[2] for c in cells])
        # each column's own bound over M: closing those above T closes every column M·T cannot pay for
        self.stage_ms = np.stack(own)[self.position, self.shape, self.group] / M if len(self.position) else np.zeros(0)
        self.empty = any(not np.any(self.position == p) for p in range(S))
        self.highs = None if self.empty else self._load()

    def _load(self):
        c, S, M = self.c, self.S, self.c.M
        X = len(self.position)
        pos, shape, group = self.position, self.shape, self.group
        time, forward, after = c.time[shape, group], c.forward[shape, group], c.after[shape, group]
        # columns: x (X), then C_p, F_p, E_p, Q_p (S each; Q_0 unused), Z and W, then the partial sums
        # the step rows read (S each): Σ_{q>p} C_q, Σ_{q<p} C_q, Σ_{q>p} F_q, Σ_{q>p} Q_q, Σ_{1≤q≤p} Q_q
        C, F, E, Q, Z = X, X + S, X + 2 * S, X + 3 * S, X + 4 * S
        W = Z + 1  # the drain: when the first stage's last backward ends
        C_up, C_down, F_up, Q_up, Q_down = (W + 1 + k * S for k in range(5))
        n_columns = W + 1 + 5 * S
        rows: list[tuple[np.ndarray, np.ndarray, float, float]] = []
        x = np.arange(X)
        for p in range(S):
            mine = x[pos == p]
            rows.append((mine, np.ones(len(mine)), 1.0, 1.0))
            for column, weights in ((C + p, time), (F + p, forward), (E + p, after)):
                rows.append((np.r_[mine, column], np.r_[weights[mine], -1.0], 0.0, 0.0))
        # each partial sum from its neighbour's, so that a step row holds a few columns, not O(S): the
        # LP is the same, and HiGHS's cut separators, which walk every row, take a fraction of the time
        for total, base, step, order in (
            (C_up, C, 1, range(S - 1)),  # C↑_p = C↑_{p+1} + C_{p+1}
            (F_up, F, 1, range(S - 1)),
            (Q_up, Q, 1, range(S - 1)),
            (C_down, C, -1, range(1, S)),  # C↓_p = C↓_{p−1} + C_{p−1}
        ):
            for p in order:
                rows.append(
                    (np.array([total + p, total + p + step, base + p + step]), np.array([1.0, -1.0, -1.0]), 0.0, 0.0)
                )
        for p in range(1, S):  # Q↓_p = Q↓_{p−1} + Q_p
            rows.append((np.array([Q_down + p, Q_down + p - 1, Q + p]), np.array([1.0, -1.0, -1.0]), 0.0, 0.0))
        # Q_p: the transfer from position p to p − 1, at least what p's column sends and what p − 1's receives
        for p in range(1, S):
            for side, floor in ((p, c.send), (p - 1, c.receive)):
                mine = x[(pos == side) & (floor[shape, group] > 0)]
                if len(mine):
                    rows.append((np.r_[mine, Q + p], np.r_[floor[shape[mine], group[mine]], -1.0], -math.inf, 0.0))
        for r, run in enumerate(c.runs):
            counts = c.counts[shape, r].astype(float)
            held = counts > 0
            rows.append((x[held], counts[held], float(run.count), float(run.count)))
        for t, sizes in c.sizes.items():
            size = sizes[group]
            used = size > 0
            rows.append((x[used], size[used], -math.inf, float(c.infos[t].devices)))
        last_backward = np.where(pos == 0, c.last_backward[group], 0.0)  # on position 0's group

        def up_to(p: int, weight: float) -> dict[int, float]:
            """weight·Σ_{1≤q≤p} Q_q: the boundaries sent from positions p and below."""
            return {Q_down + p: weight}

        def ahead(p: int, weight: float) -> dict[int, float]:
            """weight·Σ_{q>p} Q_q: the boundaries sent from beyond p."""
            return {Q_up + p: weight}

        def every_C(p: int) -> dict[int, float]:
            """Σ_q C_q, read at p."""
            return {C_down + p: 1.0, C + p: 1.0, C_up + p: 1.0}

        def step_row(weights: dict[int, float], extra: np.ndarray | None = None, *, above: int = Z) -> None:
            """``above`` (Z) ≥ Σ weight·column + Σ extra·x."""
            cols = np.array(list(weights), dtype=np.int64)
            vals = -np.array(list(weights.values()), dtype=float)
            if extra is not None and np.any(extra):
                used = extra != 0
                cols, vals = np.r_[cols, x[used]], np.r_[vals, -extra[used]]
            rows.append((np.r_[cols, above], np.r_[vals, 1.0], 0.0, math.inf))

        def drained(weights: dict[int, float]) -> None:
            """W ≥ a row of the drain (Z ≥ W, and the first stage's sync follows W: below)."""
            step_row(weights, above=W)

        for p in range(S):
            K = in_flight(c.schedule, M, S, S - 1 - p)
            d = 0 if c.schedule == "gpipe" else K - 1
            # fill ahead of p (each boundary upstream there and back)
            drained({C_up + p: 1.0, C + p: float(M), **ahead(p, 2.0)})
            # the whole round trip
            w = every_C(p)
            w[C + p] += M - 1
            drained({**w, F + p: -float(d), **ahead(p, 2.0), **up_to(p, 2.0)})
            # the tail after the drain: upstream forwards, then M·C − B + E = (M−1)·C + F + E
            tail = {F_up + p: 1.0, C + p: float(M - 1), F + p: 1.0, E + p: 1.0, **ahead(p, 1.0)}
            step_row(tail, last_backward if p == 0 else None)
            whole = {**tail, C_down + p: 1.0, **up_to(p, 2.0)}
            whole[F + p] = 1.0 - d
            step_row(whole, last_backward if p == 0 else None)
            if c.schedule != "gpipe":  # the in-flight cycle, K = p + 1
                q, r = divmod(M - 1, p + 1)
                cycle = {C_down + p: float(q + 1), C + p: float(q + 1 + r)}
                if not q:  # r·B_p = r·(C_p − F_p) (r·C_p once a cycle has gone round)
                    cycle[F + p] = -float(r)
                round_trips = up_to(p, 2.0 * (q + 1))
                drained({**cycle, C_up + p: 1.0, **ahead(p, 2.0), **round_trips})
                # then its sync and optimizer, without the drain: − B_p + E_p
                synced = {**cycle, F_up + p: 1.0, **ahead(p, 1.0), **round_trips, E + p: 1.0}
                synced[C + p] -= 1.0
                synced[F + p] = synced.get(F + p, 0.0) + 1.0
                step_row(synced, last_backward if p == 0 else None)
            if p >= 1:  # p's outgoing link carries 2M transfers between its first forward and last backward
                if c.schedule == "gpipe":  # (both flow shops wait on it M − 1 times each)
                    row = {**every_C(p), **ahead(p, 2.0), **up_to(p, 2.0)}
                    row[Q + p] = 2.0 * (M - 1)
                else:
                    row = {C_up + p: 1.0, C + p: 1.0, **ahead(p, 2.0), Q + p: 2.0 * M}
                drained(row)
        if c.first_tail is not None:
            first = np.where(pos == S - 1, c.first_tail[group], 0.0)
            step_row({**every_C(0), **ahead(0, 2.0)}, first)

        # Z ≥ W, and Z ≥ W − B + E of the first stage: its gradient sync and optimizer start after the
        # drain (``_closed_form``: the first stage's last backward ends at W)
        first_stage = S - 1
        step_row({W: 1.0})
        step_row({W: 1.0, C + first_stage: -1.0, F + first_stage: 1.0, E + first_stage: 1.0},
                 last_backward if first_stage == 0 else None)  # fmt: skip
        cost = np.zeros(n_columns)
        cost[Z] = 1.0
        upper = np.r_[
            np.ones(X),
            np.full(3 * S, math.inf),
            0.0,
            np.full(S - 1, math.inf),
            math.inf,
            math.inf,
            np.full(5 * S, math.inf),
        ]
        upper[[C_up + S - 1, F_up + S - 1, Q_up + S - 1, C_down, Q_down]] = 0.0  # (the empty sums)
        return highs_lp(cost, upper, rows)

    def drop_by_reduced_cost(self, cutoff_ms: float) -> np.ndarray | None:
        """Solve the LP and delete from HiGHS every stage column that only plans at or above the
        cutoff can use; returns the indices (into ``position``, ``shape``, ``group``) of the stage
        columns kept, in their new order, or None when no plan is below the cutoff.

        Reduced-cost fixing: with z the LP's optimum and d_j ≥ 0 the reduced cost of a column at 0,
        every point of the LP with x_j = 1 has Z ≥ z + d_j (LP duality), so where z + d_j ≥ cutoff
        no plan below the cutoff uses column j; under a good incumbent that is most columns of the
        deep pipelines."""
        import highspy

        X = len(self.position)
        everything = np.arange(X)
        if self.empty:
            return None
        if not math.isfinite(cutoff_ms):
            return everything
        work.run(self.highs)
        status = self.highs.getModelStatus()
        if status == highspy.HighsModelStatus.kInfeasible:
            return None
        if status != highspy.HighsModelStatus.kOptimal:
            return everything
        z = self.highs.getInfo().objective_function_value
        if z >= cutoff_ms:
            return None
        solution = self.highs.getSolution()
        value, reduced = np.asarray(solution.col_value[:X]), np.asarray(solution.col_dual[:X])
        # (a margin for HiGHS's tolerances: a column kept needlessly costs time, one dropped wrongly a false bound)
        dropped = (value <= 1e-9) & (z + reduced >= cutoff_ms * (1 + 1e-6))
        self.highs.deleteCols(int(dropped.sum()), everything[dropped].astype(np.int32))
        return everything[~dropped]

    def least_step_ms(self, within_ms: float = math.inf, *, stop_ms: float = math.inf) -> float:
        """The LP's least Z (ms) with every stage computing within ``within_ms`` per microbatch:
        +inf when it is infeasible or its dual simplex proves Z ≥ ``stop_ms`` (HiGHS's
        ``objective_bound``, which ends the solve there; HiGHS ignores it after presolve, so a
        finite ``stop_ms`` solves without), 0 when HiGHS ends undecided."""
        import highspy

        if self.empty:
            return math.inf
        X = len(self.position)
        upper = np.where(self.stage_ms <= within_ms, 1.0, 0.0)
        self.highs.changeColsBounds(X, np.arange(X, dtype=np.int32), np.zeros(X), upper)
        self.highs.setOptionValue("objective_bound", stop_ms)
        self.highs.setOptionValue("presolve", "off" if math.isfinite(stop_ms) else "choose")
        work.run(self.highs)
        status = self.highs.getModelStatus()
        if status in (highspy.HighsModelStatus.kInfeasible, highspy.HighsModelStatus.kObjectiveBound):
            return math.inf
        if status != highspy.HighsModelStatus.kOptimal:
            return 0.0
        return self.highs.getInfo().objective_function_value
