"""A recipe at one batch shape, seed and learning rate: the step, initial state and batches of a run."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from flax.training.train_state import TrainState

from recipes._registry import Recipe, get_recipe


@dataclass(frozen=True, slots=True, kw_only=True)
class RecipeRun:
    """What ``integrations.flax.train`` needs for a recipe, and the JSON a resumed run rebuilds it from.

    Every piece is a pure function of these fields, so a run resumed in another process, or recovered
    after losing devices, computes the same initial state and the same batch at every step.

    Attributes:
      recipe: recipe name (:func:`recipes.get_recipe`).
      global_batch, seq_len: batch shape of every step.
      seed: the initial state and every batch derive from it.
      learning_rate: AdamW's.

    Example:
      >>> run = RecipeRun(recipe="gpt-tiny", global_batch=4, seq_len=16)
      >>> run.batch(0)["inputs"].shape
      (4, 16)
      >>> RecipeRun.from_json(run.to_json()) == run
      True
    """

    recipe: str
    global_batch: int
    seq_len: int
    seed: int = 0
    learning_rate: float = 3e-4

    def __post_init__(self) -> None:
        get_recipe(self.recipe)  # KeyError naming the known recipes
        for name in ("global_batch", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"RecipeRun.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def spec(self) -> Recipe:
        return get_recipe(self.recipe)

    @property
    def train_step(self):
        """``train_step(state, batch) -> (state, {"loss": ...})``."""
        return self.spec.train_step

    def init_state(self) -> TrainState:
        """The state before step 0 (:meth:`Recipe.initial_state`)."""
        return self.spec.initial_state(self.seed, learning_rate=self.learning_rate)

    def batch(self, step: int) -> dict:
        """The batch of step ``step`` (:meth:`Recipe.batch_for_step`)."""
        return self.spec.batch_for_step(self.seed, step, self.global_batch, self.seq_len)

    def param_axes(self) -> dict[str, tuple[str | None, ...]] | None:
        """Logical axes for tensor parallelism: the GPTs'; None for Mamba, whose parameters carry none."""
        return self.spec.param_axes() if self.spec.family == "gpt" else None

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> RecipeRun:
        """The run ``data`` describes.

        Raises:
          KeyError: an unknown recipe.
          TypeError: ``data`` lacks a field or has one this class does not know.
          ValueError: a batch shape below 1.
        """
        return cls(**data)
