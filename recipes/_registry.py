"""Named recipes: a model config plus the batch shape it is captured and trained with."""

from __future__ import annotations

from dataclasses import dataclass

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.training.train_state import TrainState

from recipes.gpt import GPT, GPT_PRESETS, GPTConfig
from recipes.mamba import MAMBA_PRESETS, Mamba, MambaConfig
from recipes.train import adamw, create_train_state, train_step


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
        """The TrainState as ``jax.ShapeDtypeStruct`` leaves; allocates nothing."""
        return jax.eval_shape(lambda rng: self.create_state(rng, learning_rate=learning_rate), jax.random.key(0))

    def param_axes(self) -> dict[str, tuple[str | None, ...]]:
        """Logical axis names of every parameter (``"blocks_0/mlp/c_fc/kernel": ("embed", "mlp")``)."""
        from integrations.flax import param_logical_axes

        example = jax.ShapeDtypeStruct((1, min(self.seq_len, 8)), jnp.int32)
        boxed = jax.eval_shape(self.model().init, jax.random.key(0), example)
        return param_logical_axes(boxed["params"])

    train_step = staticmethod(train_step)


def _default_shape(name: str, config: GPTConfig | MambaConfig) -> tuple[int, int]:
    if name.endswith("tiny"):
        return 8, 64
    if name in ("gpt2-small",):
        return 8, 1024
    return 8, 2048


RECIPES: dict[str, Recipe] = {
    name: Recipe(
        name=name, config=config, batch_size=_default_shape(name, config)[0], seq_len=_default_shape(name, config)[1]
    )
    for name, config in {**GPT_PRESETS, **MAMBA_PRESETS}.items()
}


def get_recipe(name: str) -> Recipe:
    """The recipe called ``name``; raises ``KeyError`` listing the known names."""
    try:
        return RECIPES[name]
    except KeyError:
        raise KeyError(f"unknown recipe {name!r}; choose one of: {', '.join(RECIPES)}") from None
