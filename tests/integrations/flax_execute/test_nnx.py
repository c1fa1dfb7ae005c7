"""flax.nnx models with nnx.Optimizer, and steps written with nnx, run under a plan like on one device."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from integrations.flax import compile_step, from_nnx, orchestrate, shard
from integrations.flax._capture import capture
from integrations.flax._nnx import scope_name
from integrations.flax._shard import leaf_params
from orchestrator.bench.executor import check_plan
from orchestrator.coarsen import coarsen


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.a = nnx.Linear(8, 32, rngs=rngs)
        self.b = nnx.Linear(32, 1, rngs=rngs)

    def __call__(self, x):
        return self.b(nnx.gelu(self.a(x)))


def loss_fn(model, batch):
    return jnp.mean((model(batch["x"])[:, 0] - batch["y"]) ** 2)


def test_nnx_model_trains_under_dp4xtp2_like_one_device():
    model = MLP(nnx.Rngs(0))
    state, step = from_nnx(model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param), loss_fn)
    owners = dict(
        zip([jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]], leaf_params(state))
    )
    assert owners["['opt_state'][1]['opt_state'][0]['mu']['a']['kernel'].value"] == ("0/a/kernel/value", False)
    x = jax.random.normal(jax.random.key(1), (16, 8))
    batch = {"x": x, "y": jnp.sin(x.sum(-1))}
    reference, ref_losses = state, []
    ref_step = jax.jit(step)
    plan = check_plan("DP4xTP2", global_batch=16)
    placed = shard(plan, state)
    planned = compile_step(plan, step, placed)
    losses = []
    for _ in range(3):
        reference, metrics = ref_step(reference, batch)
        ref_losses.append(float(metrics["loss"]))
        placed, metrics = planned(placed, batch)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert losses[-1] < losses[0]
    for a, b in zip(jax.tree.leaves(placed["params"]), jax.tree.leaves(reference["params"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def user_step(model, optimizer, batch):
    """A step as nnx writes them: model and optimizer updated in place, metrics returned."""
    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    optimizer.update(model, grads)
    return {"loss": loss, "grad_norm": optax.tree.norm(grads)}


def test_a_step_written_with_nnx_is_orchestrated_like_jit():
    model = MLP(nnx.Rngs(0))
    state, step = from_nnx(model, nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param), step=user_step)
    x = jax.random.normal(jax.random.key(1), (16, 8))
    batch = {"x": x, "y": jnp.sin(x.sum(-1))}
    run = orchestrate(state, step, batch=batch, profile=False, time_limit_s=60)
    assert len(run.plan.stages) == 1  # the update is nnx's, not a TrainState's: one stage
    reference, ref_step = state, jax.jit(step)
    for _ in range(3):
        reference, expected = ref_step(reference, batch)
        metrics = run.step(batch)
        np.testing.assert_allclose(float(metrics["loss"]), float(expected["loss"]), rtol=1e-5)
        np.testing.assert_allclose(float(metrics["grad_norm"]), float(expected["grad_norm"]), rtol=1e-5)


def test_from_nnx_takes_a_loss_or_a_step():
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(1e-2), wrt=nnx.Param)
    for kwargs in ({}, {"loss_fn": loss_fn, "step": user_step}):
        with pytest.raises(ValueError, match="one of them"):
            from_nnx(model, optimizer, **kwargs)


class Block(nnx.Module):
    def __init__(self, rngs):
        self.fc = nnx.Linear(16, 32, rngs=rngs)
        self.out = nnx.Linear(32, 16, rngs=rngs)

    def __call__(self, x):
        return x + self.out(nnx.gelu(self.fc(x)))


class Net(nnx.Module):
    def __init__(self, rngs, blocks=3):
        self.embed = nnx.Linear(8, 16, rngs=rngs)
        self.blocks = nnx.List([Block(rngs) for _ in range(blocks)])
        self.head = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.mark.parametrize("written", ["loss_fn", "step"])
def test_an_nnx_model_is_cut_into_one_layer_per_module_like_linen(written):
    original = vars(Block)["__call__"]
    model = Net(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    state, step = from_nnx(model, optimizer, **({"loss_fn": loss_fn} if written == "loss_fn" else {"step": user_step}))
    batch = {"x": jax.ShapeDtypeStruct((16, 8), jnp.float32), "y": jax.ShapeDtypeStruct((16,), jnp.float32)}
    layers = coarsen(capture(step, state, batch))
    assert [layer.name for layer in layers.layers] == [
        "Net/embed",
        "Net/blocks_0",
        "Net/blocks_1",
        "Net/blocks_2",
        "Net/head",
    ]
    assert vars(Block)["__call__"] is original  # the scopes are gone once traced
    assert not hasattr(model.blocks[0], "_orchestrator_scope")  # the user's model is left as it was


def test_scope_names_follow_linen():
    assert scope_name(("blocks", 3)) == "blocks_3"
    assert scope_name(("blocks", 3, "attn")) == "attn"
    assert scope_name(("head",)) == "head"
