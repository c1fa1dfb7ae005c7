"""One predicted-vs-measured comparison of a bench."""

from __future__ import annotations

from dataclasses import dataclass


def rel_err(predicted: float, measured: float) -> float:
    """How far a prediction is from its measurement: ``predicted / measured − 1``, the one definition
    every bench uses (positive: the prediction is too high). 0 when both are 0, ∞ when only the
    measurement is 0.

    Example:
      >>> rel_err(3.0, 2.0)
      0.5
    """
    if measured == 0:
        return 0.0 if predicted == 0 else float("inf")
    return predicted / measured - 1


@dataclass(frozen=True, slots=True, kw_only=True)
class Case:
    name: str
    metric: str
    predicted: float
    measured: float
    tolerance: float  # allowed |rel_err|

    @property
    def rel_err(self) -> float:
        return rel_err(self.predicted, self.measured)

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
