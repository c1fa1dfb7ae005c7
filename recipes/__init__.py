"""Ready-made models with train steps: GPT-style transformers and Mamba.

Recipes stand on JAX, Flax and optax alone (``recipes.torch_gpt``, the GPT's PyTorch twin, on torch).
The orchestrator core and ``integrations`` never import them; ``orchestrator.cli`` and
``orchestrator.bench`` do, to turn a recipe name into a step, a state and batches
(:class:`RecipeRun`).

>>> from recipes import get_recipe
>>> recipe = get_recipe("gpt-tiny")
>>> recipe.config.num_layers
2
"""

from recipes._registry import RECIPES, Recipe, get_recipe
from recipes._run import RecipeRun
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
    "RecipeRun",
    "adamw",
    "create_train_state",
    "get_recipe",
    "loss_fn",
    "synthetic_batch",
    "train_step",
]
