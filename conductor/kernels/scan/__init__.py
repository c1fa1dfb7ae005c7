"""The selective scan (Mamba): fused chunked kernels (Pallas and XLA) and the reference.

Example:
    >>> import jax.numpy as jnp
    >>> from conductor.kernels import selective_scan
    >>> dt = v = jnp.ones((1, 64, 8)); b = c = jnp.ones((1, 64, 4)); a = -jnp.ones((8, 4))
    >>> selective_scan(dt, a, v, b, c, implementation="xla_chunked").shape
    (1, 64, 8)
"""

from __future__ import annotations

from dataclasses import dataclass

from conductor.kernels._common import Implementation, check_implementation, interpret_default
from conductor.kernels.scan._pallas import selective_scan_pallas
from conductor.kernels.scan._reference import selective_scan_reference
from conductor.kernels.scan._sharded import (
    scan_carry_bytes,
    scan_state_bytes,
    sequence_sharded_scan,
    sequence_sharded_scan_shard,
)
from conductor.kernels.scan._xla import selective_scan_chunk, selective_scan_xla_chunked


@dataclass(frozen=True, slots=True, kw_only=True)
class ScanBlockSizes:
    """Chunk length L along time (states kept every L steps) and the d_inner block of a Pallas program."""

    chunk: int = 64
    block_d: int = 128


def selective_scan(
    dt,
    a,
    v,
    b,
    c,
    *,
    block_sizes: ScanBlockSizes | None = None,
    implementation: Implementation = "pallas",
    interpret: bool | None = None,
    platform: str | None = None,
):
    """y_t = h_t C_tᵀ with h_t = exp(Δ_t ⊗ A) ⊙ h_{t−1} + v_t ⊗ B_t, h_0 = 0, without (B, T, D, N) tensors.

    Args:
      dt, v: (batch, seq, d_inner); Mamba's Δ and Δ ⊙ x.
      a: (d_inner, d_state); Mamba's A = −exp(A_log).
      b, c: (batch, seq, d_state).
      block_sizes: chunk length (must divide seq) and d_inner block (must divide d_inner).
      implementation: ``"pallas"``, ``"xla_chunked"`` or ``"reference"``.
      interpret: run Pallas in interpret mode; default: on the CPU backend.
      platform: the platform Pallas lowers for (``"tpu"``, ``"cuda"``); default the local backend.
    Returns:
      y: (batch, seq, d_inner), differentiable in every input.
    Raises:
      ValueError: mismatched shapes, a block that does not divide, or an unknown implementation.
    """
    implementation = check_implementation(implementation)
    batch, seq, d = dt.shape
    if v.shape != dt.shape or a.shape[0] != d or b.shape != (batch, seq, a.shape[1]) or c.shape != b.shape:
        raise ValueError(
            f"expected dt, v (B,T,D), a (D,N), b, c (B,T,N); got {dt.shape}, {a.shape}, {v.shape}, {b.shape}, {c.shape}"
        )
    if implementation == "reference":
        return selective_scan_reference(dt, a, v, b, c)
    sizes = block_sizes or ScanBlockSizes()
    chunk, block_d = min(sizes.chunk, seq), min(sizes.block_d, d)
    if seq % chunk or d % block_d:
        raise ValueError(f"chunk {chunk} must divide seq {seq} and block_d {block_d} must divide d_inner {d}")
    if implementation == "xla_chunked":
        return selective_scan_xla_chunked(dt, a, v, b, c, chunk=chunk)
    return selective_scan_pallas(
        dt, a, v, b, c, chunk=chunk, block_d=block_d, interpret=interpret_default(interpret), platform=platform
    )


__all__ = [
    "ScanBlockSizes",
    "scan_carry_bytes",
    "scan_state_bytes",
    "selective_scan",
    "selective_scan_chunk",
    "selective_scan_reference",
    "sequence_sharded_scan",
    "sequence_sharded_scan_shard",
]
