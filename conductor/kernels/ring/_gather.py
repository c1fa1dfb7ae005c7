"""All-gather context parallelism: gather every K/V block, then attend the local queries to all of them.

One ``all_gather`` of K and V replaces the ring's n − 1 transfers, and its transpose (a
``psum_scatter`` of dK and dV, which JAX derives) replaces the travelling accumulators. The
price is memory: each device holds the whole sequence's K/V (n blocks instead of two). The local
attention has a custom VJP that walks the gathered blocks in the ring's order with the same
steps, so causal skipping and zigzag balance carry over.
"""

from __future__ import annotations

from functools import partial

import jax
from jax import lax

from conductor.kernels.ring._steps import (
    Ring,
    attend,
    attend_step,
    backward_rows,
    empty_accumulator,
    grad_step,
    grads,
)


def _block(x, src, length: int):
    return lax.dynamic_slice_in_dim(x, src * length, length, axis=2)


def _forward(ring: Ring, q, k_all, v_all):
    n, me, length = ring.n, lax.axis_index(ring.axis_name), q.shape[3]
    acc = attend(
        ring, q, empty_accumulator(q, v_all.shape[-1]), _block(k_all, me, length), _block(v_all, me, length), "self"
    )

    def body(s, acc):
        src = (me - s) % n
        return attend_step(ring, q, acc, _block(k_all, src, length), _block(v_all, src, length), me=me, src=src)

    o, lse = lax.fori_loop(1, n, body, acc)
    return o.astype(q.dtype), lse


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gathered(ring: Ring, q, k_all, v_all):
    return _forward(ring, q, k_all, v_all)[0]


def _gathered_fwd(ring, q, k_all, v_all):
    o, lse = _forward(ring, q, k_all, v_all)
    return o, (q, k_all, v_all, o, lse)


def _gathered_bwd(ring, residuals, do):
    q, k_all, v_all, o, lse = residuals
    n, me, length = ring.n, lax.axis_index(ring.axis_name), q.shape[3]
    rows = backward_rows(q, o, lse, do)
    dq, dk, dv = grads(
        ring, rows, lax.full(q.shape, 0.0, "float32"), _block(k_all, me, length), _block(v_all, me, length), "self"
    )
    dk_all = lax.dynamic_update_slice_in_dim(lax.full(k_all.shape, 0.0, "float32"), dk, me * length, axis=2)
    dv_all = lax.dynamic_update_slice_in_dim(lax.full(v_all.shape, 0.0, "float32"), dv, me * length, axis=2)

    def body(s, carry):
        dq, dk_all, dv_all = carry
        src = (me - s) % n
        dq, dk, dv = grad_step(ring, rows, dq, _block(k_all, src, length), _block(v_all, src, length), me=me, src=src)
        put = partial(lax.dynamic_update_slice_in_dim, start_index=src * length, axis=2)
        return dq, put(dk_all, dk), put(dv_all, dv)

    dq, dk_all, dv_all = lax.fori_loop(1, n, body, (dq, dk_all, dv_all))
    return dq.astype(q.dtype), dk_all.astype(k_all.dtype), dv_all.astype(v_all.dtype)


_gathered.defvjp(_gathered_fwd, _gathered_bwd)


def all_gather_local(ring: Ring, q, k, v):
    """All-gather attention on local slices: q (B, Hkv, G, T/n, D), k and v (B, Hkv, T/n, D)."""
    k_all = lax.all_gather(k, ring.axis_name, axis=2, tiled=True)
    v_all = lax.all_gather(v, ring.axis_name, axis=2, tiled=True)
    return _gathered(ring, q, k_all, v_all)
