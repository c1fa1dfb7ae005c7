"""Kernels the conductor rewrites into: flash attention and a chunked selective scan.

Each has a pure-JAX reference beside it and an ``implementation=`` switch:
``"pallas"`` (the kernel; interpreted on CPU), ``"xla_chunked"`` (the same
blocking in plain XLA, compiled everywhere) and ``"reference"``.
"""

from conductor.kernels._common import GPU_SHARED_MEMORY_BYTES, IMPLEMENTATIONS, Implementation, divisible_block
from conductor.kernels.attention import AttentionBlockSizes, attention, attention_reference
from conductor.kernels.scan import ScanBlockSizes, selective_scan, selective_scan_chunk, selective_scan_reference

__all__ = [
    "GPU_SHARED_MEMORY_BYTES",
    "IMPLEMENTATIONS",
    "AttentionBlockSizes",
    "Implementation",
    "ScanBlockSizes",
    "attention",
    "attention_reference",
    "divisible_block",
    "selective_scan",
    "selective_scan_chunk",
    "selective_scan_reference",
]
