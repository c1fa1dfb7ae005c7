"""The records an op-graph is made of: tensors and ops.

An :class:`Op` is one primitive operation of a captured training step, after
any loop it sits in has been accounted for: ``flops`` and the byte counts are
totals over all ``repeats`` of the op (a body of ``lax.scan(length=T)`` has
``repeats == T``).

FLOPs follow XLA's ``HloCostAnalysis`` conventions so captured totals can be
checked against ``compiled.cost_analysis()``:

* matmul: 2 · (output elements) · (contracted elements) — one FMA is 2 FLOPs;
* elementwise arithmetic, compare, select and dtype conversion: 1 per output
  element; transcendental functions (exp, log, tanh, ...) are counted apart in
  ``transcendentals``, not in ``flops``;
* reductions: (input elements − output elements) · (FLOPs of the reducer);
* data movement (reshape, transpose, slice, gather, ...): 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np

OpKind = Literal[
    "matmul",
    "conv",
    "elementwise",
    "reduction",
    "softmax",
    "attention",
    "scan",
    "collective",
    "data_movement",
    "other",
]
"""The closed vocabulary of op kinds."""

Phase = Literal["forward", "backward", "optimizer"]
"""Which part of a training step an op belongs to."""

OP_KINDS: tuple[str, ...] = get_args(OpKind)
PHASES: tuple[str, ...] = get_args(Phase)


def dtype_itemsize(dtype: str) -> int:
    """Bytes per element of a dtype name such as ``"float32"`` or ``"bfloat16"``."""
    if dtype in ("bool", "bool_"):
        return 1
    if dtype.startswith("key<"):  # typed PRNG keys: a (2,) uint32 payload
        return 8
    try:
        import ml_dtypes  # noqa: F401  (registers bfloat16 and float8 with numpy)
    except ImportError:  # pragma: no cover - ml_dtypes ships with jax
        pass
    return int(np.dtype(dtype).itemsize)


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorSpec:
    """Shape and dtype of one tensor."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * dtype_itemsize(self.dtype)

    def to_json(self) -> dict:
        return {"shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_json(cls, data: dict) -> TensorSpec:
        return cls(shape=tuple(int(d) for d in data["shape"]), dtype=str(data["dtype"]))


@dataclass(frozen=True, slots=True, kw_only=True)
class Op:
    """One operation of a captured step.

    Attributes:
      name: unique within its graph, e.g. ``"dot_general_17"``.
      kind: one of :data:`OpKind`.
      primitive: the framework's own name for it (``"dot_general"``, ``"aten.mm"``).
      inputs, outputs: tensor specs of one execution.
      flops: total floating-point operations over all repeats (XLA conventions).
      transcendentals: total exp/log/tanh/... evaluations over all repeats.
      bytes_read, bytes_written: total bytes of inputs read and outputs written,
        unfused (every op reads and writes main memory).
      param_bytes: bytes of model parameters this op is the first reader of;
        summed over a graph it gives the model's parameter bytes exactly.
      param_paths: those parameters, as paths below the parameter root
        (``"blocks_3/attn/c_attn/kernel"``).
      param_reads: every parameter the op reads directly, first read or not
        (a backward matmul reads the kernel its forward matmul read first).
      scope: module scope path such as ``"GPT/blocks_3/attn"`` (``""`` if none).
      phase: forward, backward or optimizer.
      repeats: how many times the op runs per step (loop trip counts multiplied).
    """

    name: str
    kind: OpKind
    primitive: str
    inputs: tuple[TensorSpec, ...] = ()
    outputs: tuple[TensorSpec, ...] = ()
    flops: float = 0.0
    transcendentals: float = 0.0
    bytes_read: int = 0
    bytes_written: int = 0
    param_bytes: int = 0
    param_paths: tuple[str, ...] = ()
    param_reads: tuple[str, ...] = ()
    scope: str = ""
    phase: Phase = "forward"
    repeats: int = 1

    def __post_init__(self) -> None:
        if self.kind not in OP_KINDS:
            raise ValueError(f"Op {self.name!r}: kind {self.kind!r} is not one of {OP_KINDS}")
        if self.phase not in PHASES:
            raise ValueError(f"Op {self.name!r}: phase {self.phase!r} is not one of {PHASES}")
        if self.repeats < 1:
            raise ValueError(f"Op {self.name!r}: repeats must be >= 1, got {self.repeats}")

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "kind": self.kind,
            "primitive": self.primitive,
            "inputs": [t.to_json() for t in self.inputs],
            "outputs": [t.to_json() for t in self.outputs],
            "flops": self.flops,
            "transcendentals": self.transcendentals,
            "bytes_read": self.bytes_read,
            "bytes_written": self.bytes_written,
            "param_bytes": self.param_bytes,
            "param_paths": list(self.param_paths),
            "param_reads": list(self.param_reads),
            "scope": self.scope,
            "phase": self.phase,
            "repeats": self.repeats,
        }

    @classmethod
    def from_json(cls, data: dict) -> Op:
        return cls(
            name=data["name"],
            kind=data["kind"],
            primitive=data["primitive"],
            inputs=tuple(TensorSpec.from_json(t) for t in data["inputs"]),
            outputs=tuple(TensorSpec.from_json(t) for t in data["outputs"]),
            flops=float(data["flops"]),
            transcendentals=float(data["transcendentals"]),
            bytes_read=int(data["bytes_read"]),
            bytes_written=int(data["bytes_written"]),
            param_bytes=int(data["param_bytes"]),
            param_paths=tuple(data["param_paths"]),
            param_reads=tuple(data["param_reads"]),
            scope=data["scope"],
            phase=data["phase"],
            repeats=int(data["repeats"]),
        )
