"""Budgets in solver work: the clock a search's time shares read, counted in nominal seconds.

A search that shares a wall-clock limit between its steps takes different steps on a loaded
machine: each solve stops wherever its share runs out, and the plan and its certified gap follow.
Inside :func:`work_budget` the clock counts work instead — simplex iterations (weighted by the
size of the model they iterate on), branch-and-bound nodes, and whatever the caller charges
(:func:`charge`, e.g. per plan priced) — each at a fixed price in nominal seconds, about what it
takes on an idle core. Every share read off that clock, and every solve's node limit
(:func:`limits`), is then the same however busy the machine is, so the same input takes the same
steps; a wall-clock limit stays only as a safety cap (:func:`wall_limit_s`), far above the budget.

Outside :func:`work_budget`, :func:`now` is ``time.perf_counter()`` and nothing is counted.
The clock is one per process: one search counts at a time (a second one waits for the first).

Solves run side by side in **lanes** (:func:`lane`, :func:`fold`): each worker thread's work is
counted on a lane of its own, which starts at the clock's time, and is added to the clock only
once every lane of the wave has ended, in the order the lanes were started. A solve then reads the
same clock (its deadline, its share) whatever the other lanes did meanwhile, so a wave of solves
takes the same steps on one core or two, loaded or idle.

Example:
  >>> from orchestrator.solver import work
  >>> with work.work_budget():
  ...     work.charge(0.5)
  ...     round(work.now(), 3)
  0.5
  >>> work.counting()
  False
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")

# nominal seconds per unit of work, about an idle core's: one simplex iteration per (row + column) of
# the model it iterates on, one branch-and-bound node (its LP iterations are counted apart)
ITERATION_CELL_S = 3e-8
NODE_S = 1e-3
# one plan priced by the closed form, one (run, group) cell of a bound's cost table (what a
# search's own Python charges)
PLAN_S = 1e-4
CELL_S = 2e-4
# a MIP given s nominal seconds may explore this many nodes per second
NODES_PER_S = 400
# the wall-clock safety cap, as a multiple of the budget (plus a constant): a search stopped by it
# is no longer load-independent, so it sits far above what an idle machine needs
WALL_CAP = 10.0
WALL_CAP_S = 30.0


class Lane:
    """One worker's count inside a wave: it reads the clock as ``start + spent``."""

    def __init__(self, start: float) -> None:
        self.start, self.spent = start, 0.0


class _Clock:
    def __init__(self) -> None:
        self.spent = 0.0
        self.lock = threading.Lock()

    def charge(self, seconds: float) -> None:
        with self.lock:
            self.spent += seconds


_active: _Clock | None = None
_depth = 0
_one_search = threading.RLock()  # held by the thread whose search counts
_lanes = threading.local()  # the lane this thread counts on, if any


@contextmanager
def work_budget() -> Iterator[None]:
    """Count work on the clock while inside, from 0; nested (a re-plan's search) it goes on with the
    outer count, and another thread's search waits for this one."""
    global _active, _depth
    with _one_search:
        if _depth == 0:
            _active = _Clock()
        _depth += 1
        try:
            yield
        finally:
            _depth -= 1
            if _depth == 0:
                _active = None


def counting() -> bool:
    """Whether the clock counts work (inside :func:`work_budget`)."""
    return _active is not None


def now() -> float:
    """The clock: nominal seconds of work counted (on this thread's lane, if it runs on one), or
    ``time.perf_counter()`` when not counting."""
    clock = _active
    if clock is None:
        return time.perf_counter()
    current = getattr(_lanes, "current", None)
    return current.start + current.spent if current is not None else clock.spent


def charge(seconds: float) -> None:
    """Count ``seconds`` of nominal work (on this thread's lane, if it runs on one; nothing when not
    counting)."""
    clock = _active
    if clock is None:
        return
    current = getattr(_lanes, "current", None)
    if current is not None:
        current.spent += seconds
    else:
        clock.charge(seconds)


def lane() -> Lane:
    """A lane starting at the clock's time now, to hand a worker (:func:`counted_on`)."""
    return Lane(now())


def counted_on(on: Lane, job: Callable[[], T]) -> T:
    """``job()`` with this thread's work counted on ``on`` (call it on the worker thread)."""
    _lanes.current = on
    try:
        return job()
    finally:
        _lanes.current = None


def fold(lanes: Iterable[Lane]) -> None:
    """Add the ended ``lanes``' work to the clock, in the order given (their start order)."""
    for ended in lanes:
        charge(ended.spent)


def charge_highs(highs) -> None:
    """Count the work of the run ``highs`` just finished: its simplex iterations, each weighted by
    the model's rows and columns, and its branch-and-bound nodes."""
    clock = _active
    if clock is None:
        return
    info = highs.getInfo()
    cells = highs.getNumRow() + highs.getNumCol()
    iterations = max(0, int(info.simplex_iteration_count)) + max(0, int(info.ipm_iteration_count))
    charge(iterations * cells * ITERATION_CELL_S + max(0, int(info.mip_node_count)) * NODE_S)


def run(highs) -> None:
    """``highs.run()``, its work counted."""
    highs.run()
    charge_highs(highs)


def limits(seconds: float) -> dict:
    """HiGHS options that end a MIP given ``seconds`` (nominal) by its work when counting: a node
    limit, and no feasibility jump (a primal heuristic run before the first node, which no node
    limit stops and which can run for minutes on a model a node limit keeps to a second). Empty when
    not counting (its time limit ends it)."""
    if _active is None:
        return {}
    return {"mip_max_nodes": max(1, int(seconds * NODES_PER_S)), "mip_heuristic_run_feasibility_jump": False}


def wall_cap_s(seconds: float) -> float:
    """The wall-clock safety cap of work budgeted at ``seconds``."""
    return WALL_CAP * seconds + WALL_CAP_S


def wall_limit_s(seconds: float) -> float:
    """The wall-clock limit of a solve given ``seconds``: those seconds when not counting, else the
    safety cap far above them."""
    return seconds if _active is None else wall_cap_s(seconds)
