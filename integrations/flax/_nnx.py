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

nnx modules open no name scope of their own, so the step runs each submodule's ``__call__``
inside ``jax.named_scope`` of its attribute name (``blocks_3`` for item 3 of a list
``blocks``, the class name for the root), as linen does: capture then sees module scopes and the
coarsener cuts layers per module, not by FLOP balance alone.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator


def scope_name(path: tuple) -> str:
    """The name scope of the submodule at graph ``path``: its attribute name, with the index
    of a list item appended (``("blocks", 3)`` → ``blocks_3``), as linen names them."""
    *_, parent, last = ("", *path)
    return f"{parent}_{last}" if isinstance(last, int) else str(last)


_SCOPE = "_orchestrator_scope"


@contextlib.contextmanager
def module_scopes(model) -> Iterator[None]:
    """While open, each nnx submodule of ``model`` called runs inside ``jax.named_scope`` of its
    :func:`scope_name` (the root: its class name).

    Each submodule gets its name as a static attribute, so the copies nnx transforms make
    (``nnx.value_and_grad`` splits and merges the model) carry it too; the classes' ``__call__``
    are wrapped for the duration and restored after. Modules without the attribute (outside
    ``model``) are untouched, and a subclass calling ``super().__call__`` opens its scope once.
    """
    import jax
    from flax import nnx

    modules = [(path, node) for path, node in nnx.iter_graph(model) if isinstance(node, nnx.Module)]
    for path, node in modules:
        object.__setattr__(node, _SCOPE, scope_name(path) if path else type(node).__name__)
    classes = {cls for _, node in modules for cls in type(node).__mro__ if "__call__" in vars(cls)}
    inside: set[int] = set()

    def wrap(call):
        @functools.wraps(call)
        def scoped(self, *args, **kwargs):
            name = getattr(self, _SCOPE, None)
            if name is None or id(self) in inside:
                return call(self, *args, **kwargs)
            inside.add(id(self))
            try:
                with jax.named_scope(name):
                    return call(self, *args, **kwargs)
            finally:
                inside.discard(id(self))

        return scoped

    saved = {cls: vars(cls)["__call__"] for cls in classes if cls is not object}
    try:
        for cls, call in saved.items():
            cls.__call__ = wrap(call)
        yield
    finally:
        for cls, call in saved.items():
            cls.__call__ = call


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
        with module_scopes(model):
            metrics = step(model, optimizer, batch)
        _, new_params, new_rest = nnx.split((model, optimizer), nnx.Param, ...)
        return {"params": new_params, "opt_state": new_rest}, metrics if isinstance(metrics, dict) else {
            "loss": metrics
        }

    return {"params": params, "opt_state": rest}, train_step
