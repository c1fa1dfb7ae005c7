"""Where a search stands, for a ``plan(progress=...)`` observer: the step, the pieces solved, incumbent, bound, gap."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

Step = Literal["first plan", "bounds", "models", "pieces", "done"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SearchProgress:
    """One report of a running ``plan()``: sent as each step of the search starts and as each piece's
    solve ends (``_driver``), on the thread that called ``plan()``.

    Example:
      >>> SearchProgress(step="pieces", elapsed_s=1.0, incumbent_s=0.2, bound_s=0.19).gap
      0.04999999999999996
    """

    step: Step
    """"first plan" (heuristic, baselines, local search), "bounds" (whole-stage and packing bounds),
    "models" (each microbatch count's model built), "pieces" (their solves), "done"."""
    elapsed_s: float
    """Seconds since ``plan()`` started."""
    incumbent_s: float | None = None
    """The best plan's step time so far (None before the first)."""
    bound_s: float | None = None
    """A lower bound on every plan's step time, once the search has one over the whole space."""
    pieces_solved: int = 0
    """Piece solves finished so far (a piece may be solved more than once)."""
    pieces: int = 0
    """The pieces the search built."""

    @property
    def gap(self) -> float | None:
        """(incumbent − bound) / incumbent, when both are known."""
        if self.incumbent_s is None or self.bound_s is None or self.bound_s == -math.inf:
            return None
        # a bound past the incumbent (every open piece closed: +inf) certifies it
        bound = min(self.bound_s, self.incumbent_s)
        return (self.incumbent_s - bound) / self.incumbent_s if self.incumbent_s > 0 else 0.0


Observer = Callable[[SearchProgress], None]
