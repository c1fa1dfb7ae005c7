"""The selective scan fused and chunked in XLA: nothing of size (B, T, D, N) is kept.

The time axis is cut into T/L chunks. An outer ``lax.scan`` over chunks carries
h; each chunk is a ``jax.checkpoint``-ed inner scan that forms exp(Δ_t A) and
v_t B_t on the fly. The forward keeps only h at chunk boundaries, (T/L)·B·D·N
numbers; the backward recomputes one chunk's states at a time, L·B·D·N more.
With L ≈ √T both are O(√T) instead of the written form's two (B, T, D, N)
tensors plus T saved states. This is what Mamba's CUDA kernel does in on-chip
memory.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name


def _step(a):
    def step(h, x):  # h: (B, D, N)
        dt_t, v_t, b_t, c_t = x  # (B, D), (B, D), (B, N), (B, N)
        h = jnp.exp(dt_t[:, :, None] * a) * h + v_t[:, :, None] * b_t[:, None, :]
        return h, jnp.einsum("bdn,bn->bd", h, c_t)

    return step


def selective_scan_chunk(h, dt, a, v, b, c):
    """One chunk of the scan from state ``h`` (B, D, N): dt, v (B, L, D), b, c (B, L, N) → (h, y (L, B, D))."""
    return lax.scan(_step(a), h, tuple(jnp.swapaxes(x, 0, 1) for x in (dt, v, b, c)))


def selective_scan_xla_chunked(dt, a, v, b, c, *, chunk: int):
    """Fused, chunk-checkpointed selective scan; shapes as :func:`selective_scan_reference`."""
    batch, seq, d = dt.shape
    n_chunks = seq // chunk

    def chunks(x):  # (B, T, ...) → (T/L, L, B, ...)
        x = jnp.swapaxes(x, 0, 1)
        return x.reshape(n_chunks, chunk, *x.shape[1:])

    @jax.checkpoint
    def one_chunk(h, xs):
        return lax.scan(_step(a), h, xs)

    def boundary(h, xs):
        # named, so that a checkpoint around the kernel (conductor.optimize's fused island) keeps the
        # boundary states rather than recomputing the whole forward scan in the backward
        return one_chunk(checkpoint_name(h, "conductor_scan_state"), xs)

    h0 = jnp.zeros((batch, d, a.shape[1]), jnp.result_type(dt, a, v, b))
    _, y = lax.scan(boundary, h0, tuple(chunks(x) for x in (dt, v, b, c)))
    return jnp.swapaxes(y.reshape(seq, batch, d), 0, 1)
