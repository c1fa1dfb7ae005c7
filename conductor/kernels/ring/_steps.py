"""One step of context-parallel attention: a device's queries against one device's key/value block.

Both forms (ring and all-gather) walk the same steps; they differ only in where the K/V block of
step s comes from. A block from device ``src`` holds as many chunks as the local slice, and each
(query chunk, key chunk) pair is skipped, computed fully or computed as a diagonal, from the
chunks' global indices (``_layout``). Which pairs are which depends only on how ``src`` compares
with this device (``me``), for both layouts:

    src = me:  the chunks' own diagonals, plus (zigzag) the late query chunk over the early key chunk
    src < me:  full pairs for the early key chunk (zigzag: both query chunks over it), the rest skipped
    src > me:  nothing (contiguous), or the late query chunk over the whole block (zigzag)

so a step is one ``lax.cond`` on src < me between two static plans, and a plan's full pairs are
merged into one rectangle of queries × keys where they form one: zigzag's off-diagonal steps are
each one half-size block call, the same work on every device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import jax.numpy as jnp
from jax import lax

from conductor.kernels._common import full_varying
from conductor.kernels.attention import AttentionBlockSizes, flash_backward, flash_forward
from conductor.kernels.ring._layout import DIAGONAL, FULL, Layout, chunk_index, chunks_per_device, pair_kind

Relation = Literal["self", "before", "after"]  # src = me, src < me, src > me


@dataclass(frozen=True, slots=True)
class Ring:
    """Static description of one context-parallel attention (hashable: a custom VJP's static argument)."""

    axis_name: str
    n: int
    layout: Layout
    causal: bool
    scale: float
    block_q: int
    block_k: int
    implementation: str = "xla_chunked"
    interpret: bool = False

    @property
    def chunks(self) -> int:
        return chunks_per_device(self.layout, self.causal)


@dataclass(frozen=True, slots=True)
class _Call:
    """One block call: query chunks [q0, q1) against key chunks [k0, k1)."""

    q0: int
    q1: int
    k0: int
    k1: int
    diagonal: bool


def static_kinds(ring: Ring, relation: Relation) -> dict[tuple[int, int], int]:
    """Pair kinds for every (query chunk, key chunk) under ``relation``.

    The kinds depend on the order of ``src`` and ``me`` only, so two devices of a ring of two
    stand for every pair of that order (``tests/conductor/test_ring_layout.py`` checks n ≤ 8).
    """
    me, src = {"self": (0, 0), "before": (1, 0), "after": (0, 1)}[relation]
    pairs = [(a, b) for a in range(ring.chunks) for b in range(ring.chunks)]
    if not ring.causal:
        return {pair: FULL for pair in pairs}
    return {
        (a, b): pair_kind(chunk_index(ring.layout, 2, me, a), chunk_index(ring.layout, 2, src, b)) for a, b in pairs
    }


def _plan(kinds: dict[tuple[int, int], int]) -> tuple[_Call, ...]:
    calls = [_Call(a, a + 1, b, b + 1, True) for (a, b), kind in sorted(kinds.items()) if kind == DIAGONAL]
    full = sorted(pair for pair, kind in kinds.items() if kind == FULL)
    rows, cols = sorted({a for a, _ in full}), sorted({b for _, b in full})
    contiguous = rows and rows == list(range(rows[0], rows[-1] + 1)) and cols == list(range(cols[0], cols[-1] + 1))
    if contiguous and len(full) == len(rows) * len(cols):
        return (*calls, _Call(rows[0], rows[-1] + 1, cols[0], cols[-1] + 1, False))
    return (*calls, *(_Call(a, a + 1, b, b + 1, False) for a, b in full))


def plan(ring: Ring, relation: Relation) -> tuple[_Call, ...]:
    """The block calls of one step under ``relation``."""
    return _plan(static_kinds(ring, relation))


def _kernel(ring: Ring, length: int) -> dict:
    """The blockwise kernel's settings for chunks of ``length``."""
    sizes = AttentionBlockSizes(block_q=min(ring.block_q, length), block_k=min(ring.block_k, length))
    return dict(scale=ring.scale, block_sizes=sizes, implementation=ring.implementation, interpret=ring.interpret)


def _heads(x):
    """(B, Hkv, G, T, …) → (B, Hkv·G, T, …): the kernels' heads-major layout (free: no data moves)."""
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])


def _grouped(x, like):
    """The inverse of :func:`_heads`, with ``like``'s (B, Hkv, G)."""
    return x.reshape(*like.shape[:3], *x.shape[2:])


def _combine(o, lse, o_new, lse_new):
    """Merges two partial softmax results; the first may still be empty (L = −∞)."""
    m = jnp.maximum(lse, lse_new)  # finite: every computed pair gives each query at least one key
    w, w_new = jnp.exp(lse - m), jnp.exp(lse_new - m)
    total = w + w_new
    return (w[..., None] * o + w_new[..., None] * o_new) / total[..., None], m + jnp.log(total)


def _by_relation(ring: Ring, me, src, run, *operands):
    """``run(relation, *operands)`` for the relation of ``src`` to ``me`` (src ≠ me)."""
    if not ring.causal:
        return run("before", *operands)
    return lax.cond(src < me, lambda *x: run("before", *x), lambda *x: run("after", *x), *operands)


def empty_accumulator(q, head_dim_v: int):
    """(O, L) before any block: zeros and −∞, q in (B, Hkv, G, T, D)."""
    shape = q.shape[:-1]
    return full_varying((*shape, head_dim_v), 0.0, q), full_varying(shape, -jnp.inf, q)


def attend(ring: Ring, q, acc, k, v, relation: Relation):
    """Folds one K/V block into the local queries' (O, L) accumulator under a static ``relation``."""
    length = q.shape[3] // ring.chunks
    kernel = _kernel(ring, length)
    o, lse = acc
    for c in plan(ring, relation):
        rows, cols = slice(c.q0 * length, c.q1 * length), slice(c.k0 * length, c.k1 * length)
        q_c = q[:, :, :, rows]
        new_o, new_lse = flash_forward(_heads(q_c), k[:, :, cols], v[:, :, cols], causal=c.diagonal, **kernel)
        new_o, new_lse = _grouped(new_o, q_c), _grouped(new_lse, q_c)
        o_c, lse_c = _combine(o[:, :, :, rows], lse[:, :, :, rows], new_o, new_lse)
        o, lse = o.at[:, :, :, rows].set(o_c), lse.at[:, :, :, rows].set(lse_c)
    return o, lse


def attend_step(ring: Ring, q, acc, k, v, *, me, src):
    """:func:`attend` for a block from another device, choosing the plan by src < me at run time."""
    return _by_relation(ring, me, src, lambda rel, acc, k, v: attend(ring, q, acc, k, v, rel), acc, k, v)


def grads(ring: Ring, rows, dq, k, v, relation: Relation):
    """One K/V block's share of the backward under a static ``relation``: (dQ updated, dK, dV), fp32.

    ``rows`` is (q, dO, L, D) of the local queries, with L and D = rowsum(dO ⊙ O) of the finished output.
    """
    q, do, lse, delta = rows
    length = q.shape[3] // ring.chunks
    kernel = _kernel(ring, length)
    # a step that skips every pair returns these as they are, so they vary as a computed one would
    dk, dv = full_varying(k.shape, 0.0, q, k, v), full_varying(v.shape, 0.0, q, k, v)
    for c in plan(ring, relation):
        r, s = slice(c.q0 * length, c.q1 * length), slice(c.k0 * length, c.k1 * length)
        q_c = q[:, :, :, r]
        dq_c, dk_c, dv_c = flash_backward(
            _heads(q_c),
            k[:, :, s],
            v[:, :, s],
            _heads(do[:, :, :, r]),
            _heads(lse[:, :, :, r]),
            _heads(delta[:, :, :, r]),
            causal=c.diagonal,
            **kernel,
        )
        dq = dq.at[:, :, :, r].add(_grouped(dq_c, q_c))
        dk, dv = dk.at[:, :, s].add(dk_c), dv.at[:, :, s].add(dv_c)
    return dq, dk, dv


def grad_step(ring: Ring, rows, dq, k, v, *, me, src):
    """:func:`grads` for a block from another device, choosing the plan by src < me at run time."""
    return _by_relation(ring, me, src, lambda rel, dq, k, v: grads(ring, rows, dq, k, v, rel), dq, k, v)


def backward_rows(q, o, lse, do):
    """(q, dO, L, D = rowsum(dO ⊙ O)) for :func:`grads`."""
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)
    return q, do.astype(jnp.float32), lse, delta
