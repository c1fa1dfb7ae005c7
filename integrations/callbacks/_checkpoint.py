"""``Checkpointer``: asynchronous orbax checkpoints of the (sharded) state, the last k kept.

The state is saved as its Flax state dict (``flax.serialization.to_state_dict``:
step, params, opt_state; the apply function and optimizer are code, not data),
so any TrainState-like pytree works. Restoring reads straight into the
shardings of a given target state: a state placed by
:func:`~integrations.flax.shard` comes back on the plan's meshes.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import jax

from integrations.callbacks._base import Callback


class Checkpointer(Callback):
    """Saves every ``every`` steps (and at the end) into ``directory``, keeping the last ``keep``.

    Args:
      directory: checkpoint root (created; must be absolute or is made absolute).
      every: save after steps ``every − 1``, ``2·every − 1``, … (0-based).
      keep: how many checkpoints to keep.
      async_save: write in the background (orbax's async checkpointing).

    Example:
      >>> ckpt = Checkpointer("/tmp/run/ckpt", every=100, keep=3)  # doctest: +SKIP
      >>> state = ckpt.restore(state)  # latest, into state's shardings  # doctest: +SKIP
    """

    def __init__(self, directory: str | Path, *, every: int = 1, keep: int = 3, async_save: bool = True):
        import orbax.checkpoint as ocp

        if every < 1 or keep < 1:
            raise ValueError(f"Checkpointer needs every >= 1 and keep >= 1, got every={every}, keep={keep}")
        self.directory = Path(directory).absolute()
        self.every = every
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save)
        self.manager = ocp.CheckpointManager(self.directory, options=options)
        self._last_saved: int | None = None

    def save(self, step: int, state) -> None:
        """Start saving ``state`` as checkpoint ``step`` (returns before it is written when async)."""
        import orbax.checkpoint as ocp
        from flax import serialization

        self.manager.save(step, args=ocp.args.StandardSave(serialization.to_state_dict(state)))
        self._last_saved = step

    def on_step_end(self, step: int, metrics: Mapping, *, state=None) -> None:
        if state is not None and (step + 1) % self.every == 0:
            self.save(step, state)

    def on_train_end(self, *, state=None) -> None:
        if state is not None:
            latest = self.manager.latest_step()
            step = int(jax.device_get(state.step)) - 1 if hasattr(state, "step") else (latest or 0) + 1
            if latest is None or step > latest:
                self.save(step, state)
        self.wait()

    def wait(self) -> None:
        """Block until background saves are written."""
        self.manager.wait_until_finished()

    def steps(self) -> list[int]:
        """Steps with a checkpoint on disk, oldest first."""
        return sorted(self.manager.all_steps())

    def restore(self, target, step: int | None = None):
        """The checkpoint ``step`` (latest if None) read into ``target``'s structure and shardings.

        Raises:
          FileNotFoundError: there is no checkpoint.
        """
        import orbax.checkpoint as ocp
        from flax import serialization

        self.wait()
        step = self.manager.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x,
            serialization.to_state_dict(target),
        )
        restored = self.manager.restore(step, args=ocp.args.StandardRestore(abstract))
        return serialization.from_state_dict(target, restored)

    def close(self) -> None:
        self.manager.close()
