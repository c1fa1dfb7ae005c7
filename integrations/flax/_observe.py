"""The pipeline executor's observer hook: see every host → device dispatch of a step.

A :class:`~integrations.flax.Pipeline` built with ``observers=[...]`` tells each observer when a
step begins and ends, and hands it every dispatch before and after it is issued: a jitted
program of a stage (its parameter gather, forward, backward, gradient-accumulator zeros,
cotangent sum, replica gradient sum, update) or a transfer onto a stage's devices. Timing, counting, recording and
fault injection are observers; the executor itself does none of them, and a pipeline with no
observers does no work for them.

Example, an observer that counts a step's dispatches by kind::

    class Count:
        def on_step_begin(self, stages): self.kinds = collections.Counter()
        def on_dispatch(self, dispatch): pass
        def on_dispatched(self, dispatch, outputs): self.kinds[dispatch.kind] += 1
        def on_step_end(self): pass

    step = Pipeline(plan, train_step, state, layers=layers, observers=[Count()])
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

DispatchKind = Literal["gather", "forward", "backward", "zeros", "add", "sum", "update", "transfer"]


@dataclass(frozen=True, slots=True)
class Dispatch:
    """One host → device dispatch of a pipeline step.

    Attributes:
      stage: the stage whose devices it goes to.
      kind: ``"gather"`` (an ``fsdp`` stage's parameter shards gathered whole, once a step),
        ``"forward"``, ``"backward"`` (one microbatch's), ``"zeros"`` (the stage's gradient
        accumulators), ``"add"`` (two cotangents of one activation summed), ``"sum"`` (a
        data-parallel stage's replica gradients summed before they move to the parameter's
        owner), ``"update"`` (the stage's optimizer step) or ``"transfer"`` (a value placed on
        the stage's devices).
      microbatch: the microbatch it belongs to; None for per-step work.
      devices: the stage's devices.
      fn: the jitted program called; None for a transfer.
      args: the program's arguments (for a transfer: the value moved). A backward's accumulator
        argument is donated: read it in ``on_dispatch``, not after.
    """

    stage: int
    kind: DispatchKind
    microbatch: int | None
    devices: tuple
    fn: Callable | None
    args: tuple


class PipelineObserver(Protocol):
    """What a pipeline calls on its observers, in the order they were given.

    ``on_dispatch`` runs just before a dispatch is issued, ``on_dispatched`` just after, with what
    it returned (not waited for: block on ``outputs`` to time the work). Work an observer adds in
    ``on_dispatched`` (waited for) falls inside the window of every observer after it.
    """

    def on_step_begin(self, stages: int) -> None: ...

    def on_dispatch(self, dispatch: Dispatch) -> None: ...

    def on_dispatched(self, dispatch: Dispatch, outputs) -> None: ...

    def on_step_end(self) -> None: ...
