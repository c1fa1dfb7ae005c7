"""PyTorch/XLA integration: capture torch models into the op-graph and run plans with torch_xla SPMD.

Importing this package imports torch; ``torch_xla`` itself is imported only
when a plan is applied or a checkpoint written, so capture works without it.
"""

from integrations.torch_xla._apply import Layout, PlanNotSupported, apply, partition_spec
from integrations.torch_xla._capture import CaptureWarning, capture, scope_path

__all__ = ["CaptureWarning", "Layout", "PlanNotSupported", "apply", "capture", "partition_spec", "scope_path"]
