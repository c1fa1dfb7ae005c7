"""One ring step's attention between a query chunk and a key/value chunk, flash-blocked in XLA.

A ring step needs what a whole-sequence flash kernel hides: the forward returns the chunk's
normalised output *and* its log-sum-exp L, so steps combine as

    L = log(e^{L₁} + e^{L₂}),   O = e^{L₁−L} O₁ + e^{L₂−L} O₂,

and the backward takes the *global* L and D = rowsum(dO ⊙ O) of the finished output, so each
chunk pair's p = e^{s−L} is already normalised over the whole sequence:

    dV = pᵀ dO,   dS = p ⊙ (dO vᵀ − D),   dK = scale · dSᵀ q,   dQ = scale · dS k.

``diagonal`` marks a pair of chunks at the same global positions (query i sees key j ≤ i);
any other pair the ring computes is fully visible. Inside a pair the work is split into
(block_q × block_k) tiles, tiles above the diagonal are skipped, so the live memory is one
score tile per query block. Layout: q (B, Hkv, G, L, D), k and v (B, Hkv, L, D) — query head
h = kv_head · G + g (GQA).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

_MASK = -1e30  # finite, so a fully masked tile row never produces NaN via (−∞) − (−∞)


def _scores(q_blk, k_blk, i, j, bq, bk, scale, diagonal):
    s = jnp.einsum("bhgqd,bhkd->bhgqk", q_blk, k_blk, preferred_element_type=jnp.float32) * scale
    if diagonal:
        rows = i * bq + jnp.arange(bq)[:, None]
        cols = j * bk + jnp.arange(bk)[None, :]
        s = jnp.where(rows >= cols, s, _MASK)
    return s


def _k_upper(i, bq, bk, nk, diagonal):
    return jnp.minimum(((i + 1) * bq + bk - 1) // bk, nk) if diagonal else nk


def full_varying(shape, value: float, *like):
    """fp32 ``value`` of ``shape``, varying over the mesh axes ``like`` varies over.

    Inside ``shard_map`` a loop carry must keep its type, and a constant varies over no axis
    while a carry computed from the inputs varies over theirs.
    """
    out = jnp.full(shape, value, jnp.float32)
    for x in like:
        out = out + jnp.zeros_like(x[(0,) * x.ndim], jnp.float32)
    return out


def _split(x, block: int, axis: int):
    """Moves ``axis`` of length n·block to a leading (n, …, block, …) pair."""
    shape = (*x.shape[:axis], x.shape[axis] // block, block, *x.shape[axis + 1 :])
    return jnp.moveaxis(x.reshape(shape), axis, 0)


def _merge(x, axis: int):
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape((*x.shape[:axis], x.shape[axis] * x.shape[axis + 1], *x.shape[axis + 2 :]))


def block_forward(q, k, v, *, diagonal: bool, scale: float, bq: int, bk: int):
    """(O, L) of q's chunk over one k/v chunk; O (B, Hkv, G, L, D) fp32, L (B, Hkv, G, L)."""
    nk = k.shape[2] // bk

    def one_q_block(args):
        i, q_blk = args  # (B, Hkv, G, bq, D)
        shape = q_blk.shape[:-1]

        def body(j, carry):
            o, m, norm = carry
            k_blk = lax.dynamic_slice_in_dim(k, j * bk, bk, axis=2)
            v_blk = lax.dynamic_slice_in_dim(v, j * bk, bk, axis=2)
            s = _scores(q_blk, k_blk, i, j, bq, bk, scale, diagonal)
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
        o, m, norm = lax.fori_loop(0, _k_upper(i, bq, bk, nk, diagonal), body, init)
        return o / norm[..., None], m + jnp.log(norm)

    qb = _split(q, bq, 3)
    o, lse = lax.map(one_q_block, (jnp.arange(qb.shape[0]), qb))
    return _merge(o, 3), _merge(lse, 3)


def block_backward(q, k, v, do, lse, delta, *, diagonal: bool, scale: float, bq: int, bk: int):
    """(dQ, dK, dV) in fp32 of one chunk pair, given the global log-sum-exp and D = rowsum(dO ⊙ O)."""
    nq, nk = q.shape[3] // bq, k.shape[2] // bk
    do = do.astype(jnp.float32)

    def q_slice(x, i):
        return lax.dynamic_slice_in_dim(x, i * bq, bq, axis=3)

    def one_k_block(args):
        j, k_blk, v_blk = args  # (B, Hkv, bk, D)

        def body(i, carry):
            dk, dv = carry
            q_blk, do_blk = q_slice(q, i), q_slice(do, i)
            s = _scores(q_blk, k_blk, i, j, bq, bk, scale, diagonal)
            p = jnp.exp(s - q_slice(lse[..., None], i))
            dv = dv + jnp.einsum("bhgqk,bhgqd->bhkd", p, do_blk)
            dp = jnp.einsum("bhgqd,bhkd->bhgqk", do_blk, v_blk.astype(jnp.float32))
            ds = p * (dp - q_slice(delta[..., None], i))
            dk = dk + scale * jnp.einsum("bhgqk,bhgqd->bhkd", ds, q_blk.astype(jnp.float32))
            return dk, dv

        lower = (j * bk) // bq if diagonal else 0
        zeros = full_varying(k_blk.shape, 0.0, k_blk, v_blk, q, do), full_varying(v_blk.shape, 0.0, k_blk, v_blk, q, do)
        return lax.fori_loop(lower, nq, body, zeros)

    def one_q_block(args):
        i, q_blk, do_blk, lse_blk, delta_blk = args

        def body(j, dq):
            k_blk = lax.dynamic_slice_in_dim(k, j * bk, bk, axis=2)
            v_blk = lax.dynamic_slice_in_dim(v, j * bk, bk, axis=2)
            s = _scores(q_blk, k_blk, i, j, bq, bk, scale, diagonal)
            p = jnp.exp(s - lse_blk[..., None])
            dp = jnp.einsum("bhgqd,bhkd->bhgqk", do_blk, v_blk.astype(jnp.float32))
            ds = p * (dp - delta_blk[..., None])
            return dq + scale * jnp.einsum("bhgqk,bhkd->bhgqd", ds, k_blk.astype(jnp.float32))

        zeros = full_varying(q_blk.shape, 0.0, q_blk, do_blk, k, v)
        return lax.fori_loop(0, _k_upper(i, bq, bk, nk, diagonal), body, zeros)

    dk, dv = lax.map(one_k_block, (jnp.arange(nk), _split(k, bk, 2), _split(v, bk, 2)))
    rows = (jnp.arange(nq), _split(q, bq, 3), _split(do, bq, 3), _split(lse, bq, 3), _split(delta, bq, 3))
    dq = lax.map(one_q_block, rows)
    return _merge(dq, 3), _merge(dk, 2), _merge(dv, 2)
