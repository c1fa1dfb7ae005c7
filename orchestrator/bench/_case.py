"""One predicted-vs-measured comparison of a bench."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class Case:
    name: str
    metric: str
    predicted: float
    measured: float
    tolerance: float  # allowed |rel_err|

    @property
    def rel_err(self) -> float:
        if self.measured == 0:
            return 0.0 if self.predicted == 0 else float("inf")
        return self.predicted / self.measured - 1

    @property
    def ok(self) -> bool:
        return abs(self.rel_err) <= self.tolerance

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "metric": self.metric,
            "predicted": float(self.predicted),
            "measured": float(self.measured),
            "rel_err": float(self.rel_err),
            "tolerance": float(self.tolerance),
            "ok": bool(self.ok),
        }
