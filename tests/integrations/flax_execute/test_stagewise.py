"""A step whose update does not split by pipeline stage runs on one stage, like on one device."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax.training.train_state import TrainState

from integrations.flax import orchestrate
from integrations.flax._stagewise import why_not_stagewise
from orchestrator.bench.executor import check_plan


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(16, name="stem")(x)
        for i in range(2):
            x = nn.relu(nn.Dense(16, name=f"layers_{i}")(x))
        return nn.Dense(4, name="head")(x)


def train_step(state, batch):
    def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}


def state_with(tx):
    params = MLP().init(jax.random.key(0), jnp.ones((2, 8)))["params"]
    return TrainState.create(apply_fn=MLP().apply, params=params, tx=tx)


@pytest.mark.parametrize(
    "tx",
    [
        optax.adamw(1e-3),
        optax.sgd(1e-2, momentum=0.9),
        optax.lion(1e-4),
        optax.chain(optax.clip(1.0), optax.adam(1e-3)),
    ],
    ids=["adamw", "sgd-momentum", "lion", "clip-per-element"],
)
def test_leafwise_optimizers_split_by_stage(tx):
    assert why_not_stagewise(state_with(tx)) is None


@pytest.mark.parametrize(
    ("tx", "reason"),
    [
        (optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)), "updates parameter"),
        (optax.apply_if_finite(optax.adam(1e-3), 3), "updates parameter"),
    ],
    ids=["global-norm-clip", "apply-if-finite"],
)
def test_optimizers_across_parameters_do_not_split(tx, reason):
    assert reason in why_not_stagewise(state_with(tx))


def test_a_state_without_apply_gradients_does_not_split():
    assert "has no apply_gradients" in why_not_stagewise({"params": {"w": jnp.ones(3)}})


def test_a_global_norm_clip_is_planned_on_one_stage_and_trains_like_jit():
    tx = optax.chain(optax.clip_by_global_norm(0.1), optax.adam(1e-2))
    state = state_with(tx)
    x = jax.random.normal(jax.random.key(1), (32, 8))
    batch = {"x": x, "y": (jnp.arange(32) % 4).astype(jnp.int32)}
    with pytest.raises(ValueError, match="runs on one stage only: its optimizer updates"):
        orchestrate(state, train_step, batch=batch, plan=check_plan("2 stages (3+1) x 4 mb", global_batch=32))
    run = orchestrate(state, train_step, batch=batch, profile=False, time_limit_s=5)
    assert len(run.plan.stages) == 1 and run.plan.notes[0].startswith("one stage: its optimizer updates")
    reference, step = state, jax.jit(train_step)
    losses, ref_losses = [], []
    for _ in range(3):
        reference, metrics = step(reference, batch)
        ref_losses.append(float(metrics["loss"]))
        losses.append(float(run.step(batch)["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)


def test_sgd_with_momentum_trains_under_a_pipeline_like_jit():
    state = state_with(optax.sgd(0.1, momentum=0.9))
    x = jax.random.normal(jax.random.key(1), (32, 8))
    batch = {"x": x, "y": (jnp.arange(32) % 4).astype(jnp.int32)}
    plan = check_plan("2 stages (3+1) x 4 mb", global_batch=32)
    run = orchestrate(state, train_step, batch=batch, plan=plan, profile=False)
    reference, step = state, jax.jit(train_step)
    losses, ref_losses = [], []
    for _ in range(3):
        reference, metrics = step(reference, batch)
        ref_losses.append(float(metrics["loss"]))
        losses.append(float(run.step(batch)["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert losses[-1] < losses[0]
