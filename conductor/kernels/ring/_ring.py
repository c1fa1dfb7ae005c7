"""Ring attention on one device's slice, inside ``shard_map`` (Liu et al. 2023, "Ring Attention").

Forward, n steps: at step s device r holds the K/V block of device (r − s) mod n, sends it on
to r + 1 (``ppermute``) and, while it travels, folds it into the local queries' (O, L).

Backward, a second ring pass with a custom VJP (only Q, K, V, O and L are kept): the K/V
blocks travel again, the other way round (device r → r − 1, so step s holds the block of
r + s), and each block's dK/dV accumulator travels with it,

    step s:  acc_in = ppermute(acc_out_{s−1}) (nothing at s = 0),  acc_out_s = acc_in + grad(block)

so the accumulator arriving at step s is not needed until the step's own contribution is
computed, and one last ``ppermute`` brings every block's sum home after n steps. Traffic per
device: forward (n − 1) K/V blocks; backward (n − 1) K/V blocks and n dK/dV blocks (fp32).

The backward sends K and V joined in one array. Its first send is then never the forward's
first send again (for n = 2 the two directions are the same permutation), which XLA would merge
when both passes are one program, keeping the received block alive from the forward to the
backward: one more K/V block per layer.

Step 0 (the device's own block) and the last step (nothing left to send) are peeled off a
``fori_loop`` over the steps between, so the program's size does not grow with n and only the
block in use and the one arriving are live.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
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


def _shift(ring: Ring, tree, direction: int = 1):
    """Sends ``tree`` one place along the ring, device i → i + ``direction``."""
    return lax.ppermute(tree, ring.axis_name, [(i, (i + direction) % ring.n) for i in range(ring.n)])


def _forward(ring: Ring, q, k, v):
    n, me = ring.n, lax.axis_index(ring.axis_name)
    acc = empty_accumulator(q, v.shape[-1])
    if n == 1:
        o, lse = attend(ring, q, acc, k, v, "self")
        return o.astype(q.dtype), lse
    # each block is sent before the step that uses the current one, so the transfer overlaps it
    nxt = _shift(ring, (k, v))
    acc = attend(ring, q, acc, k, v, "self")

    def body(s, carry):
        (k, v), acc = carry
        nxt = _shift(ring, (k, v))
        return nxt, attend_step(ring, q, acc, k, v, me=me, src=(me - s) % n)

    (k, v), acc = lax.fori_loop(1, n - 1, body, (nxt, acc))
    o, lse = attend_step(ring, q, acc, k, v, me=me, src=(me - (n - 1)) % n)
    return o.astype(q.dtype), lse


def _backward(ring: Ring, q, k, v, o, lse, do):
    n, me, d = ring.n, lax.axis_index(ring.axis_name), k.shape[-1]
    rows = backward_rows(q, o, lse, do)
    dq = lax.full(q.shape, 0.0, "float32")
    dq, dk, dv = grads(ring, rows, dq, k, v, "self")
    if n == 1:
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
    # K and V travel joined (and dK, dV likewise): one message per step (B, Hkv, T/n, D + Dv)
    nxt = _shift(ring, jnp.concatenate([k, v], axis=-1), -1)

    def step(s, kv, acc, dq):
        incoming = _shift(ring, acc, -1)
        dq, dk, dv = grad_step(ring, rows, dq, kv[..., :d], kv[..., d:], me=me, src=(me + s) % n)
        return incoming + jnp.concatenate([dk, dv], axis=-1), dq

    def body(s, carry):
        kv, acc, dq = carry
        return _shift(ring, kv, -1), *step(s, kv, acc, dq)

    kv, acc, dq = lax.fori_loop(1, n - 1, body, (nxt, jnp.concatenate([dk, dv], axis=-1), dq))
    acc, dq = step(n - 1, kv, acc, dq)
    acc = _shift(ring, acc, -1)  # every block's sum goes home
    return dq.astype(q.dtype), acc[..., :d].astype(k.dtype), acc[..., d:].astype(v.dtype)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def ring_local(ring: Ring, q, k, v):
    """Ring attention on local slices: q (B, Hkv, G, T/n, D), k and v (B, Hkv, T/n, D)."""
    return _forward(ring, q, k, v)[0]


def _ring_fwd(ring, q, k, v):
    o, lse = _forward(ring, q, k, v)
    return o, (q, k, v, o, lse)


def _ring_bwd(ring, residuals, do):
    return _backward(ring, *residuals, do)


ring_local.defvjp(_ring_fwd, _ring_bwd)
