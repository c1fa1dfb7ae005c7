"""``--model package.module:factory``: a user's own JAX/Flax training step for ``orchestrator plan``, ``graph``
and ``train``.

The factory takes no arguments and returns ``(train_step, state, batch)``:
``train_step(state, batch)`` is the step to plan, ``state`` the training
state it takes (a Flax ``TrainState``, any pytree of arrays; shapes are
enough, ``jax.ShapeDtypeStruct`` included) and ``batch`` one global batch,
whose leading dimension is the batch size. The module is imported with the
current directory on ``sys.path``, as ``python -m`` would.

Example (``mymodels/mlp.py``)::

    import flax.linen as nn, jax, jax.numpy as jnp, optax
    from flax.training.train_state import TrainState

    def make():
        model = nn.Sequential([nn.Dense(256), nn.relu, nn.Dense(10)])
        x = jnp.ones((64, 32))
        state = TrainState.create(apply_fn=model.apply, params=model.init(jax.random.key(0), x), tx=optax.adamw(1e-3))

        def train_step(state, batch):
            loss = lambda p: ((state.apply_fn(p, batch["x"]) - batch["y"]) ** 2).mean()
            value, grads = jax.value_and_grad(loss)(state.params)
            return state.apply_gradients(grads=grads), {"loss": value}

        return train_step, state, {"x": x, "y": jnp.ones((64, 10))}

``orchestrator plan --model mymodels.mlp:make --cluster a100x8``; ``orchestrator train --model
mymodels.mlp:make --run-dir run`` also needs what :func:`trainable_or_fail` checks: arrays, a
``state.step``, and ``(state, {"loss": ...})`` from the step.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any

import typer

from orchestrator.cli._common import fail

UserModelOption = Annotated[
    str | None,
    typer.Option(
        "--model",
        help="Your own step instead of a recipe: package.module:factory, a function returning "
        "(train_step, state, batch).",
    ),
]
"""The ``--model`` option of every command that takes a user's step instead of a recipe."""


@dataclass(frozen=True, slots=True, kw_only=True)
class UserModel:
    """What a ``--model`` factory returned, with shapes only.

    Attributes:
      spec: the ``package.module:factory`` it came from.
      train_step: ``train_step(state, batch)``.
      state, batch: pytrees of ``jax.ShapeDtypeStruct``.
      batch_size: the leading dimension of the batch's arrays.
      initial_state, example_batch: the state and batch as the factory returned them (what ``train`` runs).
    """

    spec: str
    train_step: Callable
    state: Any
    batch: Any
    batch_size: int
    initial_state: Any = None
    example_batch: Any = None


def explicit(ctx, name: str) -> bool:
    """Whether the option ``name`` was given on the command line (not left at its default)."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP")


def user_model_or_fail(spec: str, ctx=None, *, recipe_options: tuple[str, ...] = ()) -> UserModel:
    """Import ``package.module:factory``, call it, check what it returns; a one-line error for each mistake.

    ``recipe_options`` name the command's options that only a recipe takes: given along with
    ``--model``, they are an error rather than silently ignored.
    """
    for name in recipe_options:
        if ctx is not None and explicit(ctx, name):
            fail(f"--{name.replace('_', '-')} applies to recipes; with --model the factory's batch sets the shapes")
    module_name, colon, attr = spec.partition(":")
    if not colon or not module_name or not attr or ":" in attr:
        fail(f"--model takes package.module:factory, got {spec!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name and (module_name == error.name or module_name.startswith(f"{error.name}.")):
            fail(f"--model {spec}: no module named {module_name!r} (run from the directory that holds it)")
        fail(f"--model {spec}: importing {module_name!r} needs {error.name!r}, which is not installed")
    factory = getattr(module, attr, None)
    if factory is None:
        fail(f"--model {spec}: module {module_name!r} has no function {attr!r}")
    if not callable(factory):
        fail(f"--model {spec}: {attr!r} is not a function (it is {type(factory).__name__})")
    return _checked(spec, factory())


def _checked(spec: str, returned) -> UserModel:
    import jax
    import jax.numpy as jnp

    expected = "must return (train_step, state, batch)"
    if not isinstance(returned, tuple | list) or len(returned) != 3:
        got = f"{len(returned)} items" if isinstance(returned, tuple | list) else type(returned).__name__
        fail(f"--model {spec} {expected}, got {got}")
    train_step, initial_state, example_batch = returned
    if not callable(train_step):
        fail(f"--model {spec} {expected}: its train_step is not a function (it is {type(train_step).__name__})")

    def abstract(x):  # shapes only; a Python scalar (TrainState.create's int step) becomes a 0-d array
        x = x if hasattr(x, "shape") and hasattr(x, "dtype") else jnp.asarray(x)
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    state, batch = jax.tree.map(abstract, initial_state), jax.tree.map(abstract, example_batch)
    leaves = jax.tree.leaves(batch)
    if not leaves or not leaves[0].shape:
        fail(f"--model {spec} {expected}: the batch has no array with a leading batch dimension")
    return UserModel(
        spec=spec,
        train_step=train_step,
        state=state,
        batch=batch,
        batch_size=leaves[0].shape[0],
        initial_state=initial_state,
        example_batch=example_batch,
    )


def trainable_or_fail(model: UserModel) -> UserModel:
    """``model`` if ``orchestrator train`` can run it, else a one-line error saying what is missing.

    Training needs values, not shapes; a state that counts its steps (``state.step``, as a Flax
    ``TrainState`` does: a checkpoint is read back at it); and a step returning ``(state, metrics)``
    with ``metrics["loss"]``, of the same structure as the state.
    """
    import jax

    spec = model.spec
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves((model.initial_state, model.example_batch))):
        fail(f"--model {spec}: training needs arrays, and its state or batch holds shapes (jax.ShapeDtypeStruct)")
    if not hasattr(model.state, "step"):
        fail(
            f"--model {spec}: training needs a state with a step counter (a Flax TrainState); "
            f"its state is a {type(model.state).__name__}"
        )
    try:
        out = jax.eval_shape(model.train_step, model.state, model.batch)
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as error:  # the user's code, on shapes
        fail(f"--model {spec}: its train_step fails on the factory's state and batch: {str(error).splitlines()[0]}")
    shape = "train_step(state, batch) must return (state, metrics) with metrics['loss']"
    if not (isinstance(out, tuple | list) and len(out) == 2 and isinstance(out[1], Mapping) and "loss" in out[1]):
        fail(f"--model {spec}: to train, {shape}; it returns {type(out).__name__}")
    if jax.tree.structure(out[0]) != jax.tree.structure(model.state):
        fail(f"--model {spec}: to train, {shape}; its new state differs in structure from the state it takes")
    return model


def user_cost_model(model: UserModel, cluster):
    """The cost model of a user's step on ``cluster``, captured at the batch the factory returned."""
    from integrations.flax import capture
    from orchestrator.coarsen import coarsen
    from orchestrator.costs import CostModel

    graph = capture(model.train_step, model.state, model.batch)
    return CostModel(graph, coarsen(graph), cluster, batch_size=model.batch_size)
