"""Named recipes: a model config plus the batch shape it is captured and trained with."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.training.train_state import TrainState
from flax.traverse_util import flatten_dict

from recipes.gpt import GPT, GPT_PRESETS, GPTConfig
from recipes.mamba import MAMBA_PRESETS, Mamba, MambaConfig
from recipes.train import adamw, create_train_state, synthetic_batch, train_state_of, train_step


@dataclass(frozen=True, slots=True, kw_only=True)
class Recipe:
    """A model preset with its default batch shape.

    Attributes:
      name: preset name, e.g. ``"gpt2-small"``.
      config: the model's :class:`GPTConfig` or :class:`MambaConfig`.
      batch_size, seq_len: the default batch the step is captured with.
    """

    name: str
    config: GPTConfig | MambaConfig
    batch_size: int
    seq_len: int

    @property
    def family(self) -> str:
        return "gpt" if isinstance(self.config, GPTConfig) else "mamba"

    @property
    def block_prefix(self) -> str:
        """Module-name prefix of the repeated blocks (``blocks_3``, ``layers_3``)."""
        return "blocks_" if self.family == "gpt" else "layers_"

    def model(self) -> nn.Module:
        return GPT(self.config) if self.family == "gpt" else Mamba(self.config)

    def batch_spec(self, batch_size: int | None = None, seq_len: int | None = None) -> dict:
        shape = (batch_size or self.batch_size, seq_len or self.seq_len)
        token = jax.ShapeDtypeStruct(shape, jnp.int32)
        return {"inputs": token, "targets": token}

    def create_state(self, rng: jax.Array, *, learning_rate: float = 3e-4) -> TrainState:
        """Concrete parameters and AdamW state (allocates the model)."""
        example = jnp.zeros((1, min(self.seq_len, 8)), jnp.int32)
        return create_train_state(self.model(), rng, example, adamw(learning_rate))

    def abstract_state(self, *, learning_rate: float = 3e-4) -> TrainState:
        """The TrainState as ``jax.ShapeDtypeStruct`` leaves, as :meth:`create_state` makes it;
        allocates nothing (the model's init is traced once per recipe, shared with :meth:`param_axes`)."""
        model = self.model()
        return jax.eval_shape(lambda v: train_state_of(model, v, adamw(learning_rate)), _abstract_variables(self))

    def param_axes(self) -> dict[str, tuple[str | None, ...]]:
        """Logical axis names of every parameter (``"blocks_0/mlp/c_fc/kernel": ("embed", "mlp")``).

        Read with Flax alone, from the ``nn.with_logical_partitioning`` boxes of an abstract init
        (``nn.get_partition_spec``, paths joined with ``/``), so recipes stand on Flax only; it is
        the table ``integrations.flax.param_logical_axes`` gives for any boxed model.
        """
        specs = flatten_dict(nn.get_partition_spec(_abstract_variables(self)["params"]), sep="/")
        return {path: tuple(spec) for path, spec in specs.items()}

    def initial_state(self, seed: int, *, learning_rate: float = 3e-4) -> TrainState:
        """The state before step 0 (on the default device): a pure function of ``seed`` and ``learning_rate``.

        Its key is the first half of ``split(key(seed))``; :meth:`batch_for_step` draws from the second.
        """
        return _jitted_create_state(self, learning_rate)(jax.random.split(jax.random.key(seed))[0])

    def batch_for_step(self, seed: int, step: int, batch_size: int | None = None, seq_len: int | None = None) -> dict:
        """The synthetic batch of step ``step``: a pure function of ``(seed, step)`` and the batch shape.

        Drawn with ``fold_in(data_key, step)``, ``data_key`` the second half of ``split(key(seed))``, so
        a run that resumes or recovers at any step sees the batches an uninterrupted run sees.
        """
        shape = (batch_size or self.batch_size, seq_len or self.seq_len)
        return _batch(seed, step, *shape, self.config.vocab_size)

    train_step = staticmethod(train_step)


@functools.cache
def _jitted_create_state(recipe: Recipe, learning_rate: float):
    """``recipe.create_state`` under ``jax.jit``, once per process: eager init costs seconds of dispatch, and
    states made by one jitted init share their static fields (``apply_fn``, ``tx``), so a step compiled for
    one of them serves the others."""
    return jax.jit(lambda key: recipe.create_state(key, learning_rate=learning_rate))


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _batch(seed, step, batch_size: int, seq_len: int, vocab_size: int) -> dict:
    # one dispatch per step: the key derivation runs eagerly op by op otherwise
    data_key = jax.random.split(jax.random.key(seed))[1]
    return synthetic_batch(jax.random.fold_in(data_key, step), batch_size, seq_len, vocab_size)


def _default_shape(name: str, config: GPTConfig | MambaConfig) -> tuple[int, int]:
    if name.endswith("tiny"):
        return 8, 64
    if name in ("gpt2-small",):
        return 8, 1024
    return 8, 2048


# the 1T GPT of Megatron-LM's weak-scaling runs (Narayanan et al., SC'21, arXiv 2104.04473, Table 1), the
# largest shape the planner is held to at scale (3072 A100)
SCALE_PRESETS: dict[str, GPTConfig] = {
    "gpt-1t": GPTConfig(vocab_size=51200, max_seq_len=2048, num_layers=128, num_heads=160, d_model=25600),
}

RECIPES: dict[str, Recipe] = {
    name: Recipe(
        name=name, config=config, batch_size=_default_shape(name, config)[0], seq_len=_default_shape(name, config)[1]
    )
    for name, config in {**GPT_PRESETS, **SCALE_PRESETS, **MAMBA_PRESETS}.items()
}


def get_recipe(name: str) -> Recipe:
    """The recipe called ``name``; raises ``KeyError`` listing the known names."""
    try:
        return RECIPES[name]
    except KeyError:
        raise KeyError(f"unknown recipe {name!r}; choose one of: {', '.join(RECIPES)}") from None


@functools.cache
def _abstract_variables(recipe: Recipe) -> dict:
    """The variables of ``recipe``'s model from an abstract init at :meth:`Recipe.create_state`'s
    example shape, logical-axis boxes kept (``jax.ShapeDtypeStruct`` leaves): tracing a large
    model's init takes seconds, and both the abstract state and the axes read it."""
    example = jax.ShapeDtypeStruct((1, min(recipe.seq_len, 8)), jnp.int32)
    return jax.eval_shape(recipe.model().init, jax.random.key(0), example)
