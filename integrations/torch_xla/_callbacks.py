"""``fit``: a torch training loop driving :mod:`integrations.callbacks`, the callbacks both frameworks share.

A loop (:func:`fit`, or your own) calls ``on_train_begin(plan=...)``, then
per step ``on_step_begin(step)`` and ``on_step_end(step, metrics)``, then
``on_train_end()``: the hooks of :class:`integrations.callbacks.Callback`,
with no ``state=`` (a torch module and optimizer change in place; a
checkpoint store holds them, :class:`~integrations.torch_xla.SPMDCheckpointStore`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

from integrations.callbacks import Callback, CallbackList


def fit(
    step: Callable[..., object],
    batches: Iterable[Sequence],
    callbacks: Sequence[Callback] = (),
) -> list[dict[str, float]]:
    """Run ``step(*batch)`` over ``batches`` with the callbacks; returns each step's metrics.

    ``step`` returns the loss (a 0-d tensor or a float) or a dict of metrics;
    they are read to the host (``float``) before ``on_step_end``, so a step's
    time includes the device work it launched. A step built by
    :func:`~integrations.torch_xla.apply` carries its plan, which
    ``on_train_begin`` receives (a :class:`~integrations.callbacks.StepTimer`
    then compares against ``plan.iteration_s``).
    """
    hooks = CallbackList(callbacks)
    history: list[dict[str, float]] = []
    hooks.on_train_begin(plan=getattr(step, "plan", None))
    for index, batch in enumerate(batches):
        hooks.on_step_begin(index)
        out = step(*batch)
        metrics = {k: float(v) for k, v in out.items()} if isinstance(out, Mapping) else {"loss": float(out)}
        history.append(metrics)
        hooks.on_step_end(index, metrics)
    hooks.on_train_end()
    return history
