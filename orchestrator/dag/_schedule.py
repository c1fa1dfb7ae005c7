"""A schedule: where and when each task runs, checked against its problem."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from orchestrator.dag._problem import ScheduleProblem

_EPS = 1e-9


@dataclass(frozen=True, slots=True, kw_only=True)
class Placement:
    device: int
    slot: int
    start_s: float
    finish_s: float


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """Task placements and how they were found.

    Attributes:
      placements: task → device, slot, start and finish.
      method: "heft", "cpop", "milp", "exhaustive".
      bound: proven lower bound on the optimal makespan (0 if none).
      gap: (makespan − bound) / makespan, as certified by the solver.
      solve_s: seconds spent finding it.
      status: the solver's status, for the MILP.
    """

    problem: ScheduleProblem
    placements: dict[str, Placement]
    method: str
    bound: float = 0.0
    gap: float = float("inf")
    solve_s: float = 0.0
    status: str = ""

    @property
    def makespan(self) -> float:
        return max(p.finish_s for p in self.placements.values())

    def device_of(self, task: str) -> str:
        return self.problem.devices[self.placements[task].device]

    def validate(self) -> None:
        """Raise ``AssertionError`` naming the first violated rule."""
        prob = self.problem
        assert set(self.placements) == set(prob.tasks), "every task placed exactly once"
        for task, p in self.placements.items():
            duration = prob.exec_s[task][p.device]
            assert duration != float("inf"), f"{task} on a device it may not use"
            assert 0 <= p.slot < prob.slots[p.device], f"{task} on a slot its device lacks"
            assert abs(p.finish_s - p.start_s - duration) <= _EPS * max(1.0, duration), f"{task} duration"
            assert p.start_s >= -_EPS, f"{task} starts before 0"
        for a, b in prob.edges:
            pa, pb = self.placements[a], self.placements[b]
            ready = pa.finish_s + prob.transfer_s((a, b), pa.device, pb.device)
            assert pb.start_s >= ready - _EPS * max(1.0, ready), f"{b} starts before {a}'s data arrives"
        by_slot: dict[tuple[int, int], list[Placement]] = {}
        for p in self.placements.values():
            by_slot.setdefault((p.device, p.slot), []).append(p)
        for slot, items in by_slot.items():
            items.sort(key=lambda p: p.start_s)
            for first, second in itertools.pairwise(items):
                assert second.start_s >= first.finish_s - _EPS * max(1.0, first.finish_s), f"overlap on {slot}"

    def to_json(self) -> dict:
        return {
            "method": self.method,
            "makespan": self.makespan,
            "bound": self.bound,
            "gap": self.gap,
            "solve_s": self.solve_s,
            "status": self.status,
            "placements": {
                t: {
                    "device": self.problem.devices[p.device],
                    "slot": p.slot,
                    "start_s": p.start_s,
                    "finish_s": p.finish_s,
                }
                for t, p in self.placements.items()
            },
        }


def earliest_start(problem: ScheduleProblem, placements: dict[str, Placement], task: str, device: int) -> float:
    """When all of ``task``'s inputs can be on ``device``."""
    ready = 0.0
    for pred in problem.preds(task):
        p = placements[pred]
        ready = max(ready, p.finish_s + problem.transfer_s((pred, task), p.device, device))
    return ready


def insertion_slot(busy: list[tuple[float, float]], ready: float, duration: float) -> float:
    """Earliest start ≥ ``ready`` of an idle gap of ``duration`` among sorted ``busy`` intervals."""
    start = ready
    for begin, end in busy:
        if start + duration <= begin + _EPS:
            return start
        start = max(start, end)
    return start
