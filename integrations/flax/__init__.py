"""JAX/Flax integration: capture a training step into Orchestrator's op-graph."""

from integrations.flax._capture import CaptureWarning, capture, is_param_path, parse_name_stack
from integrations.flax._xla import xla_flops

__all__ = ["CaptureWarning", "capture", "is_param_path", "parse_name_stack", "xla_flops"]
