"""flax.nnx models with ``nnx.Optimizer``: a pytree state and a pure train step the executor can run.

``nnx.split`` separates the model's ``nnx.Param`` variables from everything
else (optimizer moments and counters, other model variables); the state is
``{"params": <Param state>, "opt_state": <the rest>}``, so capture finds the
parameters under ``params`` and :func:`~integrations.flax.shard` places each
optimizer moment with its parameter. The step merges, differentiates with
``nnx.value_and_grad``, calls ``optimizer.update`` and splits again.
Single-stage plans only: the pipeline's per-stage update needs a Flax
``TrainState``.
"""

from __future__ import annotations

from collections.abc import Callable


def from_nnx(model, optimizer, loss_fn: Callable) -> tuple[dict, Callable]:
    """``(state, train_step)`` for an nnx model and its ``nnx.Optimizer``.

    Args:
      model: the ``nnx.Module``.
      optimizer: ``nnx.Optimizer(model, tx, wrt=nnx.Param)``.
      loss_fn: ``loss_fn(model, batch) -> scalar loss``.

    Returns:
      ``state`` (a pytree of arrays) and ``train_step(state, batch) -> (state, {"loss": loss})``.

    Example:
      >>> state, step = from_nnx(model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param), loss_fn)  # doctest: +SKIP
    """
    from flax import nnx

    graphdef, params, rest = nnx.split((model, optimizer), nnx.Param, ...)

    def train_step(state: dict, batch):
        model, optimizer = nnx.merge(graphdef, state["params"], state["opt_state"])
        loss, grads = nnx.value_and_grad(lambda m: loss_fn(m, batch))(model)
        optimizer.update(model, grads)
        _, new_params, new_rest = nnx.split((model, optimizer), nnx.Param, ...)
        return {"params": new_params, "opt_state": new_rest}, {"loss": loss}

    return {"params": params, "opt_state": rest}, train_step
