"""Training state, train step and synthetic data shared by the recipes.

The train step is the standard Flax one: next-token cross-entropy, gradients
by ``jax.value_and_grad``, an optax AdamW update through
``TrainState.apply_gradients``. It is what Orchestrator captures, plans and runs.
"""

from __future__ import annotations

from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training.train_state import TrainState


def adamw(learning_rate: float = 3e-4, weight_decay: float = 0.01) -> optax.GradientTransformation:
    """AdamW with the usual LM defaults (β = 0.9, 0.95)."""
    return optax.adamw(learning_rate, b1=0.9, b2=0.95, weight_decay=weight_decay)


def create_train_state(
    model: nn.Module,
    rng: jax.Array,
    example_tokens: jax.Array,
    tx: optax.GradientTransformation,
) -> TrainState:
    """Initialise parameters (logical-axis boxes removed) and optimizer state."""
    return train_state_of(model, model.init(rng, example_tokens), tx)


def train_state_of(model: nn.Module, variables: dict, tx: optax.GradientTransformation) -> TrainState:
    """The TrainState of ``model``'s initialised ``variables``: their parameters, logical-axis
    boxes removed, and ``tx``'s state for them."""
    return TrainState.create(apply_fn=model.apply, params=nn.meta.unbox(variables["params"]), tx=tx)


def loss_fn(params, apply_fn, batch: dict) -> jax.Array:
    """Mean next-token cross-entropy; ``batch`` holds ``inputs`` and ``targets`` (batch, seq)."""
    logits = apply_fn({"params": params}, batch["inputs"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["targets"])
    return losses.mean()


def train_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
    """One AdamW step on ``batch``; returns the new state and ``{"loss": ...}``."""
    loss, grads = jax.value_and_grad(loss_fn)(state.params, state.apply_fn, batch)
    return state.apply_gradients(grads=grads), {"loss": loss}


@partial(jax.jit, static_argnums=(1, 2, 3))
def synthetic_batch(rng: jax.Array, batch_size: int, seq_len: int, vocab_size: int) -> dict:
    """Sequences from a fixed random bigram map: token t+1 = perm[token t].

    A model that learns the map predicts every token after the first, so the
    loss falls from ln(vocab) towards ln(vocab)/seq_len.
    """
    perm = jax.random.permutation(jax.random.key(1234), vocab_size)
    start = jax.random.randint(rng, (batch_size,), 0, vocab_size)

    def step(token, _):
        nxt = perm[token]
        return nxt, nxt

    _, rest = jax.lax.scan(step, start, None, length=seq_len)
    tokens = jnp.concatenate([start[:, None], rest.T], axis=1)  # (batch, seq + 1)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
