"""Training-loop callbacks for orchestrated steps: timing against the plan, plan reports, checkpoints, re-planning.

One protocol for both frameworks: JAX loops (``integrations.flax``) and torch
loops (:func:`integrations.torch_xla.fit`) call the same hooks.

>>> from integrations.callbacks import Callback, StepTimer
>>> timer = StepTimer(predicted_s=0.01)
>>> isinstance(timer, Callback)
True
"""

from integrations.callbacks._base import Callback, CallbackList
from integrations.callbacks._checkpoint import Checkpointer, CheckpointStore, OrbaxStore
from integrations.callbacks._replanner import Decision, Replanner
from integrations.callbacks._report import PlanReporter
from integrations.callbacks._timer import StepTimeDrift, StepTimer

__all__ = [
    "Callback",
    "CallbackList",
    "CheckpointStore",
    "Checkpointer",
    "Decision",
    "OrbaxStore",
    "PlanReporter",
    "Replanner",
    "StepTimeDrift",
    "StepTimer",
]
