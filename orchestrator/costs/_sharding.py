"""Which tensors and ops of a captured step tensor parallelism splits, and where it all-reduces.

Parameters carry logical axis names (``("embed", "heads")``); ``tp_axes`` names
the logical axes that the tensor-parallel mesh axis may shard (by default
``heads``, ``mlp`` and ``vocab``). Under degree t a parameter is split on

    its first dim whose logical name is in ``tp_axes`` and whose size t divides

and replicated if there is none (:func:`sharded_dim`; the executor places
parameters by this same function, so t = 8 over 4 heads leaves attention
replicated). A kernel laid out as (inputs…, outputs…), as Flax lays them out, is

* **column-parallel** if a later dim is split (Megatron's first matmul of a pair);
* **row-parallel** if its first dim is split (the second matmul of the pair;
  for an embedding table, the vocabulary);
* replicated otherwise.

Tags then flow through the op-graph in execution order (forward, backward and
optimizer alike), following Megatron-LM (Shoeybi et al. 2019). A split value
remembers S, the global size of its split dim:

* a matmul that combines a TP-split activation with a column- or
  row-parallel parameter contracts over the split dim: each device
  holds a partial sum and the output is **all-reduced** (forward: after a
  row-parallel matmul; backward: the input gradient of a column-parallel one);
* a matmul of a replicated activation with a column/row-parallel parameter,
  or one with a split activation and no TP parameter, gives a split output;
* a reduction or a gather whose output has fewer dims of size S than its
  split input has reduced or indexed away the split dim: each device holds a
  partial result and the output is **all-reduced** (softmax cross-entropy
  over vocabulary-split logits: its max, its sum of exponentials and the
  label's logit);
* a gather from a row-split table (an embedding lookup in a vocabulary-split
  table) has no dim of size S in its output: each device looks up the rows it
  holds, zeros elsewhere, and the output is **all-reduced**;
* any other op is split if one of its inputs is (a reshape carries S to the
  output dim that now holds the split one).

A split op does 1/t of its work on each of t devices. This is exactly what
XLA's SPMD partitioner emits for our recipes (measured on gpt2-small: two
forward and two backward all-reduces of the block's activation per layer; on
gpt-tiny with its vocabulary split, one more for the embedding lookup and three
small ones for the cross-entropy).

The graph keeps shapes but not which dims an op reduces, so "the split dim is
gone" is read from the count of dims of size S; a model whose split size
equals another dim's size in the same tensor can be mistagged.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from orchestrator.graph import OpGraph

Role = Literal["replicated", "sharded", "column", "row", "param"]
DEFAULT_TP_AXES = frozenset({"heads", "mlp", "vocab"})
_PARAM_ROLES = ("column", "row", "param")
_SPLIT_ROLES = ("sharded", "column", "row")
# Ops that can drop a split dim: the devices then hold partial results.
_GATHERS = frozenset({"gather"})
_RESHAPES = frozenset({"reshape"})


def sharded_dim(
    shape: Sequence[int] | None, axes: Sequence[str | None] | None, tp: int | None, tp_axes: frozenset[str]
) -> int | None:
    """The dim of a parameter that tensor-parallel degree ``tp`` splits, or None if it stays replicated.

    The first dim whose logical name is in ``tp_axes`` and whose size ``tp``
    divides. Without a shape or degree, divisibility is not checked.

    Example:
      >>> sharded_dim((64, 3, 4, 16), ("embed", None, "heads", "kv"), 2, frozenset({"heads"}))
      2
      >>> sharded_dim((64, 3, 4, 16), ("embed", None, "heads", "kv"), 8, frozenset({"heads"})) is None
      True
    """
    for i, name in enumerate(axes or ()):
        if name not in tp_axes:
            continue
        if shape is None or tp is None or (i < len(shape) and shape[i] % tp == 0):
            return i
    return None


def param_role(
    axes: Sequence[str | None] | None,
    tp_axes: frozenset[str],
    *,
    shape: Sequence[int] | None = None,
    tp: int | None = None,
) -> Role:
    """Column, row or plain (replicated) parameter, from its logical axis names (and shape under degree ``tp``).

    A one-dimensional parameter (bias, scale) lies along a layer's output, so a
    split one belongs to a column-parallel layer.
    """
    dim = sharded_dim(shape, axes, tp, tp_axes)
    if dim is None:
        return "param"
    return "row" if dim == 0 and len(axes or ()) > 1 else "column"


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorParallelTraits:
    """Result of :func:`tensor_parallel_traits` over a whole graph.

    Attributes:
      roles: tag of each op's output (``sharded`` outputs are split t ways).
      split_ops: ops whose work divides over the t devices.
      allreduce_ops: ops whose output is all-reduced over the TP group.
      param_roles: role of each parameter.
    """

    roles: Mapping[str, Role]
    split_ops: frozenset[str]
    allreduce_ops: frozenset[str]
    param_roles: Mapping[str, Role]

    def is_param_derived(self, op: str) -> bool:
        """True if the op's output depends on parameters only (no batch dimension)."""
        return self.roles[op] in _PARAM_ROLES


def _count(shape: Sequence[int], size: int) -> int:
    return sum(1 for d in shape if d == size)


def _reshaped_size(in_shape: Sequence[int], size: int, out_shape: Sequence[int]) -> int:
    """Size of the output dim that holds the input's (first) dim of ``size`` after a reshape."""
    if size not in in_shape:
        return size
    before = math.prod(in_shape[: list(in_shape).index(size)])
    product = 1
    for d in out_shape:
        if product * d > before:
            return d
        product *= d
    return size


def tensor_parallel_traits(
    graph: OpGraph,
    param_axes: Mapping[str, Sequence[str | None]],
    tp_axes: frozenset[str] = DEFAULT_TP_AXES,
    tp: int | None = None,
) -> TensorParallelTraits:
    """Tag every op of ``graph`` (rules in the module docstring) for tensor-parallel degree ``tp``.

    With ``tp=None`` every dim named in ``tp_axes`` counts as divisible.
    """
    param_roles: dict[str, Role] = {}
    param_sizes: dict[str, int] = {}
    for path, spec in graph.params.items():
        axes = param_axes.get(path)
        param_roles[path] = param_role(axes, tp_axes, shape=spec.shape, tp=tp)
        dim = sharded_dim(spec.shape, axes, tp, tp_axes)
        if dim is not None:
            param_sizes[path] = spec.shape[dim]
    roles: dict[str, Role] = {}
    sizes: dict[str, int] = {}  # S: global size of a split output's split dim
    split, allreduce = set(), set()
    g = graph.nx
    for op in graph.ops():
        preds = list(g.predecessors(op.name))
        inputs = [roles[p] for p in preds] + [param_roles[p] for p in op.param_reads]
        sharded = "sharded" in inputs
        tp_param = "column" in inputs or "row" in inputs
        activation = any(r not in _PARAM_ROLES for r in inputs)
        split_inputs = [p for p in preds if roles[p] in _SPLIT_ROLES] + [p for p in op.param_reads if p in param_sizes]
        known = (sizes.get(p, param_sizes.get(p)) for p in split_inputs)
        size = next((s for s in known if s is not None), None)
        out_shape = op.outputs[0].shape if op.outputs else ()
        in_count = max((_count(t.shape, size) for t in op.inputs), default=0) if size else 0
        dropped = size is not None and _count(out_shape, size) < in_count
        role: Role
        if op.primitive == "dot_general" and sharded and tp_param:
            role = "replicated"
            split.add(op.name)
            allreduce.add(op.name)
        elif op.primitive == "dot_general" and tp_param and activation:
            role = "sharded"
            split.add(op.name)
        elif sharded and dropped and (op.kind == "reduction" or op.primitive in _GATHERS):
            role = "replicated"  # partial reductions or lookups on each device
            split.add(op.name)
            allreduce.add(op.name)
        elif op.primitive in _GATHERS and activation and "row" in inputs and dropped:
            role = "replicated"  # each device looks up the rows it holds
            allreduce.add(op.name)
        elif sharded:
            role = "sharded"
            split.add(op.name)
        elif inputs and not activation:
            kinds = set(inputs)
            role = kinds.pop() if len(kinds) == 1 else "param"
        else:
            role = "replicated"
        roles[op.name] = role
        if role in _SPLIT_ROLES and size is not None:
            sizes[op.name] = _reshaped_size(op.inputs[0].shape, size, out_shape) if op.primitive in _RESHAPES else size
    return TensorParallelTraits(
        roles=roles, split_ops=frozenset(split), allreduce_ops=frozenset(allreduce), param_roles=param_roles
    )
