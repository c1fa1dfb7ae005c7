"""Time of one op on one device type: a roofline scaled by measured efficiency.

    t(op) = max( flops / (peak[dtype] · e_compute[kind]),
                 (bytes read + written) / (memory bandwidth · e_memory) )

plus ``transcendentals`` at the elementwise rate. The efficiencies are
fractions of the datasheet peak that real kernels reach; :mod:`orchestrator.profile`
calibrates them for the local device from measured layer times. The defaults
below are typical of tuned GPU kernels (large matmuls reach 60–80% of peak,
streaming kernels 70–90% of memory bandwidth) and are what uncalibrated device
types are projected with.
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.cluster import DeviceType
from orchestrator.graph import Op


@dataclass(frozen=True, slots=True, kw_only=True)
class Efficiency:
    """Fractions of peak compute (matmul-like ops, other ops) and of memory bandwidth."""

    matmul: float = 0.7
    other: float = 0.3
    memory: float = 0.8

    def __post_init__(self) -> None:
        for name in ("matmul", "other", "memory"):
            value = getattr(self, name)
            if not 0 < value <= 10:
                raise ValueError(f"efficiency {name}={value} must be in (0, 10]")


_MATMUL_KINDS = frozenset({"matmul", "conv", "attention"})


def compute_dtype(op: Op) -> str:
    """The dtype an op computes in: its first floating-point input."""
    for spec in (*op.inputs, *op.outputs):
        if spec.dtype.startswith(("float", "bfloat")):
            return spec.dtype
    return "float32"


def op_time_s(op: Op, device: DeviceType, efficiency: Efficiency) -> tuple[float, float]:
    """``(compute-bound time, memory-bound time)`` of the op (all repeats) on ``device``."""
    dtype = compute_dtype(op)
    peaks = device.peak_flops
    peak = peaks.get(dtype) or peaks.get("float32") or max(peaks.values())
    kind_eff = efficiency.matmul if op.kind in _MATMUL_KINDS else efficiency.other
    compute = (op.flops + op.transcendentals) / (peak * kind_eff)
    memory = (op.bytes_read + op.bytes_written) / (device.memory_bandwidth_bytes_per_s * efficiency.memory)
    return compute, memory
