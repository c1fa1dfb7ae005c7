"""The pipeline cuts any Flax model whose layers the op-graph finds: a residual MLP written here."""

import collections

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training.train_state import TrainState

from integrations.flax import capture, compile_step, shard
from orchestrator.bench.executor._alone import stage_runs
from orchestrator.bench.executor._observers import DispatchCounter
from orchestrator.bench.executor._parity import _stage
from orchestrator.coarsen import coarsen
from orchestrator.planner._plan import Plan


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(x.shape[-1])(nn.gelu(nn.Dense(2 * x.shape[-1])(nn.LayerNorm()(x))))


class ResidualMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(32, name="inp")(x)
        for i in range(4):
            x = Block(name=f"blocks_{i}")(x)
        return nn.Dense(1, name="out")(nn.LayerNorm(name="norm")(x))


def train_step(state, batch):
    def loss_fn(params):
        pred = state.apply_fn({"params": params}, batch["x"])
        return jnp.mean((pred[:, 0] - batch["y"]) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}


def _mlp(tx):
    """(state, batch of 16, layers) of the residual MLP trained with ``tx``."""
    model = ResidualMLP()
    x = jax.random.normal(jax.random.key(1), (16, 8))
    batch = {"x": x, "y": jnp.sin(x.sum(-1))}
    params = model.init(jax.random.key(0), x[:1])["params"]
    state = TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    return state, batch, coarsen(capture(train_step, state, batch))


def test_residual_mlp_pipeline_matches_one_device():
    state, batch, layers = _mlp(optax.adam(1e-2))
    names = [layer.name for layer in layers]
    assert sum(name.startswith("ResidualMLP/blocks_") for name in names) == 4, names
    cut = len(layers) // 2 + 1  # unequal: more layers on the first stage
    stages = (
        _stage(range(cut), [0, 1], tp=1, dp=2, microbatch=2, device_type="cpu"),
        _stage(range(cut, len(layers)), [2], tp=1, dp=1, microbatch=4, device_type="cpu"),
    )
    plan = Plan(stages=stages, schedule="1f1b", microbatches=4, global_batch=16, iteration_s=0.0)

    reference, ref_losses = state, []
    ref_step = jax.jit(train_step)
    placed = shard(plan, state, layers=layers)
    step = compile_step(plan, train_step, placed, layers=layers)
    losses = []
    for _ in range(4):
        reference, metrics = ref_step(reference, batch)
        ref_losses.append(float(metrics["loss"]))
        placed, metrics = step(placed, batch)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert losses[-1] < losses[0]
    for a, b in zip(jax.tree.leaves(placed.params), jax.tree.leaves(reference.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4)
    # each parameter lives on its stage's devices only
    first = {d.id for d in placed.params["inp"]["kernel"].sharding.device_set}
    last = {d.id for d in placed.params["out"]["kernel"].sharding.device_set}
    assert first == {0, 1} and last == {2}
    # observing a step (counting the device buffers it moves, for the executor bench's host model)
    # changes nothing
    counter = DispatchCounter()
    step.observers.append(counter)
    placed, metrics = step(placed, batch)
    step.observers.remove(counter)
    reference, ref_metrics = ref_step(reference, batch)
    np.testing.assert_allclose(float(metrics["loss"]), float(ref_metrics["loss"]), rtol=1e-5)
    # every call and transfer moves at least one buffer; the first stage's parameters alone, in and
    # out of its backward, are two shards a leaf
    assert counter.buffers >= counter.dispatches > 0
    # dispatches by the device count they go to: this plan's stages have 2 devices and 1
    assert sum(counter.sizes.values()) == counter.dispatches and set(counter.sizes) <= {1, 2}
    assert counter.buffers >= 2 * len(jax.tree.leaves(placed.params["inp"]))
    # timing a stage alone also counts the buffers its two calls move: at least each parameter of the
    # stage in the forward and, with its gradient, in and out of the backward, one shard per device
    runs, buffers, _ = stage_runs(step, placed, batch)
    times = [run() for run in runs]
    assert len(times) == len(buffers) == 2 and min(times) > 0
    first_stage_leaves = len(jax.tree.leaves(placed.params["inp"]))
    assert buffers[0] >= 2 * 3 * first_stage_leaves


class _Kinds:
    """Counts a step's dispatches by (stage, kind)."""

    def on_step_begin(self, stages):
        self.seen = collections.Counter()

    def on_dispatch(self, dispatch):
        pass

    def on_dispatched(self, dispatch, outputs):
        self.seen[(dispatch.stage, dispatch.kind)] += 1

    def on_step_end(self):
        pass


def test_observers_see_every_dispatch_of_a_step():
    state, batch, layers = _mlp(optax.sgd(1e-2))
    cut = len(layers) // 2
    stages = (
        _stage(range(cut), [0], tp=1, dp=1, microbatch=4, device_type="cpu"),
        _stage(range(cut, len(layers)), [1, 2], tp=1, dp=2, microbatch=4, device_type="cpu"),
    )
    plan = Plan(stages=stages, schedule="gpipe", microbatches=4, global_batch=16, iteration_s=0.0)
    kinds = _Kinds()
    step = compile_step(plan, train_step, shard(plan, state, layers=layers), layers=layers, observers=[kinds])
    step(shard(plan, state, layers=layers), batch)
    for s in range(2):  # one forward and one backward per microbatch, one zeros and one update per step
        assert kinds.seen[(s, "forward")] == kinds.seen[(s, "backward")] == 4
        assert kinds.seen[(s, "zeros")] == kinds.seen[(s, "update")] == 1
    assert kinds.seen[(1, "transfer")] > 0 and kinds.seen[(0, "transfer")] > 0
