"""XLA's own FLOP count of a function: the external truth captures are checked against.

``compiled.cost_analysis()["flops"]`` counts a while-loop body once, whatever
its trip count (ten 128×128 matmuls: 41.9 MFLOP unrolled, 4.19 MFLOP under
``lax.scan(length=10)``). :func:`xla_flops` corrects for that: it compiles the
body of every scan on its own, takes XLA's count ``B`` for one iteration, and

    flops = raw + Σ_scans (length − 1) · B

Scans inside other scans are corrected only for their own trip count (and
reported in ``nested_scans``). Unrolling the scans instead would not do:
unrolled, jax accumulates the cotangents of the sliced inputs by padding each
slice to full size, which adds O(T²) work that the rolled loop never does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
from jax.extend import core as jcore

from integrations.flax._trace import trace


@dataclass(frozen=True, slots=True, kw_only=True)
class XlaFlops:
    """XLA's FLOP count for one function.

    Attributes:
      flops: loop-corrected total (what actually executes).
      raw_flops: ``cost_analysis()["flops"]`` as XLA reports it.
      scans: number of scans corrected for.
      nested_scans: True if some scan sits inside another.
    """

    flops: float
    raw_flops: float
    scans: int
    nested_scans: bool


def _compiled_flops(closed: jcore.ClosedJaxpr, args) -> float:
    compiled = jax.jit(jcore.jaxpr_as_fun(closed)).lower(*args).compile()
    return float(compiled.cost_analysis()["flops"])


def _scans(jaxpr, inside_scan: bool = False):
    """Yield ``(scan_eqn, inside_another_scan)`` for every scan, recursively."""
    for eqn in jaxpr.eqns:
        is_scan = eqn.primitive.name == "scan"
        if is_scan:
            yield eqn, inside_scan
        for sub in jcore.jaxprs_in_params(eqn.params):
            yield from _scans(sub, inside_scan or is_scan)


def xla_flops(fn: Callable, *args) -> XlaFlops:
    """Compile ``fn(*args)`` on the default backend and return XLA's FLOP count.

    Args may be arrays or ``jax.ShapeDtypeStruct``s; nothing runs.
    """
    closed = trace(fn, *args)
    raw = _compiled_flops(closed, jax.tree_util.tree_leaves(args))
    body_flops: dict[str, float] = {}  # identical layers have identical bodies
    total, count, nested = raw, 0, False
    for eqn, inside in _scans(closed.jaxpr):
        body = eqn.params["jaxpr"]
        key = str(body)
        if key not in body_flops:
            avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in body.jaxpr.invars]
            body_flops[key] = _compiled_flops(body, avals)
        total += (int(eqn.params["length"]) - 1) * body_flops[key]
        count += 1
        nested = nested or inside
    return XlaFlops(flops=total, raw_flops=raw, scans=count, nested_scans=nested)
