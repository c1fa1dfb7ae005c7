"""Attention: flash attention (Pallas and XLA) and its reference.

Example:
    >>> import jax.numpy as jnp
    >>> from conductor.kernels import attention
    >>> q = k = v = jnp.ones((1, 256, 2, 64))
    >>> attention(q, k, v, causal=True, implementation="xla_chunked").shape
    (1, 256, 2, 64)
    >>> attention(q, k, v, causal=True, window=64, implementation="xla_chunked").shape  # sliding window
    (1, 256, 2, 64)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import jax.numpy as jnp

from conductor.kernels._common import (
    GPU_SHARED_MEMORY_BYTES,
    Implementation,
    check_implementation,
    interpret_default,
    on_gpu,
)
from conductor.kernels.attention._mask import Band, band
from conductor.kernels.attention._pallas import attention_pallas
from conductor.kernels.attention._pallas import backward_rows as pallas_backward_rows
from conductor.kernels.attention._pallas import forward as pallas_forward
from conductor.kernels.attention._reference import attention_reference
from conductor.kernels.attention._xla import attention_xla_chunked
from conductor.kernels.attention._xla import backward_rows as xla_backward_rows
from conductor.kernels.attention._xla import forward as xla_forward


@dataclass(frozen=True, slots=True, kw_only=True)
class AttentionBlockSizes:
    """Query and key block lengths of the flash kernels (the decision model picks them)."""

    block_q: int = 128
    block_k: int = 128


def attention_tile_bytes(block: int, head_dim: int) -> int:
    """On-chip bytes of one flash step's fp32 tiles at square blocks: Q, K, V and the accumulator
    (block × head_dim each) and the block × block scores. A block fits a device whose on-chip memory
    holds twice this (the other half double-buffers the next K and V tiles)."""
    return (4 * block * head_dim + block * block) * 4


def default_block_sizes(head_dim: int, platform: str | None = None) -> AttentionBlockSizes:
    """The blocks used when none are given: 128 × 128, and on a GPU the largest power of two ≤ 128
    whose tiles (:func:`attention_tile_bytes`), double-buffered, fit one SM's shared memory: the
    decision model's rule for a GPU (``conductor.decide``). A float32 kernel at
    head_dim 64 with 128 × 128 blocks asks Triton for 257 KiB, more than an H100's SM holds; at
    64 × 64 it runs, and at bfloat16 it is also faster there than 128 × 128
    (``orchestrator/bench/data/h100_conductor_times.json``)."""
    if not on_gpu(platform):
        return AttentionBlockSizes()
    block = 128
    while block > 16 and 2 * attention_tile_bytes(block, head_dim) > GPU_SHARED_MEMORY_BYTES:
        block //= 2
    return AttentionBlockSizes(block_q=block, block_k=block)


def attention(
    q,
    k,
    v,
    *,
    causal: bool = False,
    scale: float | None = None,
    block_sizes: AttentionBlockSizes | None = None,
    implementation: Implementation = "pallas",
    interpret: bool | None = None,
    platform: str | None = None,
    window: int | tuple[int, int] | None = None,
    prefix: int = 0,
):
    """softmax(scale · Q Kᵀ [+ causal, window, prefix mask]) V without materialising the scores.

    Query i keeps key j iff j is in its band (``causal``: j ≤ i; ``window``) or j < ``prefix``.
    Key blocks the mask removes whole are skipped, forward and backward.

    Args:
      q: (batch, seq_q, heads, head_dim).
      k, v: (batch, seq_k, kv_heads, head_dim); ``heads`` must divide by ``kv_heads`` (GQA/MQA).
      causal: mask key j > query i (needs seq_q == seq_k, as do ``window`` and ``prefix``).
      window: sliding window. An int w keeps the w most recent keys (i − w < j ≤ i) when
        ``causal``, the band |i − j| < w otherwise; a pair (left, right) of ints ≥ 0 keeps
        i − left ≤ j ≤ i + right (``causal`` caps right at 0).
      prefix: keys j < prefix are kept for every query (prefix-LM with ``causal``: bidirectional
        over the prefix, causal after it).
      scale: score multiplier; default 1/√head_dim.
      block_sizes: block lengths; each must divide its sequence length.
      implementation: ``"pallas"``, ``"xla_chunked"`` or ``"reference"``.
      interpret: run Pallas in interpret mode; default: on the CPU backend.
      platform: the platform Pallas lowers for (``"tpu"``, ``"cuda"``); default the local backend.
        Set it when exporting for another platform (``jax.export(..., platforms=[...])``).
    Returns:
      (batch, seq_q, heads, head_dim), differentiable (custom VJP keeping only the log-sum-exp).
    Raises:
      ValueError: bad head counts, a block that does not divide its sequence, an unknown
        implementation, or a bad window or prefix.
    """
    implementation = check_implementation(implementation)
    if q.ndim != 4 or k.shape != v.shape[:-1] + k.shape[-1:] or k.ndim != 4:
        raise ValueError(f"expected q (B,T,H,D) and k, v (B,S,Hkv,D); got {q.shape}, {k.shape}, {v.shape}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads {q.shape[2]} must be a multiple of kv heads {k.shape[2]}")
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError(f"causal attention needs seq_q == seq_k; got {q.shape[1]} and {k.shape[1]}")
    band(causal=causal, window=window, prefix=prefix, seq_q=q.shape[1], seq_k=k.shape[1])  # checks them
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    masks = dict(causal=causal, window=window, prefix=prefix)
    if implementation == "reference":
        return attention_reference(q, k, v, scale=scale, **masks)
    sizes = block_sizes or default_block_sizes(q.shape[-1], platform)
    bq, bk = min(sizes.block_q, q.shape[1]), min(sizes.block_k, k.shape[1])
    if q.shape[1] % bq or k.shape[1] % bk:
        raise ValueError(f"block sizes ({bq}, {bk}) must divide the sequence lengths ({q.shape[1]}, {k.shape[1]})")
    blocked = dict(scale=scale, block_q=bq, block_k=bk, **masks)
    if implementation == "xla_chunked":
        return attention_xla_chunked(q, k, v, **blocked)
    return attention_pallas(q, k, v, **blocked, interpret=interpret_default(interpret), platform=platform)


Blockwise = Literal["pallas", "xla_chunked"]


def _blockwise(implementation: str, q, k, block_sizes, platform) -> tuple[int, int]:
    """(block_q, block_k) for heads-major q and k, each at most its sequence."""
    if implementation not in ("pallas", "xla_chunked"):
        raise ValueError(f"implementation={implementation!r}; choose pallas or xla_chunked")
    sizes = block_sizes or default_block_sizes(q.shape[-1], platform)
    return min(sizes.block_q, q.shape[2]), min(sizes.block_k, k.shape[2])


def flash_forward(
    q,
    k,
    v,
    *,
    causal: bool,
    scale: float,
    block_sizes: AttentionBlockSizes | None = None,
    implementation: Blockwise = "xla_chunked",
    interpret: bool | None = None,
    platform: str | None = None,
):
    """One flash forward that also returns its log-sum-exp: the piece attention across devices
    composes (two partial results merge as L = log(e^{L₁} + e^{L₂}), O = e^{L₁−L} O₁ + e^{L₂−L} O₂).

    Heads-major layout, so a grouped (B, Hkv, G, T, D) query reshapes to it for free.

    Args:
      q: (batch, heads, seq_q, head_dim); k, v: (batch, kv_heads, seq_k, head_dim).
      causal: mask key j > query i (seq_q == seq_k).
      block_sizes: tile lengths; each must divide its sequence length.
      implementation: ``"xla_chunked"`` or ``"pallas"`` (``interpret`` and ``platform`` as in
        :func:`attention`).
    Returns:
      (O, L): O (batch, heads, seq_q, head_dim_v) and L (batch, heads, seq_q), both fp32.
    """
    bq, bk = _blockwise(implementation, q, k, block_sizes, platform)
    if implementation == "pallas":
        o, lse = pallas_forward(
            q, k, v, causal, scale, bq, bk, interpret_default(interpret), platform, o_dtype=jnp.float32
        )
        return o, lse[:, :, 0]
    b, h, t, d = q.shape
    hkv = k.shape[1]
    o, lse = xla_forward(q.reshape(b, hkv, h // hkv, t, d), k, v, causal, scale, bq, bk, out_dtype=jnp.float32)
    return o.reshape(b, h, t, v.shape[-1]), lse.reshape(b, h, t)


def flash_backward(
    q,
    k,
    v,
    do,
    lse,
    delta,
    *,
    causal: bool,
    scale: float,
    block_sizes: AttentionBlockSizes | None = None,
    implementation: Blockwise = "xla_chunked",
    interpret: bool | None = None,
    platform: str | None = None,
):
    """(dQ, dK, dV) in fp32 of one flash block pair, given the log-sum-exp ``lse`` and
    ``delta`` = rowsum(dO ⊙ O) (batch, heads, seq_q) of the *finished* output, so each pair's
    p = e^{s − L} is already normalised over every key block the output saw. Layout and the
    other arguments as :func:`flash_forward`; dK and dV come back per kv head."""
    bq, bk = _blockwise(implementation, q, k, block_sizes, platform)
    if implementation == "pallas":
        rows = lse[:, :, None], delta[:, :, None]
        return pallas_backward_rows(
            q, k, v, do, *rows, causal, scale, bq, bk, interpret_default(interpret), platform, grad_dtype=jnp.float32
        )
    b, h, t, d = q.shape
    hkv = k.shape[1]
    grouped = (b, hkv, h // hkv, t)
    dq, dk, dv = xla_backward_rows(
        q.reshape(*grouped, d),
        k,
        v,
        do.reshape(*grouped, do.shape[-1]),
        lse.reshape(grouped),
        delta.reshape(grouped),
        causal,
        scale,
        bq,
        bk,
        grad_dtype=jnp.float32,
    )
    return dq.reshape(q.shape), dk, dv


__all__ = [
    "AttentionBlockSizes",
    "Band",
    "Blockwise",
    "attention",
    "attention_reference",
    "attention_tile_bytes",
    "default_block_sizes",
    "flash_backward",
    "flash_forward",
]
