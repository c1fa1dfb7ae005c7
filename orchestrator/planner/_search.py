"""``plan()``: solve the stage ILP for every stage count and microbatch count, keep the best.

The ILP (``_ilp``) fixes M so that in-flight activations (which depend on a
stage's distance from the end of the pipeline) stay linear, and each M's model
is solved once per stage count S (a *piece*: positions ≥ S closed, S − 1 open),
the pieces of one M in its HiGHS sessions, up to one solve per core at once
(``_workers``). The search runs in three steps:

1. the balanced heuristic and the baselines give a first incumbent (in at most a third of the
   time), which a local search (``_polish``) improves (in at most ``POLISH_SHARE`` more, and
   by half the time);
2. every (M, S) piece gets a bound from whole stages as columns (``_paths``: an LP, then a MIP
   where the LP leaves it open, in at most ``COLUMN_SHARE`` of the time left; every plan a MIP
   finds is priced, may become the incumbent, and is excluded from that MIP), which closes most
   pieces before any ILP is built (an M whose pieces all close is done); every M not bounded for every S gets its packing bound
   (``_packing``, at most 9/10 of the time left), which drops the M that cannot beat the
   incumbent (on GPT-175B all but two of nine); every other
   M's model is built and its LP relaxation solved (with the packing bound, the
   bound of its pieces until their own solves do better); then a first pass gives each piece
   (fewest stages first) a short, presolve-free solve: most prove at once that
   they cannot beat the incumbent. The stage counts from ``TAIL_FROM`` on start as one tail
   piece per M, split into one piece per count when it does not close at once;
3. rounds over the pieces still open, weakest bound first, share what is left.

Every solve asks only for plans ``gap`` better than the incumbent (``_cutoff_ms``), and an M
or piece whose bound is within ``gap`` of it is closed: the plan returned is then certified
within ``gap`` of the optimum, not necessarily optimal. The certified lower bound is the
smallest bound over all pieces (a piece never solved keeps its column bound, its M's packing or relaxation
bound, or the solve-free capacity bound, or its own link bound — the transfers on the
pipeline's critical paths, which grow with S, ``_ilp.link_bound_s`` — whichever is highest;
a piece whose starting bound is within the gap of the incumbent is closed unsolved), so the
gap covers the whole search space.
Solves still running at the deadline are left behind (``_workers``): their pieces keep the
bounds they had, so the planner returns within its time limit.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass

import pulp

from orchestrator.cluster import Cluster, Link
from orchestrator.costs import CostModel
from orchestrator.planner._diagnose import binding_notes, infeasibility_message
from orchestrator.planner._evaluate import Evaluation, evaluate
from orchestrator.planner._groups import (
    GroupConfig,
    TypeInfo,
    group_configs,
    mixed_group_configs,
    pair_links,
    type_infos,
    with_mixed_links,
)
from orchestrator.planner._ilp import MS, Run, StageModel, layer_runs, simple_bound_s, undominated
from orchestrator.planner._migration import Migration
from orchestrator.planner._packing import TOLERANCE, PackingBound
from orchestrator.planner._paths import StageColumns
from orchestrator.planner._plan import Plan, PlanInfeasible, PlanNotFound, Stage
from orchestrator.planner._polish import polish
from orchestrator.planner._table import CostTable
from orchestrator.planner._workers import PieceWorkers, default_workers
from orchestrator.solver import HighsSession, highs_available, solve

log = logging.getLogger(__name__)

DEFAULT_MICROBATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# HiGHS's MIP presolve spent 11.6 s on gpt2-small × mixed-a100-v100 at M = 8 (3,358 columns)
# before its root LP, so a solve given a share of a 10 s budget ended with no bound at all;
# without it the root bound comes first. The first pass's short solves go without presolve;
# the later rounds, with time for it, keep HiGHS's default.
MIP_OPTIONS = {"presolve": "off"}
# a solve's status when it proved no plan below its cutoff (``_cutoff_ms``)
CUT_OFF = "Cut off"
# stage counts from this one on start as one tail piece per M (split if it does not close at once):
# on gpt-1.3b × mixed-a100-v100 the pieces of 7 to 16 stages were each cut off in 0.4–1.1 s,
# 15 s of a 30 s budget (session 11)
TAIL_FROM = 5
# the first pass gives each (M, S) piece at most this long; what is left then goes to the open ones
FIRST_PASS_S = 0.2
# a piece solved again gets at least this many times its last limit. Each try starts over, so a
# piece that needs t s wastes up to t/(growth − 1) on the tries before; a limit is only a cap, so a
# larger growth costs nothing where a piece closes sooner. With 2, gpt-13b × mixed-a100-v100's pieces
# of 6 stages took three tries (3.3, 6.4, 6.8 s) in a 30 s run where one 5.8 s solve closed it in a
# 60 s run; with 4, gpt-1.3b × mixed-a100-v100 went from 4.57% to 4.00% at 30 s (session 19)
RETRY_GROWTH = 4
# mixed groups (two device types per stage) are offered by default on clusters of at most this many
# hosts: on mixed-4type-512 (64 hosts) their 240 extra groups, each costed at every M, took the
# 10 s budget of GPT-175B (session 10: packing bounds for 2 of 9 M, gap 73% instead of 16%)
MIXED_HOSTS = 16
# the packing bounds' first pass stops each M's search this close (relative) to the most its bound could be
COARSE = 1e-2
# the local search around the first incumbent (``_polish``) gets at most this share of the budget: on
# gpt2-small × mixed-4type-512 it took the heuristic's 113.5 ms to 62.8 ms in 3.3 s (session 13)
POLISH_SHARE = 1 / 6
# seconds to build a model per (group, run, stage) cell, before one has been built (``plan``)
BUILD_S_PER_CELL = 1e-4
# what building the plan after the search takes at most: 30–40 ms on GPT-175B's 16 stages
FINISH_S = 0.1
# the whole-stage bounds (``_paths``) get at most this share of the time left after the local search:
# since their MIPs close most pieces (session 22), the ILP's pieces seldom close in what is left (gpt-13b ×
# mixed-4type-512's M = 32 at 7 stages: none in 12 s, session 21); 0.85 until then
COLUMN_SHARE = 0.95
# each stage count's whole-stage MIP (``_paths``), where its LP left the piece open, gets a fair share of
# the time left, and at least this long (GPT-175B × mixed-4type-512's 10 open pieces: 0.06–2.2 s each)
COLUMN_MIP_S = 1.0
# each M's whole-model LP relaxation gets at most this long: the bound of its pieces never reached
# (gpt-13b × mixed-4type-64: 70.2 s against the 32.0 s capacity bound, 0.7–2.5 s per M)
RELAXATION_S = 2.0


@dataclass(frozen=True, slots=True)
class SearchSpace:
    """What every microbatch count's ILP and the exhaustive search share."""

    infos: dict[str, TypeInfo]
    groups: list[GroupConfig]
    table: CostTable
    links: dict[tuple[str, str], Link]
    runs: list[Run]
    layers: int


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


def offers_mixed(cluster: Cluster, mixed_stages: bool | None) -> bool:
    """``mixed_stages``, or when None whether the cluster is small enough (``MIXED_HOSTS``)."""
    if mixed_stages is None:
        return len({d.host for d in cluster.devices()}) <= MIXED_HOSTS
    return mixed_stages


def _allocate(
    cluster: Cluster, groups: list[GroupConfig], prefer: list[tuple[str, ...] | None] | None = None
) -> list[tuple[str, ...]]:
    """Concrete devices for each stage: preferred devices where they still match its group,
    then whole hosts first, then host slices, first fit. Devices come replica-major: each run
    of ``tp`` devices is one tensor-parallel group inside one host."""
    kinds = {d.ref: d.device_type for d in cluster.devices()}
    out: list[tuple[str, ...] | None] = [None] * len(groups)
    taken: set[str] = set()
    for index, wanted in enumerate(prefer or []):
        group = groups[index] if index < len(groups) else None
        if (
            group is not None
            and not group.mixed
            and wanted
            and len(wanted) == group.size
            and all(kinds.get(d) == group.device_type for d in wanted)
            and not taken & set(wanted)
        ):
            out[index] = tuple(wanted)
            taken |= set(wanted)
    free: dict[str, list[list[str]]] = {}
    for host in cluster.hosts:
        refs = [d.ref for d in cluster.devices() if d.host == host.name and d.ref not in taken]
        free.setdefault(host.device_type, []).append(refs)
    for index in sorted(range(len(groups)), key=lambda i: -groups[i].size):
        if out[index] is not None:
            continue
        group = groups[index]
        # a mixed group: its first type's replicas, then its second's
        out[index] = tuple(
            ref for kind, size in group.by_type.items() for ref in _take(free[kind], kind, size, group.tp)
        )
    return out  # type: ignore[return-value]


def _take(hosts: list[list[str]], kind: str, size: int, tp: int) -> list[str]:
    """``size`` free devices from ``hosts`` (lists of free refs, taken from), each run of ``tp`` in one host."""
    picked: list[str] = []
    for refs in sorted(hosts, key=len, reverse=size > min(len(h) for h in hosts)):
        take = min(len(refs), size - len(picked))
        take -= take % tp  # a tensor-parallel group never spans two hosts
        if take and (size <= len(refs) or take == len(refs) - len(refs) % tp):
            picked += refs[:take]
            del refs[:take]
        if len(picked) == size:
            return picked
    raise PlanInfeasible(
        f"cannot place {size} {kind} devices with tensor parallelism {tp} inside "
        "hosts: too many devices are out of service on partly available hosts (mark whole hosts unavailable)"
    )


def _relaxation_bound(lp, *, time_limit_s: float) -> float:
    """The LP relaxation's optimum: a lower bound when the MIP search stopped before its root
    bound was known (HiGHS then reports none); +inf when the relaxation is infeasible (so is
    the MIP), −inf when it ran out of time."""
    kinds = {v.name: v.cat for v in lp.variables()}
    values = {v.name: v.varValue for v in lp.variables()}
    for v in lp.variables():
        v.cat = pulp.LpContinuous
    try:
        relaxed = solve(lp, time_limit_s=time_limit_s, gap=0.0)
    finally:
        for v in lp.variables():
            v.cat, v.varValue = kinds[v.name], values[v.name]
    if relaxed.status == "Infeasible":
        return math.inf
    return relaxed.bound if relaxed.status == "Optimal" else -math.inf


def _heuristic_stage_counts(cluster: Cluster, max_stages: int) -> list[int]:
    """2^k and 3·2^k stages, and the counts that give every stage whole hosts of one type (the
    hosts in service and their divisors: 7 hosts left of 8 give 7 one-host blocks, which no
    power of two does)."""
    hosts = len({d.host for d in cluster.devices()})
    counts = {1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64} | {d for d in range(1, hosts + 1) if hosts % d == 0}
    return sorted(s for s in counts if s <= max_stages)


def _heuristic(model, space, global_batch, schedule, candidates, max_stages, recompute, deadline=None):
    """The best of our balanced heuristic and every baseline (over stage counts of the form 2^k
    and 3·2^k, to bound the time): the ILP starts from it, so the plan returned is never worse
    than those baselines, even when the time limit stops the search.

    The balanced heuristic runs first and may use the whole ``deadline``: it is the one that
    finds a plan wherever one fits (GPT-175B on 512 devices: 16 stages, in 1.8 s, where an
    equal share of the window, 0.55 s, stopped it before any plan and the planner had none to
    return). The baselines share what it leaves."""
    from orchestrator.baselines import BASELINES, balanced

    settings = {
        "global_batch": global_batch,
        "schedule": schedule,
        "microbatch_candidates": tuple(candidates),
        "max_stages": max_stages,
        "recompute": recompute,
        "space": space,
        "stage_counts": _heuristic_stage_counts(model.cluster, max_stages),
    }
    found = [balanced(model, **settings, deadline=deadline)]
    baselines = list(BASELINES.values())
    for index, run in enumerate(baselines):  # each gets an equal share of what balanced left
        if deadline is not None:
            left = deadline - time.perf_counter()
            if left <= 0:
                break
            settings["deadline"] = time.perf_counter() + left / (len(baselines) - index)
        found.append(run(model, **settings))
    found = [f for f in found if f is not None]
    return min(found, key=lambda f: f.iteration_s) if found else None


@dataclass(frozen=True, slots=True)
class OneStage:
    """The one-stage plans, all priced: the best (evaluation, group, M) or None when none fits, and
    per M the least step time of any (inf where none fits); ``complete`` is False when the deadline
    stopped the pricing, and ``least_s`` then covers only what was priced."""

    best: tuple[Evaluation, GroupConfig, int] | None
    least_s: dict[int, float]
    complete: bool


def _single_stage(space: SearchSpace, candidates, schedule: str, *, deadline: float) -> OneStage:
    """The best plan of one stage: every layer on one group (any type, size, tp, recompute, or a
    mixed group with its batch shares), at every M.

    The balanced heuristic and the baselines build pipelines and place one type per stage, so
    they miss plans that give one stage every device of two types: on gpt2-small ×
    mixed-4type-64 the best plan is data parallelism over 16 a100 and 16 h100 (102.4 ms), and the
    local search from the heuristic's 3 stages stopped at 119.4 ms, which the ILP did not improve in
    30 s (session 16). Trying every group takes 0.6–1.5 s on the presets (208 groups × 7–9 M).
    A group whose parameters and optimizer state alone overflow its devices is skipped at once.

    Pricing every group is enumeration: when it completes, each M's least one-stage time is that
    M's one-stage optimum, so the ILP's one-stage piece of that M needs no solve (session 19)."""
    layers = list(range(space.layers))
    found = None
    least = dict.fromkeys(candidates, math.inf)
    for group in space.groups:
        for M in candidates:
            if time.perf_counter() >= deadline:
                return OneStage(found, least, complete=False)
            if space.table.microbatch(group, M) is None:
                continue
            if _state_overflows(space.table, layers, group, M):
                break  # (the state does not depend on M)
            ev = evaluate(
                [layers],
                [group],
                M,
                table=space.table,
                infos=space.infos,
                schedule=schedule,
                links=space.links,
                report_infeasible=False,
            )
            if not ev.feasible:
                continue
            least[M] = min(least[M], ev.iteration_s)
            if found is None or ev.iteration_s < found[0].iteration_s:
                found = (ev, group, M)
    return OneStage(found, least, complete=True)


def _state_overflows(table, layers: list[int], group: GroupConfig, M: int) -> bool:
    """Whether ``layers``' parameters, gradients and optimizer state alone exceed some part of ``group``."""
    parts = [table.memory_parts(l, group, M) for l in layers]
    return any(sum(part[p][1].static_bytes for part in parts) > capacity for p, (capacity, _) in enumerate(parts[0]))


def _packing_bounds(
    space: SearchSpace, candidates, max_stages: int, schedule: str, best, *, gap: float, deadline: float
):
    """{M: packing bound (s)}, never below the capacity bound: +inf where no plan of that M fits, the
    cutoff (``_cutoff_ms``) where none is ``gap`` better than the incumbent ``best``.

    Two passes. First every M to ``COARSE`` (fewest microbatches first: where memory binds hardest
    the bound is cheapest, GPT-175B proves M ≤ 16 empty in 0.1 s each), each with an equal share of
    the time left; then what is left refines the weakest M, which is the one the certified bound
    reads, to the packing search's own tolerance. (With one pass to full precision, gpt-13b ×
    mixed-4type-64 spent 3–4 s each taking M = 64 and 128 from about 75.5 to 76.1 s, and M = 256,
    last, stopped at 67.4 s for want of time: a 15.8% gap where 5.5% was within reach, session 13.)
    A search stopped by its share keeps the bound it reached."""
    cutoff_s = _cutoff_ms(best, gap) / MS if best else math.inf
    found, searches = {}, {}
    for index, M in enumerate(sorted(candidates)):
        groups = undominated(
            [g for g in space.groups if space.table.microbatch(g, M) is not None], space.runs, space.table, M
        )
        simple = simple_bound_s(space.runs, groups, space.table, space.infos, M)
        if not groups or time.perf_counter() >= deadline or not highs_available():  # (the LP needs highspy)
            found[M] = simple
            continue
        searches[M] = PackingBound(
            space.runs,
            groups,
            space.table,
            space.infos,
            microbatches=M,
            max_stages=max_stages,
            schedule=schedule,
            links=space.links,
        )
        share = time.perf_counter() + (deadline - time.perf_counter()) / (len(candidates) - index)
        found[M] = _packing_search(searches[M], simple, cutoff_s, best, share, COARSE)
        log.debug("M=%d: packing bound %.6g s (capacity %.6g s)", M, found[M], simple)
    refined: set[int] = set()
    while time.perf_counter() < deadline:
        open_bounds = [M for M in searches if M not in refined and found[M] < cutoff_s]
        if not open_bounds:
            break
        M = min(open_bounds, key=found.get)
        found[M] = max(found[M], _packing_search(searches[M], found[M], cutoff_s, best, deadline, TOLERANCE))
        refined.add(M)
        log.debug("M=%d: packing bound refined to %.6g s", M, found[M])
    return found


def _packing_search(search: PackingBound, above_s: float, cutoff_s: float, best, deadline: float, tolerance: float):
    bound = search.bound_s(above_s=above_s, below_s=cutoff_s, deadline=deadline, tolerance=tolerance)
    if bound == math.inf and best:  # (with no incumbent, +inf means no plan of this M fits)
        return cutoff_s
    return bound


def _column_bounds(
    space: SearchSpace,
    candidates,
    max_stages: int,
    schedule: str,
    best,
    *,
    gap: float,
    deadline: float,
    improve: Callable[[list[list[int]], list[GroupConfig], int], tuple[float, object]],
) -> dict[int, dict[int, float]]:
    """{M: {S: bound (s)}} from whole stages as columns (``_paths``), each at most the cutoff
    (``_cutoff_ms``), which closes the piece: the LP of every (M, S), the incumbent's M and its
    neighbours first, then, where an LP leaves its (M, S) more than ``gap`` below the incumbent
    ``best``, its MIP (after every LP, weakest first; a fair share of the time left, at least
    ``COLUMN_MIP_S``), all on ``default_workers()`` threads (highspy releases the GIL). Every MIP
    solution whose stages chain goes to ``improve(stages, groups, M)``, which prices it, keeps it if
    it beats the incumbent and returns (its step time, the incumbent); the MIP then excludes it and goes
    on (``StageColumns.integer_bound_s``). A better incumbent lowers the cutoff for the MIPs
    running and still to run, and a MIP stopped by its time limit runs again, with at least ``RETRY_GROWTH``
    times its last limit, while time is left. Solves ``deadline`` stops leave their (M, S) out (LP)
    or at the LP's bound (MIP).

    On gpt2-small × ``mixed-4type-64`` the LPs closed all but 7 of the 98 pieces of M = 1–64 in under
    2 s and the MIPs 4 of those 7; its ILP pieces had taken 93 s to close them all (session 21). On
    gpt-1.3b × ``mixed-4type-64`` the MIPs' plans took the incumbent from 5.34 to 5.19 s, under whose
    cutoff the MIP of M = 32 at 6 stages closes in 1.6 s (at its LP's 4.83 s before)."""
    found: dict[int, dict[int, float]] = {M: {} for M in candidates}
    if not highs_available():
        return found
    cutoff_s = _cutoff_ms(best, gap) / MS if best else math.inf
    columns: dict[int, StageColumns] = {}
    for M in candidates:
        groups = [g for g in space.groups if space.table.microbatch(g, M) is not None]
        if not groups:  # no group divides the microbatch: no plan of this M
            found[M] = dict.fromkeys(range(1, max_stages + 1), math.inf)
            continue
        columns[M] = StageColumns(
            space.runs, groups, space.table, space.infos, microbatches=M, schedule=schedule, links=space.links
        )
    near = best[4] if best else max(candidates, default=1)
    order = sorted(columns, key=lambda M: abs(math.log2(M / near)))
    workers = default_workers()
    pool = ThreadPoolExecutor(workers)
    jobs = [
        ("lp", M, S, functools.partial(columns[M].bound_s, S, cutoff_s=cutoff_s))
        for M in order
        for S in range(1, max_stages + 1)
    ]
    limits: dict[tuple[int, int], float] = {}  # each MIP's last time limit

    lock = threading.Lock()

    def price(M: int, stages: list[list[int]], groups: list[GroupConfig]) -> tuple[float, float]:
        """A MIP's plan priced (``improve``, which may make it the incumbent): (its step, the cutoff now).
        Past the deadline the search has moved on: (0, 0) ends the MIP, whose result is not read."""
        nonlocal best, cutoff_s
        if time.perf_counter() >= deadline:
            return 0.0, 0.0
        with lock:
            score, best = improve(stages, groups, M)
            cutoff_s = _cutoff_ms(best, gap) / MS
            return score, cutoff_s

    def mip(M: int, S: int):  # (under the cutoff of the incumbent when it starts)
        left = deadline - time.perf_counter()
        share = left * workers / (len(jobs) + 1)  # (the MIPs still waiting, and this one)
        limit = limits[M, S] = min(left, max(COLUMN_MIP_S, share, RETRY_GROWTH * limits.get((M, S), 0.0)))
        return columns[M].integer_bound_s(S, cutoff_s=cutoff_s, time_limit_s=limit, price=functools.partial(price, M))

    def queue(pieces) -> None:  # MIPs of the open pieces, weakest first (never without an incumbent)
        if best is not None:
            waiting = sorted((found[M][S], M, S) for M, S in pieces if found[M][S] < cutoff_s)
            jobs.extend(("mip", M, S, functools.partial(mip, M, S)) for _, M, S in waiting)

    lps, stopped = len(jobs), []
    try:
        for kind, M, S, result in _on_threads(pool, workers, jobs, deadline):
            if kind == "lp":
                found[M][S] = result
                lps -= 1
                if not lps:
                    log.debug("column LPs done")
                    queue([(M, S) for M, bounds in found.items() for S in bounds])
                continue
            bound, _, decided = result  # (its plans went to ``price``)
            log.debug(
                "column MIP M=%d S=%d: %.6g ms (LP %.6g), decided %s, limit %.2f s",
                M,
                S,
                bound * MS,
                found[M][S] * MS,
                decided,
                limits[M, S],
            )
            found[M][S] = max(found[M][S], bound)
            if not decided:
                stopped.append((M, S))
            if not jobs:  # the pass is over: the MIPs stopped early go again
                queue(stopped)
                stopped = []
    finally:
        pool.shutdown(wait=False)  # a solve still running past the deadline ends at its own time limit
    for M, bounds in found.items():
        log.debug(
            "M=%d: column bounds %s ms",
            M,
            ", ".join(f"{S}: {'closed' if b >= cutoff_s else f'{b * MS:.6g}'}" for S, b in sorted(bounds.items())),
        )
    return found


def _on_threads(pool: ThreadPoolExecutor, workers: int, jobs: list, deadline: float):
    """Run the (kind, M, S, job) of ``jobs``, first first, at most one per worker at once, yielding
    (kind, M, S, job()) as each ends, until ``deadline``; the caller may add jobs between yields."""
    running = {}
    while (jobs or running) and (left := deadline - time.perf_counter()) > 0:
        while jobs and len(running) < workers:
            kind, M, S, job = jobs.pop(0)
            running[pool.submit(job)] = (kind, M, S)
        done, _ = wait(running, timeout=left, return_when=FIRST_COMPLETED)
        for future in done:
            kind, M, S = running.pop(future)
            yield kind, M, S, future.result()


@dataclass(slots=True)
class _Piece:
    """One piece of the search: microbatch count ``model.M`` with exactly ``stages`` stages.

    Fixing S removes the relaxation's cheapest trick — spreading the work over fractions
    of many stages, which hides the pipeline fill — so a piece proves its bound far sooner
    than the whole model of its M (``orchestrator bench planner``, 30 s: mamba-130m ×
    mixed-a100-v100 certified to 0.3% in 14 s, where one model per M stayed at 38%). The
    pieces of one M share its HiGHS sessions (the model loaded once per session, bounds
    changed per solve; ``_workers`` opens another when two pieces of one M solve at once)."""

    model: StageModel
    sessions: list[HighsSession]
    stages: int
    bound_s: float  # certified lower bound (s); inf once it cannot beat the incumbent
    done: bool = False
    limit_s: float = 0.0  # the time limit of its last solve (a solve restarts from scratch)
    most: int = 0  # a tail piece: any stage count from ``stages`` to ``most`` (0: exactly ``stages``)

    @property
    def last(self) -> int:
        """The largest stage count the piece covers."""
        return max(self.stages, self.most)

    def split(self) -> list[_Piece]:
        """A tail piece's stage counts as pieces of their own, each keeping its bound (or its own
        link bound, which grows with the stage count)."""
        return [
            _Piece(self.model, self.sessions, S, bound_s=max(self.bound_s, self.model.link_bound_s(S)))
            for S in range(self.stages, self.last + 1)
        ]


def _or_relaxation(result, sub: StageModel, relax):
    """``result`` with the LP relaxation's bound (``relax()``, ms) when the search stopped before
    a bound better than the solve-free one (none, or the root LP never finished); an infeasible
    relaxation proves the MIP infeasible too."""
    trivial = result.bound / MS <= sub.simple_bound_s()
    if not trivial or result.status in ("Infeasible", "Optimal"):
        return result
    relaxed = relax()
    status = "Infeasible" if relaxed == math.inf else result.status
    return dataclasses.replace(result, bound=max(result.bound, relaxed), status=status)


def _piece_solve(piece: _Piece, best, *, gap: float, time_limit_s: float, options: dict | None = None):
    """A job for :class:`PieceWorkers`: given a session of the piece's model, prepare (now, on
    this thread: the start writes the model's variables) and return the solve of ``piece`` for
    better plans than ``best`` (score s, evaluation, stages, groups, M), started from it when it
    has the piece's M and S; a search stopped before its root bound reports its relaxation's bound."""
    sub, S = piece.model, piece.stages
    closed = {sub.u[j, g]: (0.0, 0.0) for j in range(piece.last, sub.J) for g in range(len(sub.groups))}
    rows = {f"stage_order_one_group_{S - 1}": (1.0, 1.0)}
    ours = best is not None and best[4] == sub.M and S <= len(best[2]) <= piece.last
    warm = ours and sub.set_start(best[2], best[3])
    cutoff = None if warm or best is None else _cutoff_ms(best, gap)
    piece.limit_s = time_limit_s

    def prepare(session: HighsSession):
        start = session.current() if warm else None
        return functools.partial(_solve, piece, session, closed, rows, cutoff, start, gap, time_limit_s, options)

    return prepare


def _solve(piece: _Piece, session: HighsSession, closed, rows, cutoff, start, gap, time_limit_s, options):
    """The solve of :func:`_piece_solve` (on a worker thread: touches only ``session``)."""
    sub = piece.model
    result = session.solve(
        columns=closed, rows=rows, time_limit_s=time_limit_s, gap=gap, cutoff=cutoff, start=start, options=options
    )
    result = _or_relaxation(
        result,
        sub,
        lambda: session.relaxation_bound(columns=closed, rows=rows, time_limit_s=max(0.2, time_limit_s)),
    )
    if cutoff is not None and result.status == "Infeasible":  # no plan below the cutoff: that is its bound
        result = dataclasses.replace(result, status=CUT_OFF, bound=cutoff)
    log.debug(
        "M=%d, %d–%d stages: %s in %.2f s, objective %.6g ms, bound %.6g ms",
        sub.M,
        piece.stages,
        piece.last,
        result.status,
        result.solve_s,
        result.objective,
        result.bound,
    )
    return result


def _whole(sub: StageModel, best, *, gap: float, deadline: float):
    """One solve over every stage count (the CBC fallback, which has no session)."""
    warm = best is not None and best[4] == sub.M and sub.set_start(best[2], best[3])
    cutoff = None if warm or best is None else _cutoff_ms(best, gap)
    if cutoff is not None:
        sub.lp += sub.lp.objective <= cutoff, "better_than_incumbent"
    result = solve(sub.lp, time_limit_s=max(0.2, deadline - time.perf_counter()), gap=gap, use_start=warm)
    result = _or_relaxation(result, sub, lambda: _relaxation_bound(sub.lp, time_limit_s=0.5))
    if cutoff is not None and result.status == "Infeasible":
        result = dataclasses.replace(result, status=CUT_OFF, bound=cutoff)
    return result


def _cutoff_ms(best, gap: float) -> float:
    """Only plans below this (ms) are wanted from a solve: within ``gap`` of the incumbent ``best``
    is close enough. Asking for a plan ``gap`` better, rather than any better, lets HiGHS prune
    every node whose bound is within ``gap`` of the incumbent: on gpt-1.3b × mixed-a100-v100 the
    pieces that ran out of 30 s asking for any better plan prove in 0.2–2 s that none is 1% better
    (session 11). A piece with no plan below the cutoff gets the cutoff as its bound, so the
    certified gap still covers the whole search space; it is then at most ``gap``, not 0."""
    return best[0] * MS * (1 - max(gap * (1 - 1e-6), 1e-9))  # (a hair inside, so rounding never reports gap+)


def _first_pass(pieces: list[_Piece], workers: PieceWorkers, best, *, gap: float, deadline: float) -> list[_Piece]:
    """A short presolve-free solve of every piece, fewest stages first (``best()``: the incumbent
    now); a tail piece that does not close at once goes on as one piece per stage count. Returns
    every piece, solved or not."""
    queue, kept = list(pieces), []

    def settle(piece: _Piece) -> None:
        if piece.most and not piece.done:
            queue.extend(_close_beaten(piece.split(), best(), gap))
        else:
            kept.append(piece)

    while (queue or workers.running) and (left := deadline - time.perf_counter()) > workers.overrun_s:
        for piece in list(queue):
            if piece.done:
                queue.remove(piece)
                kept.append(piece)
            elif workers.can_start(piece):
                queue.remove(piece)
                first = min(FIRST_PASS_S, max(0.05, left * workers.workers / (2 * (len(queue) + 1))))
                workers.start(piece, _piece_solve(piece, best(), gap=gap, time_limit_s=first, options=MIP_OPTIONS))
            if workers.full:
                break
        for piece in workers.finish_one(deadline):
            settle(piece)
    for piece in workers.drain(deadline):
        settle(piece)
    # solves left running at the deadline: their pieces stay open with the bounds they had
    return kept + queue + [piece for piece, _ in workers.running.values()]


def _close_beaten(pieces: list[_Piece], best, gap: float) -> list[_Piece]:
    """``pieces``, those whose bound is within ``gap`` of the incumbent ``best`` closed unsolved: a
    tail piece's stage counts start from their link bounds, which grow with S (on gpt-1.3b ×
    mixed-4type-512 the pieces of 13 to 16 stages at M = 16 started above the cutoff and were
    solved anyway, session 19), and a better incumbent found since a piece's last solve may put
    its bound past the cutoff."""
    if best is not None:
        cutoff = _cutoff_ms(best, gap) / MS
        for piece in pieces:
            piece.done = piece.done or piece.bound_s >= cutoff
    return pieces


def _rounds(pieces: list[_Piece], workers: PieceWorkers, best, *, gap: float, deadline: float) -> None:
    """Solve the open pieces again, weakest bound first, each with a fair share of the time
    left and at least ``RETRY_GROWTH`` times its last try (each try starts over), until all close or
    time is up."""
    while (left := deadline - time.perf_counter()) > 0.05 + workers.overrun_s:
        _close_beaten(pieces, best(), gap)
        # weakest bound first; among equal bounds the piece tried least (a stage count never reached
        # beyond its starting bound may close at once where a long-tried one will not)
        waiting = sorted(
            (p for p in pieces if not p.done and not workers.is_running(p)), key=lambda p: (p.bound_s, p.limit_s)
        )
        if not waiting and not workers.running:
            break
        open_count = len(waiting) + len(workers.running)
        for piece in waiting:
            if workers.can_start(piece):
                limit = min(
                    left - workers.overrun_s,
                    max(0.1, left * workers.workers / open_count, RETRY_GROWTH * piece.limit_s),
                )
                workers.start(piece, _piece_solve(piece, best(), gap=gap, time_limit_s=limit))
        workers.finish_one(deadline)
    workers.drain(deadline)


def plan(
    model: CostModel,
    *,
    global_batch: int,
    schedule: str = "1f1b",
    microbatch_candidates: tuple[int, ...] = DEFAULT_MICROBATCHES,
    max_stages: int | None = None,
    time_limit_s: float = 30.0,
    gap: float = 1e-3,
    recompute: bool = True,
    start: tuple[list[list[int]], list[GroupConfig], int] | None = None,
    prefer_devices: list[tuple[str, ...] | None] | None = None,
    migration: Migration | None = None,
    zero: bool = False,
    mixed_stages: bool | None = None,
) -> Plan:
    """The best plan for ``model``'s layers on its cluster (see ``_ilp`` for the model).

    One ILP per microbatch count M decides the stage count (≤ ``max_stages``), the
    split, each stage's group and recompute; the certified lower bound is the smallest
    of the per-M bounds, so the reported gap covers the whole search space. An M whose
    packing bound or LP relaxation already reaches the incumbent is skipped (its bound is
    then above the incumbent and cannot lower the certified bound).

    Args:
      model: the cost model (it carries the layers and the cluster).
      global_batch: samples per step; M must divide it, and each stage's data-parallel
        degree must divide the microbatch.
      schedule: "1f1b" or "gpipe" (what in-flight activations each stage holds).
      microbatch_candidates: the M to consider.
      max_stages: the largest pipeline depth (default: layers, at most 16).
      time_limit_s: wall-clock budget for all solves; the incumbent and its gap are
        returned when it runs out.
      gap: relative gap at which each solve stops.
      recompute: also consider recomputing each stage's forward in its backward.
      start: a known plan (layers per stage, groups, M) to start from, e.g. the previous
        plan when re-planning; used when it fits and beats the heuristic.
      prefer_devices: devices for the stage at each position counted from the end of the
        pipeline (0 = last stage), used when its group still fits them (re-planning keeps
        surviving stages where they are, so their state need not move).
      migration: when re-planning, the cost of moving state off the previous plan's surviving
        stages, amortised per step and added to the objective (``_migration``); the plan's
        ``objective`` then includes it, its ``iteration_s`` does not.
      zero: plan with ZeRO-1: every stage with data parallelism shards its optimizer state
        over its replicas (less memory, and the update split; its gradient sync becomes a
        reduce-scatter and an all-gather, in the ring model the cost of the all-reduce it
        replaces). Off by default, as in the executor; the stages record it (``Stage.zero``).
      mixed_stages: also consider stages on hosts of two device types, each type's replicas
        with its own batch share (``_groups``, ``CostTable``). None (default): on clusters of at
        most ``MIXED_HOSTS`` hosts. The executor runs one SPMD program per stage, which cannot
        give replicas uneven shares: plan with False to execute.

    Raises:
      PlanInfeasible: no plan fits (proven); the message names the binding constraint and
        the least extra memory per device that would make one exist.
      PlanNotFound: the time limit ran out before any plan was found and before the
        search space was proven empty.
    """
    if schedule not in ("gpipe", "1f1b"):
        raise ValueError(f"schedule must be 'gpipe' or '1f1b', got {schedule!r}")
    if global_batch < 1:
        raise ValueError(f"global_batch must be >= 1, got {global_batch}")
    started = time.perf_counter()
    cluster = model.cluster
    mixed_stages = offers_mixed(cluster, mixed_stages)
    space = search_space(model, global_batch, recompute=recompute, zero=zero, mixed=mixed_stages)
    L = space.layers
    max_stages = min(max_stages or 16, L, len(cluster.devices()))
    candidates = sorted((m for m in microbatch_candidates if global_batch % m == 0), reverse=True)
    best, lower, unproven = None, math.inf, []
    keys = [(layer.signature, layer.activation_bytes) for layer in model.layers]
    log.debug(
        "search space in %.2f s: %d groups, %d runs, M in %s",
        time.perf_counter() - started,
        len(space.groups),
        len(space.runs),
        candidates,
    )

    def score(ev: Evaluation, stages: list[list[int]], groups: list[GroupConfig]) -> float:
        """What the search minimises: the step time, plus the amortised migration when re-planning."""
        if migration is None:
            return ev.iteration_s
        return ev.iteration_s + migration.step_cost_s(stages, groups, space.table, keys)

    def offer(stages: list[list[int]], groups: list[GroupConfig], M: int) -> Evaluation:
        """Price a plan by the closed form and make it the incumbent if it fits and scores better."""
        nonlocal best
        ev = evaluate(stages, groups, M, table=space.table, infos=space.infos, schedule=schedule, links=space.links)
        if ev.feasible and (best is None or score(ev, stages, groups) < best[0]):
            best = (score(ev, stages, groups), ev, stages, groups, M)
        return ev

    # the heuristic and baselines get at most a third of the budget (largest M first)
    given = start
    start = _heuristic(
        model, space, global_batch, schedule, candidates, max_stages, recompute, deadline=started + time_limit_s / 3
    )
    if start is not None:
        ev = evaluate(
            start.stages,
            start.groups,
            start.microbatches,
            table=space.table,
            infos=space.infos,
            schedule=schedule,
            links=space.links,
        )
        best = (score(ev, start.stages, start.groups), ev, start.stages, start.groups, start.microbatches)
        log.debug(
            "heuristic start: %.6g ms at M=%d, %d stages", ev.iteration_s * MS, start.microbatches, len(start.stages)
        )
    single = _single_stage(space, candidates, schedule, deadline=started + time_limit_s / 3)
    # each M's one-stage optimum, where every group was priced (with a migration term the score is
    # not the step time, so its one-stage pieces are solved as the others are)
    one_stage_s = single.least_s if single.complete and migration is None else {}
    if single.best is not None:
        ev, group, M = single.best
        stages = [list(range(L))]
        if best is None or score(ev, stages, [group]) < best[0]:
            best = (score(ev, stages, [group]), ev, stages, [group], M)
            log.debug("single stage start: %.6g ms at M=%d on %s", ev.iteration_s * MS, M, group)
    if given is not None and given[2] in candidates:
        offer(*given)
    if best is not None:  # the local search around it, in at most POLISH_SHARE of the budget, by half of it
        _, _, stages, groups, M = best
        polished = polish(
            stages,
            groups,
            M,
            space=space,
            schedule=schedule,
            candidates=candidates,
            max_stages=max_stages,
            score=score,
            deadline=min(started + time_limit_s / 2, time.perf_counter() + POLISH_SHARE * time_limit_s),
        )
        if polished is not None and polished.score < best[0]:
            best = (polished.score, polished.evaluation, polished.stages, polished.groups, polished.microbatches)
            log.debug("polished start: %.6g ms at M=%d, %d stages", best[1].iteration_s * MS, best[4], len(best[2]))

    def record(sub: StageModel, result, piece: _Piece | None = None) -> None:
        """Fold one solve into the incumbent and the certified bound (per piece, or per M)."""
        nonlocal lower
        bound = max(result.bound / MS, sub.simple_bound_s())
        if result.has_solution:
            offer(*sub.read(), sub.M)
        if piece is None:  # a whole M at once
            if result.status != "Infeasible":
                lower = min(lower, bound)
                if not result.has_solution and result.status != CUT_OFF:
                    unproven.append(sub.M)
            return
        if result.status == "Infeasible":
            piece.bound_s, piece.done = math.inf, True
        else:
            piece.bound_s = max(piece.bound_s, bound)
            # within the gap of the incumbent is as good as closed (a better incumbent later keeps it so)
            close = best is not None and bound >= _cutoff_ms(best, gap) / MS
            piece.done = result.status in ("Optimal", CUT_OFF) or close

    # whole stages as columns, for every M and S, in at most COLUMN_SHARE of the time left: most pieces close here
    def improve(stages: list[list[int]], groups: list[GroupConfig], M: int):
        """A column MIP's plan, priced by the closed form, made the incumbent if it fits and its score
        is better; returns (its step time, fitting or not; the incumbent). A MIP excludes the plan for
        every plan of the columns it dominates, whose step time is no lower (``_paths``), but which
        may fit where it does not, and whose migration term may be lower: what bounds their scores
        is its step time."""
        before = best
        ev = offer(stages, groups, M)
        if best is not before:
            log.debug("column plan: %.6g ms at M=%d, %d stages", ev.iteration_s * MS, M, len(stages))
        return ev.iteration_s, best

    found_columns = _column_bounds(
        space,
        candidates,
        max_stages,
        schedule,
        best,
        gap=gap,
        deadline=time.perf_counter() + COLUMN_SHARE * (time_limit_s - (time.perf_counter() - started)),
        improve=improve,
    )
    # an M with a column bound for every S needs no packing bound: the least of them bounds it, and it
    # is at least as tight (each column LP is the packing LP restricted to whole stages, one per position)
    complete = {M: min(b.values()) for M, b in found_columns.items() if len(b) == max_stages}
    # each M's packing bound, in at most 9/10 of the time left (it needs them only where the ILP's
    # own pieces would not finish either: GPT-175B, 1.5 s per M; with ¾, its M = 64 stopped at
    # 420.6 s instead of 472.1 s once the local search took its share, session 17)
    packing = _packing_bounds(
        space,
        [M for M in candidates if M not in complete],
        max_stages,
        schedule,
        best,
        gap=gap,
        deadline=time.perf_counter() + 0.9 * (time_limit_s - (time.perf_counter() - started)),
    )
    packing.update(complete)
    # each M's model and its pieces, one per stage count (the CBC fallback solves the model whole)
    pieces: list[_Piece] = []
    # how long the last model took to build; before the first, an estimate from its size (0.5–1.3 s
    # for 208 groups × 3 runs × 16 stages, session 17: GPT-175B's first model, built with 0.8 s
    # left, took its 10 s to 10.1)
    build_s = BUILD_S_PER_CELL * len(space.groups) * len(space.runs) * max_stages
    for index, M in enumerate(candidates):
        packed = packing[M]
        if packed == math.inf:  # no plan of this M fits
            continue
        if best is not None and packed >= _cutoff_ms(best, gap) / MS:  # none is gap better than the incumbent
            lower = min(lower, packed)
            continue
        # out of time, or of time to build one more model (as long as the last took, 1–2 s on the
        # 64-device presets, which overran the limit by up to 1.3 s in session 13): it keeps its packing bound
        if time_limit_s - (time.perf_counter() - started) <= build_s:
            lower = min(lower, packed)
            if best is None:
                unproven.append(M)
            continue
        columns = found_columns.get(M, {})
        building = time.perf_counter()
        sub = StageModel(
            runs=space.runs,
            max_stages=max_stages,
            microbatches=M,
            groups=space.groups,
            table=space.table,
            infos=space.infos,
            schedule=schedule,
            links=space.links,
        )
        sub.build(incumbent_s=best[0] if best else None)
        if migration is not None:
            migration.add_to(sub)
        build_s = time.perf_counter() - building
        log.debug("M=%d: model built in %.2f s (%d groups, %d runs)", M, build_s, len(space.groups), len(space.runs))
        if not highs_available():
            left = time_limit_s - (time.perf_counter() - started)
            result = _whole(sub, best, gap=gap, deadline=time.perf_counter() + left / (len(candidates) - index))
            record(sub, dataclasses.replace(result, bound=max(result.bound, packed * MS)))
            continue
        session = HighsSession(sub.lp)
        # the whole model's relaxation bounds every piece of this M until a piece's own solve does
        # better; where the packing bound got past the capacity bound it is the stronger one (gpt-13b ×
        # mixed-4type-64: 73.9 against 70.6 s, and 2 s per M spent on relaxations of 5 M, session 11)
        left = time_limit_s - (time.perf_counter() - started)
        relaxed = -math.inf
        if packed <= sub.simple_bound_s() * (1 + 1e-9):
            relaxed = session.relaxation_bound(time_limit_s=min(RELAXATION_S, left / (len(candidates) - index)))
            log.debug("M=%d: relaxation bound %.6g ms", M, relaxed)
        if relaxed == math.inf:  # no piece of this M can beat the incumbent
            continue
        floor = max(packed, relaxed / MS)  # packed is never below the capacity bound
        if best is not None and floor >= _cutoff_ms(best, gap) / MS:  # none is gap better than the incumbent
            lower = min(lower, floor)
            continue
        tail = min(TAIL_FROM, sub.J)  # stage counts from here on start as one piece
        sessions = [session]
        # a piece of S stages starts from its link bound where that is higher (it grows with S)
        if len(columns) == sub.J:  # one piece per stage count, each from its column bound
            built = [
                _Piece(sub, sessions, S, bound_s=max(floor, sub.link_bound_s(S), columns[S]))
                for S in range(1, sub.J + 1)
            ]
        else:
            built = [
                _Piece(sub, sessions, S, bound_s=max(floor, sub.link_bound_s(S), columns.get(S, 0.0)))
                for S in range(1, tail)
            ]
            built.append(_Piece(sub, sessions, tail, bound_s=max(floor, sub.link_bound_s(tail)), most=sub.J))
        if M in one_stage_s and built[0].last == 1:  # its one-stage piece is solved already, by enumeration
            built[0].bound_s, built[0].done = max(built[0].bound_s, one_stage_s[M]), True
        pieces += built
    _close_beaten(pieces, best, gap)  # none is gap better than the incumbent
    pieces.sort(key=lambda p: p.stages)
    with PieceWorkers(default_workers(), lambda piece, result: record(piece.model, result, piece)) as workers:
        # the search ends a little early, so the plan (devices, explanation) is built within the limit
        searched_by = started + time_limit_s - min(FINISH_S, time_limit_s / 100)
        pieces = _first_pass(pieces, workers, lambda: best, gap=gap, deadline=searched_by)
        _rounds(pieces, workers, lambda: best, gap=gap, deadline=searched_by)
    for piece in pieces:
        lower = min(lower, piece.bound_s)
        if not piece.done:
            unproven.append(piece.model.M)
            log.debug(
                "open: M=%d, %d–%d stages, bound %.6g ms", piece.model.M, piece.stages, piece.last, piece.bound_s * MS
            )
    if best is None:
        if unproven:
            raise PlanNotFound(
                f"no plan found within time_limit_s={time_limit_s:g} for {L} layers on {len(cluster.devices())} "
                f"devices, and none proven impossible (microbatch counts {sorted(unproven)} ran out of time): "
                "raise time_limit_s"
            )
        raise PlanInfeasible(infeasibility_message(model, space, candidates, max_stages, schedule, global_batch))
    total, ev, stages, chosen, M = best
    return make_plan(
        model,
        space,
        ev,
        stages,
        chosen,
        M,
        schedule=schedule,
        global_batch=global_batch,
        bound=lower,
        gap=gap,
        started=started,
        prefer_devices=prefer_devices,
        objective=total,
    )


def make_plan(
    model: CostModel,
    space: SearchSpace,
    ev: Evaluation,
    stages: list[list[int]],
    chosen: list[GroupConfig],
    M: int,
    *,
    schedule: str,
    global_batch: int,
    bound: float,
    gap: float,
    started: float,
    prefer_devices: list[tuple[str, ...] | None] | None = None,
    objective: float | None = None,
) -> Plan:
    """The :class:`Plan` of an evaluated solution: devices allocated (``prefer_devices`` by
    position from the end), certified ``bound`` (s) on the step time; ``objective`` defaults to
    the step time."""
    S = len(chosen)
    prefer = [
        prefer_devices[S - 1 - s] if prefer_devices and S - 1 - s < len(prefer_devices) else None for s in range(S)
    ]
    devices = _allocate(model.cluster, chosen, prefer=prefer)
    plan_stages = tuple(
        Stage(
            layers=tuple(layers),
            device_type=g.device_type,
            devices=devices[s],
            tp=g.tp,
            dp=g.dp,
            recompute=g.recompute,
            zero=space.table.zero and g.dp > 1,
            microbatch_size=space.table.microbatch(g, M),
            parts=g.parts,
            shares=space.table.shares(g, M) if g.mixed else (),
            time_s=ev.stage_time_s[s],
            memory_bytes=ev.stage_memory_bytes[s],
            forward_s=ev.stage_forward_s[s],
            send_s=ev.stage_send_s[s],
            dp_sync_s=ev.stage_sync_s[s],
            optimizer_s=ev.stage_optimizer_s[s],
        )
        for s, (layers, g) in enumerate(zip(stages, chosen))
    )
    bound = min(bound, ev.iteration_s)
    final_gap = (ev.iteration_s - bound) / ev.iteration_s if ev.iteration_s > 0 else 0.0
    return Plan(
        stages=plan_stages,
        schedule=schedule,  # type: ignore[arg-type]
        microbatches=M,
        global_batch=global_batch,
        iteration_s=ev.iteration_s,
        breakdown=ev.breakdown,
        solver="HiGHS" if highs_available() else "CBC",
        status="Optimal" if final_gap <= gap else "Time limit reached",
        objective=ev.iteration_s if objective is None else objective,
        bound=bound,
        gap=final_gap,
        solve_s=time.perf_counter() - started,
        notes=binding_notes(stages, chosen, M, ev, space),
    )
