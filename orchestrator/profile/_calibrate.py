"""Fit the cost model's efficiencies to measured layer times.

For each measured piece (a layer's forward, backward or optimizer part) the
model predicts

    t̂ = Σ_class term_class / e_class        (see ``orchestrator.costs._roofline``)

with each term the seconds the piece's ops would take at the device's peak.
That is linear in the inverse efficiencies, so the fit is a non-negative
least-squares problem, solved exactly. Rows are weighted
by 1/t: the error minimised is relative, each piece counting the same.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from orchestrator.cluster import DeviceType
from orchestrator.costs import EFFICIENCY_CLASSES, Efficiency, op_terms, op_time_s
from orchestrator.graph import Op

_NAMES = EFFICIENCY_CLASSES


def features(ops: Sequence[Op], device: DeviceType, traffic: Mapping[str, float] | None = None) -> np.ndarray:
    """Seconds each efficiency class would take at 100%, summed over ``ops``."""
    if not ops:
        return np.zeros(len(_NAMES))
    return np.sum([op_terms(op, device, traffic[op.name] if traffic else None) for op in ops], axis=0)


def predict(
    ops: Sequence[Op], device: DeviceType, eff: Efficiency, traffic: Mapping[str, float] | None = None
) -> float:
    return sum(op_time_s(op, device, eff, traffic[op.name] if traffic else None) for op in ops)


def calibrate(
    pieces: Sequence[tuple[Sequence[Op], float]],
    device: DeviceType,
    traffic: Mapping[str, float] | None = None,
) -> Efficiency:
    """Efficiencies that best explain ``pieces`` = [(ops, measured seconds), ...].

    A class the pieces do not exercise (all-zero column) keeps its default.
    """
    from scipy.optimize import nnls

    rows = [(features(ops, device, traffic), t) for ops, t in pieces if t > 0 and ops]
    if not rows:
        raise ValueError("calibrate needs at least one measured piece with ops")
    a = np.array([f / t for f, t in rows])
    used = a.any(axis=0)
    inverse = np.zeros(len(_NAMES))
    inverse[used], _ = nnls(a[:, used], np.ones(len(rows)))
    default = Efficiency()
    values = {}
    for name, used_here, c in zip(_NAMES, used, inverse):
        # unused: keep the default; fitted to zero: the class costs nothing measurable here
        values[name] = float(getattr(default, name) if not used_here else (1.0 / c if c > 0.01 else 100.0))
    return Efficiency(**values)
