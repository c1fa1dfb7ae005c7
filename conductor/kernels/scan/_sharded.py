"""The selective scan over a sequence sharded n ways: a chunked scan across devices.

Device r holds the contiguous tokens [r·T/n, (r+1)·T/n). The recurrence h_t = Ā_t ⊙ h_{t−1} + v_t ⊗ B_t
(Ā_t = exp(Δ_t ⊗ A)) is linear in h, so a shard acts on the state passing through it as the
affine map h ↦ P_r ⊙ h + H_r, with its total decay P_r = exp(A ⊙ Σ_t Δ_t) and H_r the state its
own tokens leave from a zero start. The state entering shard r is the exclusive scan of these
maps in device order:

    h_in_0 = 0,   h_in_{r+1} = P_r ⊙ h_in_r + H_r

Per device and scan:
  1. H_r in parallel form, chunk by chunk: H ← exp(A·ΣΔ_chunk) ⊙ H + Σ_t exp(A·Σ_{s>t}Δ_s) ⊙ v_t ⊗ B_t
     (the inner sums run inside the chunk), and the shard's Σ_t Δ_t, which gives P_r;
  2. one ``all_gather`` of (H_r, ΣΔ) packed as (B, D, N + 1), then the combine of the earlier
     shards' maps on the device: n fused multiply-adds of a (B, D, N) state;
  3. the shard's outputs from h_in_r:
     ``"xla_chunked"``: the chunked scan itself, started from h_in_r (``selective_scan_chunk`` in a
     loop over checkpointed chunks, as the one-device XLA kernel);
     ``"pallas"``: y⁰ from a zero state by the one-device Pallas kernel, plus the carry's part
     C_t · (exp(A ⊙ Σ_{s≤t}Δ_s) ⊙ h_in_r), added chunk by chunk.

Memory stays at the one-device chunked kernel's level: every loop runs over chunks of L tokens
with a checkpointed body, so one (B, L, D, N) block is live and the backward keeps a (B, D, N)
or (B, D) carry per chunk; nothing of size (B, T/n, D, N) is formed. Compiled, the gradient's
temp is 1.7–2× the one-device kernel's on the same slice: step 1's cotangents of Δ, v and B are
buffers of the inputs' size, held until they are added to step 3's. Step 1 is not a second
sequential scan: its chunk has no dependence along time, only a reverse cumulative sum. The
XLA form runs one sequential pass (step 3); the Pallas form's correction is the price of a kernel
that starts from zero, and it lets GPUs and TPUs keep the fused kernel.

The backward is JAX's derivative through ``shard_map``: the transpose of the ``all_gather`` is
a reduce-scatter, which carries each device's ∂loss/∂h_in back to the earlier devices' H_r and
ΣΔ, the reverse carry. With s = B·D·(N + 1)·4 bytes (one packed fp32 state), each device sends
(n − 1)·s in the forward (a ring all-gather) and (n − 1)·s in the backward (a ring
reduce-scatter): :func:`scan_carry_bytes`.

A chain of n − 1 ``ppermute`` steps would send as many bytes but make n − 1 collectives wait on
one another. The states are small (a layer of mamba-130m at B = 1: 1536 × 17 floats, 104 KB), so
one collective and n local FMAs cost less than n − 1 latencies.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from conductor.kernels.scan._xla import selective_scan_chunk

if TYPE_CHECKING:
    from conductor.kernels.scan import ScanBlockSizes

ShardedImplementation = Literal["xla_chunked", "pallas"]
SHARDED_IMPLEMENTATIONS: tuple[ShardedImplementation, ...] = ("xla_chunked", "pallas")


def _chunked(x, chunk: int):
    """(B, T, ...) → (T/L, B, L, ...), chunks leading for ``lax.scan``."""
    batch, seq = x.shape[:2]
    return jnp.swapaxes(x.reshape(batch, seq // chunk, chunk, *x.shape[2:]), 0, 1)


def _later_sum(x):
    """Σ_{s>t} x_s along axis 1, summed from the end, so no difference of large sums rounds it."""
    later = jnp.concatenate([x[:, 1:], jnp.zeros_like(x[:, :1])], axis=1)
    return jnp.flip(jnp.cumsum(jnp.flip(later, 1), axis=1), 1)


def _varying(x, axis_name: str):
    """``x`` marked as varying over ``axis_name``: one ``pcast`` whose transpose is the one ``psum`` of
    ∂loss/∂x, instead of a ``psum`` for every use of an invariant ``x`` in the shard's work."""
    if axis_name in jax.typeof(x).manual_axis_type.varying:
        return x
    return lax.pcast(x, (axis_name,), to="varying")


def final_state(dt, a, v, b, *, chunk: int):
    """The state a shard leaves from a zero start, H = Σ_t exp(A Σ_{s>t} Δ_s) ⊙ v_t ⊗ B_t, (B, D, N) fp32.

    Args:
      dt, v: (batch, seq, d_inner); b: (batch, seq, d_state); a: (d_inner, d_state) fp32.
      chunk: tokens per step of the loop (divides seq); one (B, L, D, N) block is live at a time.
    """

    @jax.checkpoint
    def step(h, xs):
        dt_c, v_c, b_c = xs  # (B, L, D), (B, L, D), (B, L, N)
        weights = jnp.exp(_later_sum(dt_c)[..., None] * a)  # (B, L, D, N)
        h = jnp.exp(jnp.sum(dt_c, axis=1)[..., None] * a) * h
        return h + jnp.einsum("bldn,bld,bln->bdn", weights, v_c, b_c), None

    xs = tuple(_chunked(x.astype(jnp.float32), chunk) for x in (dt, v, b))
    h0 = jnp.zeros_like(xs[0][0, :, 0, :, None] * a)  # varies over the mesh axes its inputs vary over
    return lax.scan(step, h0, xs)[0]


def incoming_state(total_dt, h_end, a, *, axis_name: str):
    """h_in of this device: the earlier devices' maps h ↦ exp(A ΣΔ_j) ⊙ h + H_j applied in order to 0.

    Args:
      total_dt: (batch, d_inner), this shard's Σ_t Δ_t; h_end: (batch, d_inner, d_state), its H.
      a: (d_inner, d_state) fp32.
      axis_name: the mesh axis the sequence is sharded over, in sequence order.
    Returns:
      (batch, d_inner, d_state) fp32; zeros on the first device.
    """
    me = lax.axis_index(axis_name)
    packed = jnp.concatenate([h_end, total_dt[..., None]], axis=-1)  # (B, D, N + 1): one collective
    gathered = lax.all_gather(packed, axis_name)  # (n, B, D, N + 1)

    def combine(h, xs):
        j, packed_j = xs
        h_j, total_j = packed_j[..., :-1], packed_j[..., -1]
        return jnp.where(j < me, jnp.exp(total_j[..., None] * a) * h + h_j, h), None

    return lax.scan(combine, jnp.zeros_like(h_end), (jnp.arange(gathered.shape[0]), gathered))[0]


def scan_from(h, dt, a, v, b, c, *, chunk: int):
    """The chunked scan of a shard started from state ``h`` (B, D, N): (B, T, D), checkpointed per chunk."""

    @jax.checkpoint
    def step(h, xs):
        return selective_scan_chunk(h, xs[0], a, *xs[1:])

    _, y = lax.scan(step, h, tuple(_chunked(x, chunk) for x in (dt, v, b, c)))  # (T/L, L, B, D)
    return jnp.swapaxes(y.reshape(-1, *y.shape[2:]), 0, 1)


def carry_correction(h_in, dt, a, c, *, chunk: int):
    """C_t · (exp(A Σ_{s≤t} Δ_s) ⊙ h_in) for every t of the shard, (B, T, D) fp32, chunk by chunk.

    Args:
      h_in: (batch, d_inner, d_state), the state arriving from the earlier shards.
      dt: (batch, seq, d_inner); c: (batch, seq, d_state); a: (d_inner, d_state) fp32.
      chunk: tokens per step of the loop (divides seq).
    """

    @jax.checkpoint
    def step(offset, xs):  # offset: (B, D), Σ Δ before the chunk
        dt_c, c_c = xs
        decay = offset[:, None] + jnp.cumsum(dt_c, axis=1)  # (B, L, D)
        y = jnp.einsum("bldn,bdn,bln->bld", jnp.exp(decay[..., None] * a), h_in, c_c)
        return decay[:, -1], y

    xs = tuple(_chunked(x.astype(jnp.float32), chunk) for x in (dt, c))
    _, y = lax.scan(step, jnp.zeros_like(xs[0][0, :, 0]), xs)  # (T/L, B, L, D)
    return jnp.swapaxes(y, 0, 1).reshape(dt.shape)


def scan_state_bytes(batch: int, d_inner: int, d_state: int, dtype_bytes: int = 4) -> int:
    """Bytes of one device's message: its final state and total Δ packed as (B, D, N + 1)."""
    return batch * d_inner * (d_state + 1) * dtype_bytes


def scan_carry_bytes(
    batch: int, d_inner: int, d_state: int, n: int, dtype_bytes: int = 4, *, backward: bool = False
) -> int:
    """Bytes each device sends per sequence-sharded scan, for the cost model.

    A ring all-gather of n messages sends n − 1 of them from each device; the backward's
    reduce-scatter sends as many again.

    Args:
      batch: the local batch; d_inner, d_state: D and N.
      n: devices along the sequence axis.
      dtype_bytes: bytes per element of the carry (fp32: 4).
      backward: count the backward's reduce-scatter too.

    Example:
        >>> scan_carry_bytes(1, 1536, 16, 8, backward=True)
        1462272
    """
    once = (n - 1) * scan_state_bytes(batch, d_inner, d_state, dtype_bytes)
    return 2 * once if backward else once


def sequence_sharded_scan_shard(
    dt,
    a,
    v,
    b,
    c,
    *,
    axis_name: str,
    block_sizes: ScanBlockSizes | None = None,
    implementation: ShardedImplementation = "xla_chunked",
    interpret: bool | None = None,
    platform: str | None = None,
):
    """The selective scan of one device's contiguous slice of the sequence, inside ``jax.shard_map``.

    Args:
      dt, v: (batch, seq/n, d_inner), this device's tokens; a: (d_inner, d_state), the same everywhere.
      b, c: (batch, seq/n, d_state).
      axis_name: the mesh axis the sequence is sharded over; device i holds the i-th slice.
      block_sizes: the chunk length (divides seq/n) of every loop, and the Pallas kernel's d block.
      implementation: ``"xla_chunked"`` (the scan started from the incoming state; runs under
        ``check_vma=True``) or ``"pallas"`` (the one-device Pallas kernel from zero plus the carry's
        correction; its ``pallas_call`` declares no varying axes, so the ``shard_map`` needs
        ``check_vma=False``).
      interpret, platform: the Pallas kernel's, as :func:`selective_scan`.
    Returns:
      y: (batch, seq/n, d_inner), differentiable in every input.
    Raises:
      ValueError: mismatched shapes, a chunk that does not divide seq/n, or an unknown implementation.
    """
    from conductor.kernels.scan import ScanBlockSizes, selective_scan  # the package imports this module

    if implementation not in SHARDED_IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r}; choose one of {', '.join(SHARDED_IMPLEMENTATIONS)}")
    batch, seq, d = dt.shape
    if v.shape != dt.shape or a.shape[0] != d or b.shape != (batch, seq, a.shape[1]) or c.shape != b.shape:
        raise ValueError(
            f"expected dt, v (B,T,D), a (D,N), b, c (B,T,N); got {dt.shape}, {a.shape}, {v.shape}, {b.shape}, {c.shape}"
        )
    chunk = min((block_sizes or ScanBlockSizes()).chunk, seq)
    if seq % chunk:
        raise ValueError(f"chunk {chunk} must divide the local sequence length {seq}")
    a32 = _varying(a.astype(jnp.float32), axis_name)
    h_end = final_state(dt, a32, v, b, chunk=chunk)
    h_in = incoming_state(jnp.sum(dt.astype(jnp.float32), axis=1), h_end, a32, axis_name=axis_name)
    out_dtype = jnp.result_type(dt, a, v, b, c)
    if implementation == "xla_chunked":
        return scan_from(h_in, dt, a32, v, b, c, chunk=chunk).astype(out_dtype)
    y0 = selective_scan(
        dt, a, v, b, c, block_sizes=block_sizes, implementation="pallas", interpret=interpret, platform=platform
    )
    return (y0 + carry_correction(h_in, dt, a32, c, chunk=chunk)).astype(out_dtype)


def sequence_sharded_scan(
    dt,
    a,
    v,
    b,
    c,
    *,
    mesh: Mesh,
    axis_name: str = "context",
    batch_axis: str | None = None,
    block_sizes: ScanBlockSizes | None = None,
    implementation: ShardedImplementation = "xla_chunked",
    interpret: bool | None = None,
    platform: str | None = None,
):
    """The selective scan of whole (batch, seq, ·) arrays with seq sharded contiguously over ``axis_name``.

    Runs :func:`sequence_sharded_scan_shard` under ``jax.shard_map`` (the batch optionally over
    ``batch_axis``); the other arguments are that function's.

    Example:
        >>> import jax, numpy as np
        >>> from jax.sharding import Mesh
        >>> mesh = Mesh(np.array(jax.devices()[:2]), ("context",))
        >>> dt = v = jax.numpy.ones((1, 64, 8)); b = c = jax.numpy.ones((1, 64, 4)); a = -jax.numpy.ones((8, 4))
        >>> sequence_sharded_scan(dt, a, v, b, c, mesh=mesh).shape
        (1, 64, 8)
    """
    tokens = PartitionSpec(batch_axis, axis_name, None)

    def shard(dt, a, v, b, c):
        return sequence_sharded_scan_shard(
            dt,
            a,
            v,
            b,
            c,
            axis_name=axis_name,
            block_sizes=block_sizes,
            implementation=implementation,
            interpret=interpret,
            platform=platform,
        )

    specs = (tokens, PartitionSpec(), tokens, tokens, tokens)
    check_vma = implementation != "pallas"
    return jax.shard_map(shard, mesh=mesh, in_specs=specs, out_specs=tokens, check_vma=check_vma)(dt, a, v, b, c)
