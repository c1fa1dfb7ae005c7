"""The framework-neutral op-graph every part of Orchestrator reads."""

from orchestrator.graph._op import OP_KINDS, PHASES, Op, OpKind, Phase, TensorSpec, dtype_itemsize
from orchestrator.graph._opgraph import OpGraph

__all__ = [
    "OP_KINDS",
    "PHASES",
    "Op",
    "OpGraph",
    "OpKind",
    "Phase",
    "TensorSpec",
    "dtype_itemsize",
]
