"""The pieces of the search, and the certificate their solves add up to.

A *piece* is one microbatch count M's ILP (``_ilp.StageModel``) with exactly S stages: positions
≥ S closed, S − 1 open. Fixing S removes the relaxation's cheapest trick (spreading the work over
fractions of many stages, which hides the pipeline fill), so a piece proves its bound far sooner
than the whole model of its M. The pieces of one M share its HiGHS sessions (the model loaded
once per session, bounds changed per solve; ``_workers`` opens another when two pieces of one M
solve at once).

The certified lower bound is the smallest bound over all pieces, and over the M closed before
their pieces were built, so the gap covers the whole search space.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from orchestrator.planner._ilp import MS, StageModel
from orchestrator.planner._incumbent import Best, Incumbent, cutoff_ms
from orchestrator.solver import HighsSession

log = logging.getLogger(__name__)

# a solve's status when it proved no plan below its cutoff (``_incumbent.cutoff_ms``)
CUT_OFF = "Cut off"


@dataclass(slots=True)
class Piece:
    """One piece of the search: microbatch count ``model.M`` with exactly ``stages`` stages (a tail
    piece: any count from ``stages`` to ``most``)."""

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

    def split(self) -> list[Piece]:
        """A tail piece's stage counts as pieces of their own, each keeping its bound (or its own
        link bound, which grows with the stage count)."""
        return [
            Piece(self.model, self.sessions, S, bound_s=max(self.bound_s, self.model.link_bound_s(S)))
            for S in range(self.stages, self.last + 1)
        ]


def close_beaten(pieces: list[Piece], best: Incumbent | None, gap: float) -> list[Piece]:
    """``pieces``, those whose bound is within ``gap`` of the incumbent ``best`` closed unsolved: a
    tail piece's stage counts start from their link bounds, which grow with S and may start above
    the cutoff, and a better incumbent found since a piece's last solve may put its bound past it."""
    if best is not None:
        cutoff = cutoff_ms(best, gap) / MS
        for piece in pieces:
            piece.done = piece.done or piece.bound_s >= cutoff
    return pieces


@dataclass(slots=True)
class Certificate:
    """What the search has proven: ``lower``, the least bound (s) over every M and piece closed or
    left open, and ``unproven``, the M whose search ran out of time before it found or excluded a plan."""

    best: Best
    gap: float
    lower: float = math.inf
    unproven: list[int] = field(default_factory=list)

    def close(self, bound_s: float) -> None:
        """An M or piece closed (or given up) with this bound."""
        self.lower = min(self.lower, bound_s)

    def record(self, sub: StageModel, result, piece: Piece | None = None) -> None:
        """Fold one solve into the incumbent and the certified bound (per piece, or per M)."""
        bound = max(result.bound / MS, sub.simple_bound_s())
        if result.has_solution:
            self.best.offer(*sub.read(), sub.M)
        if piece is None:  # a whole M at once
            if result.status != "Infeasible":
                self.close(bound)
                if not result.has_solution and result.status != CUT_OFF:
                    self.unproven.append(sub.M)
            return
        if result.status == "Infeasible":
            piece.bound_s, piece.done = math.inf, True
        else:
            piece.bound_s = max(piece.bound_s, bound)
            # within the gap of the incumbent is as good as closed (a better incumbent later keeps it so)
            close = self.best.current is not None and bound >= cutoff_ms(self.best.current, self.gap) / MS
            piece.done = result.status in ("Optimal", CUT_OFF) or close

    def settle(self, pieces: list[Piece]) -> None:
        """Fold the pieces' bounds in once their solves are over: an open piece leaves its M unproven."""
        for piece in pieces:
            self.close(piece.bound_s)
            if not piece.done:
                self.unproven.append(piece.model.M)
                log.debug(
                    "open: M=%d, %d–%d stages, bound %.6g ms",
                    piece.model.M,
                    piece.stages,
                    piece.last,
                    piece.bound_s * MS,
                )
