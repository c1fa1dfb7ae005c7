"""Solving the pieces: a presolve-free first pass, then rounds over the open ones, weakest first.

Every solve asks only for plans ``gap`` better than the incumbent (``_incumbent.cutoff_ms``);
a piece with no plan below the cutoff takes the cutoff as its bound. Solves still running at the
deadline are left behind (``_workers``): their pieces keep the bounds they had, so the planner
returns within its time limit.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Callable

import pulp

from orchestrator.planner._ilp import MS, StageModel
from orchestrator.planner._incumbent import Incumbent, cutoff_ms
from orchestrator.planner._options import SearchOptions
from orchestrator.planner._pieces import CUT_OFF, Piece, close_beaten
from orchestrator.planner._workers import PieceWorkers
from orchestrator.solver import HighsSession, solve, work

log = logging.getLogger(__name__)

Current = Callable[[], Incumbent | None]  # the incumbent now (it changes while pieces solve)


def first_pass(
    pieces: list[Piece], workers: PieceWorkers, best: Current, *, gap: float, deadline: float, options: SearchOptions
) -> list[Piece]:
    """A short presolve-free solve of every piece, fewest stages first; a tail piece that does not
    close at once goes on as one piece per stage count. Returns every piece, solved or not."""
    queue, kept = list(pieces), []

    def settle(piece: Piece) -> None:
        if piece.most and not piece.done:
            queue.extend(close_beaten(piece.split(), best(), gap))
        else:
            kept.append(piece)

    while (queue or workers.running) and (left := deadline - work.now()) > workers.overrun_s:
        for piece in list(queue):
            if piece.done:
                queue.remove(piece)
                kept.append(piece)
            elif workers.can_start(piece):
                queue.remove(piece)
                first = min(options.first_pass_s, max(0.05, left * workers.workers / (2 * (len(queue) + 1))))
                workers.start(
                    piece, piece_solve(piece, best(), gap=gap, time_limit_s=first, options=options.mip_options())
                )
            if workers.full:
                break
        for piece in workers.finish_one(deadline):
            settle(piece)
    for piece in workers.drain(deadline):
        settle(piece)
    # solves left running at the deadline: their pieces stay open with the bounds they had
    return kept + queue + [piece for piece, _ in workers.running.values()]


def rounds(
    pieces: list[Piece], workers: PieceWorkers, best: Current, *, gap: float, deadline: float, options: SearchOptions
) -> None:
    """Solve the open pieces again, weakest bound first, each with a fair share of the time left and
    at least ``options.retry_growth`` times its last try (each try starts over), until all close or
    time is up."""
    while (left := deadline - work.now()) > 0.05 + workers.overrun_s:
        close_beaten(pieces, best(), gap)
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
                    max(0.1, left * workers.workers / open_count, options.retry_growth * piece.limit_s),
                )
                workers.start(piece, piece_solve(piece, best(), gap=gap, time_limit_s=limit))
        workers.finish_one(deadline)
    workers.drain(deadline)


def piece_solve(piece: Piece, best: Incumbent | None, *, gap: float, time_limit_s: float, options: dict | None = None):
    """A job for :class:`PieceWorkers`: given a session of the piece's model, prepare (now, on this
    thread: the start writes the model's variables) and return the solve of ``piece`` for better
    plans than ``best``, started from it when it has the piece's M and S; a search stopped before
    its root bound reports its relaxation's bound."""
    sub, S = piece.model, piece.stages
    closed = {sub.u[j, g]: (0.0, 0.0) for j in range(piece.last, sub.J) for g in range(len(sub.groups))}
    rows = {f"stage_order_one_group_{S - 1}": (1.0, 1.0)}
    ours = best is not None and best.microbatches == sub.M and S <= len(best.stages) <= piece.last
    warm = ours and sub.set_start(best.stages, best.groups)
    cutoff = None if warm or best is None else cutoff_ms(best, gap)
    piece.limit_s = time_limit_s

    def prepare(session: HighsSession):
        start = session.current() if warm else None
        return functools.partial(_solve, piece, session, closed, rows, cutoff, start, gap, time_limit_s, options)

    return prepare


def _solve(piece: Piece, session: HighsSession, closed, rows, cutoff, start, gap, time_limit_s, options):
    """The solve of :func:`piece_solve` (on a worker thread: touches only ``session``)."""
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


def whole(sub: StageModel, best: Incumbent | None, *, gap: float, deadline: float):
    """One solve over every stage count (the CBC fallback, which has no session)."""
    warm = best is not None and best.microbatches == sub.M and sub.set_start(best.stages, best.groups)
    cutoff = None if warm or best is None else cutoff_ms(best, gap)
    if cutoff is not None:
        sub.lp += sub.lp.objective <= cutoff, "better_than_incumbent"
    result = solve(sub.lp, time_limit_s=max(0.2, deadline - work.now()), gap=gap, use_start=warm)
    result = _or_relaxation(result, sub, lambda: _relaxation_bound(sub.lp, time_limit_s=0.5))
    if cutoff is not None and result.status == "Infeasible":
        result = dataclasses.replace(result, status=CUT_OFF, bound=cutoff)
    return result


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
