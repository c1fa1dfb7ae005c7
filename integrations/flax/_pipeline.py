"""Run a multi-stage plan as an MPMD pipeline: one jitted forward and backward per stage, each on its own mesh.

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

**Backward and update.** Each stage's backward is ``jax.vjp`` of its forward:
the forward program returns the VJP residuals (or, under ``recompute``, the
backward program recomputes them), the backward program takes the cotangents
of its outputs (``1/M`` for the loss of each of the M microbatches, so the
gradient is the mean over microbatches) and returns parameter gradients and
the cotangents of its inputs, which go back to the stages that produced them.
Gradients are summed over microbatches per stage; a parameter read by several
stages has its partial gradients moved to its owner and added. Each stage then
applies ``state.apply_gradients`` to the parameters and optimizer-state leaves
it owns (other leaves masked out as ``None``), which equals the single-program
update for any optimizer that acts leaf by leaf (AdamW, SGD, Adam; not a global
gradient-norm clip).

**Schedule.** Each stage runs its forwards and backwards in the order
:func:`orchestrator.simulate.stage_order` gives, the one the simulator replays
(GPipe: all forwards, then all backwards; 1F1B: ``min(S − s − 1, M)`` warm-up
forwards, then one forward and one backward in turn, then the drain). The per-stage lists are merged into one
dispatch order that respects dependencies; jax dispatches asynchronously, so
stages on disjoint devices overlap.

**Data parallelism inside a stage** with dp > 1: the stage is cut from the
step traced at the per-replica microbatch (b/dp samples), and its forward and
backward run under ``jax.shard_map`` with ``"data"`` manual and ``"model"``
left to XLA (tensor parallelism by the parameters' shardings). Each replica
accumulates its own gradients into a buffer with a leading replica axis; the
update sums that axis, which is the step's one gradient all-reduce. Batch-major
activations cross stages split over ``"data"``; a replicated activation's
cotangent is summed over replicas (``psum``) by its consumer and split 1/dp
per replica by its producer.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from integrations.flax._capture import _key_name, capture, is_param_path, param_path_name
from integrations.flax._shard import DATA, device_map, leaf_params, param_owners, param_spec, stage_mesh
from integrations.flax._slice import SlicedStep
from integrations.flax._transfer import transfer
from orchestrator.simulate import stage_order

Kind = str  # "param" | "batch" | "act"


@dataclass(slots=True)
class StageProgram:
    """The forward of one stage as a closed jaxpr with typed inputs and outputs.

    ``inputs``: per jaxpr invar, ``("param", path)``, ``("batch", leaf index)`` or
    ``("act", producer stage, key)``; ``outputs``: keys of the activations it
    produces (consumed by later stages), then ``"loss"`` if it computes it.
    """

    index: int
    closed: jcore.ClosedJaxpr
    inputs: list[tuple]
    outputs: list[object]
    consumers: dict[object, list[int]] = field(default_factory=dict)


def _out_loss_index(train_step, state, batch) -> int:
    leaves = jax.tree_util.tree_flatten_with_path(jax.eval_shape(train_step, state, batch))[0]
    for i, (path, _) in enumerate(leaves):
        names = [_key_name(k) for k in path]
        if names and names[0] == "1" and names[-1] == "loss":
            return i
    raise ValueError("a pipelined train step must return (state, metrics) with metrics['loss'] (the mean loss)")


def cut_stages(train_step: Callable, state, batch, *, plan, layers) -> list[StageProgram]:
    """Cut ``train_step`` traced at ``batch``'s shape into one forward program per stage of ``plan``.

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
    stage_of_layer = {index: s for s, stage in enumerate(plan.stages) for index in stage.layers}
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

    n = len(plan.stages)
    eqns: list[list] = [[] for _ in range(n)]
    producer: dict[object, int] = {}
    # Activations are keyed by (flat equation, output) position, the same in traces at any batch size.
    position = {v: (i, j) for i, item in enumerate(sliced.flat) for j, v in enumerate(item.eqn.outvars)}
    for item, names in zip(sliced.flat, sliced.ops_of):
        phases = {graph.op(name).phase for name in names}
        if phases != {"forward"}:
            continue
        stages = {stage_of_op[name] for name in names}
        if len(stages) != 1:
            raise ValueError(f"one equation spans stages {sorted(stages)}")
        [s] = stages
        eqns[s].append(item.eqn)
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
        out.append(StageProgram(index=s, closed=closed, inputs=kinds, outputs=keys, consumers=consumers))
    return out


def _is_float(aval) -> bool:
    return jnp.issubdtype(aval.dtype, jnp.floating)


def shard_count(tree) -> int:
    """Device buffers behind a pytree of arrays: one per shard."""
    return sum(len(x.sharding.device_set) for x in jax.tree.leaves(tree) if hasattr(x, "sharding"))


class Pipeline:
    """``step(state, batch) -> (state, {"loss": mean over microbatches})`` for a multi-stage plan.

    Args:
      plan: the plan (stages, schedule, microbatches).
      train_step: the user's step (``value_and_grad`` of a mean loss, then ``state.apply_gradients``).
      state: the state placed by :func:`~integrations.flax.shard` with the same ``layers``.
      layers: the coarsened layers of the step the plan was made for.
      param_axes: logical axis names by parameter path (tensor parallelism inside stages).
      cluster: resolves the plan's device refs.
      timed: block on every program call and add its wall time and the process's CPU time during it
        to its stage (``stage_busy_s``, ``stage_cpu_s``). This serialises the stages; on virtual CPU
        devices sharing a few cores they barely overlap anyway.
      slowdown: fault injection, jax device id → extra forward runs: each forward of a stage using that
        device is run that many more times (the most any of its devices asks for), results discarded,
        so the stage really does more work. Read at every step: change the mapping to start or stop it.

    Attributes:
      stage_busy_s: per stage, the wall seconds its programs ran during the last step (``timed`` only).
      stage_cpu_s: per stage, the CPU seconds this process spent while they ran: on virtual CPU
        devices, the work itself, unaffected by other processes on the machine (``timed`` only).
    """

    def __init__(
        self,
        plan,
        train_step: Callable,
        state,
        *,
        layers,
        param_axes=None,
        cluster=None,
        timed: bool = False,
        slowdown: Mapping[int, int] | None = None,
    ):
        if not hasattr(state, "apply_gradients"):
            raise ValueError(
                "a multi-stage plan needs a Flax TrainState (its apply_gradients runs each stage's update); "
                "run other states (e.g. from_nnx) under single-stage plans (planner max_stages=1)"
            )
        self.plan, self.train_step, self.layers = plan, train_step, layers
        self.param_axes = param_axes or {}
        devices = device_map(cluster)
        self.meshes = [stage_mesh(stage, devices) for stage in plan.stages]
        self.owners = param_owners(plan, layers)
        self._built: dict[str, tuple] = {}
        self._record: list | None = None  # (stage, "forward" | "backward" | "update", jitted, args)
        self.dispatches = 0
        self.dispatch_sizes: Counter[int] = Counter()  # this step's dispatches by the device count they go to
        # Observation for the executor bench: count the device buffers (one per shard) that the
        # step's calls and transfers take and return; the host's cost of a call grows with them.
        self.count_buffers = False
        self.buffers = 0
        # Per state leaf: the stage owning it (a parameter or its optimizer moments), None if shared.
        self.leaf_owner = [None if name is None else self.owners[name] for name, _ in leaf_params(state)]
        self._updates = [self._update_fn(s) for s in range(len(plan.stages))]
        # Observation and fault injection (the Replanner and its tests; see ``stage_busy_s``).
        self.timed = timed
        self.slowdown = slowdown if slowdown is not None else {}
        self.stage_busy_s: list[float] = [0.0] * len(plan.stages)
        self.stage_cpu_s: list[float] = [0.0] * len(plan.stages)

    def _extra_forwards(self, s: int) -> int:
        """Extra forward runs stage ``s`` makes per forward: the most any of its devices asks for."""
        if not self.slowdown:
            return 0
        return max(self.slowdown.get(d.id, 0) for d in self.meshes[s].devices.flat)

    # -- placement --------------------------------------------------------------
    def act_sharding(self, s: int, aval, microbatch: int) -> NamedSharding:
        """Activations (and their cotangents) on stage ``s``: split over "data" on the batch dim."""
        dp = self.plan.stages[s].dp
        batch_major = aval.ndim >= 1 and aval.shape[0] == microbatch and microbatch % dp == 0
        return NamedSharding(self.meshes[s], P(DATA) if batch_major else P())

    def param_sharding(self, s: int, path: str, shape) -> NamedSharding:
        return NamedSharding(self.meshes[s], param_spec(shape, self.param_axes.get(path), self.plan.stages[s].tp))

    # -- programs -----------------------------------------------------------------
    def _build(self, state, batch):
        m = self.plan.microbatches
        sizes = {np.shape(leaf)[0] for leaf in jax.tree.leaves(batch)}
        if len(sizes) != 1 or next(iter(sizes)) % m:
            raise ValueError(f"every batch leaf needs a leading dim divisible by {m} microbatches, got sizes {sizes}")
        micro = next(iter(sizes)) // m
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
        cuts = {}  # data-parallel degree → the step cut at the per-replica microbatch
        for stage in self.plan.stages:
            if micro % stage.dp:
                raise ValueError(f"a microbatch of {micro} samples does not split over dp={stage.dp} replicas")
            if stage.dp not in cuts:
                local = micro // stage.dp
                spec = jax.tree.map(lambda x, b=local: jax.ShapeDtypeStruct((b, *np.shape(x)[1:]), x.dtype), batch)
                cuts[stage.dp] = cut_stages(self.train_step, abstract, spec, plan=self.plan, layers=self.layers)
        programs = [cuts[stage.dp][s] for s, stage in enumerate(self.plan.stages)]
        fns = [self._stage_fns(p, micro // self.plan.stages[p.index].dp) for p in programs]
        return micro, programs, fns

    def _stage_fns(self, program: StageProgram, local_batch: int):
        fun = jcore.jaxpr_as_fun(program.closed)
        avals = program.closed.in_avals
        diff = [
            i for i, (kind, aval) in enumerate(zip(program.inputs, avals)) if kind[0] != "batch" and _is_float(aval)
        ]
        out_avals = program.closed.out_avals
        diff_out = [i for i, aval in enumerate(out_avals) if _is_float(aval)]

        def split(args):
            return [args[i] for i in diff]

        def run(diff_args, args):
            full = list(args)
            for i, a in zip(diff, diff_args):
                full[i] = a
            outs = fun(*full)
            return [outs[i] for i in diff_out], outs

        def forward(args):
            _, vjp, outs = jax.vjp(lambda d: run(d, args), split(args), has_aux=True)
            return outs, vjp

        def forward_only(args):
            return fun(*args)

        params = [j for j, i in enumerate(diff) if program.inputs[i][0] == "param"]

        def accumulate(grads, acc):
            """(acc + parameter gradients, activation cotangents): gradients summed over microbatches."""
            new = [a + grads[j] for a, j in zip(acc, params)]
            return new, [g for j, g in enumerate(grads) if j not in params]

        def backward(vjp, cts, acc):
            (grads,) = vjp([cts[i] for i in diff_out])
            return accumulate(grads, acc)

        def backward_recompute(args, cts, acc):
            _, vjp, _ = jax.vjp(lambda d: run(d, args), split(args), has_aux=True)
            (grads,) = vjp([cts[i] for i in diff_out])
            return accumulate(grads, acc)

        stage = self.plan.stages[program.index]
        recompute, dp = stage.recompute, stage.dp
        fns = {
            "diff": diff,
            "param_inputs": [diff[j] for j in params],
            "act_inputs": [i for j, i in enumerate(diff) if j not in params],
            "recompute": recompute,
            "out_avals": out_avals,
            "dp": dp,
        }
        if dp == 1:
            fns["forward"] = jax.jit(forward_only if recompute else forward)
            fns["backward"] = jax.jit(backward_recompute if recompute else backward, donate_argnums=(2,))
            return fns

        # dp > 1: "data" is manual (shard_map), "model" stays with XLA. Each replica computes its own
        # gradients into an accumulator with a leading replica axis; the update sums it: one sync per step.
        def batch_major(aval) -> bool:
            return aval.ndim >= 1 and aval.shape[0] == local_batch

        in_specs = [
            P() if kind[0] == "param" else P(DATA) if kind[0] == "batch" or batch_major(aval) else P()
            for kind, aval in zip(program.inputs, avals)
        ]
        out_specs = [
            P(DATA) if key == "loss" or batch_major(aval) else P() for key, aval in zip(program.outputs, out_avals)
        ]
        ct_specs = [P() if key == "loss" else spec for key, spec in zip(program.outputs, out_specs)]
        act_specs = [in_specs[i] for i in fns["act_inputs"]]
        treedef: dict = {}

        def lift(outs):
            return [o[None] if key == "loss" else o for o, key in zip(outs, program.outputs)]

        def local_cts(cts):
            # a replicated activation's cotangent is the whole one: each replica takes 1/dp of it
            return [
                c if spec == P(DATA) or key == "loss" else c / dp
                for c, spec, key in zip(cts, ct_specs, program.outputs)
            ]

        def finish(grads, acc):
            new = [a + grads[j][None] for a, j in zip(acc, params)]
            act = [g for j, g in enumerate(grads) if j not in params]
            return new, [g if spec == P(DATA) else jax.lax.psum(g, DATA) for g, spec in zip(act, act_specs)]

        def sm_forward(args):
            outs, vjp = forward(args)
            leaves, treedef["vjp"] = jax.tree_util.tree_flatten(vjp)
            return lift(outs), [x[None] for x in leaves]

        def sm_forward_only(args):
            return lift(fun(*args))

        def sm_backward(residuals, cts, acc):
            vjp = jax.tree_util.tree_unflatten(treedef["vjp"], [x[0] for x in residuals])
            (grads,) = vjp([local_cts(cts)[i] for i in diff_out])
            return finish(grads, [a[0] for a in acc])

        def sm_backward_recompute(args, cts, acc):
            _, vjp, _ = jax.vjp(lambda d: run(d, args), split(args), has_aux=True)
            (grads,) = vjp([local_cts(cts)[i] for i in diff_out])
            return finish(grads, [a[0] for a in acc])

        mesh = self.meshes[program.index]

        def manual(fn, in_specs, out_specs):
            return jax.shard_map(
                fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names={DATA}, check_vma=False
            )

        if recompute:
            fns["forward"] = jax.jit(manual(sm_forward_only, (in_specs,), out_specs))
            backward_fn = manual(sm_backward_recompute, (in_specs, ct_specs, P(DATA)), (P(DATA), act_specs))
        else:
            fns["forward"] = jax.jit(manual(sm_forward, (in_specs,), (out_specs, P(DATA))))
            backward_fn = manual(sm_backward, (P(DATA), ct_specs, P(DATA)), (P(DATA), act_specs))
        fns["backward"] = jax.jit(backward_fn, donate_argnums=(2,))
        return fns

    @staticmethod
    def _accumulator(like, sharding: NamedSharding, dp: int) -> tuple[tuple, object, NamedSharding]:
        """(shape, dtype, sharding) of a parameter's gradient accumulator: with a leading
        replica axis, split over the data axis, when dp > 1."""
        if dp == 1:
            return like.shape, like.dtype, sharding
        return (dp, *like.shape), like.dtype, NamedSharding(sharding.mesh, P(DATA, *sharding.spec))

    @staticmethod
    def _zeros(like, sharding: NamedSharding, dp: int) -> jax.Array:
        """A zero gradient accumulator for a parameter."""
        shape, dtype, placed = Pipeline._accumulator(like, sharding, dp)
        return jax.device_put(np.zeros(shape, dtype), placed)

    @staticmethod
    def _zeros_program(likes: list, shardings: list, dp: int):
        """One jitted call that makes every zero accumulator of a stage on its devices (a
        ``device_put`` of host zeros per parameter cost 0.17 ms each, 29 a step on gpt-tiny)."""
        layouts = [Pipeline._accumulator(x, sh, dp) for x, sh in zip(likes, shardings)]
        return jax.jit(
            lambda: [jnp.zeros(shape, dtype) for shape, dtype, _ in layouts], out_shardings=[o for *_, o in layouts]
        )

    def _update_fn(self, s: int):
        stacked = self.plan.stages[s].dp > 1

        def update(state, grads, extra):
            """``extra``: path → gradient contributions of other stages reading this stage's parameters.

            Gradients of a data-parallel stage carry a leading replica axis: summing it is the step's one sync.
            """
            if stacked:
                grads = jax.tree.map(lambda g: g.sum(0), grads)
            grads = jax.tree_util.tree_map_with_path(
                lambda path, g: g + sum(extra.get(param_path_name(path), [])), grads
            )
            return state.apply_gradients(grads=grads)

        return jax.jit(update, donate_argnums=(0,))

    def collective_bytes(self, state, batch) -> tuple[list[dict[str, int]], object]:
        """Per stage, the collective operand bytes (per device, by kind) of one step, and the new state.

        Runs one step and compiles what it dispatched: each stage's forward and
        backward programs count M times, its update once. Transfers between
        stages are device-to-device copies, not collectives, and are not counted.
        """
        from integrations.flax._xla import hlo_collective_bytes

        m = self.plan.microbatches
        self._record = []
        try:
            lowered = [(s, what, jitted.lower(*args)) for s, what, jitted, args in self._record_step(state, batch)]
            # (arguments were recorded as abstract values: several are donated while the step runs)
        finally:
            self._record = None
        per_stage = [
            dict.fromkeys(("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all"), 0)
            for _ in self.plan.stages
        ]
        for s, what, low in lowered:
            for kind, nbytes in hlo_collective_bytes(low.compile().as_text()).items():
                per_stage[s][kind] += nbytes * (1 if what == "update" else m)
        return per_stage, self._last_state

    def stage_seconds(self, state, batch, *, repeats: int = 5) -> list[float]:
        """Per stage, the median wall time of one microbatch's forward + backward, run alone
        (:meth:`stage_runs`, each run ``repeats`` times after its warm-up)."""
        import statistics

        return [statistics.median(run() for _ in range(repeats)) for run in self.stage_runs(state, batch)]

    def stage_runs(self, state, batch) -> list[Callable[[], float]]:
        """Per stage, a function that runs one microbatch's forward + backward alone and returns its
        wall seconds.

        Stage s's inputs are real: earlier stages' forwards run first (untimed);
        cotangents are ones (the loss's is 1/M). Other stages idle meanwhile.
        Each runs once here (compiling, untimed); afterwards ``self.stage_buffers[s]`` holds the
        device buffers the two calls take and return (for the host's share of the time), and
        ``self.stage_forward_buffers[s]`` those of the forward call alone.
        """
        key = str(jax.tree.map(lambda x: (np.shape(x), str(x.dtype)), batch))
        if key not in self._built:
            self._built[key] = self._build(state, batch)
        micro, programs, fns = self._built[key]
        params = {
            param_path_name(path): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]
            if is_param_path(path)
        }
        leaves = jax.tree.leaves(batch)
        acts: dict[tuple[int, object], jax.Array] = {}
        out = []
        self.stage_buffers, self.stage_forward_buffers = [], []
        for s, (p, f) in enumerate(zip(programs, fns)):
            args = []
            for kind in p.inputs:
                if kind[0] == "param":
                    leaf = params[kind[1]]
                    args.append(jax.device_put(leaf, self.param_sharding(s, kind[1], leaf.shape)))
                elif kind[0] == "batch":
                    leaf = leaves[kind[1]][:micro]
                    args.append(jax.device_put(leaf, self.act_sharding(s, leaf, micro)))
                else:
                    args.append(acts[(s, kind[2])])
            outs = f["forward"](args)
            outs = outs if f["recompute"] else outs[0]
            for k, value in zip(p.outputs, outs):
                for t in p.consumers.get(k, []):
                    acts[(t, k)] = jax.device_put(value, self.act_sharding(t, value, micro))
            cts = [  # ones shaped like the (global) outputs; the loss's seed 1/(M·dp) as in a step
                jax.device_put(
                    np.full(a.shape, 1.0 / (self.plan.microbatches * f["dp"]), a.dtype),
                    NamedSharding(self.meshes[s], P()),
                )
                if k == "loss"
                else jax.device_put(np.ones(o.shape, o.dtype), o.sharding)
                for k, a, o in zip(p.outputs, f["out_avals"], outs)
            ]
            shardings = [args[i].sharding for i in f["param_inputs"]]

            def once(args=args, cts=cts, f=f, shardings=shardings, s=s):
                acc = [self._zeros(args[i], sh, f["dp"]) for i, sh in zip(f["param_inputs"], shardings)]
                jax.block_until_ready(acc)
                start = time.perf_counter()
                forward = f["forward"](args)
                saved = args if f["recompute"] else forward[1]  # what the backward reads
                result = f["backward"](saved, cts, acc)
                jax.block_until_ready(result)
                elapsed = time.perf_counter() - start
                if len(self.stage_buffers) == s:  # each call's arguments and results
                    self.stage_forward_buffers.append(shard_count(args) + shard_count(forward))
                    backward = shard_count((saved, cts, acc)) + shard_count(result)
                    self.stage_buffers.append(self.stage_forward_buffers[-1] + backward)
                return elapsed

            once()  # warm-up (compiles), and counts the buffers
            out.append(once)
        return out

    def _record_step(self, state, batch):
        records = self._record
        self._last_state, _ = self(state, batch)
        return records

    def _note(self, s: int, what: str, jitted, args) -> None:
        if self._record is not None:
            spec = jax.tree.map(
                lambda x: (
                    jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x
                ),
                args,
            )
            self._record.append((s, what, jitted, spec))

    # -- one step -----------------------------------------------------------------
    def __call__(self, state, batch):
        key = str(jax.tree.map(lambda x: (np.shape(x), str(x.dtype)), batch))
        if key not in self._built:
            self._built[key] = self._build(state, batch)
        micro, programs, fns = self._built[key]
        plan, n, m = self.plan, len(self.plan.stages), self.plan.microbatches
        self.dispatches = 0  # host → device calls this step: jitted programs and transfers
        self.dispatch_sizes = Counter()
        self.buffers = 0

        def put(x, sharding, **kwargs):
            self.dispatches += 1
            self.dispatch_sizes[len(sharding.device_set)] += 1
            out = jax.device_put(x, sharding, **kwargs) if kwargs else transfer(x, sharding)
            if self.count_buffers:
                self.buffers += shard_count(out)
            return out

        busy, cpu = [0.0] * n, [0.0] * n

        def call(fn, *args, stage: int):
            self.dispatches += 1
            self.dispatch_sizes[self.meshes[stage].devices.size] += 1
            if self.count_buffers:
                out = fn(*args)
                self.buffers += shard_count(args) + shard_count(out)
                return out
            if not self.timed:
                return fn(*args)
            start, start_cpu = time.perf_counter(), time.process_time()
            out = jax.block_until_ready(fn(*args))
            busy[stage] += time.perf_counter() - start
            cpu[stage] += time.process_time() - start_cpu
            return out

        # the batch on the host once: each stage's microbatch slices then go host → devices directly
        batch_leaves = [np.asarray(leaf) for leaf in jax.tree.leaves(batch)]
        flat_state, treedef = jax.tree_util.tree_flatten(state)
        params = {
            param_path_name(path): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]
            if is_param_path(path)
        }

        # Parameters each stage reads, placed on its mesh (foreign ones copied once per step).
        stage_params = []
        for p in programs:
            placed = {}
            for kind in p.inputs:
                if kind[0] == "param" and kind[1] not in placed:
                    leaf = params[kind[1]]
                    placed[kind[1]] = put(leaf, self.param_sharding(p.index, kind[1], leaf.shape))
            stage_params.append(placed)

        acts: dict[tuple[int, int, object], jax.Array] = {}  # (consumer stage, microbatch, key) → array
        residuals: dict[tuple[int, int], object] = {}
        cts: dict[tuple[int, int, object], jax.Array] = {}  # (producer stage, microbatch, key) → summed cotangent
        accumulated: list[list | None] = [None] * n  # per stage: gradient sums of the parameters it reads
        param_shardings = [
            [stage_params[s][programs[s].inputs[i][1]].sharding for i in fns[s]["param_inputs"]] for s in range(n)
        ]
        losses = []

        def args_of(s: int, mb: int) -> list:
            out = []
            for kind in programs[s].inputs:
                if kind[0] == "param":
                    out.append(stage_params[s][kind[1]])
                elif kind[0] == "batch":
                    leaf = batch_leaves[kind[1]][mb * micro : (mb + 1) * micro]
                    out.append(put(leaf, self.act_sharding(s, leaf, micro)))
                else:
                    out.append(acts[(s, mb, kind[2])])
            return out

        def run_forward(s: int, mb: int) -> None:
            p, f = programs[s], fns[s]
            args = args_of(s, mb)
            if mb == 0:
                self._note(s, "forward", f["forward"], (args,))
            if f["recompute"]:
                outs = call(f["forward"], args, stage=s)
                residuals[(s, mb)] = args
            else:
                outs, vjp = call(f["forward"], args, stage=s)
                residuals[(s, mb)] = vjp
            for _ in range(self._extra_forwards(s)):  # injected slowdown: the same work again, discarded
                call(f["forward"], args, stage=s)
            for key, value in zip(p.outputs, outs):
                if key == "loss":
                    losses.append(value)
                    continue
                for t in p.consumers[key]:
                    acts[(t, mb, key)] = put(value, self.act_sharding(t, value, micro))
            if not f["recompute"]:
                for kind in p.inputs:  # activations read only through the residuals from now on
                    if kind[0] == "act":
                        acts.pop((s, mb, kind[2]), None)

        def run_backward(s: int, mb: int) -> None:
            p, f = programs[s], fns[s]
            out_cts = []
            for key, aval in zip(p.outputs, f["out_avals"]):
                if key == "loss":  # the loss cotangent: the same constant every microbatch and step
                    if "seed" not in f:
                        seed = np.full(aval.shape, 1.0 / (m * f["dp"]), aval.dtype)
                        f["seed"] = put(seed, NamedSharding(self.meshes[s], P()))
                    out_cts.append(f["seed"])
                else:
                    out_cts.append(cts.pop((s, mb, key)))
            saved = residuals.pop((s, mb))
            acc = accumulated[s]
            if acc is None:
                if "zeros" not in f:
                    likes = [stage_params[s][p.inputs[i][1]] for i in f["param_inputs"]]
                    f["zeros"] = self._zeros_program(likes, param_shardings[s], f["dp"])
                acc = call(f["zeros"], stage=s)  # ``call`` counts its buffers
            if mb == 0:
                self._note(s, "backward", f["backward"], (saved, out_cts, acc))
            accumulated[s], in_cts = call(f["backward"], saved, out_cts, acc, stage=s)
            if f["recompute"]:
                for kind in p.inputs:
                    if kind[0] == "act":
                        acts.pop((s, mb, kind[2]), None)
            for i, ct in zip(f["act_inputs"], in_cts):
                _, producer, key = p.inputs[i]
                ct = put(ct, self.act_sharding(producer, ct, micro))
                prev = cts.get((producer, mb, key))
                cts[(producer, mb, key)] = ct if prev is None else call(_add, prev, ct, stage=producer)

        orders = [
            [("F" if phase == "forward" else "B", mb) for phase, mb in stage_order(plan.schedule, n, m, s)]
            for s in range(n)
        ]
        done: set[tuple[str, int, int]] = set()
        needs_forward = [{kind[1] for kind in p.inputs if kind[0] == "act"} for p in programs]
        feeds = [{t for ts in p.consumers.values() for t in ts} for p in programs]
        position = [0] * n
        while any(position[s] < len(orders[s]) for s in range(n)):
            progressed = False
            for s in range(n):
                if position[s] >= len(orders[s]):
                    continue
                op, mb = orders[s][position[s]]
                if op == "F" and all(("F", j, mb) in done for j in needs_forward[s]):
                    run_forward(s, mb)
                elif op == "B" and ("F", s, mb) in done and all(("B", t, mb) in done for t in feeds[s]):
                    run_backward(s, mb)
                else:
                    continue
                done.add((op, s, mb))
                position[s] += 1
                progressed = True
            if not progressed:
                raise RuntimeError(f"pipeline schedule {plan.schedule!r} deadlocked at {position}")

        # Gradients of parameters read by several stages go to their owner.
        grads: list[dict[str, jax.Array]] = [{} for _ in range(n)]
        extra: list[dict[str, list]] = [{} for _ in range(n)]
        for s in range(n):
            for i, g in zip(fns[s]["param_inputs"], accumulated[s] or []):
                path = programs[s].inputs[i][1]
                owner = self.owners[path]
                if owner == s:
                    grads[s][path] = g
                else:
                    if fns[s]["dp"] > 1:  # this stage's replicas sync their share before it moves
                        self._note(s, "update", _sum0, (g,))
                        g = call(_sum0, g, stage=s)
                    g = put(g, self.param_sharding(owner, path, g.shape))
                    extra[owner].setdefault(path, []).append(g)

        new_leaves: list = [None] * len(flat_state)
        shared = {  # step counters, copied to every stage before any update donates them
            (s, i): put(leaf, NamedSharding(self.meshes[s], P()), may_alias=False)
            for s in range(n)
            for i, leaf in enumerate(flat_state)
            if self.leaf_owner[i] is None
        }
        for s in range(n):
            masked = [
                leaf if self.leaf_owner[i] == s else shared[(s, i)] if self.leaf_owner[i] is None else None
                for i, leaf in enumerate(flat_state)
            ]
            masked_state = jax.tree_util.tree_unflatten(treedef, masked)
            masked_grads = jax.tree_util.tree_map_with_path(
                lambda path, leaf, s=s: (
                    (grads[s].get(param_path_name(path), None) if self.owners[param_path_name(path)] == s else None)
                    if self.owners[param_path_name(path)] != s or param_path_name(path) in grads[s]
                    else self._zeros(leaf, leaf.sharding, plan.stages[s].dp)
                ),
                state.params,
            )
            self._note(s, "update", self._updates[s], (masked_state, masked_grads, extra[s]))
            updated = jax.tree_util.tree_leaves(call(self._updates[s], masked_state, masked_grads, extra[s], stage=s))
            positions = [i for i in range(len(flat_state)) if self.leaf_owner[i] in (s, None)]
            for i, leaf in zip(positions, updated):
                if self.leaf_owner[i] == s or s == 0:
                    new_leaves[i] = leaf
        loss = jnp.mean(jnp.stack(losses))
        self.stage_busy_s, self.stage_cpu_s = busy, cpu
        return jax.tree_util.tree_unflatten(treedef, new_leaves), {"loss": loss}


@jax.jit
def _add(a, b):
    return a + b


@jax.jit
def _sum0(a):
    return a.sum(0)
