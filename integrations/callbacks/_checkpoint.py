"""``Checkpointer``: save a training state every k steps and restore the newest, for either framework.

The callback decides *when* (every ``every`` steps and at the end of
training); a :class:`CheckpointStore` decides *how*. The default store,
:class:`OrbaxStore`, writes a JAX state asynchronously with orbax as its Flax
state dict (``flax.serialization.to_state_dict``: step, params, opt_state;
the apply function and optimizer are code, not data), so any TrainState-like
pytree works, and restores straight into the shardings of a given target: a
state placed by :func:`~integrations.flax.shard` comes back on the plan's
meshes. :class:`~integrations.torch_xla.SPMDCheckpointStore` writes a sharded
torch module and optimizer with ``torch.distributed.checkpoint``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Protocol

from integrations.callbacks._base import Callback


class CheckpointStore(Protocol):
    """Where a :class:`Checkpointer` writes and reads checkpoints, one per step.

    Attributes:
      directory: the checkpoint root.
      holds_state: True if the store reads the live state itself (a torch
        module and optimizer updated in place), so the training loop need not
        pass ``state=`` to the hooks.
    """

    directory: Path
    holds_state: bool

    def save(self, step: int, state) -> None:
        """Write ``state`` (None when ``holds_state``) as checkpoint ``step``."""

    def steps(self) -> list[int]:
        """Steps with a checkpoint, oldest first."""

    def restore(self, step: int, target):
        """Read checkpoint ``step``, into ``target`` where the store needs one."""

    def wait(self) -> None:
        """Block until background writes are done."""

    def close(self) -> None:
        """Release the store's resources."""

    def set_aside(self, step: int) -> None:
        """Move checkpoint ``step`` out of the way (optional): it no longer counts, is never read or overwritten."""


class OrbaxStore:
    """A JAX state's checkpoints with orbax, the last ``keep`` kept, written in the background if ``async_save``."""

    holds_state = False

    def __init__(self, directory: str | Path, *, keep: int = 3, async_save: bool = True):
        import orbax.checkpoint as ocp

        if keep < 1:
            raise ValueError(f"Checkpointer needs keep >= 1, got keep={keep}")
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save)
        with _quiet_absl():  # it reads each checkpoint's metadata; a bad one is reported when restored
            self.manager = ocp.CheckpointManager(self.directory, options=options)

    def save(self, step: int, state) -> None:
        import orbax.checkpoint as ocp
        from flax import serialization

        self.manager.save(step, args=ocp.args.StandardSave(serialization.to_state_dict(state)))

    def steps(self) -> list[int]:
        with _quiet_absl():
            return sorted(self.manager.all_steps())

    def restore(self, step: int, target):
        import jax
        import orbax.checkpoint as ocp
        from flax import serialization

        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x,
            serialization.to_state_dict(target),
        )
        restored = self.manager.restore(step, args=ocp.args.StandardRestore(abstract))
        return serialization.from_state_dict(target, restored)

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()

    def set_aside(self, step: int) -> None:
        """Rename checkpoint ``step`` to ``<step>.unreadable`` (orbax ignores names that are not numbers)."""
        path = self.directory / str(step)
        target, n = path.with_name(f"{step}.unreadable"), 1
        while target.exists():
            target, n = path.with_name(f"{step}.unreadable-{n}"), n + 1
        path.rename(target)
        with _quiet_absl():
            self.manager.reload()


class Checkpointer(Callback):
    """Saves every ``every`` steps (and at the end) into a store; restores the newest.

    Args:
      directory: checkpoint root of the default :class:`OrbaxStore` (made absolute).
      every: save after steps ``every − 1``, ``2·every − 1``, … (0-based).
      keep, async_save: options of the default store (how many checkpoints it
        keeps; whether it writes in the background).
      store: a :class:`CheckpointStore` instead of the default one (then no ``directory``).

    Raises:
      ValueError: ``every`` or ``keep`` below 1, or neither or both of ``directory`` and ``store``.

    Example:
      >>> ckpt = Checkpointer("/tmp/run/ckpt", every=100, keep=3)  # doctest: +SKIP
      >>> state = ckpt.restore(state)  # latest, into state's shardings  # doctest: +SKIP
      >>> ckpt = Checkpointer(store=SPMDCheckpointStore("/tmp/ckpt", model, optimizer))  # torch  # doctest: +SKIP
    """

    def __init__(
        self,
        directory: str | Path | None = None,
        *,
        every: int = 1,
        keep: int = 3,
        async_save: bool = True,
        store: CheckpointStore | None = None,
    ):
        if every < 1:
            raise ValueError(f"Checkpointer needs every >= 1, got every={every}")
        if (directory is None) == (store is None):
            raise ValueError("Checkpointer takes a directory (for the default orbax store) or a store=, not both")
        self.store = store if store is not None else OrbaxStore(directory, keep=keep, async_save=async_save)
        self.directory = self.store.directory
        self.every = every
        self._last_step: int | None = None

    @property
    def manager(self):
        """The default store's orbax ``CheckpointManager``."""
        return self.store.manager

    def save(self, step: int, state=None) -> None:
        """Start saving ``state`` as checkpoint ``step`` (returns before it is written when async)."""
        self.store.save(step, state)

    def _can_save(self, state) -> bool:
        return state is not None or self.store.holds_state

    def on_step_end(self, step: int, metrics: Mapping, *, state=None) -> None:
        self._last_step = step
        if self._can_save(state) and (step + 1) % self.every == 0:
            self.save(step, state)

    def on_train_end(self, *, state=None) -> None:
        if self._can_save(state):
            # a TrainState counts the steps it took; its last one is the one to save
            step = int(state.step) - 1 if hasattr(state, "step") else self._last_step
            latest = self.latest_step()
            if step is not None and (latest is None or step > latest):
                self.save(step, state)
        self.wait()

    def wait(self) -> None:
        """Block until background saves are written."""
        self.store.wait()

    def steps(self) -> list[int]:
        """Steps with a checkpoint on disk, oldest first."""
        return self.store.steps()

    def latest_step(self) -> int | None:
        """The newest checkpoint's step, None if there is none."""
        steps = self.steps()
        return steps[-1] if steps else None

    def restore(self, target=None, step: int | None = None):
        """The checkpoint ``step`` (latest if None) read back by the store.

        The orbax store returns it as ``target``'s structure on ``target``'s
        shardings; a store that ``holds_state`` loads it in place and returns the step.

        Raises:
          FileNotFoundError: there is no such checkpoint.
        """
        self.wait()
        available = self.steps()
        step = available[-1] if step is None and available else step
        if step is None or step not in available:
            raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory} (found steps {available})")
        return self.store.restore(step, target)

    def restore_newest(self, target=None, *, report: Callable[[str], None] | None = None) -> tuple[object, int] | None:
        """(the newest checkpoint that reads back into ``target``, its step), or None if none does.

        A checkpoint whose files are cut short or garbled (a host that died mid-write after the rename, a
        disk that lost blocks) is reported in one line through ``report``, set aside (the store renames it,
        so it is never read or overwritten again), and the previous kept checkpoint is tried.

        Raises:
          ValueError: a checkpoint does not read back and the store has no ``set_aside`` to move it out of
            the way (the older ones are then not tried, so a bad checkpoint is never skipped silently).
        """
        self.wait()
        for step in reversed(self.steps()):
            try:
                with _quiet_absl():
                    return self.store.restore(step, target), step
            except (ValueError, OSError, KeyError) as error:  # json, tensorstore and file errors of bad bytes
                if not hasattr(self.store, "set_aside"):
                    raise ValueError(
                        f"checkpoint {step} does not read back ({error}), and {type(self.store).__name__} cannot "
                        "set it aside: remove it or give the store a set_aside(step) method"
                    ) from error
                reason = " ".join(str(error).split())[:160]
                self.store.set_aside(step)
                older = [s for s in self.steps() if s < step]
                then = f"using checkpoint {older[-1]}" if older else "no older checkpoint is kept"
                (report or (lambda line: None))(f"checkpoint {step} does not read back ({reason}); {then}")
        return None

    def close(self) -> None:
        self.store.close()


@contextlib.contextmanager
def _quiet_absl():
    """Silence absl's ERROR lines while a checkpoint is tried: orbax logs each bad file it meets, and the
    one-line report of :meth:`Checkpointer.restore_newest` says it once."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)
