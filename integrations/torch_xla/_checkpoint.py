"""Checkpoints of sharded torch_xla training with ``torch.distributed.checkpoint`` and torch_xla's SPMD planners.

Each save writes the model's and the optimizer's state dicts to
``directory/step_<n>`` with ``torch_xla.experimental.distributed_checkpoint``'s
``SPMDSavePlanner`` (every shard written by the device holding it); restore
loads them back in place into a model that already carries its sharding
(after :func:`~integrations.torch_xla.apply`) with ``SPMDLoadPlanner``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from integrations.torch_xla._callbacks import Callback


class Checkpointer(Callback):
    """Save every ``every_steps`` steps (and at the end of training); restore the newest.

    Args:
      directory: where ``step_<n>`` checkpoints go.
      module, optimizer: what is saved (the sharded module after ``apply``).
      every_steps: save after steps n with (n + 1) % every_steps == 0.

    Raises:
      ValueError: ``every_steps`` < 1.
    """

    def __init__(self, directory: str | Path, module: nn.Module, optimizer: torch.optim.Optimizer, every_steps: int):
        if every_steps < 1:
            raise ValueError(f"every_steps must be >= 1, got {every_steps}")
        self.directory = Path(directory)
        self.module, self.optimizer, self.every_steps = module, optimizer, every_steps
        self.last_step: int | None = None
        self._saved: int | None = None

    def on_step_end(self, step: int, metrics: Mapping[str, float]) -> None:
        self.last_step = step
        if (step + 1) % self.every_steps == 0:
            self.save(step)

    def on_train_end(self) -> None:
        if self.last_step is not None and self._saved != self.last_step:
            self.save(self.last_step)

    def save(self, step: int) -> Path:
        """Write the model and optimizer state after ``step``; returns the checkpoint directory."""
        import torch.distributed.checkpoint as dist_cp
        import torch_xla.experimental.distributed_checkpoint as xc

        path = self.directory / f"step_{step}"
        state = {"model": self.module.state_dict(), "optim": self.optimizer.state_dict()}
        # per_thread_copy_ahead=0: the serial CPU loader. The overlapping one asks the
        # privateuse1 backend torch_xla registers ("torchax") for a stream it does not have.
        writer = dist_cp.FileSystemWriter(str(path), per_thread_copy_ahead=0)
        dist_cp.save(state_dict=state, storage_writer=writer, planner=xc.SPMDSavePlanner())
        self._saved = step
        return path

    def steps(self) -> list[int]:
        """Steps with a checkpoint in ``directory``, ascending."""
        found = (p.name.removeprefix("step_") for p in self.directory.glob("step_*"))
        return sorted(int(s) for s in found if s.isdigit())

    def restore(self, step: int | None = None) -> int:
        """Load the model state of ``step`` (default: the newest) in place; returns the step.

        Raises:
          FileNotFoundError: no checkpoint for that step.
        """
        import torch.distributed.checkpoint as dist_cp
        import torch_xla.experimental.distributed_checkpoint as xc

        available = self.steps()
        step = available[-1] if step is None and available else step
        if step is None or step not in available:
            raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory} (found steps {available})")
        state = {"model": self.module.state_dict()}
        reader = dist_cp.FileSystemReader(str(self.directory / f"step_{step}"))
        dist_cp.load(state_dict=state, storage_reader=reader, planner=xc.SPMDLoadPlanner())
        self.module.load_state_dict(state["model"])
        return step
