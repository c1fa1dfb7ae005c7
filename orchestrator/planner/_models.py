"""Each open microbatch count's ILP (``_ilp.StageModel``), built and cut into pieces.

An M is built only while it may still hold a plan ``gap`` better than the incumbent: its packing
bound (or, where that is only the capacity bound, its whole-model LP relaxation) must be below the
cutoff, and there must be time left to build one more model. Its pieces start from the strongest
bound known: that floor, each stage count's column bound, or its own link bound (the transfers on
the pipeline's critical paths, which grow with S, ``_ilp.link_bound_s``).
"""

from __future__ import annotations

import dataclasses
import logging
import math

from orchestrator.planner._ilp import MS, StageModel
from orchestrator.planner._incumbent import Best
from orchestrator.planner._migration import Migration
from orchestrator.planner._pieces import Certificate, Piece
from orchestrator.planner._scope import Scope
from orchestrator.planner._solve import whole
from orchestrator.planner._space import SearchSpace
from orchestrator.solver import HighsSession, highs_available, work

log = logging.getLogger(__name__)


def build_pieces(
    scope: Scope,
    certificate: Certificate,
    *,
    packing: dict[int, float],
    columns: dict[int, dict[int, float]],
    one_stage_s: dict[int, float],
    migration: Migration | None,
    started: float,
    time_limit_s: float,
) -> list[Piece]:
    """The pieces of every M that may still beat the incumbent (closing the others in
    ``certificate``), from the largest M; without HiGHS each such M is solved whole instead."""
    best, gap = certificate.best, certificate.gap
    space, candidates, max_stages, options = scope.space, scope.candidates, scope.max_stages, scope.options
    pieces: list[Piece] = []
    # how long the last model took to build; before the first, an estimate from its size
    build_s = options.build_s_per_cell * len(space.groups) * len(space.runs) * max_stages
    for index, M in enumerate(candidates):
        packed = packing[M]
        if packed == math.inf:  # no plan of this M fits
            continue
        if packed >= best.cutoff_s(gap):  # none is gap better than the incumbent
            certificate.close(packed)
            continue
        if time_limit_s - (work.now() - started) <= build_s:  # no time to build it: it keeps its packing bound
            certificate.close(packed)
            if best.current is None:
                certificate.unproven.append(M)
            continue
        building = work.now()
        sub = _model(space, M, max_stages, best, migration)
        work.charge(options.build_s_per_cell * len(space.groups) * len(space.runs) * max_stages)  # (its cells)
        build_s = work.now() - building
        log.debug("M=%d: model built in %.2f s (%d groups, %d runs)", M, build_s, len(space.groups), len(space.runs))
        if not highs_available():
            left = time_limit_s - (work.now() - started)
            result = whole(sub, best.current, gap=gap, deadline=work.now() + left / (len(candidates) - index))
            certificate.record(sub, dataclasses.replace(result, bound=max(result.bound, packed * MS)))
            continue
        session = HighsSession(sub.lp)
        # the whole model's relaxation bounds every piece of this M until a piece's own solve does
        # better; where the packing bound got past the capacity bound it is the stronger one
        left = time_limit_s - (work.now() - started)
        relaxed = -math.inf
        if packed <= sub.simple_bound_s() * (1 + 1e-9):
            relaxed = session.relaxation_bound(time_limit_s=min(options.relaxation_s, left / (len(candidates) - index)))
            log.debug("M=%d: relaxation bound %.6g ms", M, relaxed)
        if relaxed == math.inf:  # no piece of this M can beat the incumbent
            continue
        floor = max(packed, relaxed / MS)  # packed is never below the capacity bound
        if floor >= best.cutoff_s(gap):  # none is gap better than the incumbent
            certificate.close(floor)
            continue
        built = _pieces_of(sub, session, floor, columns.get(M, {}), tail_from=options.tail_from)
        if M in one_stage_s and built[0].last == 1:  # its one-stage piece is solved already, by enumeration
            built[0].bound_s, built[0].done = max(built[0].bound_s, one_stage_s[M]), True
        pieces += built
    return pieces


def _model(space: SearchSpace, M: int, max_stages: int, best: Best, migration: Migration | None) -> StageModel:
    """M's ILP, built (with the migration term when re-planning)."""
    sub = space.stage_model(M, max_stages, best.schedule)
    sub.build(incumbent_s=best.current.score if best.current else None)
    if migration is not None:
        migration.add_to(sub)
    return sub


def _pieces_of(
    sub: StageModel, session: HighsSession, floor: float, columns: dict[int, float], *, tail_from: int
) -> list[Piece]:
    """One piece per stage count, each from its column bound where every count has one; else the
    counts from ``tail_from`` on as one tail piece. A piece of S stages starts from its link bound
    where that is higher (it grows with S)."""
    sessions = [session]
    if len(columns) == sub.J:
        return [
            Piece(sub, sessions, S, bound_s=max(floor, sub.link_bound_s(S), columns[S])) for S in range(1, sub.J + 1)
        ]
    tail = min(tail_from, sub.J)
    built = [
        Piece(sub, sessions, S, bound_s=max(floor, sub.link_bound_s(S), columns.get(S, 0.0))) for S in range(1, tail)
    ]
    built.append(Piece(sub, sessions, tail, bound_s=max(floor, sub.link_bound_s(tail)), most=sub.J))
    return built
