"""Group the ops of an op-graph into layers.

This is the roadmap's "clustering variable reduction": the planner's variables
scale with layers — and its cost tables with *distinct* layers — not with ops.

Grouping by module scope:
  1. *Repeated blocks* are found at any depth below the scope all forward ops
     share: a scope whose children are named ``<prefix>_<n>`` or
     ``<prefix>_<n>_<rest>``, with at least two numbers ``n`` for one
     ``<prefix>``, holds a family of blocks (``transformer/h_3``,
     ``encoder/layers_7``, ``layers_3``); all children of one ``<prefix>_<n>``
     form one block (``res_0_norm``, ``res_0_up`` → ``res_0``). Families
     nested inside a block of another family are part of that block.
  2. The *unit* of a forward or backward op is its block, or else its scope cut
     one component below the deepest scope that holds or encloses a family
     (``transformer/wte``, ``lm_head``); without families, the first component
     below the shared scope (``GPT/blocks_3/attn/c_attn`` → ``blocks_3``).
  3. Units are ordered by their first forward op. When a model has blocks,
     each block is a layer and each run of other units between them merges
     into one layer (``wte`` + ``wpe`` before the blocks, ``ln_f`` +
     ``wte.attend`` after); when it has none, every unit is a layer.
  4. Ops without a unit (loss, glue at the root scope or at a scope enclosing
     a family, the optimizer update) join the layer of the producer they read
     the most bytes from, or failing that, of the consumer they feed the most
     bytes to. An optimizer update thereby lands in the layer whose gradient
     it reads.

Fallback for graphs without module scopes (fewer than two units): forward ops
in topological order are cut into contiguous groups of about equal FLOPs;
backward and optimizer ops then follow rule 4.
"""

from __future__ import annotations

import hashlib
import re
from collections import defaultdict

from orchestrator.coarsen._layers import Layer, LayerGraph
from orchestrator.graph import OpGraph

_BLOCK = re.compile(r"^(.*?)_(\d+)(?:_.*)?$")


def coarsen(graph: OpGraph, *, fallback_layers: int = 8, by_scope: bool = True) -> LayerGraph:
    """Group ``graph``'s ops into layers (see the module docstring for the rules).

    Args:
      graph: a captured op-graph.
      fallback_layers: number of balanced groups when the graph has no usable
        module scopes (or when ``by_scope`` is False).
      by_scope: group by module scope; False forces balanced cuts
        (``fallback_layers=1`` then makes the whole graph one layer).

    Returns:
      The :class:`LayerGraph`; its layers' ``param_bytes`` add up to the
      graph's parameter bytes credited to ops.

    Example:
      >>> layers = coarsen(graph)            # doctest: +SKIP
      >>> [layer.name for layer in layers]    # doctest: +SKIP
      ['GPT/wte+wpe', 'GPT/blocks_0', ..., 'GPT/ln_f+wte.attend']
    """
    if len(graph) == 0:
        raise ValueError("cannot coarsen an empty op-graph")
    root, units, block_of = _scope_units(graph)
    ordered_units = list(
        dict.fromkeys(u for op, u in units.items() if u is not None and graph.op(op).phase == "forward")
    )
    if by_scope and len(ordered_units) >= 2:
        names, layer_of_unit = _group_units(ordered_units, block_of)
        names = [f"{root}/{name}" if root else name for name in names]
        assignment = {op: layer_of_unit[u] for op, u in units.items() if u in layer_of_unit}
    else:
        names, assignment = _balanced(graph, fallback_layers)
    scoped = set(assignment)
    _propagate(graph, assignment, default=0)
    return _build(graph, assignment, names, scoped)


def _scope_units(graph: OpGraph) -> tuple[str, dict[str, str | None], dict[str, str | None]]:
    """The shared root scope, each op's unit below it (None if it has none), and each unit's block."""
    forward_scopes = [op.scope.split("/") for op in graph.ops() if op.phase == "forward" and op.scope]
    root: list[str] = []
    if forward_scopes:
        for parts in zip(*forward_scopes):
            if len(set(parts)) != 1:
                break
            root.append(parts[0])
        # Keep one component below the root for every scope that has one.
        if all(len(s) == len(root) for s in forward_scopes) and root:
            root = root[:-1]
    families = _families([tuple(s[len(root) :]) for s in forward_scopes])
    enclosing = {node[:depth] for node in families for depth in range(len(node) + 1)} or {()}
    units: dict[str, str | None] = {}
    block_of: dict[str, str | None] = {}
    for op in graph.ops():
        parts = tuple(op.scope.split("/")) if op.scope else ()
        if op.phase == "optimizer" or len(parts) <= len(root) or list(parts[: len(root)]) != root:
            units[op.name] = None
            continue
        unit, block = _unit(parts[len(root) :], families, enclosing)
        units[op.name] = unit
        if unit is not None:
            block_of[unit] = block
    return "/".join(root), units, block_of


def _block_key(unit: str) -> tuple[str, str] | None:
    """``("res_0", "res")`` for ``res_0_up``; ``("blocks_3", "blocks")`` for ``blocks_3``."""
    match = _BLOCK.match(unit)
    return (f"{match.group(1)}_{match.group(2)}", match.group(1)) if match else None


def _families(scopes: list[tuple[str, ...]]) -> dict[tuple[str, ...], dict[str, str]]:
    """Scopes holding a family of blocks: scope → {child name: block name}, outermost families only."""
    children: dict[tuple[str, ...], set[str]] = defaultdict(set)
    for parts in scopes:
        for depth in range(len(parts)):
            children[parts[:depth]].add(parts[depth])
    families: dict[tuple[str, ...], dict[str, str]] = {}
    for node in sorted(children, key=len):  # shallow first: an enclosing family claims its blocks
        if any(node[depth] in families.get(node[:depth], {}) for depth in range(len(node))):
            continue
        numbers: dict[str, set[str]] = defaultdict(set)
        for child in children[node]:
            key = _block_key(child)
            if key:
                numbers[key[1]].add(key[0])
        members = {
            child: key[0] for child in children[node] if (key := _block_key(child)) and len(numbers[key[1]]) >= 2
        }
        if members:
            families[node] = members
    return families


def _unit(
    parts: tuple[str, ...], families: dict[tuple[str, ...], dict[str, str]], enclosing: set[tuple[str, ...]]
) -> tuple[str | None, str | None]:
    """``(unit, block)`` of a scope below the root: walk down while the scope encloses a family."""
    for depth in range(len(parts)):
        node = parts[:depth]
        block = families.get(node, {}).get(parts[depth])
        if block is not None:
            name = "/".join((*node, block))
            return name, name
        if parts[: depth + 1] not in enclosing:
            return "/".join(parts[: depth + 1]), None
    return None, None  # glue at a scope that encloses a family


def _group_units(ordered_units: list[str], block_of: dict[str, str | None]) -> tuple[list[str], dict[str, int]]:
    has_blocks = any(block_of.get(unit) for unit in ordered_units)
    names: list[str] = []
    layer_of_unit: dict[str, int] = {}
    previous_block: str | None = None
    for unit in ordered_units:
        block = block_of.get(unit)
        if block is not None and block == previous_block:
            layer_of_unit[unit] = len(names) - 1
        elif block is not None or not has_blocks or not names or previous_block is not None:
            names.append(block or unit)
            layer_of_unit[unit] = len(names) - 1
        else:  # a run of non-block units between blocks: one layer
            names[-1] = f"{names[-1]}+{unit}"
            layer_of_unit[unit] = len(names) - 1
        previous_block = block
    return names, layer_of_unit


def _balanced(graph: OpGraph, count: int) -> tuple[list[str], dict[str, int]]:
    forward = [op for op in graph.ops() if op.phase == "forward"]
    total = sum(op.flops for op in forward) or float(len(forward))
    count = max(1, min(count, len(forward)))
    assignment, done = {}, 0.0
    for op in forward:
        # the group an op falls in is set by the FLOPs done before its midpoint
        weight = op.flops if total != len(forward) else 1.0
        assignment[op.name] = min(count - 1, int((done + weight / 2) / total * count))
        done += weight
    used = sorted(set(assignment.values()))
    renumber = {old: new for new, old in enumerate(used)}
    return [f"layer_{i}" for i in range(len(used))], {op: renumber[i] for op, i in assignment.items()}


def _propagate(graph: OpGraph, assignment: dict[str, int], *, default: int) -> None:
    """Give unassigned ops the layer of their heaviest producer, else heaviest consumer."""
    g = graph.nx
    order = list(g.nodes)
    for name in order:
        if name not in assignment:
            preds = [(d["bytes"], assignment[p]) for p, _, d in g.in_edges(name, data=True) if p in assignment]
            if preds:
                assignment[name] = max(preds)[1]
    for name in reversed(order):
        if name not in assignment:
            succs = [(d["bytes"], assignment[s]) for _, s, d in g.out_edges(name, data=True) if s in assignment]
            assignment[name] = max(succs)[1] if succs else default


def _signature(graph: OpGraph, op_names: list[str], param_bytes: int) -> str:
    """Hash of the multiset of (phase, primitive, shapes) — equal for identical layers."""
    items = sorted(
        f"{op.phase}|{op.primitive}|{op.repeats}|"
        + ";".join(f"{t.dtype}{t.shape}" for t in op.inputs)
        + "->"
        + ";".join(f"{t.dtype}{t.shape}" for t in op.outputs)
        for op in (graph.op(n) for n in op_names)
    )
    digest = hashlib.sha256()
    digest.update(str(param_bytes).encode())
    for item in items:
        digest.update(item.encode())
    return digest.hexdigest()[:16]


def _build(graph: OpGraph, assignment: dict[str, int], names: list[str], scoped: set[str]) -> LayerGraph:
    """Assemble the layers; signatures use only the ops placed by scope (rules 1–3).

    Ops placed by data flow (rule 4) are left out of the signature because a
    block's neighbours differ: the first block also absorbs the unscoped
    gradient reduction of the position embedding that reads its output.
    """
    members: list[list[str]] = [[] for _ in names]
    for op in graph.ops():
        members[assignment[op.name]].append(op.name)

    # Forward activations crossing layers: each producer's output counted once
    # per destination layer, however many ops there read it.
    crossing: dict[tuple[str, int], int] = defaultdict(int)
    for src, dst, nbytes in graph.edges():
        a, b = assignment[src], assignment[dst]
        if a < b and graph.op(src).phase == "forward" and graph.op(dst).phase == "forward":
            crossing[(src, b)] += nbytes
    edges: dict[tuple[int, int], int] = defaultdict(int)
    for (src, dst_layer), nbytes in crossing.items():
        written = sum(t.nbytes for t in graph.op(src).outputs)
        edges[(assignment[src], dst_layer)] += min(nbytes, written)
    sent = defaultdict(int)
    for (a, _), nbytes in edges.items():
        sent[a] += nbytes

    layers = []
    for index, (name, ops) in enumerate(zip(names, members)):
        records = [graph.op(n) for n in ops]
        phase_flops = defaultdict(float)
        for op in records:
            phase_flops[op.phase] += op.flops
        param_bytes = sum(op.param_bytes for op in records)
        layers.append(
            Layer(
                name=name,
                index=index,
                forward_flops=phase_flops["forward"],
                backward_flops=phase_flops["backward"],
                optimizer_flops=phase_flops["optimizer"],
                transcendentals=sum(op.transcendentals for op in records),
                param_bytes=param_bytes,
                activation_bytes=sent[index],
                signature=_signature(graph, [n for n in ops if n in scoped], param_bytes),
                params=tuple(path for op in records for path in op.param_paths),
                ops=tuple(ops),
            )
        )
    return LayerGraph(layers, dict(edges), name=graph.name)
