"""An own model for ``orchestrator plan|graph|train --model tests.orchestrator.user_model:mlp`` (and the CLI's error tests)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training.train_state import TrainState


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(64, name="stem")(x)
        for i in range(3):
            x = x + nn.Dense(64, name=f"layers_{i}")(nn.relu(x))
        return nn.Dense(10, name="head")(x)


def mlp():
    """A residual MLP with the standard ``TrainState.create`` (its step a Python int), batch 32."""
    model = MLP()
    params = model.init(jax.random.key(0), jnp.ones((32, 16)))
    state = TrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(1e-3))

    def train_step(state, batch):
        def loss(params):
            return optax.softmax_cross_entropy_with_integer_labels(
                state.apply_fn(params, batch["x"]), batch["y"]
            ).mean()

        value, grads = jax.value_and_grad(loss)(state.params)
        return state.apply_gradients(grads=grads), {"loss": value}

    x = jax.random.normal(jax.random.key(1), (32, 16))
    return train_step, state, {"x": x, "y": jnp.argmax(x[:, :10], axis=-1)}


def two_things():
    return mlp()[:2]


NOT_A_FUNCTION = 42


def not_a_step():
    _, state, batch = mlp()
    return "train_step", state, batch


def no_batch():
    step, state, _ = mlp()
    return step, state, {}


def no_loss():
    """Plans (the step's shapes are enough) but does not train: the step returns the state alone."""
    step, state, batch = mlp()
    return (lambda state, batch: step(state, batch)[0]), state, batch


def shapes_only():
    """Plans on shapes, which training cannot run."""
    step, state, batch = mlp()
    return step, jax.eval_shape(lambda: state), batch
