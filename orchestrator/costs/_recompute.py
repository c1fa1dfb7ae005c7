"""Which forward ops selective recompute rebuilds in the backward pass: the core of attention.

Selective recompute (Korthikanti et al., 2022, §4) keeps a block's activations
except those of *core attention*: the scores ``Q·Kᵀ``, the mask, the softmax,
its dropout and the product with ``V``. Those are the values that grow with the
square of the sequence and cost few FLOPs to rebuild, so the backward pass
recomputes them from the kept ``Q``, ``K`` and ``V``.

Found structurally, for any model: an *activation matmul* is a forward matmul
whose operands all come from the batch (neither is a parameter or computed from
parameters alone) — ``Q·Kᵀ`` and ``P·V``, never a projection. The core of a
layer is each pair of activation matmuls ``A → B`` with ``B`` reachable from
``A`` and every forward op on a path between them. Its time is what the
backward pass adds; its values apart from ``B``'s output (the context the
output projection reads, kept either way) leave the activations kept for the
backward. A layer with no such pair (an MLP, a fused attention kernel that
already recomputes its scores) has an empty core, and selective recompute
changes nothing there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import networkx as nx

from orchestrator.graph import OpGraph


@dataclass(frozen=True, slots=True)
class AttentionCore:
    """``ops``: the forward ops selective recompute runs again; ``dropped``: those whose values it
    does not keep for the backward (``ops`` less each core's last matmul); ``starts`` and ``ends``:
    the first and last matmul of each core (``Q·Kᵀ`` reads K, ``P·V`` reads V: what context
    parallelism passes around its ring)."""

    ops: frozenset[str]
    dropped: frozenset[str]
    starts: frozenset[str] = frozenset()
    ends: frozenset[str] = frozenset()


def attention_core(graph: OpGraph, ops: Iterable[str], from_batch: Callable[[str], bool]) -> AttentionCore:
    """The core attention among ``ops`` (one layer's ops, in execution order).

    ``from_batch(name)``: whether op ``name``'s output depends on the batch (not on parameters alone).
    """
    forward = [n for n in ops if graph.op(n).phase == "forward"]
    sub = graph.nx.subgraph(forward)
    matmuls = [
        n
        for n in forward
        if graph.op(n).kind == "matmul"
        and not graph.op(n).param_reads
        and (preds := list(graph.nx.predecessors(n)))
        and all(from_batch(p) for p in preds)
    ]
    core: set[str] = set()
    starts: set[str] = set()
    ends: set[str] = set()
    for a in matmuls:
        below = nx.descendants(sub, a)
        for b in matmuls:
            if b in below:
                core |= {a, b} | (nx.ancestors(sub, b) & below)
                starts.add(a)
                ends.add(b)
    # a matmul that starts a later pair is dropped even if it ends an earlier one
    kept = ends - starts
    return AttentionCore(
        ops=frozenset(core), dropped=frozenset(core - kept), starts=frozenset(starts), ends=frozenset(ends)
    )
