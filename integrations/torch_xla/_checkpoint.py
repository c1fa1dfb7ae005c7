"""The torch_xla store of :class:`integrations.callbacks.Checkpointer`: ``torch.distributed.checkpoint`` with SPMD planners.

Each save writes the model's and the optimizer's state dicts to
``directory/step_<n>`` with ``torch_xla.experimental.distributed_checkpoint``'s
``SPMDSavePlanner`` (every shard written by the device holding it); restore
loads the model's back in place into a module that already carries its
sharding (after :func:`~integrations.torch_xla.apply`) with ``SPMDLoadPlanner``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from torch import nn


class SPMDCheckpointStore:
    """Checkpoints of a sharded torch module and its optimizer, for :class:`~integrations.callbacks.Checkpointer`.

    The store reads the live module and optimizer itself (``holds_state``): a
    torch loop passes no ``state=`` to the hooks.

    Args:
      directory: where ``step_<n>`` checkpoints go.
      module, optimizer: what is saved (the sharded module after ``apply``).
      keep: how many checkpoints to keep (None: all).

    Example:
      >>> store = SPMDCheckpointStore("/tmp/ckpt", model, optimizer)  # doctest: +SKIP
      >>> fit(step, batches, [Checkpointer(store=store, every=100)])  # doctest: +SKIP
    """

    holds_state = True

    def __init__(
        self, directory: str | Path, module: nn.Module, optimizer: torch.optim.Optimizer, *, keep: int | None = None
    ):
        if keep is not None and keep < 1:
            raise ValueError(f"SPMDCheckpointStore needs keep >= 1 or None, got keep={keep}")
        self.directory = Path(directory).absolute()
        self.module, self.optimizer, self.keep = module, optimizer, keep

    def save(self, step: int, state=None) -> None:
        """Write the model and optimizer state after ``step`` (``state`` is unused: the store holds it)."""
        import torch.distributed.checkpoint as dist_cp
        import torch_xla.experimental.distributed_checkpoint as xc

        path = self.directory / f"step_{step}"
        state_dict = {"model": self.module.state_dict(), "optim": self.optimizer.state_dict()}
        # per_thread_copy_ahead=0: the serial CPU loader. The overlapping one asks the
        # privateuse1 backend torch_xla registers ("torchax") for a stream it does not have.
        writer = dist_cp.FileSystemWriter(str(path), per_thread_copy_ahead=0)
        dist_cp.save(state_dict=state_dict, storage_writer=writer, planner=xc.SPMDSavePlanner())
        for old in self.steps()[: -self.keep] if self.keep else ():
            shutil.rmtree(self.directory / f"step_{old}")

    def steps(self) -> list[int]:
        """Steps with a checkpoint in ``directory``, ascending."""
        found = (p.name.removeprefix("step_") for p in self.directory.glob("step_*"))
        return sorted(int(s) for s in found if s.isdigit())

    def restore(self, step: int, target=None) -> int:
        """Load the model state of ``step`` in place (``target`` is unused); returns the step."""
        import torch.distributed.checkpoint as dist_cp
        import torch_xla.experimental.distributed_checkpoint as xc

        state_dict = {"model": self.module.state_dict()}
        reader = dist_cp.FileSystemReader(str(self.directory / f"step_{step}"))
        dist_cp.load(state_dict=state_dict, storage_reader=reader, planner=xc.SPMDLoadPlanner())
        self.module.load_state_dict(state_dict["model"])
        return step

    def wait(self) -> None:
        """Saves are synchronous: nothing to wait for."""

    def close(self) -> None:
        """Nothing to release."""
