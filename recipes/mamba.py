"""A Mamba (selective state-space) language model in Flax linen.

Gu & Dao (2023). Each of the L residual blocks is x + Mixer(RMSNorm(x)); for
u ∈ ℝ^{B×T×d} the mixer computes, with D_i = expand·d inner channels and N
state dimensions:

    [x, z] = u W_in                              W_in: (d, 2·D_i)
    x = SiLU(causal depthwise conv1d(x))          kernel width 4
    [δ, B, C] = x W_x                             δ: rank R = ⌈d/16⌉, B, C: (…, N)
    Δ = softplus(δ W_dt + b_dt)                    (B, T, D_i)
    Ā = exp(Δ ⊗ A),  B̄x = Δ ⊗ B ⊗ x                (B, T, D_i, N),  A = −exp(A_log)
    h_t = Ā_t ⊙ h_{t−1} + B̄x_t,  y_t = h_t C_tᵀ + D ⊙ x_t      (the selective scan)
    out = (y ⊙ SiLU(z)) W_out

The scan is written the plain way: Ā and B̄x are materialised as (B, T, D_i, N)
tensors and a ``lax.scan`` over time carries h. This is the form the conductor
recognises and rewrites into a fused, chunked kernel.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import flax.linen as nn
import jax
import jax.numpy as jnp


@dataclass(frozen=True, slots=True, kw_only=True)
class MambaConfig:
    """Shape of a Mamba model."""

    vocab_size: int
    num_layers: int
    d_model: int
    d_state: int = 16
    expand: int = 2
    d_conv: int = 4
    dtype: str = "float32"

    @property
    def d_inner(self) -> int:
        return self.expand * self.d_model

    @property
    def dt_rank(self) -> int:
        return math.ceil(self.d_model / 16)

    def param_count(self) -> int:
        """Exact number of parameters (embedding tied to the output head)."""
        d, di, n, r = self.d_model, self.d_inner, self.d_state, self.dt_rank
        mixer = d * 2 * di + di * self.d_conv + di + di * (r + 2 * n) + r * di + di + di * n + di + di * d
        return self.num_layers * (mixer + d) + self.vocab_size * d + d


MAMBA_PRESETS: dict[str, MambaConfig] = {
    "mamba-tiny": MambaConfig(vocab_size=256, num_layers=2, d_model=64),
    "mamba-130m": MambaConfig(vocab_size=50280, num_layers=24, d_model=768),
    "mamba-370m": MambaConfig(vocab_size=50280, num_layers=48, d_model=1024),
    "mamba-1.4b": MambaConfig(vocab_size=50280, num_layers=48, d_model=2048),
    "mamba-2.8b": MambaConfig(vocab_size=50280, num_layers=64, d_model=2560),
}


def selective_scan(delta_a, delta_bx, c):
    """h_t = Ā_t ⊙ h_{t−1} + B̄x_t;  y_t = Σ_n h_t[..., n] C_t[n].

    Args:
      delta_a, delta_bx: (batch, seq, d_inner, d_state).
      c: (batch, seq, d_state).
    Returns:
      y: (batch, seq, d_inner).
    """

    def step(h, inputs):  # h: (batch, d_inner, d_state)
        a_t, bx_t, c_t = inputs
        h = a_t * h + bx_t
        return h, jnp.einsum("bdn,bn->bd", h, c_t)

    batch, _, d_inner, d_state = delta_a.shape
    h0 = jnp.zeros((batch, d_inner, d_state), delta_a.dtype)
    time_major = (jnp.swapaxes(delta_a, 0, 1), jnp.swapaxes(delta_bx, 0, 1), jnp.swapaxes(c, 0, 1))
    _, y = jax.lax.scan(step, h0, time_major)
    return jnp.swapaxes(y, 0, 1)


def _a_log_init(d_state: int):
    def init(key, shape, dtype=jnp.float32):  # S4D-real: A = −(1..N) per channel
        del key
        return jnp.log(jnp.broadcast_to(jnp.arange(1, d_state + 1, dtype=dtype), shape))

    return init


class CausalConv1d(nn.Module):
    """Depthwise causal convolution, y_t = b + Σ_k w_k ⊙ x_{t−K+1+k}, as K shifted FMAs.

    Written out instead of ``nn.Conv(feature_group_count=channels)`` because
    XLA's CPU backend computes the weight gradient of a grouped convolution as
    a dense one, ``channels`` times the work; the shifted form costs what the
    math costs on every backend.
    """

    width: int
    sequence_axis: str | None = None  # see Mamba

    @nn.compact
    def __call__(self, x):  # (batch, seq, channels)
        channels, seq = x.shape[-1], x.shape[1]
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (self.width, channels))
        bias = self.param("bias", nn.initializers.zeros_init(), (channels,))
        if self.sequence_axis is None:
            padded = jnp.pad(x, ((0, 0), (self.width - 1, 0), (0, 0)))
        else:  # the previous device's last K − 1 tokens; the first device receives zeros
            n = jax.lax.axis_size(self.sequence_axis)
            pairs = [(i, i + 1) for i in range(n - 1)]
            halo = jax.lax.ppermute(x[:, seq - self.width + 1 :], self.sequence_axis, pairs)
            padded = jnp.concatenate([halo, x], axis=1)
        out = bias
        for k in range(self.width):
            out = out + padded[:, k : k + seq] * kernel[k]
        return out


class Mixer(nn.Module):
    config: MambaConfig
    sequence_axis: str | None = None  # see Mamba
    scan: Callable | None = None

    @nn.compact
    def __call__(self, u):  # (batch, seq, d_model)
        cfg = self.config
        di, n, r = cfg.d_inner, cfg.d_state, cfg.dt_rank
        xz = nn.Dense(2 * di, use_bias=False, dtype=cfg.dtype, name="in_proj")(u)
        x, z = jnp.split(xz, 2, axis=-1)
        x = CausalConv1d(cfg.d_conv, self.sequence_axis, name="conv1d")(x)
        x = nn.silu(x)
        dbc = nn.Dense(r + 2 * n, use_bias=False, dtype=cfg.dtype, name="x_proj")(x)
        dt, b, c = jnp.split(dbc, [r, r + n], axis=-1)
        delta = nn.softplus(nn.Dense(di, dtype=cfg.dtype, name="dt_proj")(dt))  # (batch, seq, d_inner)
        a = -jnp.exp(self.param("A_log", _a_log_init(n), (di, n)))
        y = self.core_scan(delta, a, delta * x, b, c)
        y = y + x * self.param("D", nn.initializers.ones, (di,))
        y = y * nn.silu(z)
        return nn.Dense(cfg.d_model, use_bias=False, dtype=cfg.dtype, name="out_proj")(y)

    def core_scan(self, delta, a, v, b, c):
        """The selective scan, y = scan(Δ, A, Δ ⊙ x, B, C) (see ``Mamba.scan``): a method of its own so
        that an executor can replace it (``integrations.flax``'s context-parallel step runs it
        sharded along the sequence)."""
        if self.scan is not None:
            return self.scan(delta, a, v, b, c)
        if self.sequence_axis is not None:
            raise ValueError("a sequence-sharded Mamba needs a scan that passes the state between devices")
        delta_a = jnp.exp(delta[..., None] * a)  # (batch, seq, d_inner, d_state)
        delta_bx = v[..., None] * b[:, :, None, :]
        return selective_scan(delta_a, delta_bx, c)


class MambaBlock(nn.Module):
    config: MambaConfig
    sequence_axis: str | None = None  # see Mamba
    scan: Callable | None = None

    @nn.compact
    def __call__(self, x):
        mixer = Mixer(self.config, self.sequence_axis, self.scan, name="mixer")
        return x + mixer(nn.RMSNorm(name="norm")(x))


class Mamba(nn.Module):
    """Mamba language model: tokens (batch, seq) → logits (batch, seq, vocab).

    Attributes:
      config: the model's shape.
      sequence_axis: set when the model runs inside ``jax.shard_map`` on a contiguous slice of the
        sequence, device i of this mesh axis holding the i-th slice; the convolution then reads
        the previous slice's last K − 1 tokens from its device (``ppermute``). Everything else
        is per token.
      scan: ``scan(Δ, A, Δ ⊙ x, B, C) → y`` with Δ, Δ ⊙ x, y (batch, seq, d_inner) and B, C (batch,
        seq, d_state), used instead of the written scan; with ``sequence_axis``, one that passes
        the state between devices (``conductor.kernels.scan.sequence_sharded_scan_shard``).
    """

    config: MambaConfig
    sequence_axis: str | None = None
    scan: Callable | None = None

    @nn.compact
    def __call__(self, tokens):
        cfg = self.config
        embed = nn.Embed(cfg.vocab_size, cfg.d_model, embedding_init=nn.initializers.normal(0.02), name="embedding")
        x = embed(tokens)
        for i in range(cfg.num_layers):
            x = MambaBlock(cfg, self.sequence_axis, self.scan, name=f"layers_{i}")(x)
        x = nn.RMSNorm(name="norm_f")(x)
        return embed.attend(x)
