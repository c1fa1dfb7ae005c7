"""``StepTimer``: measured step time against the plan's prediction."""

from __future__ import annotations

import statistics
import sys
import time
import warnings
from collections.abc import Mapping

from integrations.callbacks._base import Callback


class StepTimeDrift(UserWarning):
    """The median measured step time left the tolerance band around the prediction."""


class StepTimer(Callback):
    """Times each step (wall clock, until its metrics are ready) and compares with the prediction.

    One timer for both frameworks: jax metrics are waited for
    (``jax.block_until_ready``); torch loops hand over metrics already read to
    the host (:func:`~integrations.torch_xla.fit` calls ``float`` on them).

    The first ``warmup`` steps (compilation) are not counted. After every step
    past the warm-up, if the median of the last ``window`` steps differs from
    ``predicted_s`` by more than ``tolerance`` (relative), a
    :class:`StepTimeDrift` warning is issued (once until the median returns).

    Args:
      predicted_s: predicted step time; if None, taken from the plan's ``iteration_s`` at ``on_train_begin``.
      tolerance: relative band, e.g. 0.15 for ±15%.
      warmup, window: steps skipped, and steps in the running median.

    Attributes:
      times_s: measured step times after warm-up.
    """

    def __init__(self, predicted_s: float | None = None, *, tolerance: float = 0.15, warmup: int = 1, window: int = 5):
        self.predicted_s, self.tolerance, self.warmup, self.window = predicted_s, tolerance, warmup, window
        self.times_s: list[float] = []
        self._start = 0.0
        self._drifting = False

    def on_train_begin(self, *, state=None, plan=None) -> None:
        if self.predicted_s is None and plan is not None:
            self.predicted_s = plan.iteration_s

    def on_step_begin(self, step: int) -> None:
        self._start = time.perf_counter()

    def on_step_end(self, step: int, metrics: Mapping, *, state=None) -> None:
        jax = sys.modules.get("jax")  # jax metrics exist only once jax is imported
        if jax is not None:
            jax.block_until_ready(metrics)
        elapsed = time.perf_counter() - self._start
        if step < self.warmup:
            return
        self.times_s.append(elapsed)
        ratio = self.ratio
        if ratio is None:
            return
        drifting = abs(ratio - 1) > self.tolerance
        if drifting and not self._drifting:
            warnings.warn(
                f"step {step}: median step time {self.median_s * 1e3:.2f} ms is {ratio:.2f}× the predicted "
                f"{self.predicted_s * 1e3:.2f} ms (tolerance ±{self.tolerance:.0%})",
                StepTimeDrift,
                stacklevel=2,
            )
        self._drifting = drifting

    @property
    def median_s(self) -> float | None:
        """Median of the last ``window`` measured steps (None before any)."""
        return statistics.median(self.times_s[-self.window :]) if self.times_s else None

    @property
    def ratio(self) -> float | None:
        """Measured median / predicted (None without both)."""
        if self.median_s is None or not self.predicted_s:
            return None
        return self.median_s / self.predicted_s
