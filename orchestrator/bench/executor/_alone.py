"""Each stage of a plan's pipeline run alone: one microbatch's forward + backward, timed.

Stage s's inputs are real: earlier stages' forwards run first (untimed); cotangents are ones
(the loss's is 1/(M·dp), as in a step). Other stages idle meanwhile. The stage's own compiled
programs run, the ones a step dispatches (:meth:`~integrations.flax.Pipeline.build`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from orchestrator.bench.executor._observers import shard_count


class StageTimer:
    """A plan's pipeline, built once, that times each stage's forward + backward of one microbatch
    run alone.

    Args:
      plan: the plan.
      su: the :class:`~._setup.Setup` whose recipe, state, batch and layers it runs.
    """

    def __init__(self, plan, su):
        from integrations.flax import Pipeline, shard

        self.placed = shard(plan, su.state, param_axes=su.axes, layers=su.layers)
        self.pipeline = Pipeline(plan, su.recipe.train_step, self.placed, layers=su.layers, param_axes=su.axes)
        self.batch = su.batch

    def runs(self) -> tuple[list[Callable[[], float]], list[int], list[int]]:
        """Per stage: a function timing one run (warmed up: it has run once), the device buffers its
        two calls take and return (for the host's share of the time), and those its forward call
        moves."""
        return stage_runs(self.pipeline, self.placed, self.batch)


def stage_runs(pipeline, state, batch) -> tuple[list[Callable[[], float]], list[int], list[int]]:
    """Per stage of ``pipeline``: a function that runs one microbatch's forward + backward alone and
    returns its wall seconds, the buffers its two calls move, and those of its forward call."""
    b = pipeline.builder
    built = pipeline.build(state, batch)
    micro, m = built.micro, pipeline.plan.microbatches
    params = b.params_of(state)
    leaves = jax.tree.leaves(batch)
    acts: dict[tuple[int, object], jax.Array] = {}
    runs, buffers, forward_buffers = [], [], []
    for s, (p, f) in enumerate(zip(built.programs, built.fns)):
        args = []
        for kind in p.inputs:
            if kind[0] == "param":
                leaf = params[kind[1]]
                args.append(jax.device_put(leaf, b.param_sharding(s, kind[1], leaf.shape)))
            elif kind[0] == "batch":
                leaf = leaves[kind[1]][:micro]
                args.append(jax.device_put(leaf, b.act_sharding(s, leaf, micro)))
            else:
                args.append(acts[(s, kind[2])])
        outs = f.forward(args)
        outs = outs if f.recompute else outs[0]
        for k, value in zip(p.outputs, outs):
            for t in p.consumers.get(k, []):
                acts[(t, k)] = jax.device_put(value, b.act_sharding(t, value, micro))
        cts = [  # ones shaped like the (global) outputs; the loss's seed 1/(M·dp) as in a step
            jax.device_put(np.full(a.shape, 1.0 / (m * f.dp), a.dtype), NamedSharding(b.meshes[s], P()))
            if k == "loss"
            else jax.device_put(np.ones(o.shape, o.dtype), o.sharding)
            for k, a, o in zip(p.outputs, f.out_avals, outs)
        ]
        shardings = [args[i].sharding for i in f.param_inputs]

        def once(args=args, cts=cts, f=f, shardings=shardings, s=s):
            acc = [b.zeros(args[i], sh, f.dp) for i, sh in zip(f.param_inputs, shardings)]
            jax.block_until_ready(acc)
            start = time.perf_counter()
            forward = f.forward(args)
            saved = args if f.recompute else forward[1]  # what the backward reads
            result = f.backward(saved, cts, acc)
            jax.block_until_ready(result)
            elapsed = time.perf_counter() - start
            if len(buffers) == s:  # each call's arguments and results, counted on the first run
                forward_buffers.append(shard_count(args) + shard_count(forward))
                buffers.append(forward_buffers[-1] + shard_count((saved, cts, acc)) + shard_count(result))
            return elapsed

        once()  # warm-up (compiles), and counts the buffers
        runs.append(once)
    return runs, buffers, forward_buffers
