"""Cut a traced train step into one forward program per pipeline stage.

**Where the stages come from.** The user's train step is traced at the
microbatch shape and flattened (:class:`~integrations.flax.SlicedStep`), which
ties every flat equation to the captured op it produced; the coarsened layers
then say which stage each forward op belongs to. A stage's forward function is
its forward equations, closed over what they read from outside: parameters
(its own, and parameters owned by an earlier stage that it reads again, such as
a tied embedding), batch leaves, and activations computed by earlier stages.
Its outputs are the values later stages read, and, on the stage that computes
it, the step's ``"loss"`` metric. We cut the traced step rather than Flax
modules because it needs nothing from the model: any function whose layers the
op-graph finds splits the same way (a test does it for a residual MLP written
in the test), and the cut is exactly the graph the planner costed.

**Virtual stages.** Under interleaved 1F1B (``plan.virtual_stages`` = v > 1; Narayanan et
al. 2021, §2.2.2) the step is cut into V = v·S model chunks in pipeline order, chunk k running
on stage k mod S (chunk c of stage s is virtual stage c·S + s, as ``orchestrator.simulate``
orders them). A plan records each stage's layers as one contiguous range and prices each chunk
as 1/v of it; :func:`chunk_layers` lays the model out so that stage s still holds as many
layers of each kind: chunk c of stage s takes 1/v of the stage's repeated layers (the blocks,
identical, so it costs what was priced), the layers before the first block ride in the first
chunk and those after the last block in the last, as Megatron-LM places the embedding and the head.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import jax
from jax.extend import core as jcore

from integrations.flax._capture import _key_name, capture, is_param_path, param_path_name
from integrations.flax._slice import SlicedStep


@dataclass(slots=True)
class StageProgram:
    """The forward of one stage as a closed jaxpr with typed inputs and outputs.

    ``inputs``: per jaxpr invar, ``("param", path)``, ``("batch", leaf index)`` or
    ``("act", producer stage, key)``; ``outputs``: keys of the activations it
    produces (consumed by later stages), then ``"loss"`` if it computes it;
    ``flat``: per equation of ``closed``, its index in ``sliced.flat``, the flattened step it
    was cut from (which ties it to the captured ops, for the stage's options).
    """

    index: int  # its position in the pipeline: the stage, or under virtual stages the chunk (c·S + s)
    closed: jcore.ClosedJaxpr
    inputs: list[tuple]
    outputs: list[object]
    consumers: dict[object, list[int]] = field(default_factory=dict)
    flat: list[int] = field(default_factory=list)
    sliced: SlicedStep | None = None


def _out_loss_index(train_step, state, batch) -> int:
    leaves = jax.tree_util.tree_flatten_with_path(jax.eval_shape(train_step, state, batch))[0]
    for i, (path, _) in enumerate(leaves):
        names = [_key_name(k) for k in path]
        if names and names[0] == "1" and names[-1] == "loss":
            return i
    raise ValueError("a pipelined train step must return (state, metrics) with metrics['loss'] (the mean loss)")


def repeated_layers(layers) -> set[int]:
    """Indices of the layers in runs of several consecutive identical layers (equal signature and
    output bytes: the blocks), the runs the planner splits into virtual stages."""
    keys = [(layer.signature, layer.activation_bytes) for layer in layers]
    return {
        i for i, key in enumerate(keys) if (i > 0 and keys[i - 1] == key) or (i + 1 < len(keys) and keys[i + 1] == key)
    }


def chunk_layers(plan, layers) -> list[tuple[int, ...]]:
    """The layers of each pipeline program in order: a stage's, or under virtual stages each model chunk's.

    With v = ``plan.virtual_stages`` > 1 there are v·S chunks, chunk k on stage k mod S; chunk c
    of stage s takes 1/v of the repeated layers stage s holds in the plan, in model order, and
    the layers around them ride with the chunk before them (those before the first block with
    the first chunk). See the module docstring.

    Args:
      plan: the plan.
      layers: the coarsened layers its stages index.

    Raises:
      ValueError: under virtual stages, a layer in no stage or several, or a stage whose repeated
        layers v does not split evenly.

    Example: a GPT of 4 blocks planned as (embedding, blocks 0–1 | blocks 2–3, head) at v = 2
    runs as chunks (embedding, block 0 | block 1 | block 2 | block 3, head), stage 0 holding
    the first and third::

      >>> chunk_layers(plan, layers)  # doctest: +SKIP
      [(0, 1), (2,), (3,), (4, 5)]
    """
    S, v = len(plan.stages), plan.virtual_stages
    if v == 1:
        return [tuple(stage.layers) for stage in plan.stages]
    held = sorted(index for stage in plan.stages for index in stage.layers)
    if held != list(range(len(layers))):
        raise ValueError(f"the plan's stages hold layers {held}, not each of the model's {len(layers)} layers once")
    repeated = repeated_layers(layers)
    counts = [sum(index in repeated for index in stage.layers) for stage in plan.stages]
    for s, count in enumerate(counts):
        if count < v or count % v:
            raise ValueError(
                f"stage {s} holds {count} repeated layers, which {v} virtual stages do not split evenly: "
                "plan with virtual_stages=False to run it"
            )
    quotas = [counts[k % S] // v for k in range(v * S)]
    chunks: list[list[int]] = [[] for _ in quotas]
    k = filled = 0
    for index in range(len(layers)):
        if index in repeated:
            if filled == quotas[k]:
                k, filled = k + 1, 0
            filled += 1
        chunks[k].append(index)
    return [tuple(chunk) for chunk in chunks]


def cut_stages(train_step: Callable, state, batch, *, plan, layers) -> list[StageProgram]:
    """Cut ``train_step`` traced at ``batch``'s shape into one forward program per stage of ``plan``
    (under virtual stages, per model chunk: :func:`chunk_layers`).

    Args:
      train_step, state, batch: the step and abstract (or concrete) arguments at the microbatch shape.
      plan: the plan; its stages index ``layers``.
      layers: the layers the plan was made for (matched to this trace's layers by name).

    Raises:
      ValueError: the layers do not match, a layer is in no stage, or stages read backwards.
    """
    from orchestrator.coarsen import coarsen

    graph = capture(train_step, state, batch)
    mine = coarsen(graph)
    if [layer.name for layer in mine] != [layer.name for layer in layers]:
        raise ValueError(
            "the step traced at the microbatch shape coarsens into different layers than the plan's: "
            f"{[layer.name for layer in mine]} vs {[layer.name for layer in layers]}"
        )
    chunks = chunk_layers(plan, layers)
    stage_of_layer = {index: s for s, chunk in enumerate(chunks) for index in chunk}
    missing = sorted(set(range(len(mine))) - set(stage_of_layer))
    if missing:
        raise ValueError(f"layers {missing} belong to no stage of the plan")
    stage_of_op = {op: stage_of_layer[layer.index] for layer in mine for op in layer.ops}
    sliced = SlicedStep(train_step, state, batch, graph=graph)

    leaves = jax.tree_util.tree_flatten_with_path((state, batch))[0]
    n_state = len(jax.tree_util.tree_leaves(state))
    invar_kind: dict[object, tuple] = {}
    for i, ((path, _), var) in enumerate(zip(leaves, sliced.invars)):
        if i >= n_state:
            invar_kind[var] = ("batch", i - n_state)
        elif is_param_path(path[1:]):
            invar_kind[var] = ("param", param_path_name(path))
        else:
            invar_kind[var] = ("state", jax.tree_util.keystr(path))
    loss_var = sliced.outvars[_out_loss_index(train_step, state, batch)]

    n = len(chunks)
    eqns: list[list] = [[] for _ in range(n)]
    flat: list[list[int]] = [[] for _ in range(n)]
    producer: dict[object, int] = {}
    # Activations are keyed by (flat equation, output) position, the same in traces at any batch size.
    position = {v: (i, j) for i, item in enumerate(sliced.flat) for j, v in enumerate(item.eqn.outvars)}
    for i, (item, names) in enumerate(zip(sliced.flat, sliced.ops_of)):
        phases = {graph.op(name).phase for name in names}
        if phases != {"forward"}:
            continue
        stages = {stage_of_op[name] for name in names}
        if len(stages) != 1:
            raise ValueError(f"one equation spans stages {sorted(stages)}")
        [s] = stages
        eqns[s].append(item.eqn)
        flat[s].append(i)
        for var in item.eqn.outvars:
            producer[var] = s
    if loss_var not in producer:
        raise ValueError("the loss is not computed by a forward op of any stage")

    programs = []
    reads: list[set] = []
    for s in range(n):
        produced, inputs, seen = set(), [], set()
        for eqn in eqns[s]:
            for atom in eqn.invars:
                if isinstance(atom, jcore.Literal) or atom in produced or atom in seen:
                    continue
                seen.add(atom)
                inputs.append(atom)
            produced.update(eqn.outvars)
        reads.append(seen)
        kinds, const_inputs, var_inputs = [], [], []
        for atom in inputs:
            if atom in sliced.consts:
                const_inputs.append(atom)
            elif atom in invar_kind:
                kind = invar_kind[atom]
                if kind[0] == "state":
                    raise ValueError(f"stage {s} reads the non-parameter state leaf {kind[1]}; it cannot be pipelined")
                var_inputs.append(atom)
                kinds.append(kind)
            elif atom in producer:
                if producer[atom] >= s:
                    raise ValueError(
                        f"stage {s} reads a value of later stage {producer[atom]}: stages must be in order"
                    )
                var_inputs.append(atom)
                kinds.append(("act", producer[atom], position[atom]))
            else:
                raise ValueError(f"stage {s} reads a value no forward op produces ({atom.aval})")
        programs.append((s, const_inputs, var_inputs, kinds))

    out = []
    for s, const_inputs, var_inputs, kinds in programs:
        later = set().union(*reads[s + 1 :]) if s + 1 < n else set()
        outputs = [v for eqn in eqns[s] for v in eqn.outvars if v in later]
        if producer[loss_var] == s:
            outputs.append(loss_var)
        debug = jcore.DebugInfo(
            "orchestrator stage",
            f"stage {s}",
            tuple(f"in{i}" for i in range(len(var_inputs))),
            tuple(f"out{i}" for i in range(len(outputs))),
        )
        jaxpr = jcore.Jaxpr(const_inputs, var_inputs, outputs, eqns[s], debug_info=debug)
        closed = jcore.ClosedJaxpr(jaxpr, [sliced.consts[a] for a in const_inputs])
        keys = ["loss" if v is loss_var else position[v] for v in outputs]
        consumers = {position[v]: [t for t in range(s + 1, n) if v in reads[t]] for v in outputs if v is not loss_var}
        out.append(
            StageProgram(
                index=s, closed=closed, inputs=kinds, outputs=keys, consumers=consumers, flat=flat[s], sliced=sliced
            )
        )
    return out
