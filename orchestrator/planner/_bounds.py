"""Bounds on every (M, S) piece before any ILP is built: whole stages as columns, then packing.

- **Column bounds** (``_paths``): for every M and S the LP over whole stages as columns, then,
  where the LP leaves the piece open, its MIP. Every plan a MIP finds is priced, may become the
  incumbent, and is excluded from that MIP; most pieces close here.
- **Packing bounds** (``_packing``): for each M not bounded for every S by its columns, a bound
  on any stage count, which drops the M that cannot beat the incumbent.

Each bound is at most the cutoff (:func:`~orchestrator.planner._incumbent.cutoff_ms`), which
closes its piece or M.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

from orchestrator.planner._capacity import capacity_bound_s
from orchestrator.planner._groups import GroupConfig
from orchestrator.planner._ilp import MS, undominated
from orchestrator.planner._incumbent import Best, Incumbent
from orchestrator.planner._packing import TOLERANCE, PackingBound
from orchestrator.planner._paths import StageColumns
from orchestrator.planner._scope import Scope
from orchestrator.planner._workers import WAVE, default_workers
from orchestrator.solver import highs_available, work

log = logging.getLogger(__name__)


def packing_bounds(
    scope: Scope,
    best: Best,
    candidates,
    *,
    deadline: float,
    known: dict[int, float] | None = None,
    probe: bool = False,
    ordered: bool = False,
    searches: dict | None = None,
) -> dict[int, float]:
    """{M: packing bound (s)}, never below the capacity bound: +inf where no plan of that M fits, the
    cutoff where none is ``gap`` better than the incumbent; for ``candidates`` (some of the scope's).

    Two passes. First every M to ``options.coarse`` (fewest microbatches first: where memory binds
    hardest the bound is cheapest), each with an equal share of the time left; then what is left
    refines the weakest M, which is the one the certified bound reads, to the packing search's own
    tolerance: one pass to full precision spends the time on M whose bounds the certificate never
    reads and leaves the last M short. A search stopped by its share keeps the bound it reached.

    With ``probe``, only each M's first LP (the bottleneck at the cutoff over M), which alone closes
    an M that cannot beat the incumbent, and no refining. ``known``: bounds of an earlier pass, which
    the searches start from; ``ordered``: the first pass takes ``candidates`` in the order given;
    ``searches``: each M's packing LPs, kept from one call to the next."""
    space, max_stages, options = scope.space, scope.max_stages, scope.options
    incumbent, cutoff_s = best.current, best.cutoff_s(scope.gap)
    found = {}
    searches = {} if searches is None else searches
    for index, M in enumerate(candidates if ordered else sorted(candidates)):
        groups = undominated(
            [g for g in space.groups if space.table.microbatch(g, M) is not None], space.runs, space.table, M
        )
        simple = max(
            capacity_bound_s(
                space.runs, groups, space.table, space.infos, M, best.schedule, max_stages=max_stages, below_s=cutoff_s
            )
            if groups
            else math.inf,
            (known or {}).get(M, 0.0),
        )
        # (an M whose capacity alone reaches the cutoff needs no packing LP)
        if not groups or simple >= cutoff_s or work.now() >= deadline or not highs_available():
            found[M] = min(simple, cutoff_s)
            continue
        if M not in searches:
            searches[M] = PackingBound(space, groups, microbatches=M, max_stages=max_stages, schedule=best.schedule)
        share = work.now() + (deadline - work.now()) / (len(candidates) - index)
        tolerance = math.inf if probe else options.coarse
        found[M] = _packing_search(searches[M], simple, cutoff_s, incumbent, share, tolerance)
        log.debug("M=%d: packing bound %.6g s (capacity %.6g s)", M, found[M], simple)
    refined: set[int] = set()
    while not probe and work.now() < deadline:
        open_bounds = [M for M in found if M in searches and M not in refined and found[M] < cutoff_s]
        if not open_bounds:
            break
        M = min(open_bounds, key=found.get)
        found[M] = max(found[M], _packing_search(searches[M], found[M], cutoff_s, incumbent, deadline, TOLERANCE))
        refined.add(M)
        log.debug("M=%d: packing bound refined to %.6g s", M, found[M])
    return found


def _packing_search(
    search: PackingBound,
    above_s: float,
    cutoff_s: float,
    incumbent: Incumbent | None,
    deadline: float,
    tolerance: float,
) -> float:
    bound = search.bound_s(above_s=above_s, below_s=cutoff_s, deadline=deadline, tolerance=tolerance)
    if bound == math.inf and incumbent:  # (with no incumbent, +inf means no plan of this M fits)
        return cutoff_s
    return bound


def column_bounds(scope: Scope, best: Best, candidates=None, *, deadline: float) -> dict[int, dict[int, float]]:
    """{M: {S: bound (s)}} from whole stages as columns (``_paths``), each at most the cutoff, which
    closes the piece: the first LP of every (M, S), the incumbent's M and its neighbours first (a
    piece that cannot beat the incumbent closes there; ``StageColumns.first_bound_s``, whose
    bisection is not run: a piece it leaves open goes to its MIP, which is far tighter, and the
    bisections' solves are what that MIP then lacks); then, where
    an LP leaves its (M, S) more than ``gap`` below the incumbent, its MIP (after every LP, weakest
    first; a fair share of the time left, at least ``options.column_mip_s``), two or more at once
    (highspy releases the GIL). Every MIP solution whose stages chain is offered to ``best``; the
    MIP then excludes it and goes on (``StageColumns.integer_bound_s``). A better incumbent lowers
    the cutoff for the MIPs still to run, and a MIP stopped by its time limit runs again, with at
    least ``options.retry_growth`` times its last limit, while time is left. Solves ``deadline``
    stops leave their (M, S) out (first LP) or at the LP's bound (MIP). Over ``candidates``
    (default: the scope's).

    On the wall clock the solves run on ``default_workers()`` threads, each taking the next job as
    one ends, and a MIP's plans lower the cutoff of the MIPs running beside it at once. Counting
    work, they run in waves of ``WAVE`` (``_in_waves``): each solve counts on a lane of its own and
    offers its plans to a fork of ``best``, whose incumbents ``best`` keeps in start order once the
    wave ends, so the steps taken do not depend on which solve ends first."""
    space, max_stages, gap, options = scope.space, scope.max_stages, scope.gap, scope.options
    candidates = scope.candidates if candidates is None else candidates
    found: dict[int, dict[int, float]] = {M: {} for M in candidates}
    if not highs_available():
        return found
    cutoff_s = best.cutoff_s(gap)
    columns: dict[int, StageColumns] = {}
    for M in candidates:
        groups = [g for g in space.groups if space.table.microbatch(g, M) is not None]
        if not groups:  # no group divides the microbatch: no plan of this M
            found[M] = dict.fromkeys(range(1, max_stages + 1), math.inf)
            continue
        columns[M] = StageColumns(space, groups, microbatches=M, schedule=best.schedule)
    near = best.current.microbatches if best.current else max(candidates, default=1)
    order = sorted(columns, key=lambda M: abs(math.log2(M / near)))
    waves = work.counting()
    workers = WAVE if waves else default_workers()
    pool = ThreadPoolExecutor(workers)
    jobs = [
        ("lp", M, S, functools.partial(columns[M].first_bound_s, S, cutoff_s=cutoff_s))
        for M in order
        for S in range(1, max_stages + 1)
    ]
    limits: dict[tuple[int, int], float] = {}  # each MIP's last time limit

    lock = threading.Lock()

    def price(M: int, into: Best, stages: list[list[int]], groups: list[GroupConfig]) -> tuple[float, float]:
        """A MIP's plan offered to ``into`` (``best`` or its fork): (its step time, fitting or not;
        the cutoff now). A MIP excludes the plan for every plan of the columns it dominates, whose
        step time is no lower (``_paths``), but which may fit where it does not, and whose migration
        term may be lower: what bounds their scores is its step time. Past the deadline the search
        has moved on: (0, 0) ends the MIP, whose result is not read."""
        nonlocal cutoff_s
        if work.now() >= deadline:
            return 0.0, 0.0
        with lock:
            before = into.current
            ev = into.offer(stages, groups, M)
            if into.current is not before:
                log.debug("column plan: %.6g ms at M=%d, %d stages", ev.iteration_s * MS, M, len(stages))
            if into is best:
                cutoff_s = best.cutoff_s(gap)
            return ev.iteration_s, into.cutoff_s(gap)

    def mip(M: int, S: int):  # (under the cutoff of the incumbent when it starts)
        left = deadline - work.now()
        share = left * workers / (len(jobs) + 1)  # (the MIPs still waiting, and this one)
        limit = limits[M, S] = min(
            left, max(options.column_mip_s, share, options.retry_growth * limits.get((M, S), 0.0))
        )
        into = best.fork() if waves else best
        pricing = functools.partial(price, M, into)
        return columns[M].integer_bound_s(S, cutoff_s=cutoff_s, time_limit_s=limit, price=pricing), into

    def queue(pieces) -> None:  # MIPs of the open pieces, weakest first (never without an incumbent)
        if best.current is not None:
            waiting = sorted((found[M][S], M, S) for M, S in pieces if found[M][S] < cutoff_s)
            jobs.extend(("mip", M, S, functools.partial(mip, M, S)) for _, M, S in waiting)

    lps, stopped = len(jobs), []
    run = _in_waves if waves else _on_threads
    try:
        for kind, M, S, result in run(pool, workers, jobs, deadline):
            if kind == "lp":
                found[M][S], _ = result  # (the bisection it offers is not run, above)
                lps -= 1
                if not lps:
                    log.debug("column LPs done")
                    queue([(M, S) for M, bounds in found.items() for S in bounds])
                continue
            (bound, _, decided), into = result  # (its plans went to ``price``)
            if into is not best and into.current is not None:
                best.keep(into.current)
                cutoff_s = best.cutoff_s(gap)
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


def _in_waves(pool: ThreadPoolExecutor, size: int, jobs: list, deadline: float):
    """Counting work: the (kind, M, S, job) of ``jobs`` ``size`` at a time, first first, each
    counted on a lane from the wave's start (``work.lane``), yielding (kind, M, S, job()) in start
    order once the whole wave has ended and its lanes are folded into the clock; the caller may add
    jobs between yields, and no wave starts past ``deadline``."""
    while jobs and work.now() < deadline:
        wave = [jobs.pop(0) for _ in range(min(size, len(jobs)))]
        lanes = [work.lane() for _ in wave]
        futures = [pool.submit(work.counted_on, lane, job) for lane, (_, _, _, job) in zip(lanes, wave)]
        results = [future.result() for future in futures]
        work.fold(lanes)
        for (kind, M, S, _), result in zip(wave, results):
            yield kind, M, S, result


def _on_threads(pool: ThreadPoolExecutor, workers: int, jobs: list, deadline: float):
    """Run the (kind, M, S, job) of ``jobs``, first first, at most one per worker at once, yielding
    (kind, M, S, job()) as each ends, until ``deadline``; the caller may add jobs between yields."""
    running = {}
    while (jobs or running) and (left := deadline - work.now()) > 0:
        while jobs and len(running) < workers:
            kind, M, S, job = jobs.pop(0)
            running[pool.submit(job)] = (kind, M, S)
        # (counting work, the clock moves only as a job charges it: wait for the job to end)
        done, _ = wait(running, timeout=None if work.counting() else left, return_when=FIRST_COMPLETED)
        for future in done:
            kind, M, S = running.pop(future)
            yield kind, M, S, future.result()
