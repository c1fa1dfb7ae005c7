"""Evidence for the conductor: compiled memory, numerics and CPU time (``orchestrator bench conductor``)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from conductor.kernels import AttentionBlockSizes, ScanBlockSizes, attention, selective_scan


@dataclass(frozen=True, slots=True, kw_only=True)
class Case:
    """One checked claim: its name, whether it holds, and the figures behind it."""

    name: str
    ok: bool
    figures: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"name": self.name, "ok": self.ok, **self.figures}


def temp_bytes(fn: Callable, *args) -> int:
    """XLA's temp buffer bytes for ``jit(fn)`` compiled on the local backend (compiled, never run)."""
    return int(jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes)


def median_seconds(fn: Callable, *args, repeats: int = 5) -> float:
    """Median wall time of ``repeats`` runs of an already compiled ``fn`` (one warm-up run first)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def attention_step(implementation: str, *, causal: bool = True, block_sizes: AttentionBlockSizes | None = None):
    """Training step of one attention call: gradients of Σ O ⊙ W with respect to Q, K, V."""

    def loss(q, k, v, w):
        o = attention(q, k, v, causal=causal, implementation=implementation, block_sizes=block_sizes)
        return jnp.sum(o * w)

    return jax.grad(loss, argnums=(0, 1, 2))


def scan_step(implementation: str, *, block_sizes: ScanBlockSizes | None = None):
    """Training step of one selective scan: gradients of Σ y ⊙ W with respect to every input."""

    def loss(dt, a, v, b, c, w):
        return jnp.sum(selective_scan(dt, a, v, b, c, implementation=implementation, block_sizes=block_sizes) * w)

    return jax.grad(loss, argnums=(0, 1, 2, 3, 4))


def attention_specs(seq: int, *, batch: int = 1, heads: int = 8, kv_heads: int = 8, head_dim: int = 64):
    q = jax.ShapeDtypeStruct((batch, seq, heads, head_dim), jnp.float32)
    kv = jax.ShapeDtypeStruct((batch, seq, kv_heads, head_dim), jnp.float32)
    return q, kv, kv, q


def scan_inputs(batch: int, seq: int, d_inner: int, d_state: int, *, seed: int = 0):
    """Mamba-like inputs: Δ = softplus(·) > 0, A = −exp(·) < 0."""
    ks = jax.random.split(jax.random.key(seed), 6)
    dt = jax.nn.softplus(jax.random.normal(ks[0], (batch, seq, d_inner)) - 1.0)
    a = -jnp.exp(0.5 * jax.random.normal(ks[1], (d_inner, d_state)))
    v = jax.random.normal(ks[2], (batch, seq, d_inner))
    b = jax.random.normal(ks[3], (batch, seq, d_state))
    c = jax.random.normal(ks[4], (batch, seq, d_state))
    w = jax.random.normal(ks[5], (batch, seq, d_inner))
    return dt, a, v, b, c, w


def max_abs_diff(x, y) -> float:
    return max(
        float(np.max(np.abs(np.asarray(p) - np.asarray(q)))) for p, q in zip(jax.tree.leaves(x), jax.tree.leaves(y))
    )
