"""Callbacks for torch training loops, with the hook names the JAX side uses.

A loop (:func:`fit`, or your own) calls ``on_train_begin()``, then per step
``on_step_begin(step)`` and ``on_step_end(step, metrics)``, then
``on_train_end()``. :class:`StepTimer` measures wall time per step; the
checkpointer lives in ``_checkpoint``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence


class Callback:
    """Base class: override the hooks you need; each does nothing by default."""

    def on_train_begin(self) -> None:
        pass

    def on_step_begin(self, step: int) -> None:
        pass

    def on_step_end(self, step: int, metrics: Mapping[str, float]) -> None:
        pass

    def on_train_end(self) -> None:
        pass


class StepTimer(Callback):
    """Wall-clock seconds of every step, from ``on_step_begin`` to ``on_step_end``.

    The step function of :func:`~integrations.torch_xla.apply` ends in
    ``torch_xla.sync()``; :func:`fit` reads the loss with ``.item()`` before
    ``on_step_end``, so a step's time includes the device work it launched.

    Attributes:
      times_s: seconds per step, in order.
    """

    def __init__(self):
        self.times_s: list[float] = []
        self._start = 0.0

    def on_step_begin(self, step: int) -> None:
        self._start = time.perf_counter()

    def on_step_end(self, step: int, metrics: Mapping[str, float]) -> None:
        self.times_s.append(time.perf_counter() - self._start)

    def median_s(self, skip: int = 1) -> float:
        """Median step time, leaving out the first ``skip`` steps (compilation)."""
        times = self.times_s[skip:] or self.times_s
        if not times:
            raise ValueError("StepTimer has timed no step yet")
        return statistics.median(times)


def fit(
    step: Callable[..., object],
    batches: Iterable[Sequence],
    callbacks: Sequence[Callback] = (),
) -> list[dict[str, float]]:
    """Run ``step(*batch)`` over ``batches`` with the callbacks; returns each step's metrics.

    ``step`` returns the loss (a 0-d tensor or a float) or a dict of metrics.
    """
    history: list[dict[str, float]] = []
    for callback in callbacks:
        callback.on_train_begin()
    for index, batch in enumerate(batches):
        for callback in callbacks:
            callback.on_step_begin(index)
        out = step(*batch)
        metrics = {k: float(v) for k, v in out.items()} if isinstance(out, Mapping) else {"loss": float(out)}
        history.append(metrics)
        for callback in callbacks:
            callback.on_step_end(index, metrics)
    for callback in callbacks:
        callback.on_train_end()
    return history
