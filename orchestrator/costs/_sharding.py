"""Which tensors and ops of a captured step tensor parallelism splits, and where it all-reduces.

Parameters carry logical axis names (``("embed", "heads")``); a table of
logical axis rules, ``(logical axis name, mesh axis or None)`` pairs in the
form of flax's ``nn.logical_axis_rules`` and maxtext's ``logical_axis_rules``,
maps them onto the mesh ``("data", "model")`` every stage runs on. The cost
model and both executors (``integrations.flax``, ``integrations.torch_xla``)
read the same table (:data:`DEFAULT_LOGICAL_AXIS_RULES` unless the user passes
``axis_rules=``) and place a parameter by the same rule. Under degree t a
parameter is split over ``"model"`` on

    its first dim whose logical name the rules map to ``"model"`` and whose size t divides

and replicated if there is none (:func:`sharded_dim`): a dim that does not
divide is skipped, so t = 8 over 4 heads leaves attention replicated, and the
plan the cost model prices is the plan the executors run. A kernel laid out
as (inputs…, outputs…), as Flax lays them out, is

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
* its backward, a scatter-add into a table of that table's shape, is split: each
  device adds into the rows it holds (Megatron's vocabulary-parallel embedding;
  XLA's partitioner shards it as the gradient it becomes), with no collective;
* any other op is split if one of its inputs is (a reshape carries S to the
  output dim that now holds the split one), and so is an op that reads a
  column- or row-parallel parameter alone (its cast to the compute dtype, its
  optimizer update): each device works on its own shard.

A split op does 1/t of its work on each of t devices. These are the
collectives XLA's SPMD partitioner emits for the recipes: two forward and two
backward all-reduces of the block's activation per transformer layer and, with
the vocabulary split, one more for the embedding lookup and three small ones
for the cross-entropy (``orchestrator bench fidelity`` and ``orchestrator bench
torch`` compare them with the compiled HLO).

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
LogicalAxisRules = Sequence[tuple[str, str | None]]
"""``(logical axis name, mesh axis or None)`` pairs; the first pair naming an axis decides it."""

MODEL_AXIS = "model"  # the tensor-parallel mesh axis; "data" carries the batch and ZeRO's moments
DEFAULT_LOGICAL_AXIS_RULES: tuple[tuple[str, str | None], ...] = (
    ("heads", MODEL_AXIS),
    ("mlp", MODEL_AXIS),
    ("vocab", MODEL_AXIS),
    ("embed", None),
    ("kv", None),
)
"""Megatron's split: attention heads and MLP columns, and the vocabulary of the embedding table.

Splitting ``heads`` and ``mlp`` gives the column/row matmul pairs of a
transformer block (one all-reduce each way per pair). ``vocab`` splits the
embedding table and the tied LM head that reads it, so the logits and the
cross-entropy work divide too; both executors run it (XLA's SPMD partitioner
turns the lookup into a masked local gather plus an all-reduce), and the cost
model prices those all-reduces. ``embed`` (the residual stream) and ``kv``
(the head dim) stay replicated: splitting them would all-reduce inside every
matmul of the block.
"""
_PARAM_ROLES = ("column", "row", "param")
_SPLIT_ROLES = ("sharded", "column", "row")
# Ops that can drop a split dim: the devices then hold partial results.
_GATHERS = frozenset({"gather"})
_SCATTER_ADDS = frozenset({"scatter-add", "scatter_add"})
_RESHAPES = frozenset({"reshape"})


def tensor_parallel_axes(rules: LogicalAxisRules | None = None) -> frozenset[str]:
    """The logical axis names that ``rules`` (:data:`DEFAULT_LOGICAL_AXIS_RULES` if None) map to ``"model"``.

    Raises:
      ValueError: a rule is not a (name, mesh axis) pair, or names a mesh axis other than ``"model"`` or None.

    Example:
      >>> sorted(tensor_parallel_axes((("heads", "model"), ("mlp", None), ("heads", None))))
      ['heads']
    """
    split, seen = set(), set()
    for rule in DEFAULT_LOGICAL_AXIS_RULES if rules is None else rules:
        if not (isinstance(rule, tuple | list) and len(rule) == 2 and isinstance(rule[0], str)):
            raise ValueError(f"axis rule {rule!r} is not a (logical axis name, mesh axis or None) pair")
        name, mesh_axis = rule
        if mesh_axis not in (MODEL_AXIS, None):
            raise ValueError(f"axis rule {rule!r}: parameters split over {MODEL_AXIS!r} or nothing (None)")
        if name not in seen and mesh_axis == MODEL_AXIS:
            split.add(name)
        seen.add(name)
    return frozenset(split)


def sharded_dim(
    shape: Sequence[int] | None,
    axes: Sequence[str | None] | None,
    tp: int | None,
    rules: LogicalAxisRules | None = None,
) -> int | None:
    """The dim of a parameter that tensor-parallel degree ``tp`` splits, or None if it stays replicated.

    The first dim whose logical name ``rules`` map to ``"model"`` and whose
    size ``tp`` divides; a dim that does not divide is skipped. Without a shape
    or degree, divisibility is not checked.

    Example:
      >>> sharded_dim((64, 3, 4, 16), ("embed", None, "heads", "kv"), 2)
      2
      >>> sharded_dim((64, 3, 4, 16), ("embed", None, "heads", "kv"), 8) is None
      True
      >>> sharded_dim((6, 8), ("heads", "mlp"), 4)  # 6 heads do not divide: the mlp dim is split
      1
    """
    split = tensor_parallel_axes(rules)
    for i, name in enumerate(axes or ()):
        if name not in split:
            continue
        if shape is None or tp is None or (i < len(shape) and shape[i] % tp == 0):
            return i
    return None


def logical_to_mesh_axes(
    shape: Sequence[int],
    axes: Sequence[str | None] | None,
    tp: int,
    rules: LogicalAxisRules | None = None,
) -> tuple[str | None, ...]:
    """The mesh axis of each dim of a parameter under degree ``tp``: ``"model"`` on :func:`sharded_dim`, else None.

    Both executors build their partition specs from it (``PartitionSpec(*…)``
    in Flax, ``xs.mark_sharding(…)`` in torch_xla).

    Example:
      >>> logical_to_mesh_axes((64, 3, 4, 16), ("embed", None, "heads", "kv"), 2)
      (None, None, 'model', None)
    """
    spec: list[str | None] = [None] * len(shape)
    dim = sharded_dim(shape, axes, tp, rules) if tp > 1 else None
    if dim is not None:
        spec[dim] = MODEL_AXIS
    return tuple(spec)


def param_role(
    axes: Sequence[str | None] | None,
    rules: LogicalAxisRules | None = None,
    *,
    shape: Sequence[int] | None = None,
    tp: int | None = None,
) -> Role:
    """Column, row or plain (replicated) parameter, from its logical axis names (and shape under degree ``tp``).

    A one-dimensional parameter (bias, scale) lies along a layer's output, so a
    split one belongs to a column-parallel layer.
    """
    dim = sharded_dim(shape, axes, tp, rules)
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
    rules: LogicalAxisRules | None = None,
    tp: int | None = None,
    *,
    cache: dict | None = None,
) -> TensorParallelTraits:
    """Tag every op of ``graph`` (rules in the module docstring) for tensor-parallel degree ``tp``.

    With ``tp=None`` every dim that ``rules`` map to ``"model"`` counts as divisible. The ops' tags
    depend on ``tp`` only through the parameters' tags, which are the same for every ``tp`` that
    divides the same dims: ``cache`` (a dict kept by the caller for one graph) holds the ops' tags
    per parameters' tags, so those degrees walk the graph once.
    """
    param_roles: dict[str, Role] = {}
    param_sizes: dict[str, int] = {}
    for path, spec in graph.params.items():
        axes = param_axes.get(path)
        param_roles[path] = param_role(axes, rules, shape=spec.shape, tp=tp)
        dim = sharded_dim(spec.shape, axes, tp, rules)
        if dim is not None:
            param_sizes[path] = spec.shape[dim]
    if cache is None:
        return _op_traits(graph, param_roles, param_sizes)
    key = (tuple(param_roles.items()), tuple(param_sizes.items()))
    if key not in cache:
        cache[key] = _op_traits(graph, param_roles, param_sizes)
    return cache[key]


def _op_traits(graph: OpGraph, param_roles: dict[str, Role], param_sizes: dict[str, int]) -> TensorParallelTraits:
    """The tags of every op of ``graph`` given its parameters' (:func:`tensor_parallel_traits`)."""
    roles: dict[str, Role] = {}
    sizes: dict[str, int] = {}  # S: global size of a split output's split dim
    split, allreduce = set(), set()
    lookups: dict[tuple[int, ...], int] = {}  # shape of each row-split table looked up → its S
    g = graph.nx
    for op in graph.ops():
        preds = list(g.predecessors(op.name))
        inputs = [roles[p] for p in preds] + [param_roles[p] for p in op.param_reads]
        sharded = "sharded" in inputs
        tp_param = "column" in inputs or "row" in inputs
        activation = any(r not in _PARAM_ROLES for r in inputs)
        # an input no op produced and no parameter is: the step's own input (token ids read straight from the batch)
        external = len(op.inputs) > len(preds) + len(op.param_reads)
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
        elif op.primitive in _GATHERS and (activation or external) and "row" in inputs and dropped:
            role = "replicated"  # each device looks up the rows it holds
            allreduce.add(op.name)
            lookups[op.inputs[0].shape] = size
        elif op.primitive in _SCATTER_ADDS and lookups.get(out_shape) is not None:
            role = "sharded"  # a lookup's backward: each device adds into the rows it holds
            split.add(op.name)
            size = lookups[out_shape]
        elif sharded:
            role = "sharded"
            split.add(op.name)
        elif inputs and not activation:
            kinds = set(inputs)
            role = kinds.pop() if len(kinds) == 1 else "param"
            if role in ("column", "row"):
                split.add(op.name)  # work on one parameter's shard (a cast, an optimizer update)
        else:
            role = "replicated"
        roles[op.name] = role
        if role in _SPLIT_ROLES and size is not None:
            sizes[op.name] = _reshaped_size(op.inputs[0].shape, size, out_shape) if op.primitive in _RESHAPES else size
    return TensorParallelTraits(
        roles=roles, split_ops=frozenset(split), allreduce_ops=frozenset(allreduce), param_roles=param_roles
    )
