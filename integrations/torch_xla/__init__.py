"""PyTorch/XLA integration: capture torch models into the op-graph and run plans with torch_xla SPMD.

Importing this package imports torch; ``torch_xla`` itself is imported only
when a plan is applied or a checkpoint written, so capture works without it.
"""

from integrations.torch_xla._apply import DEFAULT_TP_AXES, Layout, PlanNotSupported, apply, partition_spec
from integrations.torch_xla._callbacks import Callback, StepTimer, fit
from integrations.torch_xla._capture import CaptureWarning, capture, scope_path
from integrations.torch_xla._checkpoint import Checkpointer

__all__ = [
    "DEFAULT_TP_AXES",
    "Callback",
    "CaptureWarning",
    "Checkpointer",
    "Layout",
    "PlanNotSupported",
    "StepTimer",
    "apply",
    "capture",
    "fit",
    "partition_spec",
    "scope_path",
]
