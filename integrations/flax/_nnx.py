"""flax.nnx models with ``nnx.Optimizer``: a pytree state and a pure train step the executor can run.

``nnx.split`` separates the model's ``nnx.Param`` variables from everything
else (optimizer moments and counters, other model variables); the state is
``{"params": <Param state>, "opt_state": <the rest>}``, so capture finds the
parameters under ``params`` and :func:`~integrations.flax.shard` places each
optimizer moment with its parameter. The step merges, runs the user's nnx step
(or differentiates a loss with ``nnx.value_and_grad`` and calls
``optimizer.update``) and splits again. Single-stage plans only: the pipeline's
per-stage update needs ``apply_gradients``, so ``orchestrate`` plans these
states on one stage (:mod:`integrations.flax._stagewise`).
"""

from __future__ import annotations

from collections.abc import Callable


def from_nnx(
    model, optimizer, loss_fn: Callable | None = None, *, step: Callable | None = None
) -> tuple[dict, Callable]:
    """``(state, train_step)`` for an nnx model and its ``nnx.Optimizer``.

    Give either ``loss_fn`` (the step differentiates it and calls ``optimizer.update``) or your own nnx
    ``step``, written as nnx steps are: it updates ``model`` and ``optimizer`` in place.

    Args:
      model: the ``nnx.Module``.
      optimizer: ``nnx.Optimizer(model, tx, wrt=nnx.Param)``, any optax ``tx``.
      loss_fn: ``loss_fn(model, batch) -> scalar loss``.
      step: ``step(model, optimizer, batch)`` returning the loss or a dict of metrics with ``"loss"``.

    Returns:
      ``state`` (a pytree of arrays) and ``train_step(state, batch) -> (state, metrics)``.

    Raises:
      ValueError: neither or both of ``loss_fn`` and ``step`` given.

    Example:
      >>> state, step = from_nnx(model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param), loss_fn)  # doctest: +SKIP
    """
    from flax import nnx

    if (loss_fn is None) == (step is None):
        raise ValueError("from_nnx takes loss_fn(model, batch) or step=step(model, optimizer, batch), one of them")
    if step is None:

        def step(model, optimizer, batch):
            loss, grads = nnx.value_and_grad(lambda m: loss_fn(m, batch))(model)
            optimizer.update(model, grads)
            return loss

    graphdef, params, rest = nnx.split((model, optimizer), nnx.Param, ...)

    def train_step(state: dict, batch):
        model, optimizer = nnx.merge(graphdef, state["params"], state["opt_state"])
        metrics = step(model, optimizer, batch)
        _, new_params, new_rest = nnx.split((model, optimizer), nnx.Param, ...)
        return {"params": new_params, "opt_state": new_rest}, metrics if isinstance(metrics, dict) else {
            "loss": metrics
        }

    return {"params": params, "opt_state": rest}, train_step
