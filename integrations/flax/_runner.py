"""The pipeline's runner: one training step's dispatches, in schedule order, then each stage's update.

A step places each stage's parameters on its mesh, runs every stage's forwards and backwards in
the order :func:`orchestrator.simulate.chunk_order` gives (merged into one dispatch order that
respects dependencies: jax dispatches asynchronously, so stages on disjoint devices overlap),
moves the gradients of parameters read by several stages to their owner, and applies each
stage's update to the leaves it owns. Every dispatch goes through :meth:`StepRun._call` or
:meth:`StepRun._put`, which is where observers see it, named by the stage whose devices run it.

Under virtual stages each stage runs v programs, one per model chunk: activations, residuals,
cotangents and gradient sums are kept per program (``k``, chunk k running on stage ``rank[k]``),
the parameters placed and the updates applied per stage.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from integrations.flax._capture import param_path_name
from integrations.flax._observe import Dispatch
from integrations.flax._programs import Built, PipelineBuilder, zeros, zeros_program
from integrations.flax._transfer import transfer


class StepRun:
    """One step of a built pipeline on ``state`` and ``batch``; :meth:`run` returns ``(state, metrics)``."""

    def __init__(self, builder: PipelineBuilder, built: Built, state, batch, observers=()):
        self.b, self.built, self.state = builder, built, state
        self.observers = tuple(observers)
        self.n, self.m = len(builder.plan.stages), builder.plan.microbatches
        self.rank = builder.rank  # program k (a stage, or a chunk under virtual stages) runs on stage rank[k]
        # the batch on the host once: each stage's microbatch slices then go host → devices directly
        self.batch_leaves = [np.asarray(leaf) for leaf in jax.tree.leaves(batch)]
        self.acts: dict[tuple[int, int, object], jax.Array] = {}  # (consumer program, microbatch, key) → array
        self.residuals: dict[tuple[int, int], object] = {}
        self.cts: dict[tuple[int, int, object], jax.Array] = {}  # (producer program, microbatch, key) → summed
        # per program: gradient sums of the parameters it reads
        self.accumulated: list[list | None] = [None] * len(self.rank)
        self.losses: list[jax.Array] = []

    def run(self):
        for o in self.observers:
            o.on_step_begin(self.n)
        self.stage_params = self._place_params()
        self._run_schedule()
        grads, extra = self._gradients_to_owners()
        state = self._update(grads, extra)
        metrics = {"loss": jnp.mean(jnp.stack(self.losses))}
        for o in self.observers:
            o.on_step_end()
        return state, metrics

    # -- dispatch -----------------------------------------------------------------------------
    def _call(self, stage: int, kind: str, fn, *args, microbatch: int | None = None):
        if not self.observers:
            return fn(*args)
        dispatch = Dispatch(stage, kind, microbatch, self.b.devices[stage], fn, args)
        for o in self.observers:
            o.on_dispatch(dispatch)
        out = fn(*args)
        for o in self.observers:
            o.on_dispatched(dispatch, out)
        return out

    def _put(self, stage: int, x, sharding: NamedSharding, microbatch: int | None = None, **kwargs):
        if not self.observers:
            return jax.device_put(x, sharding, **kwargs) if kwargs else transfer(x, sharding)
        dispatch = Dispatch(stage, "transfer", microbatch, self.b.devices[stage], None, (x,))
        for o in self.observers:
            o.on_dispatch(dispatch)
        out = jax.device_put(x, sharding, **kwargs) if kwargs else transfer(x, sharding)
        for o in self.observers:
            o.on_dispatched(dispatch, out)
        return out

    # -- forwards and backwards ---------------------------------------------------------------
    def _place_params(self) -> list[dict[str, jax.Array]]:
        """Per stage, the parameters its programs read on its mesh (another stage's copied once per
        step); an ``fsdp`` stage places their shards and gathers them whole in one program."""
        params = self.b.params_of(self.state)
        out: list[dict[str, jax.Array]] = [{} for _ in range(self.n)]
        shards: list[dict[str, jax.Array]] = [{} for _ in range(self.n)]
        for p in self.built.programs:
            s = self.rank[p.index]
            sharded = self.b.plan.stages[s].fsdp and self.b.plan.stages[s].dp > 1
            into, where = (shards[s], self.b.stored_sharding) if sharded else (out[s], self.b.param_sharding)
            for kind in p.inputs:
                if kind[0] == "param" and kind[1] not in into:
                    leaf = params[kind[1]]
                    into[kind[1]] = self._put(s, leaf, where(s, kind[1], leaf.shape))
        for s, held in enumerate(shards):
            if held:
                paths = tuple(held)
                gather = self.b.gather_fn(s, paths, tuple(held[path].shape for path in paths))
                out[s].update(zip(paths, self._call(s, "gather", gather, [held[path] for path in paths])))
        return out

    def _args_of(self, k: int, mb: int) -> list:
        micro, out, s = self.built.micro, [], self.rank[k]
        for kind in self.built.programs[k].inputs:
            if kind[0] == "param":
                out.append(self.stage_params[s][kind[1]])
            elif kind[0] == "batch":
                leaf = self.batch_leaves[kind[1]][mb * micro : (mb + 1) * micro]
                out.append(self._put(s, leaf, self.b.act_sharding(s, leaf, micro), mb))
            else:
                out.append(self.acts[(k, mb, kind[2])])
        return out

    def _drop_inputs(self, k: int, mb: int) -> None:
        """Forget program ``k``'s activation inputs of microbatch ``mb``: read through residuals from now on."""
        for kind in self.built.programs[k].inputs:
            if kind[0] == "act":
                self.acts.pop((k, mb, kind[2]), None)

    def _forward(self, k: int, mb: int) -> None:
        p, f, s = self.built.programs[k], self.built.fns[k], self.rank[k]
        args = self._args_of(k, mb)
        if f.recompute:
            outs = self._call(s, "forward", f.forward, args, microbatch=mb)
            self.residuals[(k, mb)] = args
        else:
            outs, self.residuals[(k, mb)] = self._call(s, "forward", f.forward, args, microbatch=mb)
            self._drop_inputs(k, mb)
        for key, value in zip(p.outputs, outs):
            if key == "loss":
                self.losses.append(value)
                continue
            for t in p.consumers[key]:
                target = self.rank[t]
                self.acts[(t, mb, key)] = self._put(
                    target, value, self.b.act_sharding(target, value, self.built.micro), mb
                )

    def _output_cts(self, k: int, mb: int) -> list:
        p, f, s = self.built.programs[k], self.built.fns[k], self.rank[k]
        out = []
        for key, aval in zip(p.outputs, f.out_avals):
            if key != "loss":
                out.append(self.cts.pop((k, mb, key)))
                continue
            if f.seed is None:  # the loss cotangent: the same constant every microbatch and step
                seed = np.full(aval.shape, 1.0 / (self.m * f.dp), aval.dtype)
                f.seed = self._put(s, seed, NamedSharding(self.b.meshes[s], P()), mb)
            out.append(f.seed)
        return out

    def _accumulators(self, k: int) -> list:
        """Program ``k``'s gradient sums, made zero by its first backward of the step."""
        if self.accumulated[k] is None:
            p, f, s = self.built.programs[k], self.built.fns[k], self.rank[k]
            if f.zeros is None:
                likes = [self.stage_params[s][p.inputs[i][1]] for i in f.param_inputs]
                f.zeros = zeros_program(likes, [x.sharding for x in likes], f.dp)
            self.accumulated[k] = self._call(s, "zeros", f.zeros)
        return self.accumulated[k]

    def _backward(self, k: int, mb: int) -> None:
        p, f, s = self.built.programs[k], self.built.fns[k], self.rank[k]
        out_cts = self._output_cts(k, mb)
        saved = self.residuals.pop((k, mb))
        acc = self._accumulators(k)
        self.accumulated[k], in_cts = self._call(s, "backward", f.backward, saved, out_cts, acc, microbatch=mb)
        if f.recompute:
            self._drop_inputs(k, mb)
        for i, ct in zip(f.act_inputs, in_cts):
            _, producer, key = p.inputs[i]
            target = self.rank[producer]
            ct = self._put(target, ct, self.b.act_sharding(target, ct, self.built.micro), mb)
            prev = self.cts.get((producer, mb, key))
            self.cts[(producer, mb, key)] = (
                ct if prev is None else self._call(target, "add", _add, prev, ct, microbatch=mb)
            )

    def _run_schedule(self) -> None:
        """Each stage's steps in its schedule order, a step as soon as what it reads is done."""
        orders = self.b.orders  # per stage: (phase, microbatch, chunk); chunk c of stage s is program c·S + s
        programs = self.built.programs
        needs = [{kind[1] for kind in p.inputs if kind[0] == "act"} for p in programs]
        feeds = [{t for ts in p.consumers.values() for t in ts} for p in programs]
        done: set[tuple[str, int, int]] = set()

        def ready(k: int, phase: str, mb: int) -> bool:
            if phase == "forward":
                return all(("forward", j, mb) in done for j in needs[k])
            return ("forward", k, mb) in done and all(("backward", t, mb) in done for t in feeds[k])

        position = [0] * self.n
        while any(position[s] < len(orders[s]) for s in range(self.n)):
            progressed = False
            for s in range(self.n):
                if position[s] == len(orders[s]):
                    continue
                phase, mb, chunk = orders[s][position[s]]
                k = chunk * self.n + s
                if not ready(k, phase, mb):
                    continue
                (self._forward if phase == "forward" else self._backward)(k, mb)
                done.add((phase, k, mb))
                position[s] += 1
                progressed = True
            if not progressed:
                raise RuntimeError(f"pipeline schedule {self.b.plan.schedule!r} deadlocked at {position}")

    # -- gradients and updates ----------------------------------------------------------------
    def _gradients_to_owners(self) -> tuple[list[dict[str, jax.Array]], list[dict[str, list]]]:
        """Per stage, the gradients of the parameters it owns, and other stages' contributions to them."""
        grads: list[dict[str, jax.Array]] = [{} for _ in range(self.n)]
        extra: list[dict[str, list]] = [{} for _ in range(self.n)]
        for k, (p, f) in enumerate(zip(self.built.programs, self.built.fns)):
            s = self.rank[k]
            for i, g in zip(f.param_inputs, self.accumulated[k] or []):
                path = p.inputs[i][1]
                owner = self.b.owners[path]
                if owner == s:  # under virtual stages, several chunks of the owner may read it
                    grads[s][path] = g if path not in grads[s] else self._call(s, "add", _add, grads[s][path], g)
                    continue
                if f.dp > 1:  # this stage's replicas sync their share before it moves
                    g = self._call(s, "sum", _sum0, g)
                g = self._put(owner, g, self.b.stored_sharding(owner, path, g.shape))
                extra[owner].setdefault(path, []).append(g)
        return grads, extra

    def _update(self, grads, extra):
        """Each stage's optimizer step on the leaves it owns; the shared leaves (step counters) from stage 0."""
        flat_state, treedef = jax.tree_util.tree_flatten(self.state)
        owner = self.b.leaf_owner
        shared = {  # step counters, copied to every stage before any update donates them
            (s, i): self._put(s, leaf, NamedSharding(self.b.meshes[s], P()), may_alias=False)
            for s in range(self.n)
            for i, leaf in enumerate(flat_state)
            if owner[i] is None
        }
        new_leaves: list = [None] * len(flat_state)
        for s in range(self.n):
            masked = [
                leaf if owner[i] == s else shared[(s, i)] if owner[i] is None else None
                for i, leaf in enumerate(flat_state)
            ]
            masked_state = jax.tree_util.tree_unflatten(treedef, masked)
            updated = self._call(s, "update", self.b.updates[s], masked_state, self._masked_grads(s, grads), extra[s])
            positions = [i for i in range(len(flat_state)) if owner[i] in (s, None)]
            for i, leaf in zip(positions, jax.tree_util.tree_leaves(updated)):
                if owner[i] == s or s == 0:
                    new_leaves[i] = leaf
        return jax.tree_util.tree_unflatten(treedef, new_leaves)

    def _masked_grads(self, s: int, grads):
        """Stage ``s``'s gradients shaped like the parameters: None where another stage owns the
        parameter, zeros where it owns one no stage read."""
        dp = self.b.plan.stages[s].dp

        def leaf_grad(path, leaf):
            name = param_path_name(path)
            if self.b.owners[name] != s:
                return None
            if name in grads[s]:
                return grads[s][name]
            return zeros(leaf, self.b.param_sharding(s, name, leaf.shape), dp)

        return jax.tree_util.tree_map_with_path(leaf_grad, self.state.params)


@jax.jit
def _add(a, b):
    return a + b


@jax.jit
def _sum0(a):
    return a.sum(0)
