"""The op-graph: a thin wrapper over a networkx DiGraph of :class:`Op` nodes.

Nodes are keyed by ``Op.name`` and carry the frozen record in the ``op``
attribute; an edge ``u → v`` means ``v`` reads a tensor ``u`` wrote, and its
``bytes`` attribute is the size of that tensor. Every later stage of
Orchestrator reads this type, whichever framework the step came from.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import networkx as nx

from orchestrator.graph._op import Op, OpKind, Phase, TensorSpec

FORMAT_VERSION = 2


class OpGraph:
    """A captured training step (or forward pass) as a DAG of ops.

    Args:
      name: what was captured, e.g. ``"gpt2-small/train_step"``.
      params: every model parameter by path (``"blocks_3/attn/c_attn/kernel"``)
        with its shape and dtype; ``param_bytes`` is their total.
      meta: free-form facts about the capture (framework, batch shape, ...).

    Example:
      >>> g = OpGraph(name="toy")
      >>> g.add_op(Op(name="a", kind="matmul", primitive="dot_general", flops=8.0))
      >>> g.add_op(Op(name="b", kind="elementwise", primitive="tanh"))
      >>> g.add_edge("a", "b", nbytes=16)
      >>> g.total_flops()
      8.0
    """

    def __init__(self, *, name: str = "", params: dict[str, TensorSpec] | None = None, meta: dict | None = None):
        self.name = name
        self.params: dict[str, TensorSpec] = dict(params or {})
        self.meta: dict = dict(meta or {})
        self.nx = nx.DiGraph()

    @property
    def param_bytes(self) -> int:
        return sum(spec.nbytes for spec in self.params.values())

    # -- building ---------------------------------------------------------
    def add_op(self, op: Op) -> None:
        if op.name in self.nx:
            raise ValueError(f"duplicate op name {op.name!r}")
        self.nx.add_node(op.name, op=op)

    def add_edge(self, src: str, dst: str, *, nbytes: int) -> None:
        """Record that ``dst`` reads a tensor of ``nbytes`` written by ``src``.

        Two tensors flowing between the same pair of ops add up on one edge.
        """
        for end in (src, dst):
            if end not in self.nx:
                raise KeyError(f"unknown op {end!r}")
        if self.nx.has_edge(src, dst):
            self.nx[src][dst]["bytes"] += nbytes
        else:
            self.nx.add_edge(src, dst, bytes=nbytes)

    # -- reading ----------------------------------------------------------
    def __len__(self) -> int:
        return self.nx.number_of_nodes()

    def __contains__(self, name: str) -> bool:
        return name in self.nx

    def op(self, name: str) -> Op:
        return self.nx.nodes[name]["op"]

    def ops(self) -> Iterator[Op]:
        """All ops in insertion order (a topological order for captured graphs)."""
        for _, data in self.nx.nodes(data=True):
            yield data["op"]

    def edges(self) -> Iterator[tuple[str, str, int]]:
        for u, v, data in self.nx.edges(data=True):
            yield u, v, data["bytes"]

    def total_flops(self, *, phase: Phase | None = None, kind: OpKind | None = None) -> float:
        return sum(
            op.flops for op in self.ops() if (phase is None or op.phase == phase) and (kind is None or op.kind == kind)
        )

    def total_transcendentals(self) -> float:
        return sum(op.transcendentals for op in self.ops())

    def flops_by(self, attribute: str) -> dict[str, float]:
        """FLOPs summed by an Op attribute, e.g. ``"kind"``, ``"phase"``, ``"primitive"``."""
        out: dict[str, float] = defaultdict(float)
        for op in self.ops():
            out[getattr(op, attribute)] += op.flops
        return dict(out)

    def is_dag(self) -> bool:
        return nx.is_directed_acyclic_graph(self.nx)

    # -- JSON -------------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "format_version": FORMAT_VERSION,
            "name": self.name,
            "params": {path: spec.to_json() for path, spec in self.params.items()},
            "meta": self.meta,
            "ops": [op.to_json() for op in self.ops()],
            "edges": [[u, v, b] for u, v, b in self.edges()],
        }

    @classmethod
    def from_json(cls, data: dict) -> OpGraph:
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise ValueError(
                f"op-graph JSON has format_version {version!r}; this Orchestrator reads "
                f"version {FORMAT_VERSION}: capture the graph again"
            )
        params = {path: TensorSpec.from_json(spec) for path, spec in data["params"].items()}
        graph = cls(name=data["name"], params=params, meta=data["meta"])
        for op in data["ops"]:
            graph.add_op(Op.from_json(op))
        for u, v, b in data["edges"]:
            graph.add_edge(u, v, nbytes=int(b))
        return graph

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json()))

    @classmethod
    def load(cls, path: str | Path) -> OpGraph:
        return cls.from_json(json.loads(Path(path).read_text()))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, OpGraph):
            return NotImplemented
        return self.to_json() == other.to_json()

    def __repr__(self) -> str:
        return (
            f"OpGraph(name={self.name!r}, ops={len(self)}, edges={self.nx.number_of_edges()}, "
            f"flops={self.total_flops():.3e}, param_bytes={self.param_bytes})"
        )
