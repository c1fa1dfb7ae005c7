"""The result of planning: pipeline stages with their devices and parallel degrees, and the predicted time."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

Schedule = Literal["gpipe", "1f1b"]


class PlanInfeasible(ValueError):
    """No plan fits: the message names the binding constraint and what would make one exist."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Stage:
    """One pipeline stage.

    Attributes:
      layers: indices of its (contiguous) layers.
      device_type: the type of all its devices.
      devices: device refs (``host/index``), tp·dp of them.
      tp, dp: tensor- and data-parallel degrees.
      recompute: whether it recomputes its forward pass in the backward pass.
      microbatch_size: samples per microbatch on each data-parallel replica.
      time_s: forward + backward seconds per microbatch (compute + TP communication).
      memory_bytes: predicted peak per device.
    """

    layers: tuple[int, ...]
    device_type: str
    devices: tuple[str, ...]
    tp: int
    dp: int
    recompute: bool
    microbatch_size: int
    time_s: float
    memory_bytes: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """A training-step plan and what it is predicted to cost.

    Attributes:
      stages: in pipeline order.
      schedule: "gpipe" or "1f1b".
      microbatches: M, microbatches per step.
      global_batch: samples per step.
      iteration_s: predicted step time; ``breakdown`` splits it.
      solver, status, objective, bound, gap, solve_s: how the plan was found.
    """

    stages: tuple[Stage, ...]
    schedule: Schedule
    microbatches: int
    global_batch: int
    iteration_s: float
    breakdown: dict[str, float] = field(default_factory=dict)
    solver: str = ""
    status: str = ""
    objective: float = 0.0
    bound: float = 0.0
    gap: float = 0.0
    solve_s: float = 0.0

    def to_json(self) -> dict:
        data = asdict(self)
        data["stages"] = [asdict(s) for s in self.stages]
        return data

    @classmethod
    def from_json(cls, data: dict) -> Plan:
        stages = tuple(
            Stage(**{**s, "layers": tuple(s["layers"]), "devices": tuple(s["devices"])}) for s in data["stages"]
        )
        return cls(**{**data, "stages": stages})

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2))

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        return cls.from_json(json.loads(Path(path).read_text()))
