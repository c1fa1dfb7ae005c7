"""A GPT-style decoder-only transformer in Flax linen, with the Llama variants as options.

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

``GPTConfig(llama=True)`` is the Llama architecture (Touvron et al. 2023; Llama 3, Dubey et al.
2024) on the same skeleton: RMSNorm for LN (no biases anywhere), rotary positions (RoPE, base
``rope_theta``) on Q and K instead of P, grouped-query attention (``num_kv_heads`` K/V heads, each
shared by H / num_kv_heads query heads; separate Q and fused KV kernels), a gated MLP

    MLP(u) = (SiLU(u W_g) ⊙ u W_u) W_d                    W_g, W_u: (d, d_ff)

with ``d_ff`` given (``ffn_hidden``), and an output head W_out: (d, V) not tied to E.
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
    llama: bool = False
    num_kv_heads: int | None = None  # grouped-query attention (llama only); None: num_heads
    ffn_hidden: int | None = None  # the MLP's width (llama only); None: mlp_ratio · d_model
    rope_theta: float = 500_000.0

    def __post_init__(self) -> None:
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by num_heads={self.num_heads}")
        if not self.llama and (self.num_kv_heads is not None or self.ffn_hidden is not None):
            raise ValueError("num_kv_heads and ffn_hidden are options of the Llama architecture: set llama=True")
        if self.num_heads % self.kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be divisible by num_kv_heads={self.kv_heads}")
        if self.llama and self.head_dim % 2:
            raise ValueError(f"rotary positions need an even head dimension, got {self.head_dim}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def d_ff(self) -> int:
        return self.ffn_hidden or self.mlp_ratio * self.d_model

    def param_count(self) -> int:
        """Exact number of parameters (LayerNorms have scale and bias; RMSNorms a scale)."""
        d, f = self.d_model, self.d_ff
        if self.llama:
            kv = 2 * self.kv_heads * self.head_dim
            block = d * d + d * kv + d * d + 3 * d * f + 2 * d
            return self.num_layers * block + 2 * self.vocab_size * d + d
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
    "llama-tiny": GPTConfig(
        vocab_size=256,
        max_seq_len=64,
        num_layers=2,
        num_heads=4,
        d_model=64,
        llama=True,
        num_kv_heads=2,
        ffn_hidden=160,
    ),
    # Llama 3 8B and 405B (Dubey et al. 2024, Table 3); vocabulary 128,256
    "llama3-8b": GPTConfig(
        vocab_size=128256,
        max_seq_len=8192,
        num_layers=32,
        num_heads=32,
        d_model=4096,
        llama=True,
        num_kv_heads=8,
        ffn_hidden=14336,
    ),
    "llama3-405b": GPTConfig(
        vocab_size=128256,
        max_seq_len=8192,
        num_layers=126,
        num_heads=128,
        d_model=16384,
        llama=True,
        num_kv_heads=8,
        ffn_hidden=53248,
    ),
}


def _dense(
    features, axes: tuple[str | None, ...], name: str, dtype: str, *, axis=-1, use_bias: bool = True
) -> nn.DenseGeneral:
    """A dense layer whose kernel carries logical axis names ``axes`` (inputs first)."""
    out_axes = axes[-len(features) :] if isinstance(features, tuple) else axes[-1:]
    return nn.DenseGeneral(
        features,
        axis=axis,
        dtype=dtype,
        use_bias=use_bias,
        kernel_init=nn.with_logical_partitioning(nn.initializers.normal(0.02), axes),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), out_axes),
        name=name,
    )


def _norm(cfg: GPTConfig, name: str) -> nn.Module:
    return nn.RMSNorm(name=name) if cfg.llama else nn.LayerNorm(name=name)


def rotary(x, theta: float, positions=None):
    """Rotary position embedding of ``x`` (batch, seq, heads, head_dim): each pair (x[2i], x[2i+1])
    at position p rotated by p·theta^(−2i/head_dim) (Su et al. 2021); ``positions`` (seq,), the
    position of each place of the sequence, default 0 … seq − 1."""
    seq, dim = x.shape[1], x.shape[-1]
    positions = jnp.arange(seq) if positions is None else positions
    inverse = theta ** (-jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
    angles = jnp.asarray(positions, jnp.float32)[:, None] * inverse[None]  # (seq, dim/2)
    cos, sin = jnp.cos(angles)[None, :, None], jnp.sin(angles)[None, :, None]
    pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], dim // 2, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1)
    return rotated.reshape(x.shape).astype(x.dtype)


def grouped_causal_attention(q, k, v):
    """softmax(QKᵀ/√d + causal mask) V for q (batch, seq, heads, d) and k, v (batch, seq, kv_heads, d):
    query head h attends to K/V head h // (heads / kv_heads)."""
    b, t, heads, d = q.shape
    kv_heads = k.shape[2]
    q = q.reshape(b, t, kv_heads, heads // kv_heads, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k) / math.sqrt(d)
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    weights = nn.softmax(scores, axis=-1)
    return jnp.einsum("bkgts,bskd->btkgd", weights, v).reshape(b, t, heads, d)


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
        qkv = _dense((3, cfg.num_heads, cfg.head_dim), ("embed", None, "heads", "kv"), "c_attn", cfg.dtype)(x)
        # (batch, seq, heads, head_dim) each
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        out = self.core_attention(q, k, v)
        return _dense(cfg.d_model, ("heads", "kv", "embed"), "c_proj", cfg.dtype, axis=(-2, -1))(out)

    def core_attention(self, q, k, v):
        """softmax(QKᵀ/√d_h + causal mask) V of (batch, seq, heads, head_dim) arrays, in sequence order.

        A method of its own, so an executor can run it another way (``nn.intercept_methods``): under
        context parallelism the sequence is split and this becomes ring attention."""
        seq = q.shape[1]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(self.config.head_dim)
        causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        weights = nn.softmax(scores, axis=-1)
        return jnp.einsum("bhqk,bkhd->bqhd", weights, v)


class GroupedQueryAttention(nn.Module):
    """Llama's causal attention: rotary Q and K, ``kv_heads`` K/V heads shared by groups of query heads.

    The Q kernel is (d_model, heads, head_dim), the fused KV kernel (d_model, 2, kv_heads, head_dim)
    and the output kernel (heads, head_dim, d_model), no biases; tensor parallelism shards the
    heads (and the K/V heads when it divides them). Each query group attends to its K/V head with
    the group as an extra dimension, so K and V are never repeated in memory.
    """

    config: GPTConfig

    @nn.compact
    def __call__(self, x):  # (batch, seq, d_model)
        cfg = self.config
        q = _dense((cfg.num_heads, cfg.head_dim), ("embed", "heads", "kv"), "q", cfg.dtype, use_bias=False)(x)
        kv = _dense((2, cfg.kv_heads, cfg.head_dim), ("embed", None, "heads", "kv"), "kv", cfg.dtype, use_bias=False)(x)
        positions = self.positions(x.shape[1])
        q, k, v = rotary(q, cfg.rope_theta, positions), rotary(kv[:, :, 0], cfg.rope_theta, positions), kv[:, :, 1]
        out = self.core_attention(q, k, v)
        return _dense(cfg.d_model, ("heads", "kv", "embed"), "o", cfg.dtype, axis=(-2, -1), use_bias=False)(out)

    def positions(self, seq: int):
        """The position of each place of the sequence, (seq,): 0 … seq − 1. A method of its own, so an
        executor that stores the sequence in another order (``nn.intercept_methods``) gives that order's."""
        return jnp.arange(seq)

    def core_attention(self, q, k, v):
        """:func:`grouped_causal_attention`, as a method an executor can run another way (ring attention
        under context parallelism)."""
        return grouped_causal_attention(q, k, v)


class MLP(nn.Module):
    config: GPTConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        if cfg.llama:  # SwiGLU: gate and up column-parallel, down row-parallel
            gate = _dense(cfg.d_ff, ("embed", "mlp"), "gate", cfg.dtype, use_bias=False)(x)
            up = _dense(cfg.d_ff, ("embed", "mlp"), "up", cfg.dtype, use_bias=False)(x)
            return _dense(cfg.d_model, ("mlp", "embed"), "down", cfg.dtype, use_bias=False)(nn.silu(gate) * up)
        x = _dense(cfg.d_ff, ("embed", "mlp"), "c_fc", cfg.dtype)(x)  # column-parallel
        x = nn.gelu(x)
        return _dense(cfg.d_model, ("mlp", "embed"), "c_proj", cfg.dtype)(x)  # row-parallel


class Block(nn.Module):
    config: GPTConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        attention = GroupedQueryAttention if cfg.llama else CausalSelfAttention
        x = x + attention(cfg, name="attn")(_norm(cfg, "ln_1")(x))
        return x + MLP(cfg, name="mlp")(_norm(cfg, "ln_2")(x))


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
        x = wte(tokens)
        if not cfg.llama:  # learned positions; Llama rotates Q and K instead
            wpe = nn.Embed(
                cfg.max_seq_len,
                cfg.d_model,
                dtype=cfg.dtype,
                embedding_init=nn.with_logical_partitioning(nn.initializers.normal(0.01), (None, "embed")),
                name="wpe",
            )
            x = x + wpe(jnp.arange(seq))[None]
        block = nn.remat(Block) if cfg.remat else Block
        for i in range(cfg.num_layers):
            x = block(cfg, name=f"blocks_{i}")(x)
        x = _norm(cfg, "ln_f")(x)
        if cfg.llama:
            return _dense(cfg.vocab_size, ("embed", "vocab"), "lm_head", cfg.dtype, use_bias=False)(x)
        return wte.attend(x)
