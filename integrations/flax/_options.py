"""Run a stage's sequence parallelism and selective recompute: in a one-stage plan's one SPMD
program (``rewrite_step``) and in a pipeline stage's programs (``stage_function``).

Both evaluate the user's step as traced — flattened, each flat equation tied to the captured ops
it produced (:class:`~integrations.flax.SlicedStep`) — equation by equation inside the ``jax.jit``
that runs the plan. Which ops each option touches is what the cost model prices, read from a
:class:`~orchestrator.costs.CostModel` of the same trace, so the executor and the prices agree:

* **sequence parallelism** (``Stage.sequence_parallel``, tp > 1), Megatron-LM's (Korthikanti et
  al., 2022): float (batch, sequence, ...) outputs of ``CostModel.sequence_split_ops(tp)`` — the
  work tensor parallelism leaves whole: LayerNorms, residual adds — are constrained to
  ``P("data", "model")``; values inside a tensor-parallel region keep the sequence whole and
  split their first dim tp divides (heads, the MLP's hidden, the vocabulary); outputs of
  all-reduced ops, per-token values every reader takes whole and token ids stay whole; and a
  sequence-split operand is taken whole where it meets a tensor-split one (``x·W_col``, the
  head, ``dy·W_rowᵀ``, weight gradients) or an embedding's backward scatters it. XLA's
  partitioner then turns each tensor-parallel all-reduce into a reduce-scatter onto the sequence
  shards (on XLA:CPU an all-reduce sliced to the shard: the same operand bytes) and an all-gather
  of 1/tp of it, where left to itself it would keep the sequence split inside the regions and
  reshard with all-to-alls. A value is (batch, sequence, ...) when its dim 0 is the batch's and
  its dim 1 the sequence length; a sequence the tensor degree does not divide stays whole.
* **selective recompute** (``Stage.selective_recompute``): in one program, the backward reads the
  values of each layer's core attention (``CostModel.attention_core``: ``Q·Kᵀ`` through ``P·V``)
  from a copy of the core's equations evaluated at the first backward equation that reads one of
  them; the copy's inputs pass through ``lax.optimization_barrier`` with that equation's operands
  and take a ``+ 0·loss`` (XLA:CPU drops barriers before CSE, and a float ``0·x`` is not folded),
  so the forward's core values die inside the forward. In a pipeline stage the core runs under
  ``jax.checkpoint``: the stage's backward is its own program, with nothing for XLA to merge.

Everything else runs as the user wrote it; the equations are the same, so training matches the
plain step up to summation order.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.extend import core as jcore
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from integrations.flax._shard import DATA, MODEL


def _options_model(train_step: Callable, state, batch, *, param_axes, axis_rules):
    """(graph, sliced step, cost model) of ``train_step`` traced at ``batch``'s shape."""
    from integrations.flax._capture import capture
    from integrations.flax._slice import SlicedStep

    graph = capture(train_step, state, batch)
    sliced = SlicedStep(train_step, state, batch, graph=graph)
    return graph, sliced, _cost_model(graph, batch, param_axes=param_axes, axis_rules=axis_rules)


def _cost_model(graph, batch, *, param_axes, axis_rules):
    from orchestrator.cluster import load_cluster
    from orchestrator.coarsen import coarsen
    from orchestrator.costs import CostModel

    batch_size = {jax.numpy.shape(leaf)[0] for leaf in jax.tree.leaves(batch)}
    return CostModel(
        graph,
        coarsen(graph),
        load_cluster("local"),
        batch_size=max(batch_size),
        param_axes=param_axes,
        axis_rules=axis_rules,
    )


def _bind(eqn, invals):
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
    return out if eqn.primitive.multiple_results else [out]


class _Cores:
    """Per layer with a core: its flat equations, the values the backward must not read from the
    forward, and the values the core reads from outside it."""

    def __init__(self, sliced, model, first_backward: int):
        # values computed from the step's inputs; the rest (masks from iota) XLA rebuilds in fusions
        variable = set(sliced.invars)
        for item in sliced.flat:
            if any(not isinstance(a, jcore.Literal) and a in variable for a in item.eqn.invars):
                variable.update(item.eqn.outvars)
        self.groups: list[tuple[list[int], set, list]] = []
        self.group_of: dict = {}  # dropped var → group index
        for index, layer in enumerate(model.layers):
            core = model.attention_core(index)
            if not core.ops:
                continue
            # identical layers share their first one's entry: carry its op names over by position
            first = next(other for other in model.layers if other.signature == layer.signature)
            rename = dict(zip(first.ops, layer.ops))
            core = type(core)(
                ops=frozenset(rename[n] for n in core.ops), dropped=frozenset(rename[n] for n in core.dropped)
            )
            eqns = [i for i, names in enumerate(sliced.ops_of) if names and set(names) <= core.ops]
            produced = {v for i in eqns for v in sliced.flat[i].eqn.outvars}
            dropped = {
                v
                for i in eqns
                if set(sliced.ops_of[i]) <= core.dropped
                for v in sliced.flat[i].eqn.outvars
                if not isinstance(v, jcore.DropVar)
            }
            inputs = []
            for i in eqns:
                for atom in sliced.flat[i].eqn.invars:
                    if isinstance(atom, jcore.Literal) or atom in produced or atom in inputs:
                        continue
                    if atom in variable:
                        inputs.append(atom)
            for v in dropped:
                self.group_of[v] = len(self.groups)
            self.groups.append((eqns, dropped, inputs))
        # the last float scalar the forward computes from the inputs (the loss): replicated, and
        # ready only once the forward has run
        self.anchor = None
        for item in sliced.flat[:first_backward]:
            for v in item.eqn.outvars:
                if v in variable and v.aval.shape == () and jax.numpy.issubdtype(v.aval.dtype, jax.numpy.floating):
                    self.anchor = v


def _floating(atom) -> bool:
    return not isinstance(atom, jcore.Literal) and jax.numpy.issubdtype(atom.aval.dtype, jax.numpy.floating)


def _sequence_parallel(sliced, model, state, batch, stage, mesh) -> tuple[dict, dict]:
    """(var → its sequence-split sharding, equation → operands it reads whole over "model")."""
    from integrations.flax._capture import is_param_path, param_path_name

    tp, rows = stage.tp, model.batch_size
    seq_len = max(jax.numpy.shape(x)[1] for x in jax.tree.leaves(batch) if len(jax.numpy.shape(x)) >= 2)
    split = model.sequence_split_ops(tp)
    traits = model.traits_for(tp)
    producer = {v: names[-1] for item, names in zip(sliced.flat, sliced.ops_of) if names for v in item.eqn.outvars}
    split_params = set()
    for (path, _), var in zip(jax.tree_util.tree_flatten_with_path(state)[0], sliced.invars):
        if is_param_path(path) and traits.param_roles.get(param_path_name(path)) in ("column", "row"):
            split_params.add(var)

    def sequence_split(atom, rank: int = 3, floating: bool = True) -> bool:
        """A float (batch, sequence, ...) value of at least ``rank`` dims of an op SP splits."""
        shape = getattr(atom.aval, "shape", ())
        return (
            not isinstance(atom, jcore.Literal)
            and producer.get(atom) in split
            and len(shape) >= rank
            and jax.numpy.issubdtype(atom.aval.dtype, jax.numpy.floating) == floating
            and shape[0] == rows
            and rows % stage.dp == 0
            and shape[1] == seq_len
            and seq_len % tp == 0
        )

    def tensor_split(atom) -> bool:
        if isinstance(atom, jcore.Literal):
            return False
        return atom in split_params or traits.roles.get(producer.get(atom)) in ("sharded", "column", "row")

    sharding = NamedSharding(mesh, P(DATA, MODEL))
    # an all-reduced op's output is constrained whole, and the sequence-split value read next
    # takes its shard: the reduce-scatter (left to itself, the partitioner would rather gather a
    # vocabulary-split table for the lookup)
    reduced = NamedSharding(mesh, P(DATA))
    constrained = {}
    for item, names in zip(sliced.flat, sliced.ops_of):
        for v in item.eqn.outvars:
            if set(names) & traits.allreduce_ops and sequence_split(v, rank=2):
                constrained[v] = reduced
            elif sequence_split(v) and any(_floating(a) for a in item.eqn.invars):
                # (a one-hot built from labels is left to the partitioner: the vocabulary-split
                # logits read it, which would gather it right back)
                constrained[v] = sharding
            elif sequence_split(v, rank=2, floating=False) and jax.numpy.issubdtype(v.aval.dtype, jax.numpy.integer):
                # token ids and labels stay whole
                constrained[v] = reduced
    # inside a region the sequence stays whole and the partitioner picks the split dim (heads, MLP)
    for item, names in zip(sliced.flat, sliced.ops_of):
        if not names or traits.roles.get(names[-1]) != "sharded":
            continue
        for v in item.eqn.outvars:
            shape = getattr(v.aval, "shape", ())
            if len(shape) >= 2 and shape[0] == rows and rows % stage.dp == 0 and seq_len in shape[1:]:
                # the first dim past the batch that is not the sequence and tp divides: heads
                # (before head_dim), the MLP's hidden, the vocabulary
                dim = next((d for d in range(1, len(shape)) if shape[d] != seq_len and shape[d] % tp == 0), None)
                if dim is not None:
                    spec = [MODEL if d == dim else None for d in range(1, len(shape))]
                    constrained[v] = NamedSharding(mesh, P(DATA, *spec))
    gathered = {}
    for i, (item, names) in enumerate(zip(sliced.flat, sliced.ops_of)):
        operands = item.eqn.invars
        into_split = bool(names) and traits.roles.get(names[-1]) in ("sharded", "column", "row")
        # an embedding's backward scatters the whole cotangent into its table, as Megatron-LM
        # gathers it before the embedding's backward
        scatter = item.eqn.primitive.name.startswith("scatter")
        if into_split or scatter or any(tensor_split(a) for a in operands):
            whole = [k for k, a in enumerate(operands) if sequence_split(a, rank=2)]
            if whole:
                gathered[i] = whole
    # a value every reader takes whole (a per-token cotangent broadcast over the vocabulary) is
    # computed whole; one that some reader takes split (a LayerNorm's output, also kept for its
    # backward) is computed split
    split_reads: dict = {}
    for i, item in enumerate(sliced.flat):
        for k, a in enumerate(item.eqn.invars):
            if not isinstance(a, jcore.Literal):
                split_reads[a] = split_reads.get(a, False) or k not in gathered.get(i, ())
    for v, placed in list(constrained.items()):
        if placed is sharding and not split_reads.get(v, True):
            constrained[v] = reduced
    # and what it is computed from comes whole: the (small) per-token operands, not its output
    for i, (item, names) in enumerate(zip(sliced.flat, sliced.ops_of)):
        if set(names) & traits.allreduce_ops or not any(constrained.get(v) is reduced for v in item.eqn.outvars):
            continue
        whole = sorted(set(gathered.get(i, [])) | {k for k, a in enumerate(item.eqn.invars) if sequence_split(a, 2)})
        if whole:
            gathered[i] = whole
    return constrained, gathered


def rewrite_step(train_step: Callable, state, batch, *, stage, mesh, param_axes=None, axis_rules=None) -> Callable:
    """``train_step`` with ``stage``'s sequence parallelism and selective recompute (module docstring).

    Args:
      train_step: the user's step ``(state, batch) -> (state, metrics)``.
      state, batch: arrays or ``ShapeDtypeStruct``s of the shapes the step is called with.
      stage: the plan's one stage (``sequence_parallel``, ``selective_recompute``, ``tp``, ``dp``).
      mesh: the stage's ``("data", "model")`` mesh.
      param_axes, axis_rules: as the plan was priced with.

    Returns:
      A function of ``(state, batch)`` to run under ``jax.jit`` with the plan's shardings.
    """
    graph, sliced, model = _options_model(train_step, state, batch, param_axes=param_axes, axis_rules=axis_rules)
    constrained: dict = {}  # var → sharding of its value
    gathered: dict = {}  # flat equation index → positions of operands read whole over "model"
    if stage.sequence_parallel and stage.tp > 1:
        constrained, gathered = _sequence_parallel(sliced, model, state, batch, stage, mesh)
    first_backward = next(
        (i for i, names in enumerate(sliced.ops_of) if any(graph.op(n).phase != "forward" for n in names)),
        len(sliced.flat),
    )
    cores = _Cores(sliced, model, first_backward) if stage.selective_recompute and not stage.recompute else None
    if cores is not None and cores.groups and cores.anchor is None:
        raise ValueError("selective recompute needs a step whose forward computes a float scalar (its loss)")
    out_tree = jax.tree.structure(jax.eval_shape(train_step, state, batch))

    def run(state, batch):
        env = dict(sliced.consts)
        env.update(zip(sliced.invars, jax.tree.leaves((state, batch))))
        rebuilt: dict = {}  # group index → {dropped var: recomputed value}

        def read(atom):
            return atom.val if isinstance(atom, jcore.Literal) else env[atom]

        def write(var, value):
            if var in constrained:
                value = jax.lax.with_sharding_constraint(value, constrained[var])
            env[var] = value

        def recompute(g: int, trigger: list) -> dict:
            eqns, dropped, inputs = cores.groups[g]
            values = jax.lax.optimization_barrier(([env[a] for a in inputs], trigger))[0]
            # XLA:CPU drops optimization barriers before CSE: a zero that no simplifier folds (0·x
            # is not 0 for a float x) tells the copy apart from the forward on every backend
            zero = 0.0 * env[cores.anchor]
            values = [
                v + zero.astype(v.dtype) if jax.numpy.issubdtype(v.dtype, jax.numpy.floating) else v for v in values
            ]
            local = dict(zip(inputs, values))

            def get(atom):
                if isinstance(atom, jcore.Literal):
                    return atom.val
                return local[atom] if atom in local else env[atom]

            for i in eqns:
                eqn = sliced.flat[i].eqn
                for var, value in zip(eqn.outvars, _bind(eqn, [get(a) for a in eqn.invars])):
                    if var in constrained:
                        value = jax.lax.with_sharding_constraint(value, constrained[var])
                    local[var] = value
            return {v: local[v] for v in dropped}

        whole = NamedSharding(mesh, P(DATA))
        for i, item in enumerate(sliced.flat):
            eqn = item.eqn
            invals = [read(a) for a in eqn.invars]
            for k in gathered.get(i, ()):
                invals[k] = jax.lax.with_sharding_constraint(invals[k], whole)
            if cores is not None and i >= first_backward:
                for k, atom in enumerate(eqn.invars):
                    g = cores.group_of.get(atom) if not isinstance(atom, jcore.Literal) else None
                    if g is None:
                        continue
                    if g not in rebuilt:
                        trigger = [
                            v
                            for a, v in zip(eqn.invars, invals)
                            if not isinstance(a, jcore.Literal) and a not in cores.group_of
                        ]
                        rebuilt[g] = recompute(g, trigger)
                    invals[k] = rebuilt[g][atom]
            for var, value in zip(eqn.outvars, _bind(eqn, invals)):
                if not isinstance(var, jcore.DropVar):
                    write(var, value)
        return jax.tree.unflatten(out_tree, [read(a) for a in sliced.outvars])

    return run


def stage_function(program, stage, mesh, *, state, batch, param_axes=None, axis_rules=None) -> Callable:
    """A pipeline stage's forward (``program``, cut by :func:`~integrations.flax.cut_stages` from
    the step traced at ``state``, ``batch``: one replica's microbatch) with ``stage``'s sequence
    parallelism and selective recompute, as ``jcore.jaxpr_as_fun(program.closed)`` takes its
    arguments.

    The constraints are those of the one-stage program (module docstring); with dp > 1 the
    stage runs under ``shard_map`` with ``"data"`` manual, so they name ``"model"`` only. The
    core attention runs under ``jax.checkpoint``: the stage's backward is its own program, so the
    VJP keeps the core's inputs and rebuilds the rest there.
    """
    sliced = program.sliced
    model = _cost_model(sliced.graph, batch, param_axes=param_axes, axis_rules=axis_rules)
    constrained: dict = {}
    gathered: dict = {}
    if stage.sequence_parallel and stage.tp > 1:
        constrained, gathered = _sequence_parallel(sliced, model, state, batch, stage, mesh)
        if stage.dp > 1:  # inside shard_map: the data axis is manual, the batch already local
            constrained = {v: P(*(None if a == DATA else a for a in s.spec)) for v, s in constrained.items()}
    whole = P() if stage.dp > 1 else NamedSharding(mesh, P(DATA))
    position = {i: k for k, i in enumerate(program.flat)}
    groups = []  # (positions of the core's equations in the stage, values read after them)
    if stage.selective_recompute and not stage.recompute:
        cores = _Cores(sliced, model, len(sliced.flat))
        for eqns, _, _ in cores.groups:
            if not all(i in position for i in eqns):
                continue
            mine = sorted(position[i] for i in eqns)
            while True:  # with what reads the core before it ends (the forward's jvp residuals)
                produced = {v for k in mine for v in program.closed.jaxpr.eqns[k].outvars}
                last = mine[-1]
                readers = [
                    (k, a)
                    for k, eqn in enumerate(program.closed.jaxpr.eqns)
                    if k not in mine
                    for a in eqn.invars
                    if not isinstance(a, jcore.Literal) and a in produced
                ]
                early = {k for k, _ in readers if k < last}
                if not early:
                    break
                mine = sorted(set(mine) | early)
            used = {a for _, a in readers} | {a for a in program.closed.jaxpr.outvars if a in produced}
            groups.append((mine, [v for k in mine for v in program.closed.jaxpr.eqns[k].outvars if v in used]))
    in_group = {k: g for g, (mine, _) in enumerate(groups) for k in mine}
    ends = {mine[-1]: g for g, (mine, _) in enumerate(groups)}
    jaxpr = program.closed.jaxpr

    def fun(*args):
        env = dict(zip(jaxpr.constvars, program.closed.consts))
        env.update(zip(jaxpr.invars, args))

        def read(atom):
            return atom.val if isinstance(atom, jcore.Literal) else env[atom]

        def run(k, local):
            eqn = jaxpr.eqns[k]
            invals = [a.val if isinstance(a, jcore.Literal) else local[a] if a in local else env[a] for a in eqn.invars]
            for j in gathered.get(program.flat[k], ()):
                invals[j] = jax.lax.with_sharding_constraint(invals[j], whole)
            for var, value in zip(eqn.outvars, _bind(eqn, invals)):
                if var in constrained:
                    value = jax.lax.with_sharding_constraint(value, constrained[var])
                local[var] = value

        for k in range(len(jaxpr.eqns)):
            if k in in_group:
                if k in ends:
                    mine, outs = groups[ends[k]]
                    produced = {v for j in mine for v in jaxpr.eqns[j].outvars}
                    inputs = list(
                        dict.fromkeys(
                            a
                            for j in mine
                            for a in jaxpr.eqns[j].invars
                            if not isinstance(a, jcore.Literal) and a not in produced
                        )
                    )

                    def core(values, mine=mine, inputs=inputs, outs=outs):
                        local = dict(zip(inputs, values))
                        for j in mine:
                            run(j, local)
                        return [local[v] for v in outs]

                    env.update(zip(outs, jax.checkpoint(core)([read(a) for a in inputs])))
                continue
            run(k, env)
        return [read(a) for a in jaxpr.outvars]

    return fun
