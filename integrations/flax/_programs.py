"""The pipeline's builder: each stage's mesh and shardings, and its compiled forward, backward and update.

Each stage's backward is ``jax.vjp`` of its forward: the forward program returns the VJP
residuals (or, under ``recompute``, the backward program recomputes them), the backward program
takes the cotangents of its outputs and returns the parameter gradients, added into the stage's
accumulators, and the cotangents of its inputs.

With dp > 1 the stage's forward and backward run under ``jax.shard_map`` with ``"data"`` manual
and ``"model"`` left to XLA (tensor parallelism by the parameters' shardings). Each replica
accumulates its own gradients into a buffer with a leading replica axis; the update sums that
axis, which is the step's one gradient all-reduce (on an ``fsdp`` stage a reduce-scatter into the
stored shards, which one gather program a step makes whole again). A replicated activation's
cotangent is summed over replicas (``psum``) by its consumer and split 1/dp per replica by its
producer.

Under virtual stages (``plan.virtual_stages`` = v > 1) there is one program per model chunk
(:func:`~integrations.flax._stages.chunk_layers`), v·S in all, chunk k compiled for stage k mod S's
mesh and options; meshes, shardings, parameter owners and updates stay per stage.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from integrations.flax._capture import is_param_path, param_path_name
from integrations.flax._shard import DATA, device_map, leaf_params, param_owners, param_spec, stage_mesh, stored_spec
from integrations.flax._stages import StageProgram, chunk_layers, cut_stages
from orchestrator.simulate import chunk_order


@dataclass(slots=True)
class StageFns:
    """A stage's compiled programs and how their arguments line up with its program's inputs.

    Attributes:
      forward: ``forward(args) -> outputs`` under ``recompute``, else ``(outputs, residuals)``.
      backward: ``backward(residuals or args, output cotangents, accumulators) -> (accumulators,
        cotangents of the activation inputs)``; the accumulators are donated.
      recompute: whether the backward recomputes the forward.
      dp: the stage's data-parallel degree.
      param_inputs, act_inputs: positions of the differentiable parameter and activation inputs.
      out_avals: the forward's outputs.
      seed: the loss's cotangent on the stage's devices, once placed (the same every step).
      zeros: the program that makes the stage's zero accumulators, once compiled.
    """

    forward: Callable
    backward: Callable
    recompute: bool
    dp: int
    param_inputs: list[int]
    act_inputs: list[int]
    out_avals: list
    seed: jax.Array | None = None
    zeros: Callable | None = None


@dataclass(frozen=True, slots=True)
class Built:
    """A pipeline's programs for one batch shape: the microbatch size, each stage's (under virtual
    stages, each chunk's) cut and its programs."""

    micro: int
    programs: list[StageProgram]
    fns: list[StageFns]


class _StageMath:
    """A stage program as a function of its differentiable inputs, and its VJP."""

    def __init__(self, program: StageProgram, fun: Callable | None = None):
        self.fun = fun or jcore.jaxpr_as_fun(program.closed)
        self.diff = [
            i
            for i, (kind, aval) in enumerate(zip(program.inputs, program.closed.in_avals))
            if kind[0] != "batch" and _is_float(aval)
        ]
        self.diff_out = [i for i, aval in enumerate(program.closed.out_avals) if _is_float(aval)]
        self.params = [j for j, i in enumerate(self.diff) if program.inputs[i][0] == "param"]

    def run(self, diff_args, args):
        full = list(args)
        for i, a in zip(self.diff, diff_args):
            full[i] = a
        outs = self.fun(*full)
        return [outs[i] for i in self.diff_out], outs

    def vjp(self, args):
        """(outputs, vjp) of the stage at ``args``."""
        _, vjp, outs = jax.vjp(lambda d: self.run(d, args), [args[i] for i in self.diff], has_aux=True)
        return outs, vjp

    def grads(self, vjp, cts):
        (grads,) = vjp([cts[i] for i in self.diff_out])
        return grads

    def split(self, grads):
        """(parameter gradients, activation cotangents)."""
        return [grads[j] for j in self.params], [g for j, g in enumerate(grads) if j not in self.params]


def _single_replica(math: _StageMath, recompute: bool) -> tuple[Callable, Callable]:
    def accumulate(grads, acc):
        params, acts = math.split(grads)
        return [a + g for a, g in zip(acc, params)], acts

    def forward(args):
        return math.vjp(args)

    def backward(vjp, cts, acc):
        return accumulate(math.grads(vjp, cts), acc)

    def backward_recompute(args, cts, acc):
        return accumulate(math.grads(math.vjp(args)[1], cts), acc)

    if recompute:
        return jax.jit(lambda args: math.fun(*args)), jax.jit(backward_recompute, donate_argnums=(2,))
    return jax.jit(forward), jax.jit(backward, donate_argnums=(2,))


def _replicated(math: _StageMath, program: StageProgram, mesh, dp: int, local_batch: int, recompute: bool):
    """Forward and backward with ``"data"`` manual: each replica runs its share of the microbatch."""

    def batch_major(aval) -> bool:
        return aval.ndim >= 1 and aval.shape[0] == local_batch

    in_specs = [
        P() if kind[0] == "param" else P(DATA) if kind[0] == "batch" or batch_major(aval) else P()
        for kind, aval in zip(program.inputs, program.closed.in_avals)
    ]
    out_specs = [
        P(DATA) if key == "loss" or batch_major(aval) else P()
        for key, aval in zip(program.outputs, program.closed.out_avals)
    ]
    ct_specs = [P() if key == "loss" else spec for key, spec in zip(program.outputs, out_specs)]
    act_specs = [in_specs[math.diff[j]] for j in range(len(math.diff)) if j not in math.params]
    treedef: dict = {}

    def lift(outs):
        return [o[None] if key == "loss" else o for o, key in zip(outs, program.outputs)]

    def local_cts(cts):
        # a replicated activation's cotangent is the whole one: each replica takes 1/dp of it
        return [
            c if spec == P(DATA) or key == "loss" else c / dp for c, spec, key in zip(cts, ct_specs, program.outputs)
        ]

    def finish(grads, acc):
        params, acts = math.split(grads)
        new = [a[0] + g[None] for a, g in zip(acc, params)]
        return new, [g if spec == P(DATA) else jax.lax.psum(g, DATA) for g, spec in zip(acts, act_specs)]

    def forward(args):
        outs, vjp = math.vjp(args)
        leaves, treedef["vjp"] = jax.tree_util.tree_flatten(vjp)
        return lift(outs), [x[None] for x in leaves]

    def forward_only(args):
        return lift(math.fun(*args))

    def backward(residuals, cts, acc):
        vjp = jax.tree_util.tree_unflatten(treedef["vjp"], [x[0] for x in residuals])
        return finish(math.grads(vjp, local_cts(cts)), acc)

    def backward_recompute(args, cts, acc):
        return finish(math.grads(math.vjp(args)[1], local_cts(cts)), acc)

    def manual(fn, in_specs, out_specs):
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names={DATA}, check_vma=False)

    if recompute:
        fwd = manual(forward_only, (in_specs,), out_specs)
        bwd = manual(backward_recompute, (in_specs, ct_specs, P(DATA)), (P(DATA), act_specs))
    else:
        fwd = manual(forward, (in_specs,), (out_specs, P(DATA)))
        bwd = manual(backward, (P(DATA), ct_specs, P(DATA)), (P(DATA), act_specs))
    return jax.jit(fwd), jax.jit(bwd, donate_argnums=(2,))


def stage_fns(program: StageProgram, stage, mesh, local_batch: int, fun: Callable | None = None) -> StageFns:
    """Compile (lazily, as jitted functions) stage ``program``'s forward and backward; ``fun``: the
    forward as run (with the stage's options, :func:`~integrations.flax._options.stage_function`)
    if not the program as cut."""
    math = _StageMath(program, fun)
    if stage.dp == 1:
        forward, backward = _single_replica(math, stage.recompute)
    else:
        forward, backward = _replicated(math, program, mesh, stage.dp, local_batch, stage.recompute)
    return StageFns(
        forward=forward,
        backward=backward,
        recompute=stage.recompute,
        dp=stage.dp,
        param_inputs=[math.diff[j] for j in math.params],
        act_inputs=[i for j, i in enumerate(math.diff) if j not in math.params],
        out_avals=program.closed.out_avals,
    )


def _is_float(aval) -> bool:
    return jnp.issubdtype(aval.dtype, jnp.floating)


def accumulator(like, sharding: NamedSharding, dp: int) -> tuple[tuple, object, NamedSharding]:
    """(shape, dtype, sharding) of a parameter's gradient accumulator: with a leading replica axis,
    split over the data axis, when dp > 1."""
    if dp == 1:
        return like.shape, like.dtype, sharding
    return (dp, *like.shape), like.dtype, NamedSharding(sharding.mesh, P(DATA, *sharding.spec))


def zeros(like, sharding: NamedSharding, dp: int) -> jax.Array:
    """A zero gradient accumulator for a parameter."""
    shape, dtype, placed = accumulator(like, sharding, dp)
    return jax.device_put(np.zeros(shape, dtype), placed)


def zeros_program(likes: list, shardings: list, dp: int) -> Callable:
    """One jitted call that makes every zero accumulator of a stage on its devices: one dispatch
    a step where a ``device_put`` of host zeros per parameter costs one each."""
    layouts = [accumulator(x, sh, dp) for x, sh in zip(likes, shardings)]
    return jax.jit(
        lambda: [jnp.zeros(shape, dtype) for shape, dtype, _ in layouts], out_shardings=[o for *_, o in layouts]
    )


class PipelineBuilder:
    """Everything a pipeline step dispatches, built once: meshes, shardings, parameter owners, and
    per batch shape, each stage's cut and compiled programs.

    Args:
      plan, train_step, state, layers, param_axes, cluster, axis_rules: as for :class:`~integrations.flax.Pipeline`.

    Attributes:
      rank: per program (stage, or chunk under virtual stages), the stage whose devices run it.
      orders: per stage, its (phase, microbatch, chunk) steps in schedule order
        (:func:`orchestrator.simulate.chunk_order`, the order the simulator prices).

    Raises:
      ValueError: virtual stages the schedule, the microbatch count or the stages' layers cannot take.
    """

    def __init__(self, plan, train_step: Callable, state, *, layers, param_axes=None, cluster=None, axis_rules=None):
        self.plan, self.train_step, self.layers = plan, train_step, layers
        self.param_axes = param_axes or {}
        self.axis_rules = axis_rules
        S, v = len(plan.stages), plan.virtual_stages
        self.orders = [chunk_order(plan.schedule, S, plan.microbatches, s, v) for s in range(S)]
        self.rank = [k % S for k in range(len(chunk_layers(plan, layers)))]
        devices = device_map(cluster)
        self.meshes = [stage_mesh(stage, devices) for stage in plan.stages]
        self.devices = [tuple(mesh.devices.flat) for mesh in self.meshes]
        self.owners = param_owners(plan, layers)
        # Per state leaf: the stage owning it (a parameter or its optimizer moments), None if shared.
        self.leaf_owner = [None if name is None else self.owners[name] for name, _ in leaf_params(state)]
        self.param_shapes = {path: tuple(np.shape(leaf)) for path, leaf in self.params_of(state).items()}
        self.updates = [self._update_fn(s) for s in range(len(plan.stages))]
        self._built: dict[str, Built] = {}
        self._gathers: dict[tuple, Callable] = {}

    zeros = staticmethod(zeros)

    @staticmethod
    def params_of(state) -> dict[str, jax.Array]:
        """``state``'s parameters by path name."""
        return {
            param_path_name(path): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]
            if is_param_path(path)
        }

    def act_sharding(self, s: int, aval, microbatch: int) -> NamedSharding:
        """Activations (and their cotangents) on stage ``s``: split over "data" on the batch dim."""
        dp = self.plan.stages[s].dp
        batch_major = aval.ndim >= 1 and aval.shape[0] == microbatch and microbatch % dp == 0
        return NamedSharding(self.meshes[s], P(DATA) if batch_major else P())

    def param_sharding(self, s: int, path: str, shape) -> NamedSharding:
        """A parameter as stage ``s``'s programs read it: split by tensor parallelism alone."""
        return NamedSharding(
            self.meshes[s], param_spec(shape, self.param_axes.get(path), self.plan.stages[s].tp, self.axis_rules)
        )

    def stored_sharding(self, s: int, path: str, shape) -> NamedSharding:
        """A parameter (its gradient sum too) as stage ``s`` stores it: split over ``"data"`` as
        well on an ``fsdp`` stage (:func:`~integrations.flax._shard.stored_spec`)."""
        stage = self.plan.stages[s]
        return NamedSharding(self.meshes[s], stored_spec(stage, shape, self.param_axes.get(path), self.axis_rules))

    def gather_fn(self, s: int, paths: tuple[str, ...], shapes: tuple) -> Callable:
        """Stage ``s``'s one all-gather a step: the ``fsdp`` stage's stored shards of ``paths`` →
        the parameters whole over ``"data"``, as its programs read them."""
        key = (s, paths, shapes)
        if key not in self._gathers:
            out = [self.param_sharding(s, path, shape) for path, shape in zip(paths, shapes)]
            self._gathers[key] = jax.jit(lambda shards: list(shards), out_shardings=out)
        return self._gathers[key]

    def build(self, state, batch) -> Built:
        """The programs for ``batch``'s shape, cut and compiled on first use."""
        key = str(jax.tree.map(lambda x: (np.shape(x), str(x.dtype)), batch))
        if key not in self._built:
            self._built[key] = self._build(state, batch)
        return self._built[key]

    def _build(self, state, batch) -> Built:
        m = self.plan.microbatches
        sizes = {np.shape(leaf)[0] for leaf in jax.tree.leaves(batch)}
        if len(sizes) != 1 or next(iter(sizes)) % m:
            raise ValueError(f"every batch leaf needs a leading dim divisible by {m} microbatches, got sizes {sizes}")
        micro = next(iter(sizes)) // m
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
        cuts, specs = {}, {}  # data-parallel degree → the step cut at the per-replica microbatch
        for stage in self.plan.stages:
            if micro % stage.dp:
                raise ValueError(f"a microbatch of {micro} samples does not split over dp={stage.dp} replicas")
            if stage.dp not in cuts:
                local = micro // stage.dp
                spec = jax.tree.map(lambda x, b=local: jax.ShapeDtypeStruct((b, *np.shape(x)[1:]), x.dtype), batch)
                cuts[stage.dp] = cut_stages(self.train_step, abstract, spec, plan=self.plan, layers=self.layers)
                specs[stage.dp] = spec
        programs = [cuts[self.plan.stages[s].dp][k] for k, s in enumerate(self.rank)]
        fns = []
        for p in programs:
            stage, mesh = self.plan.stages[self.rank[p.index]], self.meshes[self.rank[p.index]]
            fun = None
            if (stage.sequence_parallel and stage.tp > 1) or (stage.selective_recompute and not stage.recompute):
                from integrations.flax._options import stage_function

                fun = stage_function(
                    p,
                    stage,
                    mesh,
                    state=abstract,
                    batch=specs[stage.dp],
                    param_axes=self.param_axes,
                    axis_rules=self.axis_rules,
                )
            fns.append(stage_fns(p, stage, mesh, micro // stage.dp, fun))
        return Built(micro=micro, programs=programs, fns=fns)

    def _update_fn(self, s: int):
        stage = self.plan.stages[s]
        stacked, sharded = stage.dp > 1, stage.fsdp and stage.dp > 1
        stored = {
            path: self.stored_sharding(s, path, shape)
            for path, shape in self.param_shapes.items()
            if sharded and self.owners.get(path) == s
        }

        def reduce(path, g, extra):
            name = param_path_name(path)
            g = g.sum(0) if stacked else g
            if sharded:  # summed straight into the stored shards: a reduce-scatter
                g = jax.lax.with_sharding_constraint(g, stored[name])
            return g + sum(extra.get(name, []))

        def update(state, grads, extra):
            """``extra``: path → gradient contributions of other stages reading this stage's parameters.

            Gradients of a data-parallel stage carry a leading replica axis: summing it is the
            step's one sync (on an ``fsdp`` stage, into each replica's shard).
            """
            grads = jax.tree_util.tree_map_with_path(lambda path, g: reduce(path, g, extra), grads)
            return state.apply_gradients(grads=grads)

        return jax.jit(update, donate_argnums=(0,))
