"""Time of one op on one device type: peak rates scaled by measured efficiency.

    t(op) = flops / (peak[dtype] · e_class) + transcendentals / (peak · e_transcendental)
            + (bytes read + written) / (memory bandwidth · e_bytes)
            + [matmul] 2·|out| / (peak · e_matmul_output)

where the class is matmul, fused attention or other arithmetic, and bytes of data movement
(gather, scatter, transpose, ...) have their own efficiency. The terms add
rather than overlap (a roofline would take their maximum): the pieces of a
fused layer on a CPU run one after another rather than hiding behind each
other, so the sum fits profiled layers better than the maximum, and the byte
efficiencies absorb the traffic that fusion saves. The
efficiencies are fractions of the datasheet peak that real kernels reach;
:mod:`orchestrator.profile` calibrates them for the local device from measured
layer times. The defaults below are typical of tuned GPU kernels (large
matmuls reach 60–80% of peak, streaming kernels 70–90% of memory bandwidth)
and are what uncalibrated device types are projected with.

The last term is a matmul's cost per output element (loading and storing the
output tiles: the M·N part of a GEMM's M·N·K), priced as one extra
multiply-add per element. It is what makes a matmul with a short contraction
slower per FLOP than a long one: attention's K = 64 products against the
K = 768 projections.

Where the device lists its last-level cache (``DeviceType.cache_bytes``), the
bytes of an arithmetic op whose largest tensor is bigger than the cache are
priced apart (``e_memory_streamed``): they stream from main memory, while a
smaller op's operands are served by the cache (the cache-aware roofline of
Ilić et al., 2014). That is what separates an optimizer update over a token
embedding table larger than the cache, which costs more per parameter, from
one over a block's tensors, which fit in it; ``orchestrator bench fidelity``
reports the model against profiled layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from orchestrator.cluster import DeviceType
from orchestrator.graph import Op


@dataclass(frozen=True, slots=True, kw_only=True)
class Efficiency:
    """Fractions of peak a device reaches, by op class.

    Attributes:
      matmul: of peak FLOP/s, for matmuls and convolutions.
      other: of peak FLOP/s, for elementwise and reduction arithmetic.
      transcendental: of peak FLOP/s, per exp/log/tanh/... evaluation.
      memory: of memory bandwidth, for the bytes arithmetic ops read and write
        (all of them, or those of ops whose tensors fit the device's cache).
      memory_streamed: of memory bandwidth, for the bytes of arithmetic ops
        with a tensor larger than the device's last-level cache.
      movement: of memory bandwidth, for data movement (gather, scatter,
        transpose, slice, ...) and ops of unknown kind.
      matmul_output: of peak FLOP/s, for one multiply-add per matmul output
        element. The default makes the term negligible: tuned accelerator
        GEMMs hide it inside ``matmul``; calibration fits it where it shows.
      attention: of peak FLOP/s, for fused attention kernels (ops of kind
        ``attention``: a softmax between two products, tile by tile, which
        reaches less of the peak than a GEMM). None: ``matmul``'s, until
        measured.
    """

    matmul: float = 0.7
    other: float = 0.3
    transcendental: float = 0.1
    memory: float = 0.8
    memory_streamed: float = 0.8
    movement: float = 0.5
    matmul_output: float = 100.0
    attention: float | None = None

    def of(self, name: str) -> float:
        """The efficiency of class ``name``, with an unmeasured ``attention`` read as ``matmul``."""
        value = getattr(self, name)
        return self.matmul if value is None else value

    def __post_init__(self) -> None:
        for name in EFFICIENCY_CLASSES:
            value = getattr(self, name)
            if name == "attention" and value is None:
                continue
            if not 0 < value <= 100:
                raise ValueError(f"efficiency {name}={value} must be in (0, 100]")


EFFICIENCY_CLASSES = (
    "matmul",
    "other",
    "transcendental",
    "memory",
    "memory_streamed",
    "movement",
    "matmul_output",
    "attention",
)
"""The efficiency classes, in the order :func:`op_terms` returns their terms."""

MATMUL_KINDS = frozenset({"matmul", "conv", "attention"})
ARITHMETIC_KINDS = frozenset({"elementwise", "reduction", "softmax", "scan"})


def op_terms(op: Op, device: DeviceType, traffic: float | None = None) -> tuple[float, ...]:
    """Seconds at 100% efficiency, one per class of :data:`EFFICIENCY_CLASSES`.

    ``traffic`` is the op's main-memory bytes after fusion (``traffic_bytes``);
    without it, every input and output counts.
    """
    peaks = device.peak_flops
    peak = peaks.get(compute_dtype(op)) or peaks.get("float32") or max(peaks.values())
    moved = op.bytes_read + op.bytes_written if traffic is None else traffic
    nbytes = moved / device.memory_bandwidth_bytes_per_s
    is_matmul = op.kind in MATMUL_KINDS
    arithmetic = is_matmul or op.kind in ARITHMETIC_KINDS
    largest = max((t.nbytes for t in (*op.inputs, *op.outputs)), default=0)
    streamed = device.cache_bytes is not None and largest > device.cache_bytes
    fused_attention = op.kind == "attention"
    return (
        op.flops / peak if is_matmul and not fused_attention else 0.0,
        0.0 if is_matmul else op.flops / peak,
        op.transcendentals / peak,
        nbytes if arithmetic and not streamed else 0.0,
        nbytes if arithmetic and streamed else 0.0,
        0.0 if arithmetic else nbytes,
        2.0 * op.repeats * sum(math.prod(t.shape) for t in op.outputs) / peak if is_matmul else 0.0,
        op.flops / peak if fused_attention else 0.0,
    )


def compute_dtype(op: Op) -> str:
    """The dtype an op computes in: its first floating-point input."""
    for spec in (*op.inputs, *op.outputs):
        if spec.dtype.startswith(("float", "bfloat")):
            return spec.dtype
    return "float32"


def op_time_s(op: Op, device: DeviceType, efficiency: Efficiency, traffic: float | None = None) -> float:
    """Seconds the op (all repeats) takes on ``device``: each term over its efficiency, added."""
    terms = op_terms(op, device, traffic)
    return sum(t / efficiency.of(name) for t, name in zip(terms, EFFICIENCY_CLASSES))
