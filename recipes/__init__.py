"""Ready-made models with train steps: GPT-style transformers and Mamba.

>>> from recipes import get_recipe
>>> recipe = get_recipe("gpt-tiny")
>>> recipe.config.num_layers
2
"""

from recipes._registry import RECIPES, Recipe, get_recipe
from recipes.gpt import GPT, GPT_PRESETS, GPTConfig
from recipes.mamba import MAMBA_PRESETS, Mamba, MambaConfig
from recipes.train import adamw, create_train_state, loss_fn, synthetic_batch, train_step

__all__ = [
    "GPT",
    "GPT_PRESETS",
    "MAMBA_PRESETS",
    "RECIPES",
    "GPTConfig",
    "Mamba",
    "MambaConfig",
    "Recipe",
    "adamw",
    "create_train_state",
    "get_recipe",
    "loss_fn",
    "synthetic_batch",
    "train_step",
]
