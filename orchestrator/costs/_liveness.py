"""Peak memory of a captured program by liveness over the op-graph, with XLA-style fusion.

XLA does not give every jaxpr value a buffer: elementwise and data-movement
ops fuse into the ops that read them and are recomputed there. We model that:

* an op's output is **materialized** if the op is not fusible (matmul,
  convolution, reduction, scan, collective, gather/scatter, ...), if its
  reader is not fusible (a matmul's operands are whole buffers), if it has
  no reader (a program output), or if it is a forward value that several
  ops read and the backward pass is among them (a residual XLA keeps rather
  than recompute in each reader) — never for a broadcast or a view, which XLA
  recomputes wherever it is read, nor for a residual computed elementwise
  from one same-shaped value that is itself kept for the backward (GELU's
  ``0.5·(1 + tanh(…))`` from the kept ``tanh``: XLA recomputes it at no memory
  cost);
* an all-reduce is out of place: while it runs, its input and its result
  both hold a buffer; an in-place update (a scatter-add into zeros) owns its
  operand's buffer, so a broadcast only such updates read holds none of its own;
* a fused value occupies no memory, but keeps the values it is computed from
  alive until its own last use (that is what recomputation needs).

Buffers are allocated when produced and freed after their last use; the peak
of the live total is the program's temporary memory. Program outputs (values
no op reads: gradients, the input's gradient) are not in that total: XLA
allocates them apart for the whole program (``memory_analysis()``'s output
bytes), and the cost model counts them whole. Each op's bytes are
scaled by ``scale(op_name)`` (1/t for tensor-parallel shards, the microbatch
fraction for batch-dependent values).

What XLA:CPU keeps of a LayerNorm (read from its buffer assignment, ``--xla_dump_to``): the (batch, seq, d) broadcasts of each LayerNorm's ``rsqrt`` and scale (two per
LayerNorm), which the model does not keep, while it recomputes ``x − mean`` and ``rsqrt·scale``,
which the model keeps: the two cancel. Above a size, XLA keeps ``rsqrt·scale`` as well. The
rule is XLA:CPU's: ``IsInstructionPreferredByYnn`` (``xla/backends/cpu/ynn_support.cc``) lets
an elementwise op into a YNNPACK fusion only when it or an operand has at least
``kMinElements = 4096`` elements. A LayerNorm's per-row ``rsqrt`` has one element per token, so
from 4,096 tokens on a device it joins the fusion that reduces the input gradient, and the
``rsqrt·scale`` product it feeds is kept besides its broadcasts. Modelled here
(``row_fusion_elements``, on CPU clusters only): a kept forward residual computed
from a per-row statistic — an elementwise value of shape (…, 1) with fewer elements than the
residual — with at least ``YNN_MIN_ELEMENTS`` of them on a device holds a second buffer of its size.
With it the error against ``memory_analysis()`` does not step at the threshold; a shortfall that
does not depend on size remains on XLA:CPU and is not modelled (``orchestrator bench fidelity``
reports the model against ``memory_analysis()``).

XLA:GPU fuses more (``xla_gpu=True``; the cost model's rule on clusters that are not CPU ones),
as its buffer assignment for the recipe's bf16 GPT block shows (H100, jax 0.11, ``--xla_dump_to``):

* a reduction reads its elementwise producers inside its own fusion (XLA:GPU's input fusions),
  so a reader that is a reduction does not make a value a buffer;
* a forward value the backward reads is recomputed in each reader from the buffers it is
  computed from, unless it is *expensive* (``tanh``, ``log``, ``erf``, …; ``exp``, ``div``,
  ``sqrt`` and ``rsqrt`` only below float32, as ``GpuInstructionFusion::IsExpensive`` says),
  which keeps its buffer as on CPU. A LayerNorm computed in float32 from a bf16 input thus
  keeps the bf16 input and its per-row statistics, not its float32 ``x − mean`` and normalised
  values; GELU's ``tanh`` in bf16 keeps its buffer.

Either way, a value from outside ``ops`` (the layer's input) that an op of the backward still
reads, directly or through fused values, is held until then: it counts in the boundary.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from orchestrator.graph import OpGraph

# XLA:CPU's ``kMinElements`` (``IsInstructionPreferredByYnn``): smaller elementwise ops stay out of YNNPACK fusions
YNN_MIN_ELEMENTS = 4096

_FUSIBLE_KINDS = frozenset({"elementwise", "data_movement"})
# Views and broadcasts XLA recomputes wherever they are read, even across the
# forward/backward boundary: they never hold a buffer of their own.
_FREE_VIEWS = frozenset({"broadcast_in_dim", "iota", "reshape", "squeeze", "expand_dims"})
_UNFUSIBLE_PRIMITIVES = frozenset(
    {"gather", "scatter", "scatter-add", "scatter_add", "dynamic_update_slice", "concatenate", "sort"}
)


# ops that read only the operand elements they return, not the whole operand
_GATHERS = frozenset({"gather", "dynamic_slice", "slice"})
# ops that update their operand's buffer in place (XLA aliases output and operand)
_IN_PLACE = frozenset({"scatter", "scatter-add", "scatter_add", "scatter-mul", "dynamic_update_slice"})


# XLA's InstructionFusion::IsExpensive for elementwise ops: fusing one into several readers
# computes it again in each, so XLA keeps its buffer instead
_EXPENSIVE = frozenset(
    {"atan2", "cbrt", "cos", "div", "erf", "erf_inv", "erfc", "exp", "exp2", "expm1", "log", "log1p",
     "logistic", "pow", "rem", "rsqrt", "sin", "sqrt", "tan", "tanh"}
)  # fmt: skip
# GpuInstructionFusion::IsExpensive: cheap on a GPU in float32 and float16
_CHEAP_ON_GPU = frozenset({"div", "exp", "rsqrt", "sqrt"})


def fusible(graph: OpGraph, name: str) -> bool:
    op = graph.op(name)
    return op.kind in _FUSIBLE_KINDS and op.primitive not in _UNFUSIBLE_PRIMITIVES


def _expensive_on_gpu(graph: OpGraph, name: str) -> bool:
    op = graph.op(name)
    if op.primitive in _CHEAP_ON_GPU:
        return not op.outputs or op.outputs[0].dtype not in ("float32", "float16")
    return op.primitive in _EXPENSIVE


def materialized_ops(graph: OpGraph, order: Iterable[str] | None = None, *, xla_gpu: bool = False) -> dict[str, bool]:
    """Whether each op's output gets a buffer of its own (rules in the module docstring; ``xla_gpu``:
    XLA:GPU's)."""
    order = list(graph.nx.nodes) if order is None else list(order)
    members = set(order)
    readers = {n: [c for c in graph.nx.successors(n) if c in members] for n in order}

    out: dict[str, bool] = {}

    def crosses(n: str) -> bool:
        return graph.op(n).phase == "forward" and any(graph.op(c).phase != "forward" for c in readers[n])

    def recomputable(n: str) -> bool:
        # one same-shaped kept value feeds n's fused chain: recomputing n costs no memory
        preds = [p for p in graph.nx.predecessors(n) if p in members]
        if len(preds) != 1 or graph.op(preds[0]).outputs[:1] != graph.op(n).outputs[:1]:
            return False
        p = preds[0]
        return crosses(p) if out[p] else recomputable(p)

    def needs_buffer(reader: str) -> bool:
        # XLA:GPU's input fusions compute a reduction's elementwise operands inside it
        return not fusible(graph, reader) and not (xla_gpu and graph.op(reader).kind == "reduction")

    def is_materialized(n: str) -> bool:
        if not readers[n] or not fusible(graph, n) or any(needs_buffer(c) for c in readers[n]):
            return True
        if graph.op(n).primitive in _FREE_VIEWS:
            return False
        if xla_gpu:
            return crosses(n) and len(readers[n]) > 1 and _expensive_on_gpu(graph, n)
        return crosses(n) and len(readers[n]) > 1 and not recomputable(n)

    for n in order:
        out[n] = is_materialized(n)
    return out


def traffic_bytes(graph: OpGraph) -> dict[str, float]:
    """Main-memory bytes each op moves once fused: what it reads from buffers plus what it writes to one.

    A value read from a fused producer is computed in registers and costs no
    traffic; a fused op's own output is not written. A gather reads from its
    operand only the elements it returns (the 1,024 looked-up rows of a
    154 MB embedding table, not the table); a scatter updates its operand in
    place, reading and writing only the rows it touches. All repeats included.
    """
    materialized = materialized_ops(graph)
    out = {}
    for op in graph.ops():
        from_fused = sum(d["bytes"] for p, _, d in graph.nx.in_edges(op.name, data=True) if not materialized[p])
        inputs = [t.nbytes for t in op.inputs]
        written = sum(t.nbytes for t in op.outputs) if materialized[op.name] else 0.0
        in_place = op.primitive in _IN_PLACE and len(inputs) >= 3
        if op.primitive in _GATHERS and inputs:
            inputs[0] = min(inputs[0], sum(t.nbytes for t in op.outputs))
        elif in_place:  # operand, indices, updates: the touched rows are read and written
            inputs[0] = 0
            written = min(written, inputs[2])
        read = max(0.0, sum(inputs) - from_fused)
        out[op.name] = (read + written) * op.repeats
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class Liveness:
    """Peak and boundary figures of one liveness pass, in (scaled) bytes.

    Attributes:
      peak_bytes: the largest live total of materialized temporaries
        (values some op reads; program outputs are apart).
      boundary_bytes: live bytes held by forward values that the backward
        pass still needs, at the moment the first backward op starts
        (the activations a pipeline keeps per in-flight microbatch), the
        values from outside ``ops`` it still reads included.
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
    row_fusion_elements: float | None = None,
    recomputed: frozenset[str] = frozenset(),
    xla_gpu: bool = False,
) -> Liveness:
    """Simulate buffer lifetimes over ``ops`` (default: all) in execution order.

    ``allreduced`` names the ops whose output is all-reduced across devices.
    ``row_fusion_elements``: XLA:CPU's YNNPACK threshold (``ROW_FUSION_ELEMENTS``; None: not
    modelled): a kept forward residual computed from a per-row statistic that has at least this
    many elements on a device holds a second buffer of its size (module docstring).
    ``xla_gpu``: XLA:GPU's fusion rules (module docstring).
    """
    order = list(graph.nx.nodes) if ops is None else list(ops)
    members = set(order)
    position = {name: i for i, name in enumerate(order)}
    g = graph.nx
    readers = {n: [c for c in g.successors(n) if c in members] for n in order}

    materialized = materialized_ops(graph, order, xla_gpu=xla_gpu)
    for n in order:  # a view only in-place updates read is written straight into the buffer they own
        if graph.op(n).primitive in _FREE_VIEWS and readers[n]:
            materialized[n] &= not all(graph.op(c).primitive in _IN_PLACE for c in readers[n])
    # last_use[n]: position after which n's buffer (or, if fused, its inputs) may be freed
    last_use: dict[str, int] = {}
    for n in reversed(order):
        uses = [position[c] if materialized[c] else last_use[c] for c in readers[n]]
        last_use[n] = max(uses, default=position[n])
    first_backward = next((i for i, n in enumerate(order) if graph.op(n).phase == "backward"), None)
    # values from outside ``ops`` (the layer's input) that the backward still reads: (bytes, last use)
    held_inputs: dict[str, tuple[float, int]] = {}
    for p in {p for n in order for p in g.predecessors(n) if p not in members}:
        reads = [c for c in g.successors(p) if c in members]
        last = max(position[c] if materialized[c] else last_use[c] for c in reads)
        if first_backward is not None and last >= first_backward and graph.op(p).phase == "forward":
            held_inputs[p] = (max(g.edges[p, c]["bytes"] for c in reads) * scale(p), last)

    def size(n: str) -> float:
        own = sum(t.nbytes for t in graph.op(n).outputs) * scale(n)
        return 2 * own if row_fused(n) else own

    def row_fused(n: str) -> bool:
        if row_fusion_elements is None or not materialized[n] or not fusible(graph, n):
            return False
        op = graph.op(n)
        if op.phase != "forward" or not any(graph.op(c).phase != "forward" for c in readers[n]):
            return False
        elements = math.prod(op.outputs[0].shape)
        for p in g.predecessors(n):
            if not fusible(graph, p) or graph.op(p).primitive in _FREE_VIEWS:
                continue
            shape = graph.op(p).outputs[0].shape
            rows = math.prod(shape)
            if len(shape) >= 2 and shape[-1] == 1 and rows < elements and rows * scale(p) >= row_fusion_elements:
                return True
        return False

    frees: dict[int, float] = {}
    live = peak = boundary = outputs = 0.0
    for nbytes, last in held_inputs.values():  # live from the layer's start, freed after their last read
        live += nbytes
        frees[last] = frees.get(last, 0.0) + nbytes
    for i, n in enumerate(order):
        if i == first_backward:
            boundary = sum(nbytes for nbytes, _ in held_inputs.values()) + sum(
                size(m)
                for m in order[:i]
                if materialized[m]
                and last_use[m] >= i
                and graph.op(m).phase == "forward"
                and readers[m]
                and m not in recomputed
            )
        if materialized[n] and readers[n]:
            nbytes = size(n)
            live += nbytes
            frees[last_use[n]] = frees.get(last_use[n], 0.0) + nbytes
        elif materialized[n]:
            outputs += size(n)
        in_flight = size(n) if n in allreduced else 0.0
        peak = max(peak, live + in_flight)
        live -= frees.pop(i, 0.0)
    return Liveness(peak_bytes=peak, boundary_bytes=boundary, output_bytes=outputs)
