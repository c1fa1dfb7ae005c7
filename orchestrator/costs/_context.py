"""Context parallelism: what ring and all-gather attention over n devices move, hold, and expose.

The sequence of T tokens is split n ways (the zigzag layout balances a causal mask, so every
device does 1/n of the attention's work). Per device, with a K/V block of
b_kv = 2·B·(T/n)·H_kv·D·s bytes (s bytes per element) and a dK/dV block of b_g, the same
elements in fp32 (the backward's accumulators):

    ring:        forward (n−1)·b_kv, backward (n−1)·b_kv + n·b_g, as 2n − 1 single-block sends
    all-gather:  forward (n−1)·b_kv, backward (n−1)·b_kv (the dK/dV reduce-scatter), two collectives

Each ring step computes one (query block, K/V block) pair while the next block travels, so a
step exposes only the part of its send its computation does not hide. With c_f and c_b the
forward and backward seconds of one block step (1/n of the device's attention), a link of
latency α and bandwidth β, and κ the fixed cost of one ring step (a kernel launch and the
send/receive handshake):

    ring exposed        = (n−1)·[max(0, α + b_kv/β − c_f) + max(0, 2α + (b_kv + b_g)/β − c_b)] + 2n·κ
    all-gather exposed  = max(0, (n−1)·(α + b_kv/β) − c_f) + max(0, (n−1)·(α + b_kv/β) − c_b)
                          (each collective hides behind the local block only)
    extra memory        ring 2·b_kv (the block in use and the one arriving), all-gather (n−1)·b_kv

The ring is never slower on bandwidth alone; the all-gather wins where blocks are small (short
sequences, few K/V heads under GQA) and the ring's per-step overhead exceeds the exposed
transfer. :func:`context_parallel_cost` chooses the all-gather when it exposes less and its
gathered K/V fits the memory budget, the ring otherwise. The cost model prices attention
layers with it (``CostModel.layer_cost`` under ``ParallelConfig.context_parallel``); the
conductor's ring kernels take the chosen ``form`` as an argument.

Each block step runs the blockwise (flash) kernels: per (query block, key block) tile they compute,
4·D FLOPs and one exponential per (query, key) pair, and Q, K, V and O pass through memory once; the
scores never leave the chip. Under a causal mask a tile above the diagonal is skipped and one on it
computed whole, so of the T²/n pairs a device would compute unmasked, it runs the fraction f of
:func:`ring_tile_fraction` (the zigzag ring's tiles at 128 × 128 blocks, the kernels' default: just
over ½, the same on every device; 1 unmasked). Per device:

    forward   c_F = f·F/(P·e_attention) + f·X/(P·e_transcendental) + (Q + K + V + O bytes)/(W·e_memory)
    backward  2.5·c_F (the kernels recompute the scores);    one block step c_f = c_F/n, c_b = 2.5·c_f

with F and X the unmasked attention's matmul FLOPs and exponentials on the device's share, P its
peak FLOP/s and W its memory bandwidth (:func:`blockwise_attention_s`). e_attention is the fused
attention kernels' efficiency (``Efficiency.attention``, matmul's where unmeasured), the one the
cost model prices a fused attention kernel with elsewhere: the block steps are those kernels. :func:`square_ops` finds
the captured ops this replaces (the T × T scores' forward and backward work and the mask built for
them) and :func:`masked_by_position` whether the mask is causal; :func:`choose_context_parallel`
prices a layer given by shapes and a device's FLOP/s.

A selective scan (Mamba) over a sequence split contiguously n ways passes its carry instead of
K/V: each device's final state and total Δ, s = B·D·(N + 1)·4 bytes (fp32), in one all-gather
forward and its transpose, a reduce-scatter, backward (``conductor.kernels.scan``'s
sequence-sharded scan). Each sends (n − 1)·s, and the scan's outputs wait for the carry, so
nothing hides it:

    scan exposed  = 2·(n−1)·(α + s/β)          extra memory  n·s (the gathered states)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Literal

from orchestrator.cluster import DeviceType, Link
from orchestrator.costs._collectives import all_gather_s, reduce_scatter_s
from orchestrator.costs._recompute import AttentionCore
from orchestrator.costs._roofline import Efficiency, compute_dtype
from orchestrator.graph import OpGraph

Form = Literal["ring", "all_gather"]
BACKWARD_RATIO = 2.5  # a blockwise attention backward's FLOPs over its forward's (it recomputes the scores)
STEP_OVERHEAD_S = 10e-6  # κ: a ring step's launch and send/receive handshake
# the ring kernels' query and key block length (conductor.kernels.AttentionBlockSizes' default, which the
# cost model may not import; a test holds the two equal)
RING_BLOCK = 128


@dataclass(frozen=True, slots=True, kw_only=True)
class ContextParallelCost:
    """One form's price for a forward and backward of attention with context parallelism, per device.

    Attributes:
      form: ``"ring"`` or ``"all_gather"``.
      time_s: compute and exposed communication, forward and backward.
      compute_forward_s, compute_backward_s: the n block steps' computation (n·c_f, n·c_b).
      exposed_forward_s, exposed_backward_s: the communication no block computation hides.
      bytes_sent: forward + backward.
      extra_memory_bytes: K/V held beyond the local slice.
    """

    form: Form
    time_s: float
    compute_forward_s: float
    compute_backward_s: float
    exposed_forward_s: float
    exposed_backward_s: float
    bytes_sent: int
    extra_memory_bytes: int

    @property
    def exposed_s(self) -> float:
        return self.exposed_forward_s + self.exposed_backward_s


@dataclass(frozen=True, slots=True, kw_only=True)
class ContextParallelChoice:
    """Both forms' prices and the form chosen, with why."""

    form: Form
    ring: ContextParallelCost
    all_gather: ContextParallelCost
    reason: str

    @property
    def chosen(self) -> ContextParallelCost:
        return self.ring if self.form == "ring" else self.all_gather


def block_bytes(batch: int, seq_len: int, n: int, kv_heads: int, head_dim: int, itemsize: int) -> int:
    """Bytes of one device's K and V slices together: 2·B·(T/n)·H_kv·D·s."""
    return 2 * batch * (seq_len // n) * kv_heads * head_dim * itemsize


def ring_permute_bytes(
    batch: int, seq_len: int, n: int, kv_heads: int, head_dim: int, itemsize: int, *, backward: bool
) -> int:
    """Bytes a device sends through ``collective-permute`` in ring attention (forward, or forward + backward)."""
    kv = block_bytes(batch, seq_len, n, kv_heads, head_dim, itemsize)
    return _permute_bytes(kv, block_bytes(batch, seq_len, n, kv_heads, head_dim, 4), n, backward=backward)


def _permute_bytes(kv_bytes, grad_bytes, n: int, *, backward: bool):
    """(n−1)·b_kv forward; with the backward another (n−1)·b_kv and n·b_g."""
    forward = (n - 1) * kv_bytes
    return 2 * forward + n * grad_bytes if backward else forward


def context_parallel_cost(
    *,
    n: int,
    kv_bytes: float,
    grad_bytes: float,
    step_forward_s: float,
    step_backward_s: float,
    link: Link,
    step_overhead_s: float = STEP_OVERHEAD_S,
    memory_budget_bytes: float = float("inf"),
) -> ContextParallelChoice:
    """Prices ring and all-gather attention over ``n`` devices and picks one (formulas in the module docstring).

    Args:
      n: the context-parallel degree, at least 2.
      kv_bytes: b_kv, one device's K and V slices; grad_bytes: b_g, their gradients' accumulators.
      step_forward_s, step_backward_s: c_f and c_b, one block step's computation.
      link: the link between ring neighbours.
      step_overhead_s: κ.
      memory_budget_bytes: what the gathered K/V may take; the ring where it does not fit.

    Example:
      >>> from orchestrator.cluster import Link
      >>> c = context_parallel_cost(n=8, kv_bytes=8e6, grad_bytes=16e6, step_forward_s=1e-3,
      ...     step_backward_s=2.5e-3, link=Link(bandwidth_bytes_per_s=2.5e10, latency_s=5e-6))
      >>> c.form, c.ring.exposed_forward_s == 0.0
      ('ring', False)
    """
    if n < 2:
        raise ValueError(f"context parallelism needs n >= 2 devices; got {n}")
    alpha, beta = link.latency_s, link.bandwidth_bytes_per_s
    compute = n * (step_forward_s + step_backward_s)
    send_f = alpha + kv_bytes / beta
    send_b = 2 * alpha + (kv_bytes + grad_bytes) / beta
    ring_f = (n - 1) * max(0.0, send_f - step_forward_s) + n * step_overhead_s
    ring_b = (n - 1) * max(0.0, send_b - step_backward_s) + n * step_overhead_s
    gather = (n - 1) * (alpha + kv_bytes / beta)
    gather_f, gather_b = max(0.0, gather - step_forward_s), max(0.0, gather - step_backward_s)
    steps = dict(compute_forward_s=n * step_forward_s, compute_backward_s=n * step_backward_s)
    ring = ContextParallelCost(
        form="ring",
        time_s=compute + ring_f + ring_b,
        **steps,
        exposed_forward_s=ring_f,
        exposed_backward_s=ring_b,
        bytes_sent=int(_permute_bytes(kv_bytes, grad_bytes, n, backward=True)),
        extra_memory_bytes=int(2 * kv_bytes),
    )
    all_gather = ContextParallelCost(
        form="all_gather",
        time_s=compute + gather_f + gather_b,
        **steps,
        exposed_forward_s=gather_f,
        exposed_backward_s=gather_b,
        bytes_sent=int(2 * (n - 1) * kv_bytes),
        extra_memory_bytes=int((n - 1) * kv_bytes),
    )
    if all_gather.extra_memory_bytes > memory_budget_bytes:
        reason = (
            f"the gathered K/V ({all_gather.extra_memory_bytes} B) exceeds the budget ({memory_budget_bytes:.0f} B)"
        )
        return ContextParallelChoice(form="ring", ring=ring, all_gather=all_gather, reason=reason)
    if all_gather.time_s < ring.time_s:
        reason = (
            f"all-gather {all_gather.time_s:.3g} s < ring {ring.time_s:.3g} s: "
            "the ring's per-step overhead exceeds its overlap"
        )
        return ContextParallelChoice(form="all_gather", ring=ring, all_gather=all_gather, reason=reason)
    reason = f"ring {ring.time_s:.3g} s <= all-gather {all_gather.time_s:.3g} s: each transfer hides behind a block"
    return ContextParallelChoice(form="ring", ring=ring, all_gather=all_gather, reason=reason)


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
    step_overhead_s: float = STEP_OVERHEAD_S,
    memory_budget_bytes: float = float("inf"),
) -> ContextParallelChoice:
    """:func:`context_parallel_cost` of one attention given by its shapes on a device of ``flops_per_s``.

    Example:
        >>> c = choose_context_parallel(batch=1, seq_len=131072, heads=32, kv_heads=8, head_dim=128, n=8,
        ...     causal=True, itemsize=2, flops_per_s=4e14, bandwidth_bytes_per_s=2.5e10, latency_s=5e-6)
        >>> c.form
        'ring'
    """
    if n < 2:
        raise ValueError(f"context parallelism needs n >= 2 devices; got {n}")
    fraction = ring_tile_fraction(seq_len, n, causal=causal)
    step = 4 * batch * heads * (seq_len // n) ** 2 * head_dim * fraction / flops_per_s
    return context_parallel_cost(
        n=n,
        kv_bytes=block_bytes(batch, seq_len, n, kv_heads, head_dim, itemsize),
        grad_bytes=block_bytes(batch, seq_len, n, kv_heads, head_dim, 4),
        step_forward_s=step,
        step_backward_s=BACKWARD_RATIO * step,
        link=Link(bandwidth_bytes_per_s=bandwidth_bytes_per_s, latency_s=latency_s),
        step_overhead_s=step_overhead_s,
        memory_budget_bytes=memory_budget_bytes,
    )


@functools.cache
def ring_tile_fraction(
    seq_len: int, n: int, *, causal: bool, block_q: int = RING_BLOCK, block_k: int = RING_BLOCK
) -> float:
    """Of the T²/n (query, key) pairs a device of a zigzag ring over ``n`` computes unmasked, the share
    its kernels run: the tiles (``block_q`` × ``block_k``) of each (query chunk, key chunk) pair that a
    causal mask keeps whole (key chunk before the query chunk) or in part (the same chunk: the tiles
    on and below the diagonal). 1 without a mask.

    Device r holds chunks r and 2n − 1 − r of the 2n, which have r and 2n − 1 − r chunks before them:
    every device runs 2n − 1 chunk pairs whole and two diagonal ones, so the count is the same on
    every device and takes O(chunk / block) steps however many devices there are.

    The count of ``conductor.kernels.ring.attention_flops_per_device`` (the busiest device's), which
    the cost model may not import; a test holds the two equal.

    Example:
        >>> round(ring_tile_fraction(131072, 16, causal=True), 4)
        0.5005
    """
    length = seq_len // (2 * n)  # the zigzag chunk
    if not causal or length == 0:
        return 1.0
    bq, bk = min(block_q, length), min(block_k, length)
    full = (length // bq) * (length // bk)
    diagonal = sum(min(((i + 1) * bq + bk - 1) // bk, length // bk) for i in range(length // bq))
    tiles = (2 * n - 1) * full + 2 * diagonal
    return tiles * bq * bk / (2 * n * length) ** 2 * n


def blockwise_attention_s(
    *, flops: float, exponentials: float, io_bytes: float, dtype: str, device: DeviceType, efficiency: Efficiency
) -> float:
    """Seconds of a blockwise (flash) attention forward that runs ``flops`` matmul FLOPs and
    ``exponentials`` exponentials on chip and moves ``io_bytes`` (Q, K, V and O) through memory once,
    in ``dtype`` on ``device`` (the roofline terms of ``_roofline``, added; its products at the fused
    attention kernels' efficiency, ``efficiency.of("attention")``)."""
    peaks = device.peak_flops
    peak = peaks.get(dtype) or peaks.get("float32") or max(peaks.values())
    return (
        flops / (peak * efficiency.of("attention"))
        + exponentials / (peak * efficiency.transcendental)
        + io_bytes / (device.memory_bandwidth_bytes_per_s * efficiency.memory)
    )


def masked_by_position(graph: OpGraph, core_ops: Collection[str], constant_ops: Collection[str]) -> bool:
    """Whether a core attention's scores pass a select whose predicate is computed from positions alone
    (``constant_ops``: no batch, no parameter; an iota comparison): a causal or banded mask, whose
    tiles above the diagonal the ring kernels skip. A mask read from the batch (padding) is not."""
    for name in core_ops:
        if graph.op(name).primitive != "select_n":
            continue
        if any(p in constant_ops and graph.op(p).outputs[0].dtype == "bool" for p in graph.nx.predecessors(name)):
            return True
    return False


def ring_attention_work(
    graph: OpGraph,
    core: AttentionCore,
    constant_ops: Collection[str],
    seq_len: int,
    n: int,
    share: Callable[[str], float],
) -> dict:
    """The forward work of a captured ``core`` attention run by the ring's blockwise kernels over ``n``
    devices, per device: the keyword arguments of :func:`blockwise_attention_s`. ``share(op)``: the
    part of captured op ``op`` one device runs (its samples, its tensor-parallel heads). The matmul
    FLOPs (Q·Kᵀ and P·V) and exponentials are those of the tiles the ring runs (:func:`ring_tile_fraction`,
    causal where :func:`masked_by_position`); the bytes are Q and K (Q·Kᵀ's operands), V and O (P·V's
    smaller operand and its output), once."""
    fraction = ring_tile_fraction(seq_len, n, causal=masked_by_position(graph, core.ops, constant_ops))
    ends = [graph.op(name) for name in sorted(core.ends)]
    starts = [graph.op(name) for name in sorted(core.starts)]
    flops = sum(graph.op(name).flops * share(name) for name in core.starts | core.ends)
    exponentials = sum(graph.op(name).transcendentals * share(name) for name in core.ops)
    io = sum(sum(t.nbytes for t in op.inputs) * share(op.name) for op in starts) + sum(
        (min(t.nbytes for t in op.inputs) + op.outputs[0].nbytes) * share(op.name) for op in ends
    )
    return {
        "flops": flops * fraction,
        "exponentials": exponentials * fraction,
        "io_bytes": io,
        "dtype": compute_dtype(starts[0]),
    }


def square_ops(
    graph: OpGraph, ops: Iterable[str], core: AttentionCore, constant_ops: Collection[str]
) -> tuple[frozenset[str], frozenset[str]]:
    """(forward, backward): a layer's ``ops`` that a blockwise attention kernel does not run, because
    they work on the T × T scores the kernel keeps on chip. Forward: the ``core`` attention (from Q·Kᵀ
    to P·V) and the position-only ops (``constant_ops``) that build its mask; backward: every op
    reading or writing a tensor of the scores' size (Q·Kᵀ's output) that holds their length T twice:
    dP, the softmax's and the mask's backward, and the products of dS and P with Q, K and dO (an
    activation of the same size by chance, an MLP's B·T·4d where 4d = H·T, holds T once)."""
    ops = list(ops)
    square = _score_shaped(graph, core)
    core_ops = set(core.ops)
    mask = set()
    for name in core_ops:
        mask |= {p for p in graph.nx.predecessors(name) if p in constant_ops}
    frontier = list(mask)
    while frontier:  # the mask's own producers, all position-only
        for p in graph.nx.predecessors(frontier.pop()):
            if p in constant_ops and p not in mask:
                mask.add(p)
                frontier.append(p)
    layer = set(ops)
    forward = frozenset(core_ops | (mask & layer))
    backward = frozenset(
        name
        for name in ops
        if (op := graph.op(name)).phase == "backward" and any(square(t) for t in (*op.inputs, *op.outputs))
    )
    return forward, backward


def _score_shaped(graph: OpGraph, core: AttentionCore) -> Callable[[object], bool]:
    """Whether a tensor spec has the size of ``core``'s scores (Q·Kᵀ's output) and holds their length
    T twice (an activation of the same size by chance, an MLP's B·T·4d where 4d = H·T, holds T once)."""
    scores = [graph.op(name).outputs[0] for name in core.starts]
    score_sizes = {spec.size for spec in scores}
    lengths = {max((d for d in spec.shape if spec.shape.count(d) > 1), default=spec.shape[-1]) for spec in scores}
    return lambda spec: spec.size in score_sizes and any(spec.shape.count(length) > 1 for length in lengths)


def unmaterialized_ops(
    graph: OpGraph, ops: Iterable[str], core: AttentionCore, constant_ops: Collection[str]
) -> frozenset[str]:
    """Of :func:`square_ops`, those whose every output is score-shaped: the tensors a blockwise kernel
    never writes to memory (the scores, their softmax and mask, dP and dS). Their outputs hold no
    memory under context parallelism; the kernels' own buffers are the K/V blocks of
    ``ContextParallelCost.extra_memory_bytes``, and what the backward reads of the forward (Q, K, V
    and the output) stays kept as the layer's other values are."""
    square = _score_shaped(graph, core)
    forward, backward = square_ops(graph, ops, core, constant_ops)
    return frozenset(
        name for name in forward | backward if (outputs := graph.op(name).outputs) and all(square(t) for t in outputs)
    )


# the formulas of conductor.kernels.scan.scan_state_bytes and scan_carry_bytes, which the cost model
# may not import (the core does not depend on the conductor); tests check the two agree
def scan_state_bytes(batch: int, d_inner: int, d_state: int, dtype_bytes: int = 4) -> int:
    """Bytes of one device's carry message in a sequence-sharded scan: its final state and total Δ, B·D·(N + 1)·s."""
    return batch * d_inner * (d_state + 1) * dtype_bytes


def scan_carry_bytes(
    batch: int, d_inner: int, d_state: int, n: int, dtype_bytes: int = 4, *, backward: bool = False
) -> int:
    """Bytes each device sends per sequence-sharded scan over ``n`` devices: (n − 1) messages forward
    (a ring all-gather), as many again backward (its reduce-scatter).

    Example:
        >>> scan_carry_bytes(1, 1536, 16, 8, backward=True)
        1462272
    """
    once = (n - 1) * scan_state_bytes(batch, d_inner, d_state, dtype_bytes)
    return 2 * once if backward else once


@dataclass(frozen=True, slots=True, kw_only=True)
class ScanCarryCost:
    """A sequence-sharded scan's carry exchange, per device (module docstring).

    Attributes:
      forward_s, backward_s: the all-gather and the reduce-scatter, exposed whole.
      bytes_sent: forward + backward.
      extra_memory_bytes: the n gathered messages.
    """

    forward_s: float
    backward_s: float
    bytes_sent: int
    extra_memory_bytes: int


def scan_carry_cost(*, batch: int, d_inner: int, d_state: int, n: int, link: Link) -> ScanCarryCost:
    """The carry exchange of one selective scan of state (``batch``, ``d_inner``, ``d_state``) over ``n`` devices.

    Example:
        >>> from orchestrator.cluster import Link
        >>> c = scan_carry_cost(batch=1, d_inner=1536, d_state=16, n=8, link=Link(bandwidth_bytes_per_s=2.5e10, latency_s=5e-6))
        >>> c.bytes_sent
        1462272
    """
    if n < 2:
        raise ValueError(f"a sequence-sharded scan needs n >= 2 devices; got {n}")
    message = scan_state_bytes(batch, d_inner, d_state)
    return ScanCarryCost(
        forward_s=all_gather_s(n * message, n, link),
        backward_s=reduce_scatter_s(n * message, n, link),
        bytes_sent=scan_carry_bytes(batch, d_inner, d_state, n, backward=True),
        extra_memory_bytes=n * message,
    )
