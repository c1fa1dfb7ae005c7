"""Plain attention, the numerics every attention kernel is checked against.

    O = softmax(scale · Q Kᵀ + M) V,   M_ij = −∞ where the mask removes key j from query i
    (causal: j > i; a window or prefix as in ``_mask.Band``).

K and V may have fewer heads than Q (GQA/MQA): query head h reads kv head
h // (H / H_kv).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from conductor.kernels.attention._mask import band


def attention_reference(q, k, v, *, causal: bool = False, scale: float | None = None, window=None, prefix: int = 0):
    """Materialised-scores attention.

    Args:
      q: (batch, seq_q, heads, head_dim).
      k, v: (batch, seq_k, kv_heads, head_dim); ``heads`` divisible by ``kv_heads``.
      causal: mask keys after the query position (needs seq_q == seq_k).
      window, prefix: a sliding window and a prefix every query keeps, as in :func:`conductor.kernels.attention`.
      scale: multiplies the scores; default 1/√head_dim.
    Returns:
      (batch, seq_q, heads, head_dim).
    """
    groups = q.shape[2] // k.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    k = jnp.repeat(k, groups, axis=2)
    v = jnp.repeat(v, groups, axis=2)
    s = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=jnp.float32) * scale
    t, sk = s.shape[-2:]
    mask = band(causal=causal, window=window, prefix=prefix, seq_q=t, seq_k=sk)
    if mask.masked:
        s = jnp.where(mask.keep(jnp.arange(t)[:, None], jnp.arange(sk)[None, :]), s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhts,bshd->bthd", p.astype(v.dtype), v).astype(q.dtype)
