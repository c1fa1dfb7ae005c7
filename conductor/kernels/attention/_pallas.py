"""Flash attention forward and backward as Pallas kernels (same math as ``_xla``).

Integer division is ``lax.div`` (operands are never negative): ``//`` on jax
integers lowers through ``sign``, which Mosaic TPU only lowers on a real TPU.

Grid (batch, head, query block) for the forward and for dQ, (batch, head, key
block) for dK/dV; K/V blocks of query head h come from kv head h // G (GQA).
Each program keeps one (block_q, block_k) score tile; the only residual of
the forward besides its inputs and output is the log-sum-exp L (B, H, T).
dK/dV are produced per query head and summed over each group of G heads.
Each program's loop visits only the blocks its mask meets (``_mask.Band``):
a causal, sliding-window or prefix mask skips the others instead of masking them.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from conductor.kernels._common import compiler_params
from conductor.kernels.attention._mask import Band, as_band, band

_MASK = -1e30


def _tile_scores(q, k, i, j, bq, bk, scale, mask: Band):
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
    if mask.masked:
        rows = i * bq + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
        cols = j * bk + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
        s = lax.select(mask.keep(rows, cols), s, jnp.full_like(s, _MASK))  # lax.select: no jit inside the kernel
    return s


def _forward_kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, *, scale, mask, bq, bk):
    i = pl.program_id(2)
    nk = k_ref.shape[0] // bk
    q = q_ref[...].astype(jnp.float32)  # (bq, D)
    n, block = mask.key_blocks(i, bq, bk, nk)

    def body(step, carry):
        o, m, norm = carry
        j = block(step)
        k = k_ref[pl.ds(j * bk, bk), :].astype(jnp.float32)
        v = v_ref[pl.ds(j * bk, bk), :].astype(jnp.float32)
        s = _tile_scores(q, k, i, j, bq, bk, scale, mask)
        m_new = jnp.maximum(m, s.max(axis=1))
        p = jnp.exp(s - m_new[:, None])
        corr = jnp.exp(m - m_new)
        o = corr[:, None] * o + jnp.dot(p, v, preferred_element_type=jnp.float32)
        return o, m_new, corr * norm + p.sum(axis=1)

    init = (
        jnp.zeros((bq, v_ref.shape[-1]), jnp.float32),
        jnp.full((bq,), -jnp.inf, jnp.float32),
        jnp.zeros((bq,), jnp.float32),
    )
    o, m, norm = lax.fori_loop(0, n, body, init)
    o_ref[...] = (o / norm[:, None]).astype(o_ref.dtype)
    lse_ref[...] = (m + jnp.log(norm))[None]


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *, scale, mask, bq, bk):
    j = pl.program_id(2)
    nq = q_ref.shape[0] // bq
    k = k_ref[...].astype(jnp.float32)  # (bk, D)
    v = v_ref[...].astype(jnp.float32)

    def body(i, carry):
        dk, dv = carry
        q = q_ref[pl.ds(i * bq, bq), :].astype(jnp.float32)
        do = do_ref[pl.ds(i * bq, bq), :].astype(jnp.float32)
        p = jnp.exp(_tile_scores(q, k, i, j, bq, bk, scale, mask) - lse_ref[0, pl.ds(i * bq, bq)][:, None])
        dv = dv + lax.dot_general(p, do, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        dp = lax.dot_general(do, v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        ds = p * (dp - delta_ref[0, pl.ds(i * bq, bq)][:, None])
        dk = dk + scale * lax.dot_general(ds, q, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return dk, dv

    lower, upper = mask.query_blocks(j, bq, bk, nq)
    dk, dv = lax.fori_loop(lower, upper, body, (jnp.zeros_like(k), jnp.zeros_like(v)))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *, scale, mask, bq, bk):
    i = pl.program_id(2)
    nk = k_ref.shape[0] // bk
    q = q_ref[...].astype(jnp.float32)
    do = do_ref[...].astype(jnp.float32)
    lse, delta = lse_ref[0], delta_ref[0]
    n, block = mask.key_blocks(i, bq, bk, nk)

    def body(step, dq):
        j = block(step)
        k = k_ref[pl.ds(j * bk, bk), :].astype(jnp.float32)
        v = v_ref[pl.ds(j * bk, bk), :].astype(jnp.float32)
        p = jnp.exp(_tile_scores(q, k, i, j, bq, bk, scale, mask) - lse[:, None])
        dp = lax.dot_general(do, v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        ds = p * (dp - delta[:, None])
        return dq + scale * jnp.dot(ds, k, preferred_element_type=jnp.float32)

    dq = lax.fori_loop(0, n, body, jnp.zeros_like(q))
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _out(shape, dtype, *inputs):
    """An output of ``shape`` varying over every mesh axis its ``inputs`` vary over, which
    ``pallas_call`` needs to be told inside a type-checked ``shard_map`` (outside, none)."""
    varying = frozenset().union(*(jax.typeof(x).mat.varying for x in inputs))
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.sharding.ManualAxisType(varying=varying))


def _specs(t, s, d, groups, bq, bk):
    """BlockSpecs over (B, H, T, D) query-side and (B, Hkv, S, D) key-side arrays."""
    q_blk = pl.BlockSpec((None, None, bq, d), lambda b, h, i: (b, h, i, 0))
    q_all = pl.BlockSpec((None, None, t, d), lambda b, h, i: (b, h, 0, 0))
    k_blk = pl.BlockSpec((None, None, bk, d), lambda b, h, j: (b, lax.div(h, groups), j, 0))
    k_all = pl.BlockSpec((None, None, s, d), lambda b, h, i: (b, lax.div(h, groups), 0, 0))
    row_blk = pl.BlockSpec((None, None, 1, bq), lambda b, h, i: (b, h, 0, i))  # (B, H, 1, T) rows
    row_all = pl.BlockSpec((None, None, 1, t), lambda b, h, i: (b, h, 0, 0))
    kq_blk = pl.BlockSpec((None, None, bk, d), lambda b, h, j: (b, h, j, 0))  # per-query-head dK/dV
    return q_blk, q_all, k_blk, k_all, row_blk, row_all, kq_blk


def _cost(b, h, t, s, d, mask: Band, *, matmuls: int, arrays) -> pl.CostEstimate:
    """What a kernel does, for those who price it (XLA's scheduler, Orchestrator's capture): ``matmuls``
    (t, s, d)-sized products per (query, key) pair the mask keeps, one exponential each, and its
    arrays read or written once. The kernel's inner loop over key blocks hides this from a count
    of its body."""
    pairs = b * h * mask.kept_pairs(t, s)
    return pl.CostEstimate(
        flops=2 * d * matmuls * pairs,
        transcendentals=pairs,
        bytes_accessed=sum(x.size * x.dtype.itemsize for x in arrays),
    )


def forward(q, k, v, causal, scale, bq, bk, interpret, platform, mask: Band | None = None, o_dtype=None):
    """(O, L): O (B, H, T, D) in ``o_dtype`` (default q's), L (B, H, 1, T) fp32."""
    mask = as_band(causal, mask)
    b, h, t, d = q.shape
    s, groups = k.shape[2], h // k.shape[1]
    q_blk, _, _, k_all, row_blk, _, _ = _specs(t, s, d, groups, bq, bk)
    return pl.pallas_call(
        partial(_forward_kernel, scale=scale, mask=mask, bq=bq, bk=bk),
        grid=(b, h, t // bq),
        in_specs=[q_blk, k_all, k_all],
        out_specs=[q_blk, row_blk],
        out_shape=[_out(q.shape, o_dtype or q.dtype, q, k, v), _out((b, h, 1, t), jnp.float32, q, k, v)],
        interpret=interpret,
        compiler_params=compiler_params(platform),
        cost_estimate=_cost(b, h, t, s, d, mask, matmuls=2, arrays=(q, k, v, q)),
        name="conductor_flash_fwd",
    )(q, k, v)


def _bwd(q, k, v, o, lse, do, causal, scale, bq, bk, interpret, platform, mask: Band | None = None):
    delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)[:, :, None]  # (B, H, 1, T)
    return backward_rows(q, k, v, do, lse, delta, causal, scale, bq, bk, interpret, platform, mask)


def backward_rows(
    q, k, v, do, lse, delta, causal, scale, bq, bk, interpret, platform, mask: Band | None = None, grad_dtype=None
):
    """(dQ, dK, dV) in ``grad_dtype`` (default their inputs') from L and D = rowsum(dO ⊙ O),
    both (B, H, 1, T): the backward's only use of O."""
    mask = as_band(causal, mask)
    b, h, t, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    groups = h // hkv
    q_blk, q_all, k_blk, k_all, row_blk, row_all, kq_blk = _specs(t, s, d, groups, bq, bk)
    dk, dv = pl.pallas_call(
        partial(_dkdv_kernel, scale=scale, mask=mask, bq=bq, bk=bk),
        grid=(b, h, s // bk),
        in_specs=[q_all, k_blk, k_blk, q_all, row_all, row_all],
        out_specs=[kq_blk, kq_blk],
        out_shape=[
            _out((b, h, s, d), grad_dtype or k.dtype, q, k, v, do, lse, delta),
            _out((b, h, s, d), grad_dtype or v.dtype, q, k, v, do, lse, delta),
        ],
        interpret=interpret,
        compiler_params=compiler_params(platform),
        cost_estimate=_cost(b, h, t, s, d, mask, matmuls=4, arrays=(q, k, v, do, k, v)),
        name="conductor_flash_dkdv",
    )(q, k, v, do, lse, delta)
    dq = pl.pallas_call(
        partial(_dq_kernel, scale=scale, mask=mask, bq=bq, bk=bk),
        grid=(b, h, t // bq),
        in_specs=[q_blk, k_all, k_all, q_blk, row_blk, row_blk],
        out_specs=q_blk,
        out_shape=_out(q.shape, grad_dtype or q.dtype, q, k, v, do, lse, delta),
        interpret=interpret,
        compiler_params=compiler_params(platform),
        cost_estimate=_cost(b, h, t, s, d, mask, matmuls=3, arrays=(q, k, v, do, q)),
        name="conductor_flash_dq",
    )(q, k, v, do, lse, delta)
    dk = dk.reshape(b, hkv, groups, s, d).sum(2)
    dv = dv.reshape(b, hkv, groups, s, d).sum(2)
    return dq, dk, dv


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7, 8))
def _flash(q, k, v, mask, scale, bq, bk, interpret, platform):
    return forward(q, k, v, mask, scale, bq, bk, interpret, platform)[0]


def _flash_fwd(q, k, v, mask, scale, bq, bk, interpret, platform):
    o, lse = forward(q, k, v, mask, scale, bq, bk, interpret, platform)
    return o, (q, k, v, o, lse)


def _flash_bwd(mask, scale, bq, bk, interpret, platform, residuals, do):
    q, k, v, o, lse = residuals
    return _bwd(q, k, v, o, lse, do, mask, scale, bq, bk, interpret, platform)


_flash.defvjp(_flash_fwd, _flash_bwd)


def attention_pallas(
    q,
    k,
    v,
    *,
    causal: bool,
    scale: float,
    block_q: int,
    block_k: int,
    interpret: bool,
    platform: str | None = None,
    window=None,
    prefix: int = 0,
):
    """Pallas flash attention on (batch, seq, heads, head_dim) arrays; K/V may have fewer heads (GQA).

    ``window`` and ``prefix`` as in :func:`conductor.kernels.attention`: key blocks outside the band
    are skipped, not masked.
    """
    mask = band(causal=causal, window=window, prefix=prefix, seq_q=q.shape[1], seq_k=k.shape[1])
    o = _flash(
        q.transpose(0, 2, 1, 3),
        k.transpose(0, 2, 1, 3),
        v.transpose(0, 2, 1, 3),
        mask,
        scale,
        block_q,
        block_k,
        interpret,
        platform,
    )
    return o.transpose(0, 2, 1, 3)
