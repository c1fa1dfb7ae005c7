"""Flash attention in plain XLA: query blocks × key blocks, only O(T) residuals.

Forward (FlashAttention-2, Dao 2023), per query block i, over key blocks j ≤ i
(causal) with running max m, normaliser l and accumulator o:

    s = scale · q_i k_jᵀ,  m' = max(m, rowmax s),  l' = e^{m−m'} l + rowsum e^{s−m'},
    o' = e^{m−m'} o + e^{s−m'} v_j;   O_i = o / l,   L_i = m + log l   (log-sum-exp)

Backward recomputes p = e^{s − L} block by block from (Q, K, V, O, L):

    D = rowsum(dO ⊙ O),  dV_j = Σ_i pᵀ dO_i,  dS = p ⊙ (dO_i v_jᵀ − D_i),
    dK_j = scale Σ_i dSᵀ q_i,  dQ_i = scale Σ_j dS k_j.

The residuals are Q, K, V, O and L: nothing of size T² is ever live. Loops are
``lax.map`` over blocks (one block live at a time) and ``fori_loop``s over only
the blocks the mask meets (``_mask.Band``): above the diagonal when causal,
outside the band of a sliding window, and never twice for a prefix.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from conductor.kernels._common import full_varying
from conductor.kernels.attention._mask import Band, as_band, band

_MASK = -1e30  # finite, so a fully masked row never produces NaN via (−∞) − (−∞)


def _blocks(x, block: int):
    """(B, Hkv, G, T, D) → (T/block, B, Hkv, G, block, D)."""
    b, h, g, t, d = x.shape
    return x.reshape(b, h, g, t // block, block, d).transpose(3, 0, 1, 2, 4, 5)


def _unblock(x):
    n, b, h, g, block, d = x.shape
    return x.transpose(1, 2, 3, 0, 4, 5).reshape(b, h, g, n * block, d)


def _scores(q_blk, k_blk, i, j, bq, bk, scale, mask: Band):
    s = jnp.einsum("bhgqd,bhkd->bhgqk", q_blk, k_blk, preferred_element_type=jnp.float32) * scale
    if mask.masked:
        rows = i * bq + jnp.arange(bq)[:, None]
        cols = j * bk + jnp.arange(bk)[None, :]
        s = jnp.where(mask.keep(rows, cols), s, _MASK)
    return s


def forward(q, k, v, causal, scale, bq, bk, mask: Band | None = None, out_dtype=None):
    """(O, L): O (B, Hkv, G, T, D) in ``out_dtype`` (default q's), L (B, Hkv, G, T) fp32;
    q (B, Hkv, G, T, D), k and v (B, Hkv, S, D)."""
    nk = k.shape[2] // bk
    mask = as_band(causal, mask)

    def one_q_block(args):
        i, q_blk = args  # (B, Hkv, G, bq, D)
        shape = q_blk.shape[:-1]

        n, block = mask.key_blocks(i, bq, bk, nk)

        def body(step, carry):
            o, m, norm = carry
            j = block(step)
            k_blk = lax.dynamic_slice_in_dim(k, j * bk, bk, axis=2)
            v_blk = lax.dynamic_slice_in_dim(v, j * bk, bk, axis=2)
            s = _scores(q_blk, k_blk, i, j, bq, bk, scale, mask)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.exp(s - m_new[..., None])
            corr = jnp.exp(m - m_new)
            o = corr[..., None] * o + jnp.einsum("bhgqk,bhkd->bhgqd", p, v_blk.astype(jnp.float32))
            return o, m_new, corr * norm + p.sum(-1)

        init = (
            full_varying((*shape, v.shape[-1]), 0.0, q_blk, k, v),
            full_varying(shape, -jnp.inf, q_blk, k),
            full_varying(shape, 0.0, q_blk, k),
        )
        o, m, norm = lax.fori_loop(0, n, body, init)
        return (o / norm[..., None]).astype(out_dtype or q.dtype), m + jnp.log(norm)

    qb = _blocks(q, bq)
    o, lse = lax.map(one_q_block, (jnp.arange(qb.shape[0]), qb))
    return _unblock(o), _unblock(lse[..., None])[..., 0]  # (B,Hkv,G,T,D), (B,Hkv,G,T)


def _backward(q, k, v, o, lse, do, causal, scale, bq, bk, mask: Band | None = None):
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), -1)  # (B, Hkv, G, T)
    return backward_rows(q, k, v, do, lse, delta, causal, scale, bq, bk, mask)


def backward_rows(q, k, v, do, lse, delta, causal, scale, bq, bk, mask: Band | None = None, grad_dtype=None):
    """(dQ, dK, dV) in ``grad_dtype`` (default their inputs') from the log-sum-exp L and
    D = rowsum(dO ⊙ O) of the output: the backward's only use of O."""
    nq, nk = q.shape[3] // bq, k.shape[2] // bk
    mask = as_band(causal, mask)

    def q_slice(x, i):
        return lax.dynamic_slice_in_dim(x, i * bq, bq, axis=3)

    def one_k_block(args):
        j, k_blk, v_blk = args  # (B, Hkv, bk, D)

        def body(i, carry):
            dk, dv = carry
            q_blk, do_blk = q_slice(q, i), q_slice(do, i).astype(jnp.float32)
            s = _scores(q_blk, k_blk, i, j, bq, bk, scale, mask)
            p = jnp.exp(s - q_slice(lse[..., None], i))
            dv = dv + jnp.einsum("bhgqk,bhgqd->bhkd", p, do_blk)
            dp = jnp.einsum("bhgqd,bhkd->bhgqk", do_blk, v_blk.astype(jnp.float32))
            ds = p * (dp - q_slice(delta[..., None], i))
            dk = dk + scale * jnp.einsum("bhgqk,bhgqd->bhkd", ds, q_blk.astype(jnp.float32))
            return dk, dv

        lower, upper = mask.query_blocks(j, bq, bk, nq)
        zeros = full_varying(k_blk.shape, 0.0, k_blk, v_blk, q, do), full_varying(v_blk.shape, 0.0, k_blk, v_blk, q, do)
        dk, dv = lax.fori_loop(lower, upper, body, zeros)
        return dk.astype(grad_dtype or k.dtype), dv.astype(grad_dtype or v.dtype)

    def one_q_block(args):
        i, q_blk, do_blk, lse_blk, delta_blk = args
        n, block = mask.key_blocks(i, bq, bk, nk)

        def body(step, dq):
            j = block(step)
            k_blk = lax.dynamic_slice_in_dim(k, j * bk, bk, axis=2)
            v_blk = lax.dynamic_slice_in_dim(v, j * bk, bk, axis=2)
            s = _scores(q_blk, k_blk, i, j, bq, bk, scale, mask)
            p = jnp.exp(s - lse_blk[..., None])
            dp = jnp.einsum("bhgqd,bhkd->bhgqk", do_blk.astype(jnp.float32), v_blk.astype(jnp.float32))
            ds = p * (dp - delta_blk[..., None])
            return dq + scale * jnp.einsum("bhgqk,bhkd->bhgqd", ds, k_blk.astype(jnp.float32))

        dq = lax.fori_loop(0, n, body, full_varying(q_blk.shape, 0.0, q_blk, do_blk, k, v))
        return dq.astype(grad_dtype or q.dtype)

    kb = k.reshape(*k.shape[:2], nk, bk, k.shape[-1]).transpose(2, 0, 1, 3, 4)
    vb = v.reshape(*v.shape[:2], nk, bk, v.shape[-1]).transpose(2, 0, 1, 3, 4)
    dk, dv = lax.map(one_k_block, (jnp.arange(nk), kb, vb))
    dk = dk.transpose(1, 2, 0, 3, 4).reshape(k.shape)
    dv = dv.transpose(1, 2, 0, 3, 4).reshape(v.shape)
    dq = lax.map(
        one_q_block,
        (
            jnp.arange(nq),
            _blocks(q, bq),
            _blocks(do, bq),
            _blocks(lse[..., None], bq)[..., 0],
            _blocks(delta[..., None], bq)[..., 0],
        ),
    )
    return _unblock(dq), dk, dv


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _flash(q, k, v, mask, scale, bq, bk):
    return forward(q, k, v, mask, scale, bq, bk)[0]


def _flash_fwd(q, k, v, mask, scale, bq, bk):
    o, lse = forward(q, k, v, mask, scale, bq, bk)
    return o, (q, k, v, o, lse)


def _flash_bwd(mask, scale, bq, bk, residuals, do):
    q, k, v, o, lse = residuals
    return _backward(q, k, v, o, lse, do, mask, scale, bq, bk)


_flash.defvjp(_flash_fwd, _flash_bwd)


def attention_xla_chunked(
    q, k, v, *, causal: bool, scale: float, block_q: int, block_k: int, window=None, prefix: int = 0
):
    """Flash attention in XLA on (batch, seq, heads, head_dim) arrays; K/V may have fewer heads (GQA).

    ``window`` and ``prefix`` as in :func:`conductor.kernels.attention`: key blocks outside the band
    are skipped, not masked.
    """
    b, t, h, d = q.shape
    hkv = k.shape[2]
    mask = band(causal=causal, window=window, prefix=prefix, seq_q=t, seq_k=k.shape[1])
    # (B, T, H, D) → (B, Hkv, G, T, D): query head h = kv_head · G + g
    qg = q.reshape(b, t, hkv, h // hkv, d).transpose(0, 2, 3, 1, 4)
    kt, vt = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    o = _flash(qg, kt, vt, mask, scale, block_q, block_k)
    return o.transpose(0, 3, 1, 2, 4).reshape(b, t, h, v.shape[-1])
