"""The incumbent: the best plan a search has found so far, and what a better one must beat.

A search minimises a plan's *score*: its step time, plus the amortised cost of moving state
when re-planning (``_migration``). Every solve asks only for plans ``gap`` better than the
incumbent (:func:`cutoff_ms`): asking for a plan ``gap`` better, rather than any better, lets
HiGHS prune every node whose bound is within ``gap`` of the incumbent, so most pieces prove at
once that they cannot beat it. A piece with no plan below the cutoff gets the cutoff as its
bound, so the certified gap still covers the whole search space; it is then at most ``gap``,
not 0.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from orchestrator.planner._evaluate import Evaluation, evaluate
from orchestrator.planner._groups import GroupConfig
from orchestrator.planner._ilp import MS
from orchestrator.planner._migration import Migration
from orchestrator.planner._space import SearchSpace


class Incumbent(NamedTuple):
    """A priced plan that fits: its score (s), evaluation, stages (layer lists), groups and M."""

    score: float
    evaluation: Evaluation
    stages: list[list[int]]
    groups: list[GroupConfig]
    microbatches: int


def cutoff_ms(best: Incumbent, gap: float) -> float:
    """Only plans below this (ms) are wanted from a solve: within ``gap`` of ``best`` is close enough."""
    return best.score * MS * (1 - max(gap * (1 - 1e-6), 1e-9))  # (a hair inside, so rounding never reports gap+)


class Best:
    """The incumbent of one search (``current``, None before the first plan) and how plans are
    priced against it: the closed form (``evaluate``), plus the migration term when re-planning."""

    def __init__(self, space: SearchSpace, schedule: str, *, migration: Migration | None, keys: list) -> None:
        self.space, self.schedule, self.migration, self.keys = space, schedule, migration, keys
        self.current: Incumbent | None = None

    def score(self, ev: Evaluation, stages: list[list[int]], groups: list[GroupConfig]) -> float:
        """What the search minimises: the step time, plus the amortised migration when re-planning."""
        if self.migration is None:
            return ev.iteration_s
        return ev.iteration_s + self.migration.step_cost_s(stages, groups, self.space.table, self.keys)

    def evaluate(self, stages: list[list[int]], groups: list[GroupConfig], M: int) -> Evaluation:
        """A plan priced by the closed form."""
        space = self.space
        return evaluate(
            stages, groups, M, table=space.table, infos=space.infos, schedule=self.schedule, links=space.links
        )

    def keep(self, found: Incumbent) -> bool:
        """Make ``found`` the incumbent if it scores better; whether it did."""
        if self.current is None or found.score < self.current.score:
            self.current = found
            return True
        return False

    def offer(self, stages: list[list[int]], groups: list[GroupConfig], M: int) -> Evaluation:
        """Price a plan and make it the incumbent if it fits and scores better; returns its evaluation."""
        ev = self.evaluate(stages, groups, M)
        if ev.feasible:
            self.keep(Incumbent(self.score(ev, stages, groups), ev, stages, groups, M))
        return ev

    def fork(self) -> Best:
        """A Best that starts at this incumbent and whose offers leave this one alone (a solve of a
        wave offers to its own fork; :meth:`keep` takes the fork's incumbent once the wave ends)."""
        forked = Best(self.space, self.schedule, migration=self.migration, keys=self.keys)
        forked.current = self.current
        return forked

    def cutoff_s(self, gap: float) -> float:
        """The cutoff (s) of :func:`cutoff_ms`; +inf before the first plan."""
        return cutoff_ms(self.current, gap) / MS if self.current is not None else math.inf
