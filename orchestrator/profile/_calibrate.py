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
    traffic: Mapping[str, float] | Sequence[Mapping[str, float]] | None = None,
    *,
    fixed: Mapping[str, float] | None = None,
) -> Efficiency:
    """Efficiencies that best explain ``pieces`` = [(ops, measured seconds), ...].

    ``traffic``: one table for all pieces, or one per piece (pieces captured from different
    graphs). ``fixed``: classes held at the given efficiency and not fitted (on a GPU,
    elementwise arithmetic is never what bounds a fused kernel, so ``other`` and
    ``transcendental`` are held and their time goes to ``memory``). A class the pieces do not
    exercise (all-zero column) keeps its default (``attention``: None, read as ``matmul``).
    """
    from scipy.optimize import nnls

    fixed = dict(fixed or {})
    tables = traffic if isinstance(traffic, Sequence) else [traffic] * len(pieces)
    rows = [(features(ops, device, table), t) for (ops, t), table in zip(pieces, tables) if t > 0 and ops]
    if not rows:
        raise ValueError("calibrate needs at least one measured piece with ops")
    held = np.array([name in fixed for name in _NAMES])
    held_inverse = np.array([1.0 / fixed[name] if name in fixed else 0.0 for name in _NAMES])
    a = np.array([f / t for f, t in rows])
    rest = 1.0 - a[:, held] @ held_inverse[held]  # what the fitted classes must explain
    used = a.any(axis=0) & ~held
    inverse = np.zeros(len(_NAMES))
    inverse[used], _ = nnls(a[:, used], rest)
    default = Efficiency()
    values = {}
    for name, used_here, c in zip(_NAMES, used, inverse):
        # unused: keep the default; fitted to zero: the class costs nothing measurable here
        if name in fixed:
            values[name] = float(fixed[name])
        elif not used_here:
            values[name] = getattr(default, name)
        else:
            values[name] = float(1.0 / c if c > 0.01 else 100.0)
    return Efficiency(**values)
