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

import re
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


_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
_DEF = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(\(.*?\)|\w+\[[^\]]*\](?:\{[^}]*\})?)\s+([\w\-]+)\((.*)$")
_ARRAY = re.compile(r"(pred|s8|u8|s16|u16|s32|u32|s64|u64|f16|bf16|f32|f64|f8\w*)\[([\d,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4}


def _shape_bytes(shape: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        size = 1
        for d in dims.split(","):
            if d:
                size *= int(d)
        total += size * _BYTES.get(dtype, 8 if dtype in ("s64", "u64", "f64") else 1)
    return total


def hlo_collective_bytes(hlo_text: str) -> dict[str, int]:
    """Operand bytes of every collective in an optimized HLO module, by kind.

    Shapes in an SPMD-partitioned module are per device, so these are the
    bytes each device contributes. Async pairs are counted once, at ``-start``.
    """
    shapes: dict[str, int] = {}
    calls: list[tuple[str, str]] = []
    for line in hlo_text.splitlines():
        match = _DEF.match(line)
        if not match:
            continue
        name, shape, opcode, rest = match.groups()
        shapes[name] = _shape_bytes(shape)
        kind = opcode.removesuffix("-start")
        if kind in _COLLECTIVES and not opcode.endswith("-done"):
            calls.append((kind, rest))
    out = dict.fromkeys(_COLLECTIVES, 0)
    for kind, rest in calls:
        operands = rest.split(")", 1)[0]  # "%a, %b, /*index=5*/%c"
        out[kind] += sum(shapes.get(name, 0) for name in re.findall(r"%([\w.\-]+)", operands))
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class XlaProgram:
    """What XLA compiled for one sharded function: collectives and per-device memory."""

    collective_bytes: dict[str, int]
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int

    @property
    def peak_bytes(self) -> int:
        """Per-device peak as XLA reports it: arguments + temporaries + outputs − aliases."""
        return self.argument_bytes + self.temp_bytes + self.output_bytes - self.alias_bytes


def xla_program(jitted, *args) -> XlaProgram:
    """Compile a ``jax.jit``-wrapped (sharded) function and read its collectives and memory."""
    compiled = jitted.lower(*args).compile()
    memory = compiled.memory_analysis()
    return XlaProgram(
        collective_bytes=hlo_collective_bytes(compiled.as_text()),
        argument_bytes=int(memory.argument_size_in_bytes),
        output_bytes=int(memory.output_size_in_bytes),
        temp_bytes=int(memory.temp_size_in_bytes),
        alias_bytes=int(memory.alias_size_in_bytes),
    )
