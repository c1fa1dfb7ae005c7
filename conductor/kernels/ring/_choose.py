"""Ring or all-gather: the bytes each form moves, the memory it holds, and which one is cheaper.

Per device, with a K/V block of b_kv = 2·B·(T/n)·H_kv·D·s bytes (s bytes per element) and a
dK/dV block of b_g = 2·B·(T/n)·H_kv·D·4 bytes (fp32 accumulators):

    ring:        forward (n−1)·b_kv, backward (n−1)·b_kv + n·b_g, as 2n − 1 single-block sends
    all-gather:  forward (n−1)·b_kv, backward (n−1)·b_kv (the dK/dV reduce-scatter), two collectives

A step's compute, forward and backward together (the backward does 2.5× the forward's FLOPs), is
c = 3.5 · 4·B·H·(T/n)²·D·f / F seconds (f = ½ causal and balanced, 1 otherwise) on a device of F
FLOP/s; a link costs α + bytes/β. A ring step sends K/V twice and dK/dV once:
t = 2(α + b_kv/β) + α + b_g/β.

    ring time        = n·c + (n−1)·max(0, t − c) + 2n·κ                  (each send hides behind a step)
    all-gather time  = n·c + max(0, (n−1)·(2α + 2·b_kv/β) − c)           (hides behind the local step only)
    extra memory     ring 2·b_kv (the block in use and the one arriving), all-gather (n−1)·b_kv

κ is the fixed cost of one ring step (a kernel launch and the send/receive handshake). The ring
is never slower on bandwidth alone; the all-gather wins where blocks are small — short
sequences, few K/V heads (GQA) — and the ring's n·κ of per-step overhead exceeds the exposed
transfer. The choice is the all-gather when its time is lower and its gathered K/V fits
``memory_budget_bytes``; the ring otherwise. Forward and backward are priced together.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Form = Literal["ring", "all_gather"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ContextParallelCost:
    """One form's price for a forward and backward of attention with context parallelism."""

    form: Form
    time_s: float
    bytes_sent: int  # per device, forward + backward
    extra_memory_bytes: int  # K/V held beyond the local slice


@dataclass(frozen=True, slots=True, kw_only=True)
class ContextParallelChoice:
    """Both forms' prices and the form chosen, with why."""

    form: Form
    ring: ContextParallelCost
    all_gather: ContextParallelCost
    reason: str


def block_bytes(batch: int, seq_len: int, n: int, kv_heads: int, head_dim: int, itemsize: int) -> int:
    """Bytes of one device's K and V slices together: 2·B·(T/n)·H_kv·D·s."""
    return 2 * batch * (seq_len // n) * kv_heads * head_dim * itemsize


def ring_permute_bytes(
    batch: int, seq_len: int, n: int, kv_heads: int, head_dim: int, itemsize: int, *, backward: bool
) -> int:
    """Bytes a device sends through ``collective-permute`` in ring attention (forward, or forward + backward)."""
    kv = block_bytes(batch, seq_len, n, kv_heads, head_dim, itemsize)
    forward = (n - 1) * kv
    if not backward:
        return forward
    return 2 * forward + n * block_bytes(batch, seq_len, n, kv_heads, head_dim, 4)


def choose_context_parallel(
    *,
    batch: int,
    seq_len: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    n: int,
    causal: bool,
    itemsize: int,
    flops_per_s: float,
    bandwidth_bytes_per_s: float,
    latency_s: float,
    step_overhead_s: float = 10e-6,
    memory_budget_bytes: float = float("inf"),
) -> ContextParallelChoice:
    """Prices ring and all-gather attention over ``n`` devices and picks one (formulas in the module docstring).

    Example:
        >>> c = choose_context_parallel(batch=1, seq_len=131072, heads=32, kv_heads=8, head_dim=128, n=8,
        ...     causal=True, itemsize=2, flops_per_s=4e14, bandwidth_bytes_per_s=2.5e10, latency_s=5e-6)
        >>> c.form
        'ring'
    """
    if n < 2:
        raise ValueError(f"context parallelism needs n >= 2 devices; got {n}")
    kv = block_bytes(batch, seq_len, n, kv_heads, head_dim, itemsize)
    grads = block_bytes(batch, seq_len, n, kv_heads, head_dim, 4)
    work = 4 * batch * heads * (seq_len // n) ** 2 * head_dim * (0.5 if causal else 1.0)
    # forward + backward: the backward does 2.5× the forward's FLOPs and sends K/V again plus dK/dV
    compute = 3.5 * work / flops_per_s
    send = 2 * (latency_s + kv / bandwidth_bytes_per_s) + latency_s + grads / bandwidth_bytes_per_s
    ring_time = n * compute + (n - 1) * max(0.0, send - compute) + 2 * n * step_overhead_s
    gather = (n - 1) * (2 * latency_s + (kv + kv) / bandwidth_bytes_per_s)
    gather_time = n * compute + max(0.0, gather - compute)
    ring = ContextParallelCost(
        form="ring",
        time_s=ring_time,
        bytes_sent=ring_permute_bytes(batch, seq_len, n, kv_heads, head_dim, itemsize, backward=True),
        extra_memory_bytes=2 * kv,
    )
    all_gather = ContextParallelCost(
        form="all_gather", time_s=gather_time, bytes_sent=2 * (n - 1) * kv, extra_memory_bytes=(n - 1) * kv
    )
    if all_gather.extra_memory_bytes > memory_budget_bytes:
        return ContextParallelChoice(
            form="ring",
            ring=ring,
            all_gather=all_gather,
            reason=f"the gathered K/V ({all_gather.extra_memory_bytes} B) exceeds the budget ({memory_budget_bytes:.0f} B)",
        )
    if gather_time < ring_time:
        reason = (
            f"all-gather {gather_time:.3g} s < ring {ring_time:.3g} s: the ring's per-step overhead exceeds its overlap"
        )
        return ContextParallelChoice(form="all_gather", ring=ring, all_gather=all_gather, reason=reason)
    reason = f"ring {ring_time:.3g} s <= all-gather {gather_time:.3g} s: each transfer hides behind a block's compute"
    return ContextParallelChoice(form="ring", ring=ring, all_gather=all_gather, reason=reason)
