"""The GPT recipe in PyTorch: the same model, shapes and parameter names as ``recipes.gpt``.

Pre-LayerNorm decoder (Radford et al. 2019), learned positions, tied input and
output embeddings. For tokens x ∈ ℕ^{B×T}:

    h₀ = E[x] + P[0:T]                                   E: (V, d), P: (T_max, d)
    hₗ = hₗ₋₁ + Attn(LN(hₗ₋₁));  hₗ = hₗ + MLP(LN(hₗ))    l = 1..L
    Attn(u) = softmax(QKᵀ/√d_h + causal mask) V · W_o,  [Q K V] = u W_qkv + b  (H heads of d_h = d/H)
    MLP(u) = GELU_tanh(u W₁ + b₁) W₂ + b₂                W₁: (d, 4d)
    logits = LN(h_L) Eᵀ;   loss = mean cross-entropy of the next token

Every parameter has the Flax recipe's shape and path (``blocks_0/attn/c_attn/kernel``
is (d, 3, H, d_h) here as there), so one plan and one set of logical axis
names (:func:`param_axes`) serve both. Kernels are laid out (inputs…, outputs…)
as in Flax, not as ``nn.Linear``'s (out, in). Two layout choices keep tensor
parallelism free of resharding: the QKV kernel is multiplied as
(d, H, 3, d_h) → (d, H·3·d_h), heads outermost, so a split over heads is a
contiguous split of the matmul's columns; the output kernel (H, d_h, d) is
used as (H·d_h, d). The tied output head is a parameter-free module named
``head`` reading ``wte.embedding``.

Example:
  >>> cfg = GPT_PRESETS["gpt-tiny"]
  >>> with torch.device("meta"):
  ...     model = GPT(cfg)
  >>> sum(p.numel() for p in model.parameters()) == cfg.param_count()
  True
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from recipes.gpt import GPT_PRESETS, GPTConfig

__all__ = ["GPT", "GPT_PRESETS", "GPTConfig", "loss_fn", "param_axes", "synthetic_batch"]

LAYER_NORM_EPS = 1e-6  # flax.linen.LayerNorm's default


class LayerNorm(nn.Module):
    """LayerNorm as ``flax.linen.LayerNorm`` computes it: names ``scale``/``bias``, ε = 1e-6.

    y = (x − E[x]) · rsqrt(E[x²] − E[x]² + ε) · scale + bias, written out rather
    than ``F.layer_norm``: torch_xla lowers that to a batch-norm over a
    (1, batch·seq, d) reshape, which XLA's SPMD partitioner all-gathers when
    the batch is split.
    """

    def __init__(self, d: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d))

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        var = (x * x).mean(-1, keepdim=True) - mean * mean
        return (x - mean) * torch.rsqrt(var + LAYER_NORM_EPS) * self.scale + self.bias


class Embed(nn.Module):
    """A (num, d) lookup table named ``embedding``, as ``flax.linen.Embed``."""

    def __init__(self, num: int, d: int, std: float):
        super().__init__()
        self.embedding = nn.Parameter(torch.empty(num, d))
        nn.init.normal_(self.embedding, std=std)

    def forward(self, ids):
        return self.embedding[ids]


class Head(nn.Module):
    """The tied output projection: logits = x Eᵀ (no parameters of its own).

    Computed as (E xᵀ)ᵀ so that autograd forms E's gradient as a (vocab, d)
    matmul, the layout of the lookup's scatter-add gradient; XLA then adds the
    two partial sums before one data-parallel all-reduce. ``x @ E.t()`` (and
    ``F.linear``) produce a transposed (d, vocab) gradient that XLA all-reduces
    on its own, a second all-reduce of the embedding's size.
    """

    def forward(self, x, embedding):  # x: (batch, seq, d) → (batch, seq, vocab)
        b, t, d = x.shape
        return (embedding @ x.reshape(b * t, d).t()).t().reshape(b, t, -1)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        d, h, hd = cfg.d_model, cfg.num_heads, cfg.head_dim
        self.heads, self.head_dim = h, hd
        self.c_attn = _Dense((d, 3, h, hd), bias_shape=(3, h, hd))
        self.c_proj = _Dense((h, hd, d), bias_shape=(d,))

    def forward(self, x):  # (batch, seq, d_model)
        b, t, d = x.shape
        h, hd = self.heads, self.head_dim
        # (d, 3, H, d_h) → (d, H, 3, d_h): heads outermost in the fused columns
        w = self.c_attn.kernel.permute(0, 2, 1, 3).reshape(d, h * 3 * hd)
        bias = self.c_attn.bias.permute(1, 0, 2).reshape(h * 3 * hd)
        qkv = (x @ w + bias).view(b, t, h, 3, hd)
        q, k, v = qkv.unbind(dim=3)  # (batch, seq, heads, head_dim) each
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        scores = torch.where(causal, scores, torch.finfo(scores.dtype).min)
        weights = scores.softmax(dim=-1)
        out = torch.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, h * hd)
        return out @ self.c_proj.kernel.reshape(h * hd, d) + self.c_proj.bias


class _Dense(nn.Module):
    """A kernel (inputs…, outputs…) and a bias, initialised as the Flax recipe (N(0, 0.02), zeros)."""

    def __init__(self, kernel_shape: tuple[int, ...], bias_shape: tuple[int, ...]):
        super().__init__()
        self.kernel = nn.Parameter(torch.empty(kernel_shape))
        self.bias = nn.Parameter(torch.zeros(bias_shape))
        nn.init.normal_(self.kernel, std=0.02)

    def forward(self, x):
        return x @ self.kernel + self.bias


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = _Dense((cfg.d_model, cfg.d_ff), bias_shape=(cfg.d_ff,))  # column-parallel
        self.c_proj = _Dense((cfg.d_ff, cfg.d_model), bias_shape=(cfg.d_model,))  # row-parallel

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer: tokens (batch, seq) → logits (batch, seq, vocab).

    Build it under ``torch.device("meta")`` to capture a large model without
    allocating its weights.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        if config.remat:
            raise ValueError("recipes.torch_gpt does not implement remat=True; use a config with remat=False")
        self.config = config
        self.wte = Embed(config.vocab_size, config.d_model, std=0.02)
        self.wpe = Embed(config.max_seq_len, config.d_model, std=0.01)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.ln_f = LayerNorm(config.d_model)
        self.head = Head()

    def forward(self, tokens):  # (batch, seq) int64
        seq = tokens.shape[1]
        if seq > self.config.max_seq_len:
            raise ValueError(f"sequence length {seq} exceeds max_seq_len={self.config.max_seq_len}")
        x = self.wte(tokens) + self.wpe(torch.arange(seq, device=tokens.device))[None]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x), self.wte.embedding)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy; logits (batch, seq, vocab), targets (batch, seq)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def param_axes(config: GPTConfig) -> dict[str, tuple[str | None, ...]]:
    """Logical axis names of every parameter by Flax path (``integrations.torch_xla.scope_path`` of its torch
    name), equal to ``Recipe.param_axes()`` of the Flax recipe."""
    axes: dict[str, tuple[str | None, ...]] = {
        "wte/embedding": ("vocab", "embed"),
        "wpe/embedding": (None, "embed"),
        "ln_f/scale": (),
        "ln_f/bias": (),
    }
    for i in range(config.num_layers):
        p = f"blocks_{i}"
        axes.update(
            {
                f"{p}/ln_1/scale": (),
                f"{p}/ln_1/bias": (),
                f"{p}/ln_2/scale": (),
                f"{p}/ln_2/bias": (),
                f"{p}/attn/c_attn/kernel": ("embed", None, "heads", "kv"),
                f"{p}/attn/c_attn/bias": (None, "heads", "kv"),
                f"{p}/attn/c_proj/kernel": ("heads", "kv", "embed"),
                f"{p}/attn/c_proj/bias": ("embed",),
                f"{p}/mlp/c_fc/kernel": ("embed", "mlp"),
                f"{p}/mlp/c_fc/bias": ("mlp",),
                f"{p}/mlp/c_proj/kernel": ("mlp", "embed"),
                f"{p}/mlp/c_proj/bias": ("embed",),
            }
        )
    return axes


def synthetic_batch(seed: int, batch_size: int, seq_len: int, vocab_size: int) -> dict[str, torch.Tensor]:
    """Sequences from a fixed random bigram map (token t+1 = perm[token t]), as ``recipes.train.synthetic_batch``.

    Returns int64 ``inputs`` and ``targets`` of shape (batch, seq) on the CPU.
    """
    perm = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(1234))
    tokens = [torch.randint(vocab_size, (batch_size,), generator=torch.Generator().manual_seed(seed))]
    for _ in range(seq_len):
        tokens.append(perm[tokens[-1]])
    seq = torch.stack(tokens, dim=1)  # (batch, seq + 1)
    return {"inputs": seq[:, :-1], "targets": seq[:, 1:]}
