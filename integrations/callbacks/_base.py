"""The callback protocol: four hooks with the names Keras and Lightning users know."""

from __future__ import annotations

from collections.abc import Iterable, Mapping


class Callback:
    """Base class: override any of the hooks; each does nothing by default.

    A plain Python loop calls them itself::

        callbacks = CallbackList([StepTimer(predicted_s=plan.iteration_s)])
        callbacks.on_train_begin(state=state, plan=plan)
        for step, batch in enumerate(batches):
            callbacks.on_step_begin(step)
            state, metrics = train_step(state, batch)
            callbacks.on_step_end(step, metrics, state=state)
        callbacks.on_train_end(state=state)
    """

    def on_train_begin(self, *, state=None, plan=None) -> None:
        """Before the first step; ``plan`` is the executed :class:`~orchestrator.planner.Plan` if any."""

    def on_step_begin(self, step: int) -> None:
        """Before step ``step`` (0-based) is dispatched."""

    def on_step_end(self, step: int, metrics: Mapping, *, state=None) -> None:
        """After step ``step``; ``metrics`` as the train step returned them (jax arrays)."""

    def on_train_end(self, *, state=None) -> None:
        """After the last step."""


class CallbackList(Callback):
    """Calls every hook of ``callbacks`` in order."""

    def __init__(self, callbacks: Iterable[Callback] = ()):
        self.callbacks = list(callbacks)

    def on_train_begin(self, *, state=None, plan=None) -> None:
        for callback in self.callbacks:
            callback.on_train_begin(state=state, plan=plan)

    def on_step_begin(self, step: int) -> None:
        for callback in self.callbacks:
            callback.on_step_begin(step)

    def on_step_end(self, step: int, metrics: Mapping, *, state=None) -> None:
        for callback in self.callbacks:
            callback.on_step_end(step, metrics, state=state)

    def on_train_end(self, *, state=None) -> None:
        for callback in self.callbacks:
            callback.on_train_end(state=state)
