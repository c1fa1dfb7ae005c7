"""Layers — the unit the planner places — and the graph they form."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import networkx as nx

FORMAT_VERSION = 2


@dataclass(frozen=True, slots=True, kw_only=True)
class Layer:
    """A group of ops that is placed on one pipeline stage as a whole.

    Attributes:
      name: the module scope the layer stands for (``"GPT/blocks_3"``), or a
        made-up name for merged or unscoped groups (``"embedding"``, ``"head"``).
      index: position in forward order.
      forward_flops, backward_flops, optimizer_flops: FLOPs per phase.
      transcendentals: exp/log/tanh/... evaluations, all phases.
      param_bytes: bytes of the parameters first read by this layer.
      activation_bytes: bytes of forward tensors this layer sends to later
        layers (for a chain: the activation crossing the cut after it).
      signature: equal for layers that do the same work on the same shapes
        (repeated transformer blocks), so costs are computed once per signature.
      params: paths of the parameters first read by this layer.
      ops: names of the op-graph ops that make up the layer.
    """

    name: str
    index: int
    forward_flops: float
    backward_flops: float
    optimizer_flops: float
    transcendentals: float
    param_bytes: int
    activation_bytes: int
    signature: str
    params: tuple[str, ...] = field(default=(), repr=False)
    ops: tuple[str, ...] = field(default=(), repr=False)

    @property
    def flops(self) -> float:
        return self.forward_flops + self.backward_flops + self.optimizer_flops

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "index": self.index,
            "flops": self.flops,
            "forward_flops": self.forward_flops,
            "backward_flops": self.backward_flops,
            "optimizer_flops": self.optimizer_flops,
            "transcendentals": self.transcendentals,
            "param_bytes": self.param_bytes,
            "activation_bytes": self.activation_bytes,
            "signature": self.signature,
            "params": list(self.params),
            "ops": list(self.ops),
        }

    @classmethod
    def from_json(cls, data: dict) -> Layer:
        return cls(
            name=data["name"],
            index=int(data["index"]),
            forward_flops=float(data["forward_flops"]),
            backward_flops=float(data["backward_flops"]),
            optimizer_flops=float(data["optimizer_flops"]),
            transcendentals=float(data["transcendentals"]),
            param_bytes=int(data["param_bytes"]),
            activation_bytes=int(data["activation_bytes"]),
            signature=data["signature"],
            params=tuple(data["params"]),
            ops=tuple(data["ops"]),
        )


class LayerGraph:
    """Layers in forward order, and the forward activations flowing between them.

    ``nx`` is a DiGraph on layer indices whose edges carry the ``bytes`` of
    forward activations sent from one layer to a later one. It is a chain for
    sequential models and a DAG where the model branches or skips.
    """

    def __init__(self, layers: list[Layer], edges: dict[tuple[int, int], int], *, name: str = ""):
        self.name = name
        self.layers: tuple[Layer, ...] = tuple(layers)
        self.nx = nx.DiGraph()
        self.nx.add_nodes_from(range(len(layers)))
        for (src, dst), nbytes in edges.items():
            self.nx.add_edge(src, dst, bytes=nbytes)

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self):
        return iter(self.layers)

    def __getitem__(self, index: int) -> Layer:
        return self.layers[index]

    def is_chain(self) -> bool:
        return all(dst == src + 1 for src, dst in self.nx.edges)

    def cut_bytes(self) -> list[int]:
        """Activation bytes crossing the cut after each layer (all skips included)."""
        cuts = [0] * len(self.layers)
        for src, dst, data in self.nx.edges(data=True):
            for cut in range(src, dst):
                cuts[cut] += data["bytes"]
        return cuts

    def repeated(self) -> dict[str, list[int]]:
        """Signature → indices of the layers sharing it, for signatures seen more than once."""
        groups: dict[str, list[int]] = {}
        for layer in self.layers:
            groups.setdefault(layer.signature, []).append(layer.index)
        return {sig: idx for sig, idx in groups.items() if len(idx) > 1}

    def totals(self) -> dict[str, float]:
        return {
            "flops": sum(layer.flops for layer in self.layers),
            "param_bytes": sum(layer.param_bytes for layer in self.layers),
            "layers": len(self.layers),
            "distinct_layers": len({layer.signature for layer in self.layers}),
        }

    def to_json(self) -> dict:
        return {
            "format_version": FORMAT_VERSION,
            "name": self.name,
            "layers": [layer.to_json() for layer in self.layers],
            "edges": [[u, v, d["bytes"]] for u, v, d in self.nx.edges(data=True)],
        }

    @classmethod
    def from_json(cls, data: dict) -> LayerGraph:
        if data.get("format_version") != FORMAT_VERSION:
            raise ValueError(
                f"layer-graph JSON has format_version {data.get('format_version')!r}, expected {FORMAT_VERSION}"
            )
        layers = [Layer.from_json(layer) for layer in data["layers"]]
        return cls(layers, {(int(u), int(v)): int(b) for u, v, b in data["edges"]}, name=data["name"])

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json()))

    @classmethod
    def load(cls, path: str | Path) -> LayerGraph:
        return cls.from_json(json.loads(Path(path).read_text()))

    def __repr__(self) -> str:
        totals = self.totals()
        return f"LayerGraph(name={self.name!r}, layers={len(self)}, distinct={totals['distinct_layers']}, flops={totals['flops']:.3e})"
