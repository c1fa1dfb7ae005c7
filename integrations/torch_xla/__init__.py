"""PyTorch/XLA integration: capture torch models into the op-graph and run plans with torch_xla SPMD.

Importing this package imports torch; ``torch_xla`` itself is imported only
when a plan is applied or a checkpoint written, so capture works without it.
Training loops use the callbacks of :mod:`integrations.callbacks` (re-exported
here: ``Callback``, ``StepTimer``, ``Checkpointer``), with
:class:`SPMDCheckpointStore` as the checkpointer's torch store.
"""

from integrations.callbacks import Callback, Checkpointer, StepTimer
from integrations.torch_xla._apply import Layout, PlanNotSupported, apply, partition_spec
from integrations.torch_xla._callbacks import fit
from integrations.torch_xla._capture import CaptureWarning, capture, scope_path
from integrations.torch_xla._checkpoint import SPMDCheckpointStore

__all__ = [
    "Callback",
    "CaptureWarning",
    "Checkpointer",
    "Layout",
    "PlanNotSupported",
    "SPMDCheckpointStore",
    "StepTimer",
    "apply",
    "capture",
    "fit",
    "partition_spec",
    "scope_path",
]
