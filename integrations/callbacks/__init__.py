"""Training-loop callbacks for orchestrated steps: timing against the plan, plan reports, checkpoints, re-planning.

>>> from integrations.callbacks import Callback, StepTimer
>>> timer = StepTimer(predicted_s=0.01)
>>> isinstance(timer, Callback)
True
"""

from integrations.callbacks._base import Callback, CallbackList
from integrations.callbacks._checkpoint import Checkpointer
from integrations.callbacks._replanner import Decision, Replanner
from integrations.callbacks._report import PlanReporter, schedule_trace
from integrations.callbacks._timer import StepTimeDrift, StepTimer

__all__ = [
    "Callback",
    "CallbackList",
    "Checkpointer",
    "Decision",
    "PlanReporter",
    "Replanner",
    "StepTimeDrift",
    "StepTimer",
    "schedule_trace",
]
