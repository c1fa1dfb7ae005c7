"""How many bytes of a parameter's gradient the data-parallel sync moves.

Every replica computes the gradient of its own samples and the sync sums
them. XLA's SPMD partitioner places that all-reduce where the replicas' values
first differ only by a sum. For a weight read by a matmul that is the whole
gradient. For a table read only at rows that are the same on every replica
(GPT's learned positions ``P[0:T]``: a gather at ``iota(T)``, or a slice), it
is the gradient of the rows read, before they are scattered into the zero
table: XLA all-reduces T of the table's T_max rows, one row per index, for
strided, reversed and repeated constant indices, for a slice, and for a
dynamic slice at a constant start alike (as the compiled HLO shows).

So a layer whose forward reads parameter p syncs

    sync(p) = min(bytes(p), Σ_{reads r of p} bytes(output of r))   if every read r is a gather, slice or
                                                                    dynamic slice at batch-independent indices
              bytes(p)                                              otherwise

(per device: times the local fraction of p under tensor parallelism). A
value is batch-independent if it is computed from constants (``iota``,
literals) and scalars alone; indices computed from the batch (token ids)
read rows that differ per replica, and the whole table is synced.

A stage that accumulates gradients over microbatches into full-size buffers
before syncing them (the pipeline executor) syncs every table whole.
"""

from __future__ import annotations

from collections.abc import Iterable

from orchestrator.graph import OpGraph

_ROW_READS = frozenset({"gather", "slice", "dynamic_slice"})


def batch_independent_ops(graph: OpGraph) -> frozenset[str]:
    """Ops whose output is computed from constants and scalars only (no batch, no parameter).

    An op qualifies if every one of its producers does, it reads no parameter,
    and the only inputs no op produced are scalars (literals).
    """
    out: set[str] = set()
    for op in graph.ops():
        preds = list(graph.nx.predecessors(op.name))
        if op.param_reads or any(p not in out for p in preds):
            continue
        delivered = sum(graph.nx[p][op.name]["bytes"] for p in preds)
        scalars = sum(t.nbytes for t in op.inputs if t.shape == ())
        if sum(t.nbytes for t in op.inputs) - delivered <= scalars:
            out.add(op.name)
    return frozenset(out)


def synced_gradient_bytes(graph: OpGraph, ops: Iterable[str], path: str, constant: frozenset[str]) -> float:
    """Bytes of parameter ``path``'s gradient the DP sync moves for a layer of ``ops`` (module docstring).

    ``constant`` is :func:`batch_independent_ops` of the graph.
    """
    full = float(graph.params[path].nbytes)
    rows = 0.0
    for name in ops:
        op = graph.op(name)
        if op.phase != "forward" or path not in op.param_reads:
            continue
        if op.primitive not in _ROW_READS or any(p not in constant for p in graph.nx.predecessors(name)):
            return full
        rows += sum(t.nbytes for t in op.outputs)
    return min(full, rows) if rows else full
