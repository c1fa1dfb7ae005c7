"""What every step of one search reads: the space searched, the counts it ranges over, its gap, its options."""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.planner._options import SearchOptions
from orchestrator.planner._space import SearchSpace


@dataclass(frozen=True, slots=True, kw_only=True)
class Scope:
    """One ``plan()`` call's search, as its steps (``_starts``, ``_bounds``, ``_models``) read it."""

    space: SearchSpace
    candidates: list[int]
    """The microbatch counts that divide the global batch, largest first."""
    max_stages: int
    """The deepest pipeline searched."""
    gap: float
    """The relative gap within which a plan counts as optimal and a piece as closed."""
    options: SearchOptions
