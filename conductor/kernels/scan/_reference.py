"""The selective scan as Mamba's reference writes it: materialised Ā and B̄x.

    Ā_t = exp(Δ_t ⊗ A),  B̄x_t = v_t ⊗ B_t          (batch, seq, d_inner, d_state)
    h_t = Ā_t ⊙ h_{t−1} + B̄x_t,  h_0 = 0,   y_t = Σ_n h_t[:, n] C_t[n]

(``v`` is Δ ⊙ x in Mamba.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def selective_scan_reference(dt, a, v, b, c):
    """The written form: two (B, T, D, N) tensors and a ``lax.scan`` over time.

    Args:
      dt, v: (batch, seq, d_inner).
      a: (d_inner, d_state).
      b, c: (batch, seq, d_state).
    Returns:
      y: (batch, seq, d_inner).
    """
    delta_a = jnp.exp(dt[..., None] * a)
    delta_bx = v[..., None] * b[:, :, None, :]

    def step(h, inputs):  # h: (batch, d_inner, d_state)
        a_t, bx_t, c_t = inputs
        h = a_t * h + bx_t
        return h, jnp.einsum("bdn,bn->bd", h, c_t)

    h0 = jnp.zeros((dt.shape[0], *a.shape), dt.dtype)
    xs = (jnp.swapaxes(delta_a, 0, 1), jnp.swapaxes(delta_bx, 0, 1), jnp.swapaxes(c, 0, 1))
    _, y = jax.lax.scan(step, h0, xs)
    return jnp.swapaxes(y, 0, 1)
