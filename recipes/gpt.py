"""A GPT-style decoder-only transformer in Flax linen.

Pre-LayerNorm blocks (Radford et al. 2019), learned positions, tied input and
output embeddings. For tokens x ∈ ℕ^{B×T}:

    h₀ = E[x] + P[0:T]                                   E: (V, d), P: (T_max, d)
    hₗ = hₗ₋₁ + Attn(LN(hₗ₋₁));  hₗ = hₗ + MLP(LN(hₗ))    l = 1..L
    Attn(u) = softmax(QKᵀ/√d_h + causal mask) V · W_o,  Q, K, V = u W_q, u W_k, u W_v (H heads of d_h = d/H)
    MLP(u) = GELU(u W₁ + b₁) W₂ + b₂                     W₁: (d, 4d)
    logits = LN(h_L) Eᵀ

Parameters ≈ 12·L·d² + (V + T_max)·d. Kernels carry logical axis names
(``embed``, ``heads``, ``mlp``, ``vocab``) through ``nn.with_logical_partitioning``
so a plan's tensor parallelism maps onto them by logical axis rules.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import flax.linen as nn
import jax.numpy as jnp


@dataclass(frozen=True, slots=True, kw_only=True)
class GPTConfig:
    """Shape of a GPT model. ``d_model`` must divide by ``num_heads``."""

    vocab_size: int
    max_seq_len: int
    num_layers: int
    num_heads: int
    d_model: int
    mlp_ratio: int = 4
    dtype: str = "float32"
    remat: bool = False

    def __post_init__(self) -> None:
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by num_heads={self.num_heads}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def d_ff(self) -> int:
        return self.mlp_ratio * self.d_model

    def param_count(self) -> int:
        """Exact number of parameters (LayerNorms have scale and bias)."""
        d, f = self.d_model, self.d_ff
        attention = d * 3 * d + 3 * d + d * d + d
        mlp = d * f + f + f * d + d
        block = attention + mlp + 2 * 2 * d
        return self.num_layers * block + (self.vocab_size + self.max_seq_len) * d + 2 * d


GPT_PRESETS: dict[str, GPTConfig] = {
    "gpt-tiny": GPTConfig(vocab_size=256, max_seq_len=64, num_layers=2, num_heads=4, d_model=64),
    "gpt2-small": GPTConfig(vocab_size=50257, max_seq_len=1024, num_layers=12, num_heads=12, d_model=768),
    "gpt-1.3b": GPTConfig(vocab_size=50257, max_seq_len=2048, num_layers=24, num_heads=16, d_model=2048),
    "gpt-6.7b": GPTConfig(vocab_size=50257, max_seq_len=2048, num_layers=32, num_heads=32, d_model=4096),
    "gpt-13b": GPTConfig(vocab_size=50257, max_seq_len=2048, num_layers=40, num_heads=40, d_model=5120),
    "gpt-175b": GPTConfig(vocab_size=50257, max_seq_len=2048, num_layers=96, num_heads=96, d_model=12288),
}


def _dense(features, axes: tuple[str | None, ...], name: str, dtype: str, *, axis=-1) -> nn.DenseGeneral:
    """A dense layer whose kernel carries logical axis names ``axes`` (inputs first)."""
    out_axes = axes[-len(features) :] if isinstance(features, tuple) else axes[-1:]
    return nn.DenseGeneral(
        features,
        axis=axis,
        dtype=dtype,
        kernel_init=nn.with_logical_partitioning(nn.initializers.normal(0.02), axes),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), out_axes),
        name=name,
    )


class CausalSelfAttention(nn.Module):
    """Multi-head causal attention with a fused QKV projection.

    The QKV kernel is (d_model, 3, heads, head_dim) and the output kernel
    (heads, head_dim, d_model), so tensor parallelism shards whole heads
    (Megatron's column- then row-parallel pair) with no resharding in between.
    """

    config: GPTConfig

    @nn.compact
    def __call__(self, x):  # (batch, seq, d_model)
        cfg = self.config
        seq = x.shape[1]
        qkv = _dense((3, cfg.num_heads, cfg.head_dim), ("embed", None, "heads", "kv"), "c_attn", cfg.dtype)(x)
        # (batch, seq, heads, head_dim) each
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(cfg.head_dim)
        causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        weights = nn.softmax(scores, axis=-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
        return _dense(cfg.d_model, ("heads", "kv", "embed"), "c_proj", cfg.dtype, axis=(-2, -1))(out)


class MLP(nn.Module):
    config: GPTConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        x = _dense(cfg.d_ff, ("embed", "mlp"), "c_fc", cfg.dtype)(x)  # column-parallel
        x = nn.gelu(x)
        return _dense(cfg.d_model, ("mlp", "embed"), "c_proj", cfg.dtype)(x)  # row-parallel


class Block(nn.Module):
    config: GPTConfig

    @nn.compact
    def __call__(self, x):
        x = x + CausalSelfAttention(self.config, name="attn")(nn.LayerNorm(name="ln_1")(x))
        return x + MLP(self.config, name="mlp")(nn.LayerNorm(name="ln_2")(x))


class GPT(nn.Module):
    """Decoder-only transformer: tokens (batch, seq) → logits (batch, seq, vocab)."""

    config: GPTConfig

    @nn.compact
    def __call__(self, tokens):
        cfg = self.config
        seq = tokens.shape[1]
        if seq > cfg.max_seq_len:
            raise ValueError(f"sequence length {seq} exceeds max_seq_len={cfg.max_seq_len}")
        wte = nn.Embed(
            cfg.vocab_size,
            cfg.d_model,
            dtype=cfg.dtype,
            embedding_init=nn.with_logical_partitioning(nn.initializers.normal(0.02), ("vocab", "embed")),
            name="wte",
        )
        wpe = nn.Embed(
            cfg.max_seq_len,
            cfg.d_model,
            dtype=cfg.dtype,
            embedding_init=nn.with_logical_partitioning(nn.initializers.normal(0.01), (None, "embed")),
            name="wpe",
        )
        x = wte(tokens) + wpe(jnp.arange(seq))[None]
        block = nn.remat(Block) if cfg.remat else Block
        for i in range(cfg.num_layers):
            x = block(cfg, name=f"blocks_{i}")(x)
        x = nn.LayerNorm(name="ln_f")(x)
        return wte.attend(x)
