"""What the executor bench observes of a pipeline step: its dispatches and the device buffers they move.

The host's cost of a step grows with the dispatches it makes, by the number of devices each goes
to (d(k)), and with the device buffers (one per shard) its calls and transfers take and return
(b each). :class:`DispatchCounter` counts both by observing the executor
(:class:`~integrations.flax.PipelineObserver`).
"""

from __future__ import annotations

from collections import Counter

import jax


def shard_count(tree) -> int:
    """Device buffers behind a pytree of arrays: one per shard."""
    return sum(len(x.sharding.device_set) for x in jax.tree.leaves(tree) if hasattr(x, "sharding"))


class DispatchCounter:
    """Counts a pipeline step's dispatches by the number of devices each goes to and, with
    ``buffers``, the device buffers they move: a call's arguments and results, a transfer's result.

    Attributes (of the last step):
      dispatches: host → device dispatches, jitted programs and transfers.
      sizes: dispatches by the device count they go to.
      buffers: device buffers moved (0 unless ``buffers``).
    """

    def __init__(self, *, buffers: bool = True):
        self.count_buffers = buffers
        self.dispatches, self.sizes, self.buffers = 0, Counter(), 0

    def on_step_begin(self, stages: int) -> None:
        self.dispatches, self.sizes, self.buffers = 0, Counter(), 0

    def on_dispatch(self, dispatch) -> None:
        pass

    def on_dispatched(self, dispatch, outputs) -> None:
        self.dispatches += 1
        self.sizes[len(dispatch.devices)] += 1
        if self.count_buffers:
            moved = shard_count(outputs) + (0 if dispatch.kind == "transfer" else shard_count(dispatch.args))
            self.buffers += moved

    def on_step_end(self) -> None:
        pass
