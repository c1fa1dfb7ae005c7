"""Peak memory of a captured program by liveness over the op-graph, with XLA-style fusion.

XLA does not give every jaxpr value a buffer: elementwise and data-movement
ops fuse into the ops that read them and are recomputed there. We model that:

* an op's output is **materialized** if the op is not fusible (matmul,
  convolution, reduction, scan, collective, gather/scatter, ...), if its
  reader is not fusible (a matmul's operands are whole buffers), if it has
  no reader (a program output), or if it is a forward value that several
  ops read and the backward pass is among them (a residual XLA keeps rather
  than recompute in each reader) — never for a broadcast or a view, which XLA
  recomputes wherever it is read;
* an all-reduce is out of place: while it runs, its input and its result
  both hold a buffer;
* a fused value occupies no memory, but keeps the values it is computed from
  alive until its own last use (that is what recomputation needs).

Buffers are allocated when produced and freed after their last use; the peak
of the live total is the program's temporary memory. Each op's bytes are
scaled by ``scale(op_name)`` (1/t for tensor-parallel shards, the microbatch
fraction for batch-dependent values).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from orchestrator.graph import OpGraph

_FUSIBLE_KINDS = frozenset({"elementwise", "data_movement"})
# Views and broadcasts XLA recomputes wherever they are read, even across the
# forward/backward boundary: they never hold a buffer of their own.
_FREE_VIEWS = frozenset({"broadcast_in_dim", "iota", "reshape", "squeeze", "expand_dims"})
_UNFUSIBLE_PRIMITIVES = frozenset(
    {"gather", "scatter", "scatter-add", "scatter_add", "dynamic_update_slice", "concatenate", "sort"}
)


def fusible(graph: OpGraph, name: str) -> bool:
    op = graph.op(name)
    return op.kind in _FUSIBLE_KINDS and op.primitive not in _UNFUSIBLE_PRIMITIVES


def materialized_ops(graph: OpGraph, order: Iterable[str] | None = None) -> dict[str, bool]:
    """Whether each op's output gets a buffer of its own (rules in the module docstring)."""
    order = list(graph.nx.nodes) if order is None else list(order)
    members = set(order)
    readers = {n: [c for c in graph.nx.successors(n) if c in members] for n in order}

    def is_materialized(n: str) -> bool:
        if not readers[n] or not fusible(graph, n) or any(not fusible(graph, c) for c in readers[n]):
            return True
        if graph.op(n).primitive in _FREE_VIEWS:
            return False
        crosses = graph.op(n).phase == "forward" and any(graph.op(c).phase != "forward" for c in readers[n])
        return crosses and len(readers[n]) > 1

    return {n: is_materialized(n) for n in order}


def traffic_bytes(graph: OpGraph) -> dict[str, float]:
    """Main-memory bytes each op moves once fused: what it reads from buffers plus what it writes to one.

    A value read from a fused producer is computed in registers and costs no
    traffic; a fused op's own output is not written. All repeats included.
    """
    materialized = materialized_ops(graph)
    out = {}
    for op in graph.ops():
        from_fused = sum(d["bytes"] for p, _, d in graph.nx.in_edges(op.name, data=True) if not materialized[p])
        read = max(0.0, sum(t.nbytes for t in op.inputs) - from_fused)
        written = sum(t.nbytes for t in op.outputs) if materialized[op.name] else 0.0
        out[op.name] = (read + written) * op.repeats
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class Liveness:
    """Peak and boundary figures of one liveness pass, in (scaled) bytes.

    Attributes:
      peak_bytes: the largest live total of materialized temporaries.
      boundary_bytes: live bytes held by forward values that the backward
        pass still needs, at the moment the first backward op starts
        (the activations a pipeline keeps per in-flight microbatch).
      output_bytes: materialized values nothing reads (program outputs).
    """

    peak_bytes: float
    boundary_bytes: float
    output_bytes: float


def liveness(
    graph: OpGraph,
    ops: Iterable[str] | None = None,
    scale: Callable[[str], float] = lambda name: 1.0,
    allreduced: frozenset[str] = frozenset(),
) -> Liveness:
    """Simulate buffer lifetimes over ``ops`` (default: all) in execution order.

    ``allreduced`` names the ops whose output is all-reduced across devices.
    """
    order = list(graph.nx.nodes) if ops is None else list(ops)
    members = set(order)
    position = {name: i for i, name in enumerate(order)}
    g = graph.nx
    readers = {n: [c for c in g.successors(n) if c in members] for n in order}

    materialized = materialized_ops(graph, order)
    # last_use[n]: position after which n's buffer (or, if fused, its inputs) may be freed
    last_use: dict[str, int] = {}
    for n in reversed(order):
        uses = [position[c] if materialized[c] else last_use[c] for c in readers[n]]
        last_use[n] = max(uses, default=position[n])

    def size(n: str) -> float:
        return sum(t.nbytes for t in graph.op(n).outputs) * scale(n)

    frees: dict[int, float] = {}
    live = peak = boundary = outputs = 0.0
    first_backward = next((i for i, n in enumerate(order) if graph.op(n).phase == "backward"), None)
    for i, n in enumerate(order):
        if i == first_backward:
            boundary = sum(
                size(m)
                for m in order[:i]
                if materialized[m] and last_use[m] >= i and graph.op(m).phase == "forward" and readers[m]
            )
        if materialized[n]:
            nbytes = size(n)
            live += nbytes
            if readers[n]:
                frees[last_use[n]] = frees.get(last_use[n], 0.0) + nbytes
            else:
                outputs += nbytes
        in_flight = size(n) if n in allreduced else 0.0
        peak = max(peak, live + in_flight)
        live -= frees.pop(i, 0.0)
    return Liveness(peak_bytes=peak, boundary_bytes=boundary, output_bytes=outputs)
