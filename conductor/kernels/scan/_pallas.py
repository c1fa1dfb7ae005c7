"""The chunked selective scan as Pallas kernels, forward and backward.

Grid (batch, d_inner block). A program walks time sequentially with
h (block_d, N) on chip, forming exp(Δ_t A) and v_t B_t from (T, block_d) and
(T, N) inputs; it writes y and h at every chunk start (the only residual).

Backward, per chunk from last to first: recompute the chunk's states from its
boundary h into a (L, block_d, N) scratch, then walk back in time with
g = ∂loss/∂h_t:

    g_t = dy_t ⊗ C_t + Ā_{t+1} ⊙ g_{t+1}
    dC_t = Σ_d dy_t[d] h_t[d, :],   dv_t = Σ_n g_t B_t,   dB_t = Σ_d g_t v_t
    dĀ = g_t ⊙ h_{t−1},   dΔ_t = Σ_n dĀ Ā_t A,   dA += dĀ Ā_t Δ_t

dB, dC and dA are partial sums per d-block (and per batch for dA), added
outside the kernel.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from conductor.kernels._common import compiler_params


def _col(x_row):  # (1, bd) → (bd, 1)
    return x_row.reshape(x_row.shape[1], 1)


def _forward_kernel(dt_ref, a_ref, v_ref, b_ref, c_ref, y_ref, hb_ref, *, chunk):
    a = a_ref[...].astype(jnp.float32)  # (bd, N)
    n_chunks = dt_ref.shape[0] // chunk

    def chunk_body(ci, h):
        hb_ref[pl.ds(ci, 1)] = h[None]

        def step(t, h):
            idx = ci * chunk + t
            dt_t = _col(dt_ref[pl.ds(idx, 1), :].astype(jnp.float32))
            v_t = _col(v_ref[pl.ds(idx, 1), :].astype(jnp.float32))
            b_t = b_ref[pl.ds(idx, 1), :].astype(jnp.float32)  # (1, N)
            c_t = c_ref[pl.ds(idx, 1), :].astype(jnp.float32)
            h = jnp.exp(dt_t * a) * h + v_t * b_t
            y_ref[pl.ds(idx, 1), :] = jnp.sum(h * c_t, axis=1)[None].astype(y_ref.dtype)
            return h

        return lax.fori_loop(0, chunk, step, h)

    lax.fori_loop(0, n_chunks, chunk_body, jnp.zeros(a.shape, jnp.float32))


def _backward_kernel(
    dt_ref, a_ref, v_ref, b_ref, c_ref, hb_ref, dy_ref, ddt_ref, da_ref, dv_ref, db_ref, dc_ref, hs_ref, *, chunk
):
    a = a_ref[...].astype(jnp.float32)  # (bd, N)
    n_chunks = dt_ref.shape[0] // chunk

    def load(idx):
        dt_t = _col(dt_ref[pl.ds(idx, 1), :].astype(jnp.float32))
        v_t = _col(v_ref[pl.ds(idx, 1), :].astype(jnp.float32))
        return dt_t, v_t, b_ref[pl.ds(idx, 1), :].astype(jnp.float32), c_ref[pl.ds(idx, 1), :].astype(jnp.float32)

    def chunk_body(r, carry):
        ci = n_chunks - 1 - r
        h_start = hb_ref[pl.ds(ci, 1)][0]

        def recompute(t, h):
            dt_t, v_t, b_t, _ = load(ci * chunk + t)
            h = jnp.exp(dt_t * a) * h + v_t * b_t
            hs_ref[pl.ds(t, 1)] = h[None]
            return h

        lax.fori_loop(0, chunk, recompute, h_start)

        def back(s, carry):
            g_next, da = carry  # g_next = Ā_{t+1} ⊙ g_{t+1}
            t = chunk - 1 - s
            idx = ci * chunk + t
            dt_t, v_t, b_t, c_t = load(idx)
            dy_t = _col(dy_ref[pl.ds(idx, 1), :].astype(jnp.float32))
            h_t = hs_ref[pl.ds(t, 1)][0]
            h_prev = jnp.where(t > 0, hs_ref[pl.ds(jnp.maximum(t - 1, 0), 1)][0], h_start)
            g = dy_t * c_t + g_next  # (bd, N)
            abar = jnp.exp(dt_t * a)
            dabar = g * h_prev * abar
            dc_ref[pl.ds(idx, 1), :] = jnp.sum(dy_t * h_t, axis=0, keepdims=True)
            db_ref[pl.ds(idx, 1), :] = jnp.sum(g * v_t, axis=0, keepdims=True)
            dv_ref[pl.ds(idx, 1), :] = jnp.sum(g * b_t, axis=1)[None].astype(dv_ref.dtype)
            ddt_ref[pl.ds(idx, 1), :] = jnp.sum(dabar * a, axis=1)[None].astype(ddt_ref.dtype)
            return abar * g, da + dabar * dt_t

        g_next, da = carry
        g_next, da_chunk = lax.fori_loop(0, chunk, back, (g_next, jnp.zeros_like(da)))
        return g_next, da + da_chunk  # two-level sum: per chunk, then over chunks (fp32 error ~ √ of one long sum)

    zeros = jnp.zeros(a.shape, jnp.float32)
    _, da = lax.fori_loop(0, n_chunks, chunk_body, (zeros, zeros))
    da_ref[...] = da


def _specs(seq, n, bd, n_chunks):
    row_d = pl.BlockSpec((None, seq, bd), lambda i, j: (i, 0, j))  # (B, T, D)
    row_n = pl.BlockSpec((None, seq, n), lambda i, j: (i, 0, 0))  # (B, T, N)
    a_spec = pl.BlockSpec((bd, n), lambda i, j: (j, 0))
    hb_spec = pl.BlockSpec((None, n_chunks, bd, n), lambda i, j: (i, 0, j, 0))
    return row_d, row_n, a_spec, hb_spec


def _fwd(dt, a, v, b, c, chunk, bd, interpret, platform):
    batch, seq, d = dt.shape
    n, n_chunks = a.shape[1], seq // chunk
    row_d, row_n, a_spec, hb_spec = _specs(seq, n, bd, n_chunks)
    return pl.pallas_call(
        partial(_forward_kernel, chunk=chunk),
        grid=(batch, d // bd),
        in_specs=[row_d, a_spec, row_d, row_n, row_n],
        out_specs=[row_d, hb_spec],
        out_shape=[
            jax.ShapeDtypeStruct(dt.shape, dt.dtype),
            jax.ShapeDtypeStruct((batch, n_chunks, d, n), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=compiler_params(platform),
        name="conductor_scan_fwd",
    )(dt, a, v, b, c)


def _bwd(dt, a, v, b, c, hb, dy, chunk, bd, interpret, platform):
    batch, seq, d = dt.shape
    n, n_chunks, n_dblocks = a.shape[1], seq // chunk, d // bd
    row_d, row_n, a_spec, hb_spec = _specs(seq, n, bd, n_chunks)
    partial_n = pl.BlockSpec((None, None, seq, n), lambda i, j: (i, j, 0, 0))  # (B, D/bd, T, N)
    da_spec = pl.BlockSpec((None, bd, n), lambda i, j: (i, j, 0))  # (B, D, N)
    states_spec = pl.BlockSpec((None, None, chunk, bd, n), lambda i, j: (i, j, 0, 0, 0))
    ddt, da, dv, db, dc, _ = pl.pallas_call(
        partial(_backward_kernel, chunk=chunk),
        grid=(batch, n_dblocks),
        in_specs=[row_d, a_spec, row_d, row_n, row_n, hb_spec, row_d],
        out_specs=[row_d, da_spec, row_d, partial_n, partial_n, states_spec],
        out_shape=[
            jax.ShapeDtypeStruct(dt.shape, dt.dtype),
            jax.ShapeDtypeStruct((batch, d, n), jnp.float32),
            jax.ShapeDtypeStruct(v.shape, v.dtype),
            jax.ShapeDtypeStruct((batch, n_dblocks, seq, n), jnp.float32),
            jax.ShapeDtypeStruct((batch, n_dblocks, seq, n), jnp.float32),
            jax.ShapeDtypeStruct((batch, n_dblocks, chunk, bd, n), jnp.float32),  # one chunk's states
        ],
        interpret=interpret,
        compiler_params=compiler_params(platform),
        name="conductor_scan_bwd",
    )(dt, a, v, b, c, hb, dy)
    return ddt, da.sum(0).astype(a.dtype), dv, db.sum(1).astype(b.dtype), dc.sum(1).astype(c.dtype)


@partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _scan(dt, a, v, b, c, chunk, bd, interpret, platform):
    return _fwd(dt, a, v, b, c, chunk, bd, interpret, platform)[0]


def _scan_fwd(dt, a, v, b, c, chunk, bd, interpret, platform):
    y, hb = _fwd(dt, a, v, b, c, chunk, bd, interpret, platform)
    return y, (dt, a, v, b, c, hb)


def _scan_bwd(chunk, bd, interpret, platform, residuals, dy):
    return _bwd(*residuals, dy, chunk, bd, interpret, platform)


_scan.defvjp(_scan_fwd, _scan_bwd)


def selective_scan_pallas(dt, a, v, b, c, *, chunk: int, block_d: int, interpret: bool, platform: str | None = None):
    """Pallas selective scan; shapes as :func:`selective_scan_reference`."""
    return _scan(dt, a, v, b, c, chunk, block_d, interpret, platform)
