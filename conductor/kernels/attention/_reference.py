"""Plain attention, the numerics every attention kernel is checked against.

    O = softmax(scale · Q Kᵀ + M) V,   M_ij = −∞ where causal and j > i.

K and V may have fewer heads than Q (GQA/MQA): query head h reads kv head
h // (H / H_kv).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def attention_reference(q, k, v, *, causal: bool = False, scale: float | None = None):
    """Materialised-scores attention.

    Args:
      q: (batch, seq_q, heads, head_dim).
      k, v: (batch, seq_k, kv_heads, head_dim); ``heads`` divisible by ``kv_heads``.
      causal: mask keys after the query position (needs seq_q == seq_k).
      scale: multiplies the scores; default 1/√head_dim.
    Returns:
      (batch, seq_q, heads, head_dim).
    """
    groups = q.shape[2] // k.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    k = jnp.repeat(k, groups, axis=2)
    v = jnp.repeat(v, groups, axis=2)
    s = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=jnp.float32) * scale
    if causal:
        t, sk = s.shape[-2:]
        s = jnp.where(jnp.tril(jnp.ones((t, sk), bool)), s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhts,bshd->bthd", p.astype(v.dtype), v).astype(q.dtype)
